-- scripts/device_check.sh without a GPU: its plan (--plan) names every
-- part the GPU run needs, its limits fit the 420 s budget, and it fails
-- where a file a part runs is missing, a C test's GPU case is not run or
-- the limits pass the budget; run on a copy of the project (links to its
-- files) whose binaries are stand-ins that sleep and print, it runs its
-- lanes side by side, and a part the budget cuts says so in the summary.
local H = require 'helpers'

-- Each part the GPU run must have, with a piece of its command.
local NEEDED = {
  { 'report', 'build/dslua --report' },
  { 'c_test_zero', 'build/test_zero' },
  { 'gpu_first', 'spec/gpu/fp8_spec.lua' },
  { 'gpu_ops', 'spec/gpu/ops_spec.lua' },
  { 'gpu_examples', 'spec/gpu/examples_spec.lua' },
  { 'primitives', '--filter=primitive spec/gpu/multirank_spec.lua' },
  { 'bench_bf16', 'build/dslua bench/gpu.lua train 16 bf16 50304' },
  { 'bench_bf16_torch', 'python3 bench/gpu_torch.py train 16 bf16 50304' },
  { 'bench_tf32', 'build/dslua bench/gpu.lua train 8 tf32 50304' },
  { 'bench_tf32_torch', 'python3 bench/gpu_torch.py train 8 tf32 50304' },
  { 'bench_fp8', 'build/dslua bench/gpu.lua train 16 fp8 50304' },
  { 'bench_vocab50257', 'build/dslua bench/gpu.lua train 16 bf16 50257' },
  { 'bench_xl', 'build/dslua bench/gpu.lua train 4 bf16 50304 gpt2_xl' },
  { 'bench_xl_offload', 'build/dslua bench/gpu.lua train 4 bf16 50304 gpt2_xl offload' },
  { 'staged', 'bash bench/staged.sh' },
  { 'curve', 'bash bench/curve.sh' },
}
-- the multi-rank specs on device ranks, over MPI and over the NCCL double
for _, s in ipairs({ 'ddp', 'zero', 'uneven', 'pipe', 'onebit', 'checkpoint', 'reload', 'tp' }) do
  NEEDED[#NEEDED + 1] = { 'mpi_' .. s, '--filter= ' .. s .. '_spec over MPI %(staged%) spec/gpu/multirank_spec.lua' }
  NEEDED[#NEEDED + 1] = { 'nccl_' .. s, '--filter= ' .. s .. '_spec over NCCL %(the test double%) spec/gpu/multirank_spec.lua' }
end

-- The plan's parts in order: lane, name, seconds, command.
local function parse_plan(out)
  local parts = {}
  for lane, name, s, cmd in out:gmatch('([%w_-]+)%s+([%w_]+)%s+(%d+) s  ([^\n]*)') do
    parts[#parts + 1] = { lane = lane, name = name, s = tonumber(s), cmd = cmd }
  end
  return parts
end

-- The plan's length: parts outside lanes one after another, each run of
-- lanes as long as its longest lane.
local function length(parts)
  local total, lanes = 0, {}
  local function close()
    local longest = 0
    for _, s in pairs(lanes) do longest = math.max(longest, s) end
    total, lanes = total + longest, {}
  end
  for _, p in ipairs(parts) do
    if p.lane == '-' then
      close()
      total = total + p.s
    else
      lanes[p.lane] = (lanes[p.lane] or 0) + p.s
    end
  end
  close()
  return total
end

local tmpdir, remove_tmpdirs = H.tmpdirs()
teardown(remove_tmpdirs)

-- A copy of the project made of links to its folders' files, with
-- stand-ins for the binaries the parts run: each logs its start (with
-- DSLUA_NUM_THREADS) and end to $root/calls, sleeps $FAKE_SLEEP where its
-- command matches $FAKE_SLOW (a grep pattern), then prints a busted tally
-- ($FAKE_TALLY successes, 1 by default) and a bench result line.
local function fake_project()
  local root = tmpdir()
  local cwd = H.run('pwd'):gsub('%s+$', '')
  for _, d in ipairs({ 'spec', 'bench', 'tests', 'scripts' }) do
    assert(os.execute(string.format('cp -rs %s/%s %s/%s', cwd, d, root, d)) == 0)
  end
  assert(os.execute('mkdir -p ' .. root .. '/build ' .. root .. '/bin') == 0)
  local fake = root .. '/fake'
  local f = assert(io.open(fake, 'w'))
  f:write('#!/bin/sh\n',
          'echo "$(date +%s.%N) start $0 $* threads=${DSLUA_NUM_THREADS:-}" >> "$FAKE_ROOT/calls"\n',
          'if echo "$0 $*" | grep -q "${FAKE_SLOW:-^$}"; then sleep "$FAKE_SLEEP"; fi\n',
          'echo "$(date +%s.%N) end $0 $*" >> "$FAKE_ROOT/calls"\n',
          'echo "${FAKE_TALLY:-1 success} / 0 failures / 0 errors / 0 pending : 0.0 seconds"\n',
          'printf "result\\tdslua\\tfake\\t%s\\t1\\ttokens/s\\n" "$(echo "$*" | tr " " _)"\n')
  f:close()
  for _, to in ipairs({ 'build/dslua', 'build/test_zero', 'bin/python3' }) do
    assert(os.execute(string.format('cp %s %s/%s && chmod +x %s/%s', fake, root, to, root, to)) == 0)
  end
  -- bench/staged.sh runs mpirun itself, bench/curve.sh looks for a GPU: stand-ins in their place
  for _, sh in ipairs({ 'staged.sh', 'curve.sh' }) do
    assert(os.execute(string.format('rm %s/bench/%s && cp %s %s/bench/%s', root, sh, fake, root, sh)) == 0)
  end
  return root
end

-- Runs the script of the copy at root with env; its output and status.
local function device_check(root, env, args)
  return H.run(string.format('cd %s && unset DSLUA_NUM_THREADS && FAKE_ROOT=%s PATH=%s/bin:$PATH OUT=%s/out %s '
                             .. 'bash scripts/device_check.sh %s',
                             root, root, root, root, env or '', args or ''))
end

-- The script run on a fresh copy with env: its summary, output and status,
-- and the copy.
local function fake_run(env)
  local root = fake_project()
  local out, status = device_check(root, env)
  return H.read(root .. '/out/summary.txt'), out, status, root
end

describe('scripts/device_check.sh', function()
  it('plans every part the GPU run needs within the 420 s budget', function()
    local out, status = H.run('bash scripts/device_check.sh --plan')
    assert.are.equal(0, status, out)
    local parts, by_name = parse_plan(out), {}
    for _, p in ipairs(parts) do by_name[p.name] = p end
    for _, need in ipairs(NEEDED) do
      local p = by_name[need[1]]
      assert.is_not_nil(p, 'no part ' .. need[1] .. ' in:\n' .. out)
      assert.truthy(p.cmd:find(need[2], 1, true), need[1] .. ' runs ' .. p.cmd)
    end
    local total = length(parts)
    assert.is_true(total <= 420, out)
    H.has(out, string.format('planned %d s of the 420 s budget', total))
    -- the lanes: the GPU suite, the MPI path, the NCCL double, side by side
    assert.are.equal(by_name.gpu_first.lane, by_name.c_test_zero.lane)
    assert.are_not.equal(by_name.c_test_zero.lane, by_name.mpi_zero.lane)
    assert.are_not.equal(by_name.mpi_zero.lane, by_name.nccl_zero.lane)
    assert.are.equal('-', by_name.bench_xl_offload.lane)
    -- the loss curve beside the lanes, in one of its own
    for _, other in ipairs({ 'c_test_zero', 'mpi_zero', 'nccl_zero' }) do
      assert.are_not.equal(by_name[other].lane, by_name.curve.lane)
    end
    assert.are_not.equal('-', by_name.curve.lane)
    -- every GPU spec runs in some part
    local all = {}
    for _, p in ipairs(parts) do all[#all + 1] = p.cmd end
    all = table.concat(all, '\n') .. '\n'
    for spec in H.run('ls spec/gpu/*_spec.lua'):gmatch('[^\n]+') do
      assert.truthy(all:find(spec .. '[ \n]'), spec .. ' runs in no part:\n' .. out)
    end
  end)

  it('fails its plan where a file a part runs is renamed, naming the part and the file', function()
    local root = fake_project()
    os.execute(string.format('mv %s/spec/gpu/fp8_spec.lua %s/spec/gpu/fp8_gpu_spec.lua', root, root))
    os.execute('rm ' .. root .. '/bench/gpu_torch.py')
    local out, status = device_check(root, '', '--plan')
    assert.are.equal(1, status, out)
    H.has(out, 'device_check: part gpu_first runs spec/gpu/fp8_spec.lua, which does not exist')
    H.has(out, 'device_check: part bench_bf16_torch runs bench/gpu_torch.py, which does not exist')
    assert.truthy(out:find('gpu_rest[^\n]*spec/gpu/fp8_gpu_spec.lua'), out)   -- the renamed one still runs
  end)

  it('fails its plan where a C test has a GPU case no part runs', function()
    local root = fake_project()
    local f = assert(io.open(root .. '/tests/test_newgpu.c', 'w'))
    f:write('int main(void) { return ds_cuda_device_count() == 0; }\n')
    f:close()
    local out, status = device_check(root, '', '--plan')
    assert.are.equal(1, status, out)
    H.has(out, 'device_check: tests/test_newgpu.c has a GPU case but no part runs build/test_newgpu')
  end)

  it('fails its plan where the limits pass the budget', function()
    local out, status = H.run('DEVICE_CHECK_SECONDS=300 bash scripts/device_check.sh --plan')
    assert.are.equal(1, status, out)
    assert.matches('device_check: the parts need %d+ s, over the 300 s budget', out)
  end)

  it('runs every part, the lanes side by side, and tables the bench rows', function()
    -- each lane's first part takes 3 s, time for the other lanes' first parts to start on a loaded machine
    local summary, out, status, root = fake_run("FAKE_SLEEP=3 FAKE_SLOW='test_zero\\|filter=primitive\\|ddp_spec over NCCL'")
    assert.are.equal(0, status, out)
    for _, need in ipairs(NEEDED) do
      assert.matches('\nok +' .. need[1] .. ' +rc=0 +%d+ s  1 success / ', summary)
    end
    H.has(summary, 'bench/gpu.lua_train_4_bf16_50304_gpt2_xl_offload_quick')
    H.has(H.read(root .. '/out/plan.txt'), 'planned 420 s of the 420 s budget')
    -- the first part of each lane starts before any of them ends
    local starts, ends = {}, {}
    for t, what, cmd in H.read(root .. '/calls'):gmatch('([%d.]+) (%a+) ([^\n]*)') do
      if cmd:find('test_zero', 1, true) or cmd:find('filter=primitive', 1, true) or cmd:find('ddp_spec over NCCL', 1, true) then
        table.insert(what == 'start' and starts or ends, tonumber(t))
      end
    end
    assert.are.equal(3, #starts)
    assert.is_true(math.max(unpack(starts)) < math.min(unpack(ends)), H.read(root .. '/calls'))
    -- the suite's lane on 4 threads beside the ranks, the benches on what they choose
    local calls = H.read(root .. '/calls')
    assert.truthy(calls:find('start build/dslua [^\n]*ops_spec.lua threads=4\n'), calls)
    assert.truthy(calls:find('start build/dslua bench/gpu.lua train 4 bf16 50304 gpt2_xl offload quick threads=\n', 1, true),
                  calls)
  end)

  it('says in its summary which part the budget cut and which it left out', function()
    local summary, out, status = fake_run("DEVICE_CHECK_SECONDS=24 FAKE_SLEEP=30 FAKE_SLOW='ops_spec\\|ddp_spec over NCCL'")
    assert.are.equal(1, status, out)
    assert.matches('\nCUT +gpu_ops +rc=124 +%d+ s  timed out after %d+ s %(cut from 45 s%)', summary)
    -- the NCCL lane, 30 s shorter than the suite's, lets its first part take them: more than its lane's
    -- clock would give it from the start (10 s after the report's 10)
    local limit = tonumber(summary:match('\nCUT +nccl_ddp +rc=124 +%d+ s  timed out after (%d+) s\n'))
    assert.is_true(limit ~= nil and limit > 20, summary)
    assert.matches('\nok +mpi_tp +rc=0 ', summary)     -- the MPI lane ran on meanwhile
    for _, name in ipairs({ 'gpu_rest', 'nccl_zero', 'bench_bf16', 'bench_xl_offload', 'staged' }) do
      assert.matches('\nCUT +' .. name .. ' +left out: %-?%d+ s left of its %d+ s', summary)
    end
    H.has(out, 'device_check: the parts need 420 s, over the 24 s budget')
  end)

  it('runs only the parts DEVICE_CHECK_PARTS names', function()
    local summary, out, status = fake_run("DEVICE_CHECK_PARTS='bench_fp8,staged'")
    assert.are.equal(0, status, out)
    assert.matches('\nok +bench_fp8 ', summary)
    assert.matches('\nok +staged ', summary)
    assert.is_nil(summary:find('report', 1, true), summary)
    assert.is_nil(summary:find('mpi_', 1, true), summary)
  end)

  it('marks a bench that found no data EMPTY and exits with status 1', function()
    local root = fake_project()
    H.write(root .. '/bench/curve.sh', 'echo "bench/curve.sh: skipped: data/tinyshakespeare/input.txt is absent"\n')
    local out, status = device_check(root, "DEVICE_CHECK_PARTS=curve")
    assert.are.equal(1, status, out)
    assert.matches('\nEMPTY +curve +rc=0 +%d+ s  bench/curve.sh: skipped: ', H.read(root .. '/out/summary.txt'))
  end)

  it('says a part in which no test ran, and exits with status 1', function()
    -- a filter that matches nothing takes a describe's pending (no GPU) with it
    local summary, out, status = fake_run("DEVICE_CHECK_PARTS=mpi_tp FAKE_TALLY='0 successes'")
    assert.are.equal(1, status, out)
    assert.matches('\nEMPTY +mpi_tp +rc=0 +%d+ s  0 successes / ', summary)
  end)
end)
