-- Checkpoints (lua/dslua/io/checkpoint/, core/io/ds_safetensors.c): the
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

-- a 1-rank engine of run.lua's model in this process, to load with
local function tiny_engine()
  ds.manual_seed(100)
  local m = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 }
  return (ds.initialize { model = m, config = { train_batch_size = 4, steps_per_print = 1000,
                                                optimizer = { type = 'AdamW', params = { lr = 1e-2 } } } })
end

local same_state = H.same_checkpoints

local function steps_of(r)
  local out = {}
  for k in pairs(r.losses) do out[#out + 1] = tonumber(k) end
  table.sort(out)
  return out
end

-- 2 ranks save in epoch 1 (96 samples), 1 and 3 ranks resume: the samples
-- of the runs' epoch 1 are the epoch, each once, and global_samples at
-- its end is 96 on every world size
local function one_epoch(...)
  local runs, all, count = { ... }, {}, {}
  for _, r in ipairs(runs) do
    for _, v in ipairs(r.seen) do all[#all + 1] = v end
  end
  for _, v in ipairs(all) do count[v] = (count[v] or 0) + 1 end
  for i = 0, 95 do assert.are.equal(1, count[i], 'sample ' .. i) end
  assert.are.equal(96, #all)
  assert.are.equal(96, runs[#runs].epoch1_samples)
end

describe('safetensors files', function()
  local dir = H.tmpdir()

  it('take a model\'s state_dict as save_file\'s tensors, its one value, and give it back', function()
    local m = ds.nn.Sequential(ds.nn.Linear(3, 2), ds.nn.LayerNorm(2))
    assert.are.equal(1, select('#', m:state_dict()))
    local path = dir .. '/model.safetensors'
    CK.save_file(path, m:state_dict())
    local back = CK.load_file(path)
    for _, name in ipairs(m:state_keys()) do
      assert.are.same(m:state_dict()[name]:totable(), back[name]:totable())
    end
    assert.are.same({ '0.weight', '0.bias', '1.weight', '1.bias' }, m:state_keys())
  end)

  it('hold every dtype, shapes and metadata, byte for byte, with the SHA-256 and each CRC-32', function()
    local ts = { { 'a', ds.randn(3, 4) }, { 'b', ds.arange(10):to('bf16') }, { 'c', ds.randn(2, 2, 'f64') },
                 { 'd', ds.tensor({ 1, -2, 3 }, 'i64') }, { 'e', ds.tensor({ 7 }, 'u8') }, { 'f', ds.randn(5):to('f16') },
                 { 'g', ds.zeros(0) }, { 'h', ds.randn(4, 6):transpose(1, 2) } }
    local path = dir .. '/all.safetensors'
    local bytes, sha, sums = C.save(path, ts, { format = 'pt', who = 'spec' }, { crc32 = true })
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
      assert.are.equal(sums[k], st:crc32(e[1]))
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
    H.has(H.err(C.save, dir .. '/no/such/dir/y.safetensors', { { 'a', ds.ones(1) } }),
          "cannot open the directory '" .. dir .. "/no': No such file or directory")
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

  -- A file of the given header text (padded) and data bytes.
  local function raw_file(path, header, data)
    header = header .. string.rep(' ', (8 - #header % 8) % 8)
    local n, len = #header, {}
    for i = 1, 8 do len[i] = string.char(n % 256); n = math.floor(n / 256) end
    H.write(path, table.concat(len) .. header .. data)
  end

  local function entry(name, dtype, shape, b, e)
    return string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', name, dtype,
                         table.concat(shape, ','), b, e)
  end

  it('refuse a tensor named twice and tensors that share bytes, naming them', function()
    local path = dir .. '/dup.safetensors'
    raw_file(path, '{' .. entry('a', 'F32', { 1 }, 0, 4) .. ',' .. entry('a', 'F32', { 1 }, 4, 8) .. '}', ('\0'):rep(8))
    H.has(H.err(C.open, path), "'" .. path .. "': tensor 'a' is in the header twice: the file is corrupt")
    raw_file(path, '{' .. entry('w', 'F32', { 2 }, 0, 8) .. ',' .. entry('v', 'F32', { 2 }, 4, 12) .. '}', ('\0'):rep(12))
    H.has(H.err(C.open, path), "tensors 'w' [0, 8) and 'v' [4, 12) share bytes: the file is corrupt")
    raw_file(path, '{' .. entry('w', 'F32', { 4 }, 0, 16) .. ',' .. entry('v', 'F32', { 1 }, 8, 12) .. '}', ('\0'):rep(16))
    H.has(H.err(C.open, path), "tensors 'w' [0, 16) and 'v' [8, 12) share bytes")
    -- listed out of the data's order, and an empty tensor at any offset: fine
    raw_file(path, '{' .. entry('z', 'U8', { 0 }, 2, 2) .. ',' .. entry('b', 'U8', { 2 }, 2, 4) .. ','
             .. entry('a', 'U8', { 2 }, 0, 2) .. '}', '\1\2\3\4')
    local f = C.open(path)
    assert.are.same({ 1, 2 }, f:read('a'):totable())
    assert.are.same({ 3, 4 }, f:read('b'):totable())
    assert.are.same({}, f:read('z'):totable())
    assert.is_nil(f:entry('c'))
    f:close()
    raw_file(path, '{"__metadata__":{"a":"1"},"__metadata__":{"b":"2"}}', '')
    H.has(H.err(C.open, path), '__metadata__ is in the header twice')
    -- a name of a megabyte is quoted by its first 100 bytes
    local long = ('n'):rep(2 ^ 20)
    raw_file(path, '{' .. entry(long, 'F32', { 1 }, 0, 4) .. ',' .. entry(long, 'F32', { 1 }, 4, 8) .. '}', ('\0'):rep(8))
    local e = H.err(C.open, path)
    H.has(e, "tensor '" .. ('n'):rep(100) .. "...' is in the header twice")
    assert.is_true(#e < 400, #e .. ' bytes')
    raw_file(path, '{' .. entry(long, 'I16', { 1 }, 0, 2) .. '}', ('\0'):rep(2))
    assert.is_true(#H.err(C.open, path) < 400)
  end)

  it('refuse shapes and header lengths past 64 bits by name, and reads past a tensor', function()
    local path = dir .. '/big.safetensors'
    local huge = 2 ^ 40
    raw_file(path, '{' .. entry('w', 'F32', { huge, huge }, 0, 4) .. '}', ('\0'):rep(4))
    H.has(H.err(C.open, path), "tensor 'w': its shape has more than 2^63 elements: the file is corrupt")
    raw_file(path, '{' .. entry('w', 'F64', { 2 ^ 31, 2 ^ 31 }, 0, 4) .. '}', ('\0'):rep(4))
    H.has(H.err(C.open, path), "tensor 'w': its dtype and shape need more than 2^63 bytes")
    H.write(path, ('\255'):rep(8) .. '{}      ')
    H.has(H.err(C.open, path), 'a header length of 18446744073709551615 bytes: not a safetensors file, or corrupt')
    raw_file(path, '{' .. entry('w', 'F32', { 2 }, 0, 8) .. '}', ('\0'):rep(8))
    local f = C.open(path)
    H.has(H.err(f.read, f, 'w', 2 ^ 62, 2 ^ 62), "tensor 'w': 4611686018427387904 elements from element "
                                                  .. '4611686018427387904 are outside its 2')
    H.has(H.err(f.read, f, 'w', 1e300, 1), 'expected a non-negative integer')
    f:close()
  end)

  it('find each tensor by name in n log n, not n^2 (a whole file read tensor by tensor)', function()
    -- ten times the tensors cost about ten times the time through a sorted
    -- index (n log n: ~13x), a hundred times scanning the names for each;
    -- the best of three runs of each size keeps a busy machine's pauses out
    local function seconds(n)
      local parts, at = {}, 0
      for i = 1, n do
        parts[i] = entry(string.format('layer.%06d.weight', i), 'F32', { 1 }, at, at + 4)
        at = at + 4
      end
      local path = dir .. '/many' .. n .. '.safetensors'
      raw_file(path, '{' .. table.concat(parts, ',') .. '}', ('\0'):rep(4 * n))
      local best = math.huge
      for _ = 1, 3 do
        local t0 = ds.wall_time()
        local got = CK.load_file(path)
        best = math.min(best, ds.wall_time() - t0)
        assert.are.same({ 0 }, got[string.format('layer.%06d.weight', n)]:totable())
      end
      return best
    end
    local small, large = seconds(4000), seconds(40000)
    assert.is_true(large / small < 40, string.format('4,000 tensors %.3f s, 40,000 %.3f s', small, large))
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
  if H.skip_without_mpirun() then return end
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
    { name = '2 ranks, stage 1, gas 2, token shards (memory-mapped)', np = 2,
      o = { stage = 1, gas = 2, shards = H.tmpdir() } },
    { name = '1 rank, stage 2, the optimizer offloaded to nvme (streamed state)', np = 1,
      o = { stage = 2, nvme = H.tmpdir() } },
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

describe('resuming on another world size, ZeRO stage or dtype', function()
  if H.skip_without_mpirun() then return end

  it('re-shards 4 ranks stage 3 bf16 -> 2 ranks stage 1 fp32 -> 1 rank stage 0 -> 4 ranks stage 2 bf16, '
     .. 'every tensor kept to the bit', function()
    local dir = H.tmpdir()
    run(4, { stage = 3, dtype = 'bf16', dir = dir, steps = 6, final = 's3_4' })
    -- each hop loads the last tag and saves it again at once: the whole
    -- state (fp32 weights, both Adam moments, steps) is unchanged
    local hops = {
      { np = 2, stage = 1, tag = 's1_2' }, { np = 1, stage = 0, tag = 's0_1' },
      { np = 4, stage = 2, dtype = 'bf16', tag = 's2_4' },
    }
    local last = 's3_4'
    for _, hop in ipairs(hops) do
      local r, out = run(hop.np, { stage = hop.stage, dtype = hop.dtype, dir = dir, load = last, resave = hop.tag,
                                   steps = 0 })
      H.has(out, string.format('saved on %d ranks at ZeRO stage', CK.read_manifest(dir .. '/' .. last).world_size))
      assert.are.equal(6, r.global_steps)
      assert.is_true(same_state(dir, last, dir, hop.tag) > 0)
      last = hop.tag
    end
    local m = CK.read_manifest(dir .. '/s2_4')
    assert.are.equal(4, m.world_size)
    assert.are.equal(2, m.zero_stage)
    assert.are.equal('bf16', m.dtype)
    assert.are.equal(4, #m.files)
  end)


  it('goes on with exactly the samples the saved run had not read: DeepSpeed\'s loader', function()
    local dir = H.tmpdir()
    local a = run(2, { dir = dir, steps = 3, save_at = 3 })      -- 24 samples read, 8 a step
    assert.are.equal(24, a.global_samples)
    for np, micro in pairs({ [1] = 4, [3] = 3 }) do
      local b, out = run(np, { dir = dir, load = 'global_step3', steps = 40, micro = micro })
      H.has(out, string.format('saved on 2 ranks, loaded on %d: epoch 1 goes on with the 72 of its 96 samples', np))
      one_epoch(a, b)
    end
  end)

  it('goes on with exactly the samples the saved run had not read: token shards', function()
    local dir, shards = H.tmpdir(), H.tmpdir()
    local a = run(2, { dir = dir, steps = 3, save_at = 3, shards = shards })
    assert.are.equal(24, a.global_samples)
    for np, micro in pairs({ [1] = 4, [3] = 3 }) do
      local b, out = run(np, { dir = dir, load = 'global_step3', steps = 40, micro = micro, shards = shards })
      H.has(out, string.format('saved on 2 ranks, loaded on %d: epoch 1 goes on with the 72 of its 96 samples', np))
      one_epoch(a, b)
    end
  end)

  it('goes on with exactly the samples the saved run had not read: the uneven policy', function()
    local dir = H.tmpdir()
    local a = run(2, { dir = dir, steps = 5, save_at = 5, sampler = { policy = 'uneven', micro_batch_per_rank = { 6, 2 },
                                                                        data_share = { 0.75, 0.25 }, seed = 3 } })
    assert.are.equal(40, a.global_samples)
    local blocks = { [1] = { micro_batch_per_rank = { 8 } }, [3] = { micro_batch_per_rank = { 3, 3, 3 } } }
    for np, block in pairs(blocks) do
      block.policy, block.seed = 'uneven', 3
      local b = run(np, { dir = dir, load = 'global_step5', steps = 40, sampler = block })
      one_epoch(a, b)
    end
  end)

  -- 2 ranks save at step 3 of epoch 1, 3 ranks load that, read 2 steps
  -- and save, 1 rank loads that and ends the epoch: each hop's options
  local function uneven(micro, share) return { policy = 'uneven', micro_batch_per_rank = micro, data_share = share,
                                               seed = 3 } end
  local function distributed(micro) return { policy = 'distributed', micro_batch_per_rank = micro, seed = 3 } end
  local CHAINS = {
    { name = 'DeepSpeed\'s loader', hops = { { micro = 4 }, { micro = 3 }, { micro = 8 } } },
    { name = 'the distributed policy', hops = { { sampler = distributed { 4, 4 } },
                                                { sampler = distributed { 3, 3, 3 } },
                                                { sampler = distributed { 8 } } } },
    { name = 'the uneven policy over token shards', shards = true, hops = {
      { sampler = uneven({ 6, 2 }, { 0.75, 0.25 }) }, { sampler = uneven({ 4, 2, 2 }, { 0.5, 0.25, 0.25 }) },
      { sampler = uneven { 8 } } } },
  }
  for _, chain in ipairs(CHAINS) do
    it('goes on with exactly the samples not read, 2 -> 3 -> 1 ranks mid-epoch: ' .. chain.name, function()
      local dir, shards = H.tmpdir(), chain.shards and H.tmpdir() or nil
      local function hop(np, k, o)
        o.dir, o.shards, o.sampler, o.micro = dir, shards, chain.hops[k].sampler, chain.hops[k].micro
        return run(np, o)
      end
      local first = hop(2, 1, { steps = 3, save_at = 3 })
      local second, out = hop(3, 2, { load = 'global_step3', steps = 5, save_at = 5 })
      H.has(out, 'saved on 2 ranks, loaded on 3: epoch 1 goes on with the ' .. 96 - first.global_samples)
      -- the rest of the epoch is kept as an order, not its indices
      local tensors, meta = CK.load_file(dir .. '/global_step5/rank_00001.safetensors')
      local st = ds.json.decode(meta.dslua)
      assert.is_nil(tensors['loader/order'])
      assert.is_nil(tensors['sampler/indices'])
      assert.are.equal(96, (st.plan or st.loader).order.n)
      local third = hop(1, 3, { load = 'global_step5', steps = 40 })
      one_epoch(first, second, third)
      -- on 3 ranks again that order resumes to the bit of the run that went on
      local went_on = hop(3, 2, { load = 'global_step3', steps = 8 })
      local again = hop(3, 2, { load = 'global_step5', steps = 8 })
      assert.are.same({ 6, 7, 8 }, steps_of(again))
      for step = 6, 8 do
        assert.are.same(went_on.losses[tostring(step)], again.losses[tostring(step)], 'step ' .. step)
      end
    end)
  end

  it('trains on from there: a bf16 stage 3 run resumed in fp32 on 1 rank learns on', function()
    local dir = H.tmpdir()
    local a = run(2, { stage = 3, dtype = 'bf16', dir = dir, steps = 30, save_at = 10 })
    local b, out = run(1, { stage = 0, dir = dir, load = 'global_step10', steps = 30 })
    H.has(out, 'loaded checkpoint ' .. dir .. '/global_step10 (saved on 2 ranks at ZeRO stage 3 in bf16; loaded on 1 '
               .. 'at stage 0 in f32)')
    H.has(out, 'saved on 2 ranks, loaded on 1: epoch 1 goes on with the ')
    local function mean(r, lo, hi)
      local s, n = 0, 0
      for k, v in pairs(r.losses) do
        local step = tonumber(k)
        if step >= lo and step <= hi then
          for _, x in ipairs(v) do s, n = s + x, n + 1 end
        end
      end
      return s / n
    end
    -- the same training, other rounding: the losses of steps 21-30 agree within 3%
    assert.is_true(math.abs(mean(b, 21, 30) - mean(a, 21, 30)) / mean(a, 21, 30) < 0.03)
    assert.is_true(mean(b, 21, 30) < mean(a, 1, 5))
  end)
end)

describe('a stage 3 load', function()
  it('reaches a parameter read (gathered) before it: the next forward computes with the loaded weights', function()
    local dir = H.tmpdir()
    finally(function() os.execute('rm -rf ' .. dir) end)
    local cfg = { train_micro_batch_size_per_gpu = 2, steps_per_print = 1e9,
                  optimizer = { type = 'AdamW', params = { lr = 0.1 } },
                  zero_optimization = { stage = 3, stage3_param_persistence_threshold = 0 } }
    local function engine()
      ds.manual_seed(7)
      local m = ds.nn.Sequential(ds.nn.Linear(4, 8), ds.nn.Linear(8, 2))
      return ds.initialize { model = m, config = cfg }, m
    end
    local x = ds.randn(2, 4)
    local a = engine()
    a:backward(a(x):pow(2):mean())
    a:step()
    a:save_checkpoint(dir)
    local want = a(x):detach():clone()
    a:destroy()
    local b, m = engine()
    m[1].weight:sum()          -- outside a forward: gathered, and kept
    b:load_checkpoint(dir)
    H.assert_same(want, b(x):detach())
    H.assert_same(CK.read_full(dir).fp32['0.weight'], m[1].weight:detach())
    b:destroy()
  end)
end)

describe('a policy sampler\'s plan in a checkpoint', function()
  -- a 1-rank engine of run.lua's model over n windows of 2 tokens under
  -- the uneven policy, saved after a step: the engine, the folder, its
  -- rank file's path, bytes, state and tensors
  local function saved(n)
    local x = ds.zeros({ n, 2 }):to('i64')
    ds.manual_seed(100)
    local m = require('models.gpt2') { vocab_size = 32, block_size = 2, n_layer = 1, n_head = 2, n_embd = 16 }
    local e = ds.initialize { model = m, training_data = ds.data.tensors { x = x, y = x }, config = {
      steps_per_print = 1000, optimizer = { type = 'AdamW', params = { lr = 1e-2 } },
      sampler = { policy = 'uneven', micro_batch_per_rank = { 4 }, seed = 1 } } }
    for _, batch in e.training_dataloader:epoch() do
      e:backward(e(batch))
      e:step()
      break
    end
    local dir = H.tmpdir()
    finally(function() os.execute('rm -rf ' .. dir) end)
    e:save_checkpoint(dir, 'one')
    local path = dir .. '/one/rank_00000.safetensors'
    local f = assert(io.open(path, 'rb'))
    local bytes = f:seek('end')
    f:close()
    local tensors, meta = CK.load_file(path)
    return { engine = e, dir = dir, path = path, bytes = bytes, state = ds.json.decode(meta.dslua), tensors = tensors,
             meta = meta }
  end

  it('takes the same bytes at 1e3 and 1e6 windows: the order that regenerates it, not its indices', function()
    local small, large = saved(1000), saved(1000000)
    -- the files differ only in the digits of the numbers that count windows
    -- (the order's length and window, the loader's steps), where the
    -- indices were 8 bytes a window
    assert.is_true(math.abs(large.bytes - small.bytes) <= 64,
                   string.format('%d bytes at 1e3 windows, %d at 1e6', small.bytes, large.bytes))
    for _, c in ipairs({ small, large }) do
      assert.is_nil(c.tensors['sampler/indices'])
      assert.is_nil(c.tensors['sampler/micro_batch'])
    end
    assert.are.equal(1000000, large.state.plan.order.n)
    assert.are.same({ 0, 1000 }, small.state.plan.order.window)
    assert.are.equal(4, small.state.plan.micro_batch)
  end)

  it('that does not fit the dataset is refused, naming the file', function()
    local c = saved(1000)
    c.state.plan.order.window = { 999, 5 }
    c.meta.dslua = ds.json.encode(c.state)
    local list = {}
    for name, t in pairs(c.tensors) do list[#list + 1] = { name, t } end
    local bytes, sha = C.save(c.path, list, c.meta)
    local mpath = c.dir .. '/one/manifest.json'
    local m = ds.json.decode(H.read(mpath))
    m.files[1].bytes, m.files[1].sha256 = bytes, sha
    H.write(mpath, ds.json.encode(m))
    H.has(H.err(c.engine.load_checkpoint, c.engine, c.dir, 'one'), "load_checkpoint: '" .. c.path .. "': its sampler "
          .. 'plan: order: the window [999, 1004) is not inside [0, 1000)')
  end)

  -- spec/fixtures/ckpt_plan/global_step5: run.lua's model on 2 ranks under
  -- the uneven policy, saved at step 5 by a dslua that kept a plan as its
  -- indices (sampler/indices, an i64 tensor): commit 7e4899b's
  -- `mpirun -np 2 dslua spec/ckpt/run.lua out.json '{"dir": D, "steps": 5,
  -- "save_at": 5, "sampler": UNEVEN}'`, D/global_step5 copied here
  describe('saved with the plan as its indices', function()
    if H.skip_without_mpirun() then return end
    local FIXTURE = 'spec/fixtures/ckpt_plan'
    local UNEVEN = { policy = 'uneven', micro_batch_per_rank = { 6, 2 }, data_share = { 0.75, 0.25 }, seed = 3 }

    -- A rank file's plan as the list of its indices, whichever way it
    -- keeps it.
    local function plan_indices(dir, rank)
      local tensors, meta = CK.load_file(string.format('%s/global_step5/rank_%05d.safetensors', dir, rank))
      local st = ds.json.decode(meta.dslua)
      return require('samplers.policy').saved_plan_of(st.plan, function(name) return tensors[name] end)
             .indices:totable(), st, tensors
    end

    -- The fixture's numbers came from another build on another CPU and match
    -- this one's to rounding only (an ASan build's differ by 1e-10 in
    -- exp_avg, Adam makes 3e-4 of a bias of that): its plan must be exact.
    it("holds as indices the plan this dslua makes", function()
      local dir = H.tmpdir()
      run(2, { dir = dir, steps = 5, save_at = 5, sampler = UNEVEN })
      for rank = 0, 1 do
        local old, st, tensors = plan_indices(FIXTURE, rank)
        assert.is_nil(st.plan.order)
        assert.are.equal(#old, tensors['sampler/indices']:numel())
        assert.are.same(plan_indices(dir, rank), old)
      end
      assert.are.equal(24, #plan_indices(FIXTURE, 1))
    end)

    it('goes on with exactly the samples it had not read on 1, 2 and 3 ranks', function()
      local a = run(2, { dir = H.tmpdir(), steps = 5, save_at = 5, sampler = UNEVEN })
      local full = run(2, { dir = H.tmpdir(), steps = 40, sampler = UNEVEN })
      local blocks = { [1] = { micro_batch_per_rank = { 8 } }, [2] = { micro_batch_per_rank = { 6, 2 } },
                       [3] = { micro_batch_per_rank = { 3, 3, 3 } } }
      for np, block in pairs(blocks) do
        block.policy, block.seed = 'uneven', 3
        if np == 2 then block.data_share = UNEVEN.data_share end
        local b, out = run(np, { dir = H.tmpdir(), load_dir = FIXTURE, load = 'global_step5', steps = 40,
                                 sampler = block })
        if np ~= 2 then
          H.has(out, string.format('saved on 2 ranks, loaded on %d: epoch 1 goes on with the 56 of its 96 samples', np))
        end
        one_epoch(a, b)
        if np == 2 then
          -- the same world: the run that never stopped, step for step
          local steps, want = steps_of(b), {}
          for _, step in ipairs(steps_of(full)) do
            if step > 5 then want[#want + 1] = step end
          end
          assert.are.same(want, steps)
          for _, step in ipairs(steps) do
            local l, m = full.losses[tostring(step)], b.losses[tostring(step)]
            for r = 1, 2 do assert(math.abs(l[r] - m[r]) <= 1e-4 * math.abs(l[r]), 'step ' .. step) end
          end
        end
      end
    end)
  end)
end)

describe('atomic saves', function()
  if H.skip_without_mpirun() then return end

  local function latest(dir)
    local f = assert(io.open(dir .. '/latest'))
    local t = f:read('*a')
    f:close()
    return t
  end

  -- A 2-rank run saves global_step3, then global_step6 with rank k killed
  -- (SIGKILL) at a point of the save.
  local base
  setup(function()
    base = H.tmpdir()
    run(2, { dir = base, steps = 3, final = 'global_step3' })
  end)

  local function killed(point, rank, extra)
    local dir = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/. %s/', base, dir)) == 0)
    local o = { dir = dir, load = 'global_step3', steps = 6, save_at = 6 }
    for k, v in pairs(extra or {}) do o[k] = v end
    local out = os.tmpname()
    local cmd = 'DSLUA_CKPT_KILL=' .. rank .. ':' .. point .. ' ' .. H.ranks_cmd(2):gsub('%-x DSLUA_NUM_THREADS',
      '-x DSLUA_CKPT_KILL -x DSLUA_NUM_THREADS') .. ' ' .. RUN .. ' ' .. out .. ' ' .. shell_quote(ds.json.encode(o))
    local text, status = H.run(cmd)
    assert(status ~= 0, 'the killed run exited 0:\n' .. text)
    return dir
  end

  for _, case in ipairs({ { 'write', 1 }, { 'half', 0 }, { 'half', 1 }, { 'written', 1 }, { 'manifest', 0 },
                          { 'replaced', 0 } }) do
    it(string.format('leave the previous checkpoint loadable and latest on it when rank %d is killed at %s', case[2],
                     case[1]), function()
      local dir = killed(case[1], case[2])
      assert.are.equal('global_step3', latest(dir))
      local e = tiny_engine()
      assert.are.equal(dir .. '/global_step3', e:load_checkpoint(dir))
      assert.are.equal(3, e.global_steps)
      -- killed after the new tag was in place, it is whole too
      if case[1] == 'replaced' then
        e:load_checkpoint(dir, 'global_step6')
        assert.are.equal(6, e.global_steps)
      else
        assert.is_false(C.exists(dir .. '/global_step6'))
      end
    end)
  end

  it('move latest last: killed after that, the new checkpoint is the one loaded', function()
    local dir = killed('latest', 0)
    assert.are.equal('global_step6', latest(dir))
    local e = tiny_engine()
    e:load_checkpoint(dir)
    assert.are.equal(6, e.global_steps)
  end)

  it('of a tag that exists already keep the old one whole until the new one is complete', function()
    local dir = killed('manifest', 0, { tag = 'global_step3' })
    local e = tiny_engine()
    e:load_checkpoint(dir, 'global_step3')
    assert.are.equal(3, e.global_steps)
    -- the next save of it goes through, the leftovers of the killed one cleared
    local dir2 = H.tmpdir()
    run(2, { dir = dir2, steps = 3, final = 'global_step3' })
    run(2, { dir = dir2, load = 'global_step3', steps = 5, final = 'global_step3' })
    e:load_checkpoint(dir2, 'global_step3')
    assert.are.equal(5, e.global_steps)
    assert.is_nil(H.run('ls ' .. dir2):find('partial', 1, true))
  end)

  it('check that every rank saves the same tag (checkpoint.tag_validation)', function()
    local dir = H.tmpdir()
    local out, status = H.run(H.ranks_cmd(2) .. ' ' .. RUN .. ' ' .. os.tmpname() .. ' '
      .. shell_quote(ds.json.encode { dir = dir, steps = 2, save_at = 2, tag = 'rank%d', tag_validation = 'Fail' }))
    assert.are_not.equal(0, status)
    H.has(out, "save_checkpoint: checkpoint tag 'rank1' of rank 1 differs from rank 0's 'rank0': all ranks must save "
               .. 'the same tag')
  end)
end)

describe('a checkpoint that is corrupt, truncated or does not fit', function()
  teardown(H.mpi_cleanup)
  local dir = H.tmpdir()
  local engine

  local function make(n_embd)
    ds.manual_seed(5)
    local m = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = n_embd or 16 }
    return (ds.initialize { model = m, config = { train_batch_size = 2, steps_per_print = 1000,
                                                  optimizer = { type = 'AdamW', params = { lr = 1e-2 } } } })
  end

  -- a fresh copy of a good checkpoint, bytes of rank_00000 changed by fn
  local function damaged(fn)
    local d = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/good %s/', dir, d)) == 0)
    local path = d .. '/good/rank_00000.safetensors'
    local f = assert(io.open(path, 'rb'))
    local raw = f:read('*a')
    f:close()
    H.write(path, fn(raw))
    return d
  end

  setup(function()
    engine = make()
    engine:backward(engine { x = ds.tensor({ { 1, 2, 3 } }, 'i64'), y = ds.tensor({ { 2, 3, 4 } }, 'i64') })
    engine:step()
    engine:save_checkpoint(dir, 'good')
  end)

  it('names the file and the tensor whose bytes changed', function()
    local d = damaged(function(raw) return raw:sub(1, #raw - 100) .. string.char((raw:byte(#raw - 99) + 1) % 256)
                                           .. raw:sub(#raw - 98) end)
    local e = H.err(engine.load_checkpoint, engine, d, 'good')
    H.has(e, "load_checkpoint: '" .. d .. "/good/rank_00000.safetensors': tensor '")
    H.has(e, "' does not match its checksum in the manifest: the file is corrupt")
  end)

  it('names the tensor a truncated file cuts', function()
    local d = damaged(function(raw) return raw:sub(1, #raw - 100) end)
    local e = H.err(engine.load_checkpoint, engine, d, 'good')
    H.has(e, "rank_00000.safetensors': tensor '")
    H.has(e, 'the file is truncated')
  end)

  it('refuses a file of another save and a missing one', function()
    local d = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/good %s/', dir, d)) == 0)
    engine:backward(engine { x = ds.tensor({ { 3, 2, 1 } }, 'i64'), y = ds.tensor({ { 2, 3, 4 } }, 'i64') })
    engine:step()
    engine:save_checkpoint(d, 'other')
    os.rename(d .. '/other/rank_00000.safetensors', d .. '/good/rank_00000.safetensors')
    H.has(H.err(engine.load_checkpoint, engine, d, 'good'), "rank_00000.safetensors': tensor '")
    os.remove(d .. '/good/rank_00000.safetensors')
    H.has(H.err(engine.load_checkpoint, engine, d, 'good'),
          "load_checkpoint: '" .. d .. "/good/rank_00000.safetensors' is missing")
  end)

  it('refuses a model of other shapes, naming the parameter', function()
    local other = make(32)
    H.has(H.err(other.load_checkpoint, other, dir, 'good'),
          "load_checkpoint: '" .. dir .. "/good': parameter 'transformer.wte.weight' is [32,16] in the checkpoint, "
          .. '[32,32] in the model')
    H.has(H.err(engine.load_checkpoint, engine, dir, 'absent'), "load_checkpoint: '" .. dir .. "/absent' does not exist")
    local d = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/good %s/', dir, d)) == 0)
    H.write(d .. '/good/manifest.json', '{"format": "dslua-checkpoint", ')
    H.has(H.err(engine.load_checkpoint, engine, d, 'good'), 'the manifest is corrupt')
  end)

  it('refuses a manifest whose entries are of the wrong type, naming the key', function()
    local d = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/good %s/', dir, d)) == 0)
    local file = d .. '/good/manifest.json'
    local f = assert(io.open(file))
    local text = f:read('*a')
    f:close()
    local cases = {
      { function(m) m.module = { { name = 'b' } } end, 'module[1].shape is not a list' },
      { function(m) m.parameters[2].group = 7 end, 'parameters[2].group is 7 of 1 groups' },
      { function(m) m.parameters[1].shape[1] = 'x' end, 'parameters[1].shape[1] must be an integer >= 0, got "x"' },
      { function(m) m.parameters[2].group = 'all' end, 'parameters[2].group must be an integer >= 1, got "all"' },
      { function(m) m.optimizer.param_groups[1].state = { 5 } end, 'optimizer.param_groups[1].state[1] is not a name' },
      { function(m) m.optimizer = 'adam' end, 'optimizer is not a list' },
      { function(m) m.module = { { name = 'b', shape = {}, rank = 3 } } end, 'module[1].rank is rank 3 of 1' },
      { function(m) m.module = { { shape = {} } } end, 'module[1].name is not a name' },
    }
    for _, case in ipairs(cases) do
      local m = ds.json.decode(text)
      case[1](m)
      H.write(file, ds.json.encode(m))
      local want = "load_checkpoint: '" .. file .. "': " .. case[2] .. ': the manifest is corrupt'
      H.has(H.err(engine.load_checkpoint, engine, d, 'good'), want)
      H.has(H.err(CK.read_full, d, 'good'), want)
    end
  end)

  it('refuses a manifest of a newer format, naming its version', function()
    local d = H.tmpdir()
    assert(os.execute(string.format('cp -r %s/good %s/', dir, d)) == 0)
    local file = d .. '/good/manifest.json'
    local m = ds.json.decode(H.read(file))
    assert.are.equal(2, m.format_version)
    m.format_version = 3
    H.write(file, ds.json.encode(m))
    H.has(H.err(engine.load_checkpoint, engine, d, 'good'), "load_checkpoint: '" .. file .. "' has format version 3; "
          .. 'this dslua (' .. require('dslua.core').version .. ') reads up to 2')
  end)

  it('refuses a client_state that holds itself, naming the cycle, and saves one that shares a table', function()
    local d = H.tmpdir()
    local st = { run = { opts = { lr = 1 } } }
    st.run.opts.back = st.run
    H.has(H.err(engine.save_checkpoint, engine, d, 'cyc', st),
          'save_checkpoint: client_state.run.opts.back is client_state.run, a table inside itself: a cycle cannot be saved')
    local shared = { 1, 2 }
    assert.is_true(engine:save_checkpoint(d, 'dag', { a = shared, b = shared }))
    local _, client = engine:load_checkpoint(d, 'dag')
    assert.are.same({ a = { 1, 2 }, b = { 1, 2 } }, client)
  end)

  it('moves latest only when asked (save_latest), as DeepSpeed does', function()
    local d = H.tmpdir()
    engine:save_checkpoint(d, 'first')
    engine:save_checkpoint(d, 'second', nil, false)
    local f = assert(io.open(d .. '/latest'))
    assert.are.equal('first', f:read('*a'))
    f:close()
  end)

  it('without a latest file loads nothing and says so, as DeepSpeed does', function()
    local path, client = engine:load_checkpoint(H.tmpdir())
    assert.is_nil(path)
    assert.is_nil(client)
  end)
end)

describe('a hostile checkpoint', function()
  if H.skip_without_mpirun() then return end

  -- a 2-rank stage 1 checkpoint 'two', copied fresh for each case
  local base, dirs = nil, {}
  setup(function()
    base = H.tmpdir()
    run(2, { dir = base, stage = 1, steps = 2, final = 'two' })
  end)
  teardown(function()
    for _, d in ipairs(dirs) do os.execute('rm -rf ' .. d) end
    os.execute('rm -rf ' .. base)
  end)
  local function fresh()
    local d = H.tmpdir()
    dirs[#dirs + 1] = d
    assert(os.execute(string.format('cp -r %s/two %s/', base, d)) == 0)
    return d
  end
  local function edit_manifest(d, fn)
    local path = d .. '/two/manifest.json'
    local m = ds.json.decode(H.run('cat ' .. path))
    fn(m)
    H.write(path, ds.json.encode(m))
  end
  local function as_root() return H.run('id -u') == '0\n' end
  local function load_err(d, tag)
    local e = tiny_engine()
    return H.err(e.load_checkpoint, e, d, tag or 'two')
  end
  -- loads d's checkpoint in another process under `timeout`: its output and status
  local function load_elsewhere(d, tag)
    local script = d .. '/load.lua'
    H.write(script, "local ds = require 'dslua'\n"
      .. "local ok, e = pcall(ds.checkpoint.read_full, arg[1], arg[2] ~= '' and arg[2] or nil)\n"
      .. "io.stdout:write(ok and 'loaded\\n' or tostring(e) .. '\\n')\n")
    return H.run('timeout 30 ' .. H.bin() .. ' ' .. script .. ' ' .. d .. " '" .. (tag or '') .. "'")
  end

  it('loads the untouched copy', function()
    local d = fresh()
    local e = tiny_engine()
    assert.are.equal(d .. '/two', e:load_checkpoint(d, 'two'))
    assert.are.equal(2, e.global_steps)
  end)

  it('refuses manifest file names outside the folder, even with a matching SHA-256', function()
    local d = fresh()
    assert(os.execute('cp ' .. d .. '/two/rank_00000.safetensors ' .. d .. '/foreign.safetensors') == 0)
    edit_manifest(d, function(m) m.files[1].file = '../foreign.safetensors' end)
    H.has(load_err(d), "load_checkpoint: '" .. d .. "/two/manifest.json': files[1] must name a file in the "
          .. "checkpoint's folder, got \"../foreign.safetensors\"")
  end)

  it('refuses swapped manifest entries and swapped rank files, naming file, expected and found', function()
    local d = fresh()
    edit_manifest(d, function(m) m.files[1], m.files[2] = m.files[2], m.files[1] end)
    H.has(load_err(d), "files[1] (\"rank_00001.safetensors\") is listed as rank 1's, expected rank 0's")
    d = fresh()
    local r0, r1 = d .. '/two/rank_00000.safetensors', d .. '/two/rank_00001.safetensors'
    assert(os.execute(string.format('mv %s %s.x && mv %s %s && mv %s.x %s', r0, r0, r1, r0, r0, r1)) == 0)
    edit_manifest(d, function(m)
      for _, k in ipairs({ 'sha256', 'bytes', 'tensors' }) do m.files[1][k], m.files[2][k] = m.files[2][k], m.files[1][k] end
    end)
    H.has(load_err(d), "load_checkpoint: '" .. r0 .. "' holds rank 1, the manifest expects 0 for rank 0's file")
  end)

  it('refuses a rank file of another step', function()
    local d = fresh()
    edit_manifest(d, function(m) m.engine.global_steps = 7 end)
    H.has(load_err(d), "rank_00000.safetensors' holds global_steps 2, the manifest expects 7 for rank 0's file")
  end)

  it('refuses a shard below 1 and negative steps', function()
    local d = fresh()
    edit_manifest(d, function(m) m.parameters[1].shard = 0 end)
    H.has(load_err(d), "parameters[1].shard must be an integer >= 1, got 0: the manifest is corrupt")
    edit_manifest(d, function(m) m.parameters[1].shard = -3 end)
    H.has(load_err(d), "parameters[1].shard must be an integer >= 1, got -3")
    d = fresh()
    edit_manifest(d, function(m) m.parameters[1].shard = m.parameters[1].shard + 1 end)
    H.has(load_err(d), "expected " .. math.ceil(ds.json.decode(H.run('cat ' .. base .. '/two/manifest.json'))
      .parameters[1].numel / 2))
    d = fresh()
    edit_manifest(d, function(m) m.engine.global_steps = -5 end)
    H.has(load_err(d), "engine.global_steps must be an integer >= 0, got -5: the manifest is corrupt")
  end)

  it('does not follow a tag folder or a rank file linked by another user', function()
    if not as_root() then return pending('needs root to make links of another user') end
    local d = fresh()
    os.execute('ln -s ' .. d .. '/two ' .. d .. '/linked && chown -h nobody ' .. d .. '/linked')
    H.has(load_err(d, 'linked'), "'" .. d .. "/linked' is a link owned by another user (uid 65534)")
    local r1 = d .. '/two/rank_00001.safetensors'
    os.execute('mv ' .. r1 .. ' ' .. d .. '/r1 && ln -s ' .. d .. '/r1 ' .. r1 .. ' && chown -h nobody ' .. r1)
    H.has(load_err(d), "'" .. r1 .. "' is a link owned by another user (uid 65534): dslua does not follow it")
    -- to a file of this user's that is no checkpoint: refused before a byte of it is read
    os.execute('rm ' .. r1 .. ' && ln -s /etc/passwd ' .. r1 .. ' && chown -h nobody ' .. r1)
    local e = load_err(d)
    H.has(e, "'" .. r1 .. "' is a link owned by another user (uid 65534): dslua does not follow it")
    assert.is_nil(e:find('header', 1, true), e)
  end)

  it('refuses FIFOs, devices and an oversized latest instead of hanging or echoing them', function()
    local d = fresh()
    assert(os.execute('mkfifo ' .. d .. '/latest') == 0)
    local out, status = load_elsewhere(d)
    assert.are.equal(0, status, out)
    H.has(out, "zero_to_fp32: '" .. d .. "/latest' is a FIFO, expected a regular file")
    os.remove(d .. '/latest')
    H.write(d .. '/latest', string.rep('x', 50 * 1024 * 1024))
    out = load_elsewhere(d)
    H.has(out, "'" .. d .. "/latest' is 52428800 bytes, more than the 4096 it may hold")
    assert(#out < 1000, out)
    local m = d .. '/two/manifest.json'
    os.execute('mv ' .. m .. ' ' .. m .. '.x && mkfifo ' .. m)
    out = load_elsewhere(d, 'two')
    H.has(out, "load_checkpoint: '" .. m .. "' is a FIFO, expected a regular file")
    os.execute('rm ' .. m .. ' && mv ' .. m .. '.x ' .. m)
    local r0 = d .. '/two/rank_00000.safetensors'
    os.execute('rm ' .. r0 .. ' && mkfifo ' .. r0)
    H.has(load_elsewhere(d, 'two'), "'" .. r0 .. "' is a FIFO, expected a regular file")
    os.execute('rm ' .. r0 .. ' && ln -s /dev/zero ' .. r0)
    H.has(load_elsewhere(d, 'two'), "'" .. r0 .. "' is a device, expected a regular file")
  end)

  it('loads a checkpoint saved before rank files recorded their layout and step, with a warning', function()
    local d = fresh()
    local path = d .. '/two/rank_00000.safetensors'
    local tensors, meta = CK.load_file(path)
    local st = ds.json.decode(meta.dslua)
    st.world_size, st.layout, st.global_steps = nil, nil, nil
    meta.dslua = ds.json.encode(st)
    local list = {}
    for name, t in pairs(tensors) do list[#list + 1] = { name, t } end
    local bytes, sha = C.save(path, list, meta)
    edit_manifest(d, function(m) m.files[1].bytes, m.files[1].sha256 = bytes, sha end)
    local out = load_elsewhere(d, 'two')
    H.has(out, 'loaded')
    H.has(out, "warning: load_checkpoint: '" .. d .. "/two' was saved before rank files recorded their world_size, "
          .. 'layout, global_steps: only their rank is checked')
  end)
end)

describe('export and import', function()
  teardown(H.mpi_cleanup)
  local fx = H.fixture('checkpoint')

  it('loads Hugging Face GPT-2 weights (Conv1D transposed) into models.gpt2: PyTorch\'s logits', function()
    local m = require('models.gpt2').from_hf('spec/fixtures/gpt2_hf_tiny.safetensors', { n_head = 2 })
    assert.are.equal(2, m.config.n_layer)
    local logits = ds.no_grad(function() return m(H.tensor(fx.hf.ids)) end)
    H.assert_close(logits, H.tensor(fx.hf.logits), { rtol = 1e-4, atol = 1e-5 }, 'logits (file by ' .. fx.hf.writer .. ')')
    local V = m.config.vocab_size
    local p = require('models.gpt2').from_hf('spec/fixtures/gpt2_hf_tiny.safetensors',
                                             { n_head = 2, padded_vocab_size = V + 5 })
    assert.are.equal(V + 5, p.lm_head.weight:size(1))
    assert.are.equal(0, p.transformer.wte.weight:narrow(1, V + 1, 5):abs():amax():item())
    local padded = ds.no_grad(function() return p(H.tensor(fx.hf.ids)) end)
    H.assert_close(padded, H.tensor(fx.hf.logits), { rtol = 1e-4, atol = 1e-5 }, 'logits of the padded model')
  end)

  it('writes files PyTorch reads under nanoGPT\'s names (the committed fixture)', function()
    local m = require('models.gpt2') { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 64, block_size = 16 }
    m:load_state_dict(CK.load_file('spec/fixtures/dslua_gpt2_export.safetensors'))
    local logits = ds.no_grad(function() return m(H.tensor(fx.dslua_export.ids)) end)
    H.assert_close(logits, H.tensor(fx.dslua_export.logits), { rtol = 1e-4, atol = 1e-5 }, 'PyTorch read dslua\'s file')
    local keys = m:state_keys()
    table.sort(keys)
    assert.are.same(keys, fx.dslua_export.keys)
  end)

  it('consolidates a sharded bf16 checkpoint to one fp32 file (zero_to_fp32) and a 16-bit model', function()
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local dir = H.tmpdir()
    run(2, { stage = 3, dtype = 'bf16', dir = dir, steps = 4, final = 'final' })
    local out = CK.zero_to_fp32(dir, dir .. '/model.safetensors')
    local sd = CK.load_file(out)
    local full = CK.read_full(dir, 'final')
    assert.are.equal('f32', sd['transformer.wte.weight']:dtype())
    assert.are.same(sd['transformer.wte.weight']:totable(), sd['lm_head.weight']:totable())
    assert.are.same(full.fp32['transformer.h.0.mlp.c_fc.weight']:totable(), sd['transformer.h.0.mlp.c_fc.weight']:totable())
    local m = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 }
    m:load_state_dict(sd)
    local half = CK.load_file(CK.zero_to_fp32(dir, dir .. '/model_bf16.safetensors', 'final', 'bf16'))
    assert.are.equal('bf16', half['transformer.h.0.attn.c_attn.weight']:dtype())
  end)

  it('is read by PyTorch live, when python3 has torch and safetensors', function()
    local _, status = H.run("/usr/bin/python3 -c 'import torch, safetensors.torch'")
    if status ~= 0 then
      return pending('/usr/bin/python3 has no torch or no safetensors package (pip install safetensors)')
    end
    local dir = H.tmpdir()
    ds.manual_seed(9)
    local m = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 }
    local engine = ds.initialize { model = m, config = { train_batch_size = 2, steps_per_print = 1000,
                                                          bf16 = { enabled = true },
                                                          optimizer = { type = 'AdamW', params = { lr = 1e-2 } } } }
    engine:save_16bit_model(dir)
    local text = H.run('/usr/bin/python3 -c ' .. shell_quote([[
import sys
from safetensors.torch import load_file
sd = load_file(sys.argv[1] + '/model.safetensors')
print(len(sd), sd['transformer.h.0.attn.c_attn.weight'].dtype, float(sd['transformer.wte.weight'].float().sum()))
]]) .. ' ' .. dir)
    local want = m.transformer.wte.weight:to('f32'):sum():item()
    local n, dtype, sum = text:match('^(%d+) (%S+) (%S+)')
    assert(n, text)
    assert.are.equal('torch.bfloat16', dtype)
    assert.are.equal(#m:state_keys(), tonumber(n))
    assert.is_true(math.abs(tonumber(sum) - want) <= 1e-3 * math.abs(want) + 1e-4)
  end)
end)
