-- Checkpoints (lua/dslua/checkpoint.lua, core/io/ds_safetensors.c): the
-- file format, exact resume, resharding across world sizes, stages and
-- dtypes, atomic saves under kill -9, corrupt files, export and import
-- with PyTorch. Multi-rank runs are spec/ckpt/run.lua under mpirun.
local H = require 'helpers'
local ds = H.ds
local C = require('dslua.core').ckpt
local CK = ds.checkpoint

local RUN = 'spec/ckpt/run.lua'

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- Runs run.lua on np ranks with options o; its JSON and output.
local function run(np, o, env)
  local out = os.tmpname()
  local cmd = (env or '') .. H.ranks_cmd(np) .. ' ' .. RUN .. ' ' .. out .. ' ' .. shell_quote(ds.json.encode(o))
  local r, text = H.run_json(cmd, out)
  os.remove(out)
  return r, text
end

-- Every tensor of two checkpoints the same, to the bit: fp32 weights,
-- optimizer buffers, module buffers, and the optimizer's steps.
local function same_state(dir_a, tag_a, dir_b, tag_b)
  local a, b = CK.read_full(dir_a, tag_a, true), CK.read_full(dir_b, tag_b, true)
  local n = 0
  for kind, tensors in pairs(a.states) do
    for name, t in pairs(tensors) do
      local u = assert(b.states[kind][name], kind .. '/' .. name .. ' missing')
      assert.are.same(t:size(), u:size())
      local d = (t - u):abs():amax():item()
      assert(d == 0, string.format('%s/%s differs by %g', kind, name, d))
      n = n + 1
    end
  end
  for g, grp in ipairs(a.manifest.optimizer.param_groups) do
    assert.are.equal(grp.step, b.manifest.optimizer.param_groups[g].step)
  end
  return n
end

local function steps_of(r)
  local out = {}
  for k in pairs(r.losses) do out[#out + 1] = tonumber(k) end
  table.sort(out)
  return out
end

describe('safetensors files', function()
  local dir = H.tmpdir()

  it('hold every dtype, shapes and metadata, byte for byte, with each SHA-256', function()
    local ts = { { 'a', ds.randn(3, 4) }, { 'b', ds.arange(10):to('bf16') }, { 'c', ds.randn(2, 2, 'f64') },
                 { 'd', ds.tensor({ 1, -2, 3 }, 'i64') }, { 'e', ds.tensor({ 7 }, 'u8') }, { 'f', ds.randn(5):to('f16') },
                 { 'g', ds.zeros(0) }, { 'h', ds.randn(4, 6):transpose(1, 2) } }
    local path = dir .. '/all.safetensors'
    local bytes, sha, sums = C.save(path, ts, { format = 'pt', who = 'spec' }, { hashes = true })
    assert.are.equal(sha, C.sha256_file(path))
    local f = assert(io.open(path, 'rb'))
    local raw = f:read('*a')
    f:close()
    assert.are.equal(bytes, #raw)
    -- the format: 8-byte little-endian length, JSON, data 8-byte aligned
    local n = 0
    for i = 8, 1, -1 do n = n * 256 + raw:byte(i) end
    assert.are.equal(0, (8 + n) % 8)
    local header = ds.json.decode(raw:sub(9, 8 + n))
    assert.are.same({ 6, 4 }, { header.h.shape[1], header.h.shape[2] })
    assert.are.equal('BF16', header.b.dtype)
    assert.are.equal('spec', header.__metadata__.who)
    local st = C.open(path)
    for k, e in ipairs(ts) do
      local got = st:read(e[1])
      local want = e[2]:contiguous():view(-1)
      assert.are.equal(want:dtype(), got:dtype())
      assert.are.same(want:totable(), got:totable())
      assert.are.equal(sums[k], st:sha256(e[1]))
    end
    assert.are.same({ 6, 4 }, st:entry('h').shape)
    assert.are.same({ 3, 4, 5 }, st:read('b', 3, 3):to('f32'):totable())
    st:close()
    local back = CK.load_file(path)
    assert.are.same(ts[8][2]:totable(), back.h:totable())
  end)

  it('are written whole or not at all: a temporary name, then a rename', function()
    local path = dir .. '/x.safetensors'
    C.save(path, { { 'a', ds.ones(4) } })
    local out = H.run('ls ' .. dir)
    assert.is_nil(out:find('tmp', 1, true))
    H.has(H.err(C.save, dir .. '/no/such/dir/y.safetensors', { { 'a', ds.ones(1) } }), "cannot create '" .. dir .. '/no')
  end)

  it('that are truncated or corrupt give errors naming the file and the tensor', function()
    local path = dir .. '/t.safetensors'
    C.save(path, { { 'first', ds.ones(100) }, { 'second', ds.ones(100) } })
    local f = assert(io.open(path, 'rb'))
    local raw = f:read('*a')
    f:close()
    H.write(path .. '.cut', raw:sub(1, #raw - 10))
    H.has(H.err(C.open, path .. '.cut'), "tensor 'second': its bytes [400, 800) run past the end of the data (790 "
                                         .. 'bytes): the file is truncated')
    H.write(path .. '.short', raw:sub(1, 30))
    H.has(H.err(C.open, path .. '.short'), 'runs past the end of the file (30 bytes): the file is truncated')
    H.write(path .. '.json', raw:sub(1, 8) .. raw:sub(9, 20):gsub('"', '!') .. raw:sub(21))
    H.has(H.err(C.open, path .. '.json'), 'the header is not a JSON object: not a safetensors file, or corrupt')
    H.write(path .. '.dtype', (raw:gsub('"F32"', '"I16"', 1)))
    H.has(H.err(C.open, path .. '.dtype'), "tensor 'first': dtype 'I16' is not one dslua reads")
    H.write(path .. '.len', '\255\255\255\255\255\255\0\0' .. raw:sub(9))
    H.has(H.err(C.open, path .. '.len'), 'not a safetensors file, or corrupt')
    H.has(H.err(C.open, dir .. '/absent.safetensors'), "cannot open '" .. dir .. "/absent.safetensors'")
  end)

  it('carry the RNG state: get_rng_state / set_rng_state replay the same numbers', function()
    ds.manual_seed(3)
    ds.randn(5)
    local s = ds.get_rng_state()
    local a = ds.randn(7)
    ds.set_rng_state(s)
    assert.are.same(a:totable(), ds.randn(7):totable())
    H.has(H.err(ds.set_rng_state, 'xyz'), 'set_rng_state: expected 32 hex digits')
  end)
end)

describe('the checkpoint config block', function()
  it("is DeepSpeed's: tag_validation in any case, load_universal, use_node_local_storage, parallel_write", function()
    local cfg, notes = ds.config.load { train_batch_size = 1, checkpoint = { tag_validation = 'fail',
      load_universal = true, use_node_local_storage = false, parallel_write = { pipeline_stage = false } } }
    assert.are.equal('FAIL', cfg.checkpoint.tag_validation)
    assert.is_true(cfg.checkpoint.load_universal)
    H.has(table.concat(notes, '\n'), 'checkpoint.load_universal: dslua\'s checkpoints load on any world size')
    assert.are.equal('WARN', ds.config.load({ train_batch_size = 1 }).checkpoint.tag_validation)
    local e = H.err(ds.config.load, { train_batch_size = 1, checkpoint = { tag_validation = 'sometimes',
                                                                            parallel_write = { pipeline = true } } })
    H.has(e, 'checkpoint.tag_validation: must be "Ignore", "Warn" or "Fail" (any case), got "sometimes"')
    H.has(e, "checkpoint.parallel_write.pipeline: unknown key, did you mean 'pipeline_stage'?")
  end)
end)

describe('exact resume', function()
  if not H.have_mpirun() then
    print('skipping: multi-rank checkpoint specs need mpirun')
    return
  end
  local UNEVEN = { policy = 'uneven', micro_batch_per_rank = { 6, 2 }, data_share = { 0.75, 0.25 }, shuffle = true,
                   seed = 3 }
  local CASES = {
    { name = '1 rank, stage 0 fp32, gas 2, dropout, the distributed policy', np = 1,
      o = { stage = 0, gas = 2, dropout = 0.1, sampler = { policy = 'distributed', micro_batch_per_rank = { 4 } } } },
    { name = '1 rank, stage 3 fp16 (loss scaler), gas 2, DeepSpeed\'s loader', np = 1,
      o = { stage = 3, dtype = 'fp16', gas = 2 } },
    { name = '2 ranks, stage 0 fp32, gas 2, dropout, a custom policy with state', np = 2,
      o = { stage = 0, gas = 2, dropout = 0.1, sampler = { policy = 'spec/ckpt/policy.lua', micro_batch_per_rank = { 3, 3 } } } },
    { name = '2 ranks, stage 2 bf16, gas 2, the uneven policy', np = 2,
      o = { stage = 2, dtype = 'bf16', gas = 2, sampler = UNEVEN } },
  }
  local K, AFTER = 7, 50
  for _, case in ipairs(CASES) do
    it('equals the run that never stopped, to the bit, for 50 steps: ' .. case.name, function()
      local a_dir, b_dir = H.tmpdir(), H.tmpdir()
      local o = {}
      for k, v in pairs(case.o) do o[k] = v end
      o.dir, o.steps, o.save_at, o.final = a_dir, K + AFTER, K, 'final'
      local full = run(case.np, o)
      o.dir, o.save_at, o.load_dir, o.load = b_dir, nil, a_dir, 'global_step' .. K
      local resumed = run(case.np, o)
      -- the loop sees every step but those join takes at an epoch's end
      -- (an unfinished accumulation window): the same ones in both runs
      local steps, want = steps_of(resumed), {}
      for _, s in ipairs(steps_of(full)) do
        if s > K then want[#want + 1] = s end
      end
      assert.are.same(want, steps)
      assert.is_true(#steps >= AFTER - 5)
      for _, s in ipairs(steps) do
        assert.are.same(full.losses[tostring(s)], resumed.losses[tostring(s)], 'step ' .. s)
      end
      for _, k in ipairs({ 'global_steps', 'global_samples', 'epoch', 'skipped', 'scale', 'lr' }) do
        assert.are.same(full[k], resumed[k], k)
      end
      assert.are.same({ note = 'client', step = K, t = { 0, 1, 2 } }, resumed.client)
      assert.is_true(same_state(a_dir, 'final', b_dir, 'final') > 0)
    end)
  end
end)
