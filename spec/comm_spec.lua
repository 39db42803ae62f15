-- ds.comm: world size 1 in this process, then 2, 3 and 4 ranks under
-- mpirun running spec/comm/primitives.lua (every primitive, every dtype)
-- and spec/comm/failures.lua (an error, an exit, a kill, a timeout, a
-- mismatched collective: the job ends fast and names the rank).
local H = require 'helpers'
local ds = H.ds
local c = ds.comm

local function vals(t) return t:to('f64'):reshape(-1):totable() end

describe('ds.comm at world size 1', function()
  it('is one rank without MPI', function()
    assert.are.equal(0, c.rank())
    assert.are.equal(1, c.world_size())
    assert.are.equal(0, c.local_rank())
    assert.are.equal(1, c.local_size())
    assert.is_false(c.launched())
    assert.is_false(c.is_initialized())
  end)

  it('makes every primitive a no-op or a copy', function()
    local t = ds.tensor({ 1, 2, 3 })
    assert.are.equal(t, c.all_reduce(t, 'avg'))
    assert.are.same({ 1, 2, 3 }, vals(t))
    assert.are.same({ 1, 2, 3 }, vals(c.broadcast(t, 0)))
    assert.are.same({ 1, 2, 3 }, vals(c.reduce(t, 0, 'max')))
    local all = c.all_gather(t)
    assert.are.equal(1, #all)
    all[1]:fill_(7)
    assert.are.same({ 1, 2, 3 }, vals(t))          -- a copy, not the tensor
    assert.are.same({ 1, 2, 3 }, vals(c.gather(t, 0)[1]))
    local s = c.scatter({ ds.tensor({ 4, 5 }, 'i64') }, 0)
    assert.are.equal('i64', s:dtype())
    assert.are.same({ 4, 5 }, vals(s))
    assert.are.same({ 6 }, vals(c.reduce_scatter({ ds.tensor({ 6 }, 'bf16') })))
    assert.is_nil(c.barrier())
    local w = c.all_reduce(t, { async = true })
    assert.is_true(w:is_completed())
    assert.are.equal(t, w:wait())
    local g = c.new_group({ 0 })
    assert.are.equal(0, g:rank())
    assert.are.same({ 1, 2, 3 }, vals(c.all_reduce(t, 'sum', { group = g })))
  end)

  it('raises errors that name the primitive', function()
    local t = ds.ones(2)
    local function fails(pattern, fn, ...)
      local ok, err = pcall(fn, ...)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(pattern, 1, true), tostring(err))
    end
    fails('send: dst 1 out of range for a world of 1 rank', c.send, t, 1)
    fails('recv: src 0 is this rank', c.recv, t, 0)
    fails('all_reduce: op avg needs a floating dtype, got i32', c.all_reduce, ds.ones(2, 'i32'), 'avg')
    fails("all_reduce: unknown op 'mean'", c.all_reduce, t, 'mean')
    fails('all_reduce: expected a tensor, got nil', c.all_reduce, nil)
    fails('broadcast: src must be a rank', c.broadcast, t, -1)
    fails('scatter: needs a list of 1 tensor (one per rank of world), got 2', c.scatter, { t, t }, 0)
    fails('reduce_scatter: needs a list of 1 tensor', c.reduce_scatter, {})
    fails('reduce_scatter: list entry 1 is not a tensor', c.reduce_scatter, { 3 })
    fails('new_group: rank 1 out of range for a world of 1 rank', c.new_group, { 1 })
    fails('new_group: rank 0 listed twice', c.new_group, { 0, 0 })
    fails('all_gather: options must be a table or a group', c.all_gather, t, 'x')
    fails('set_timeout: seconds must be > 0', c.set_timeout, 0)
  end)

  it('keeps the timeout', function()
    local before = c.get_timeout()
    c.set_timeout(12.5)
    assert.are.equal(12.5, c.get_timeout())
    c.set_timeout(before)
  end)

  it('prints DeepSpeed comms summary numbers', function()
    assert.are.equal('0B', c.convert_size(0))
    assert.are.equal('40.0 B', c.convert_size(40))
    assert.are.equal('1.5 KB', c.convert_size(1536))
    assert.are.equal('256.0 MB', c.convert_size(256 * 2 ^ 20))
    -- Gbps from bytes and ms on 4 ranks: busbw factors 2(n-1)/n, (n-1)/n, 1
    local a, b = c.bandwidth('all_reduce', 1e6, 1, 4)
    assert.are.near(16, a, 1e-9)
    assert.are.near(12, b, 1e-9)
    a, b = c.bandwidth('all_gather', 1e6, 1, 4)
    assert.are.near(32, a, 1e-9)
    assert.are.near(24, b, 1e-9)
    a, b = c.bandwidth('broadcast', 1e6, 1, 4)
    assert.are.near(8, a, 1e-9)
    assert.are.near(8, b, 1e-9)
    c.reset_logger()
    c.configure_logger({ enabled = true, prof_all = false, prof_ops = { 'all_reduce' } })
    for _ = 1, 3 do c.all_reduce(ds.ones(1024)) end
    c.broadcast(ds.ones(4), 0)                       -- not profiled
    c.barrier({ prof = true })                       -- profiled for this call
    local lines = c.log_summary({ print = false })
    c.configure_logger({ enabled = false })
    c.reset_logger()
    assert.are.equal('Comm. Op            Message Size        Count               Total Latency(ms)   '
                     .. 'Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)    ', lines[1])
    assert.are.equal('all_reduce', lines[2])
    assert.truthy(lines[3]:match('^                    4%.0 KB              3                   [%d%.]+ +[%d%.]+ +'),
                  lines[3])
    assert.are.equal('barrier', lines[4])
    assert.truthy(lines[5]:match('^ +0B +1 '), lines[5])
    assert.are.equal(5, #lines)
    -- debug: records named after the function that called ds.comm
    c.configure_logger({ enabled = true, debug = true })
    local function sync_grads() c.all_reduce(ds.ones(2)) end
    sync_grads()
    assert.are.equal(1, c.logger_records()['all_reduce | [Caller Func: sync_grads]'][8].count)
    c.configure_logger({ enabled = false, debug = false })
    c.reset_logger()
  end)

  it('prefixes printed lines with the rank, and starts fast without MPI', function()
    local t0 = ds.wall_time()
    local out, status = H.run(H.bin() .. [[ -e "local ds = require 'dslua'; ds.comm.all_reduce(ds.ones(3));]]
                              .. [[ ds.comm.print('a\nb', 1); print(ds.comm.is_initialized())"]])
    assert.are.equal(0, status, out)
    assert.are.equal('[rank 0] a\n[rank 0] b\t1\nfalse\n', out)
    assert.is_true(ds.wall_time() - t0 < 2)
  end)
end)

-- outdir: each rank's stdout also goes to outdir/1/rank.N/stdout (mpirun
-- forwards output in chunks that can split a line between ranks)
local function mpirun(np, script, args, env, outdir)
  local cmd = 'DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. (env or '') .. ' '
              .. H.mpirun(np, { 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT' })
              .. (outdir and ' --output-filename ' .. outdir or '') .. ' '
              .. H.bin() .. ' spec/comm/' .. script .. ' ' .. (args or '')
  local t0 = ds.wall_time()
  local out, status = H.run(cmd)
  return out, status, ds.wall_time() - t0
end

local count = H.count

describe('ds.comm under mpirun', function()
  if H.skip_without_mpirun() then return end

  -- PASS lines of primitives.lua per rank, on 2, 3 and 4 ranks
  local expected = { [2] = { 157, 149 }, [3] = { 173, 157, 157 }, [4] = { 189, 165, 165, 164 } }
  for _, np in ipairs({ 2, 3, 4 }) do
    it('checks every primitive on ' .. np .. ' ranks', function()
      local dir = H.tmpdir()
      local out, status = mpirun(np, 'primitives.lua', nil, nil, dir)
      assert.are.equal(0, status, out)
      local total, first = 0, nil
      for q = 0, np - 1 do
        local f = assert(io.open(dir .. '/1/rank.' .. q .. '/stdout'))
        local text = f:read('*a')
        f:close()
        assert.are.equal(0, count(text, 'FAIL'), text)
        assert.are.equal(expected[np][q + 1], count(text, '%[rank ' .. q .. '%] PASS '), text)
        assert.truthy(text:find('[rank ' .. q .. '] PASS bf16 sum rounded once', 1, true), text)
        total = total + expected[np][q + 1]
        if q == 0 then
          -- the comms logger's table, printed by rank 0 only
          assert.are.equal(1, count(text, 'Comm%. Op +Message Size +Count +Total Latency%(ms%)'))
          assert.truthy(text:find('\nall_reduce\n                    4.0 KB              3   ', 1, true), text)
          first = text
        end
      end
      assert.truthy(first:find('DONE checks=' .. total .. ' failures=0', 1, true), first)
      os.execute('rm -rf ' .. dir)
    end)
  end

  local function fails_fast(np, mode, max_s, env)
    local out, status, secs = mpirun(np, 'failures.lua', mode, env)
    assert.are_not.equal(0, status, out)
    assert.is_true(secs < max_s, string.format('took %.1f s\n%s', secs, out))
    assert.are.equal(0, count(out, 'second collective done'), out)
    return out
  end

  it('ends every rank within seconds when one raises an error, naming it', function()
    local out = fails_fast(3, 'error', 8)
    assert.truthy(out:find('%[rank 2%] error: spec/comm/failures%.lua:%d+: boom in rank 2'), out)
  end)

  it('ends every rank when one exits with a failure status', function()
    local out = fails_fast(3, 'exit', 8)
    assert.truthy(out:find('[rank 2] exited with status 3', 1, true), out)
  end)

  it('ends every rank when one exits early with status 0', function()
    local out = fails_fast(3, 'exit0', 8)
    assert.truthy(out:find('all_reduce%(f32, 10 elements%) #2 cannot complete on rank %d: rank 2 exited %(status 0%) ' ..
                           'without joining it'), out)
  end)

  it('fails a receive at once when its sender has left', function()
    local out = fails_fast(2, 'recv', 8)
    assert.truthy(out:find('recv(f32, 10 elements) from rank 1 cannot complete on rank 0: rank 1 exited (status 0)', 1,
                           true), out)
  end)

  it('refuses a recv into a tensor larger than what its send sent, naming both sizes', function()
    local out = mpirun(2, 'failures.lua', 'recv_size')
    H.has(out, 'refused: recv: rank 1 sent 4 elements, the receiving tensor holds 10: a recv takes exactly what its '
          .. 'send sends')
    assert.are.equal(0, count(out, 'recv accepted'), out)
  end)

  it('ends every rank when one is killed', function()
    local out = fails_fast(3, 'kill', 8)
    assert.truthy(out:find('process rank 2 with PID %d+ on node %S+ exited on signal 9'), out)
  end)

  it('times out a collective a rank never joins, naming it and where each rank was', function()
    local out = fails_fast(2, 'timeout', 9, 'DSLUA_COMM_TIMEOUT=2')
    assert.truthy(out:find('[rank 0] error: all_reduce(f32, 10 elements) #2 timed out on rank 0 of 2 after 2.0 s ' ..
                           '(timeout 2 s: ds.comm.set_timeout, DSLUA_COMM_TIMEOUT): rank 1 did not arrive. Where ' ..
                           'each rank was: rank 0 waiting 2.0 s in all_reduce(f32, 10 elements) #2; last done ' ..
                           'all_reduce(f32, 10 elements) #1 on world', 1, true), out)
    H.has(out, 'rank 1 no answer in 1 s (stopped, or busy outside ds.comm)')
  end)

  it('names a stopped rank at a timeout, and where the others were', function()
    local out = fails_fast(3, 'stop', 9, 'DSLUA_COMM_TIMEOUT=2')
    -- a survivor names rank 2 and says where the other survivor was (the
    -- first to report ends the job, so the other may be gone before it prints)
    local reports = 0
    for _, q in ipairs({ 0, 1 }) do
      local line = out:match('%[rank ' .. q .. '%] error: ([^\n]*)')
      if line then
        reports = reports + 1
        H.has(line, 'all_reduce(f32, 10 elements) #2 timed out on rank ' .. q .. ' of 3')
        assert.truthy(line:find('rank 2 did not arrive%. Where each rank was: .*rank ' .. (1 - q) ..
                                ' waiting [%d.]+ s in all_reduce%(f32, 10 elements%) #2'), line)
        H.has(line, 'rank 2 no answer in 1 s (stopped, or busy outside ds.comm)')
      end
    end
    assert.is_true(reports >= 1, out)
  end)

  it('gives the exit wait a deadline: a rank stuck after its last collective is named', function()
    local out, status, secs = mpirun(2, 'failures.lua', 'stuck', 'DSLUA_COMM_TIMEOUT=2')
    assert.are_not.equal(0, status, out)
    assert.is_true(secs < 9, string.format('took %.1f s\n%s', secs, out))
    H.has(out, '[rank 0] error: exit of rank 0 timed out on rank 0 of 2 after 2.0 s')
    H.has(out, 'rank 1 did not reach the exit. Where each rank was: rank 0 waiting 2.0 s in exit of rank 0')
  end)

  it('names the ranks and both calls when collectives do not match', function()
    local out = fails_fast(3, 'mismatch', 8)
    assert.truthy(out:find('comm check: rank 2 called broadcast(f32, 10 elements, root 0) #2 while rank 0 called ' ..
                           'all_reduce(f32, 10 elements) #2', 1, true), out)
  end)

  it('agrees on the count before any byte moves, by default: every rank refuses, and goes on', function()
    local out, status = mpirun(2, 'failures.lua', 'count')
    assert.are.equal(0, status, out)
    for q = 0, 1 do
      H.has(out, '[rank ' .. q .. '] refused: comm check: rank 1 called all_reduce(f32, 10000 elements) #2 while ' ..
            'rank 0 called all_reduce(f32, 10 elements) #2')
      H.has(out, '[rank ' .. q .. '] all_reduce(f32, ' .. (q == 1 and '10000' or '10') .. ' elements) #2 failed')
      H.has(out, '[rank ' .. q .. '] refused: comm check: rank 1 called all_to_all(f32, 4 elements) #3 while ' ..
            'rank 0 called all_to_all(f32, 2 elements) #3')
      H.has(out, '[rank ' .. q .. '] second collective done')
    end
  end)

  it('lets ranks finish at different times', function()
    local out, status = mpirun(3, 'failures.lua', 'stagger')
    assert.are.equal(0, status, out)
    assert.are.equal(3, count(out, '%] END'), out)
  end)
end)
