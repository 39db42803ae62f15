-- Topology and tensor parallelism: ds.topology's layout and groups, the
-- tensor-parallel layers and models against one rank (the rank scripts
-- in spec/tp/ under mpirun).
local H = require 'helpers'
local ds = H.ds

describe('ds.topology', function()
  it('lays ranks out pipe, data, sequence, tensor, tensor innermost', function()
    local t = ds.topology { pipe = 2, tensor = 2, world_size = 8, groups = false }
    assert.are.equal(2, t:get_dim('data'))
    assert.are.same({ pipe = 1, data = 0, sequence = 0, tensor = 1 }, t:get_coord(5))
    assert.are.equal(5, t:get_rank { pipe = 1, tensor = 1 })
    for r = 0, 7 do assert.are.equal(r, t:get_rank(t:get_coord(r))) end
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, t:get_axis_comm_lists('tensor'))
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, t:get_axis_comm_lists('data'))
    assert.are.same({ { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }, t:get_axis_comm_lists('pipe'))
    assert.are.same({ 3, 7 }, t:group_ranks('pipe', 7))
    assert.are.same({ 2, 3, 6, 7 }, t:group_ranks({ 'tensor', 'pipe' }, 7))
    assert.are.same({ 1, 3, 5, 7 }, t:group_ranks({ 'data', 'pipe' }, 7))
    local s = ds.topology { sequence = 2, tensor = 2, world_size = 8, groups = false }
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, s:get_axis_comm_lists('sequence'))
    assert.are.same({ 0, 1, 2, 3 }, s:group_ranks({ 'sequence', 'tensor' }, 0))
  end)

  it('matches ds.pipe\'s PipeDataParallelTopology without tensor and sequence axes', function()
    local t = ds.topology { pipe = 3, world_size = 6, groups = false }
    local p = ds.pipe.PipeDataParallelTopology { num_pp = 3, num_dp = 2 }
    for r = 0, 5 do
      local c = t:get_coord(r)
      assert.are.equal(p:get_rank(c.pipe, c.data), r)
    end
  end)

  it('names the degrees and the world when they do not divide it', function()
    H.has(H.err(function() ds.topology { tensor = 3, world_size = 8 } end),
          'pipe 1 x tensor 3 x sequence 1 = 3 does not divide the world of 8 ranks')
    H.has(H.err(function() ds.topology { tensor = 2, data = 3, world_size = 8 } end),
          'pipe 1 x data 3 x sequence 1 x tensor 2 = 6 ranks, the world has 8')
    H.has(H.err(function() ds.topology { tensor = 0 } end),
          'tensor must be a positive integer, got 0')
    H.has(H.err(function() ds.topology { model = 2 } end),
          "unknown key 'model'")
    H.has(H.err(function() ds.topology { world_size = 4, groups = false }:group('data') end),
          'has no groups')
    H.has(H.err(function() ds.topology { world_size = 4, groups = false }:get_dim('expert') end),
          "no axis 'expert'")
  end)

  describe('under mpirun', function()
    if H.skip_without_mpirun() then return end
    local dir = H.tmpdir()
    teardown(function() os.execute('rm -rf ' .. dir) end)

    -- every group of every combination of axes holds exactly the ranks
    -- that share the other coordinates: its size and the sum of its ranks
    for _, dims in ipairs({ { 2, 2, 1, 2 }, { 1, 2, 2, 2 } }) do
      it(string.format('makes every group on 8 ranks (pipe, data, sequence, tensor = %s)', table.concat(dims, ',')),
         function()
        local out = dir .. '/topo.json'
        local text, status = H.run(string.format('%s spec/tp/topology.lua %s %s 2>&1', H.ranks_cmd(8), out,
                                                 table.concat(dims, ',')))
        assert.are.equal(0, status, text)
        local ref = ds.topology { pipe = dims[1], data = dims[2], sequence = dims[3], tensor = dims[4],
                                  world_size = 8, groups = false }
        for r = 0, 7 do
          local seen = ds.json.decode(H.read(out .. '.' .. r))
          assert.are.same(ref:get_coord(r), seen.coord)
          assert.are.equal(15, (function() local n = 0; for _ in pairs(seen.groups) do n = n + 1 end; return n end)())
          for k, v in pairs(seen.groups) do
            local axes = {}
            for a in k:gmatch('[^+]+') do axes[#axes + 1] = a end
            local ranks, sum = ref:group_ranks(axes, r), 0
            for _, q in ipairs(ranks) do sum = sum + q end
            assert.are.equal(#ranks, v.size, k)
            assert.are.equal(sum, v.sum, k)
          end
        end
      end)
    end
  end)
end)

describe('tensor-parallel layers on one rank', function()
  local P = ds.nn.parallel
  -- one sum in another order (the bias after the product, the loss's terms)
  local TOL = { atol = 1e-6, rtol = 1e-5 }

  it('cut and join a tensor by pieces, q, k and v blocks each cut with stride 3', function()
    local t = ds.arange(12, 'f32'):reshape({ 12, 1 })
    assert.are.same({ 0, 1, 4, 5, 8, 9 }, P.piece(t, 1, 0, 2, 3):reshape(-1):totable())
    assert.are.same({ 2, 3, 6, 7, 10, 11 }, P.piece(t, 1, 1, 2, 3):reshape(-1):totable())
    local pieces = {}
    for r = 0, 1 do pieces[r + 1] = P.piece(t, 1, r, 2, 3) end
    assert.are.same(t:reshape(-1):totable(), P.join(pieces, 1, 3):reshape(-1):totable())
    H.has(H.err(function() P.piece(t, 1, 0, 5) end), 'dim 1 of size 12 does not split into 1 x 5 equal parts')
  end)

  it('without a group compute what nn.Linear, nn.Embedding and ds.cross_entropy compute', function()
    ds.manual_seed(3)
    local lin = ds.nn.Linear(6, 4)
    local col, row = P.ColumnParallelLinear(lin), P.RowParallelLinear(lin)
    local x = ds.randn(2, 6)
    H.assert_same(col(x), lin(x))
    H.assert_close(row(x), lin(x), TOL)
    local emb = ds.nn.Embedding(10, 3)
    local ids = ds.tensor({ { 1, 9, 0 } }, 'i64')
    H.assert_same(P.VocabParallelEmbedding(emb)(ids), emb(ids))
    H.has(H.err(P.ColumnParallelLinear, emb), 'ColumnParallelLinear: expected an nn.Linear to split, got a Embedding')
    H.has(H.err(P.ColumnParallelLinear, 6, 4, { group = 2 }), 'ColumnParallelLinear: group must be a ds.comm group')
    local logits = ds.randn(2, 3, 7):requires_grad_()
    local targets = ds.tensor({ { 1, 6, -100 }, { 0, 2, 3 } }, 'i64')
    local a = P.vocab_parallel_cross_entropy(logits, targets)
    a:backward()
    local ga = logits.grad:clone()
    logits.grad = nil
    local b = ds.cross_entropy(logits, targets)
    b:backward()
    H.assert_close(a, b, TOL)
    H.assert_close(ga, logits.grad, TOL)
    -- 16-bit logits: the loss in f32 from their values
    local l16 = (logits:detach() * 3):to('bf16')
    H.assert_same(P.vocab_parallel_cross_entropy(l16, targets), P.vocab_parallel_cross_entropy(l16:to('f32'), targets))
    -- padding columns past `classes` count for nothing
    local padded = ds.cat({ logits:detach(), ds.full({ 2, 3, 2 }, 50) }, 3)
    H.assert_close(P.vocab_parallel_cross_entropy(padded, targets, { classes = 7 }), b, TOL)
  end)

  it('replay the model-parallel random state in a checkpointed backward', function()
    ds.checkpointing.model_parallel_manual_seed(9, 0)
    local tracker = ds.checkpointing.get_rng_tracker()
    local w = ds.randn(16):requires_grad_()
    local function f(x)
      return tracker:fork(ds.checkpointing.MODEL_PARALLEL_RNG, function() return ds.dropout(x * w, 0.5) end):sum()
    end
    local x = ds.randn(16):requires_grad_()
    ds.checkpointing.model_parallel_manual_seed(9, 0)
    f(x):backward()
    local plain = w.grad:clone()
    w.grad = nil
    ds.checkpointing.model_parallel_manual_seed(9, 0)
    ds.checkpoint(f, x):backward()
    H.assert_same(w.grad, plain)
    -- a tensor rank's state is its own
    ds.checkpointing.model_parallel_manual_seed(9, 1)
    local other = tracker:fork(ds.checkpointing.MODEL_PARALLEL_RNG, function() return ds.dropout(ds.ones(64), 0.5) end)
    ds.checkpointing.model_parallel_manual_seed(9, 0)
    local mine = tracker:fork(ds.checkpointing.MODEL_PARALLEL_RNG, function() return ds.dropout(ds.ones(64), 0.5) end)
    assert.is_true((other - mine):abs():amax():item() > 0)
  end)

  it('refuse heads, key/value heads, vocabulary or MLP widths the degree does not divide', function()
    local GPT, Llama = require 'models.gpt2', require 'models.llama'
    local g = { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 4, n_embd = 16 }
    local function with(base, k, v)
      local c = {}
      for key, val in pairs(base) do c[key] = val end
      c[k] = v
      return c
    end
    H.has(H.err(GPT, with(with(g, 'n_head', 2), 'tp', 4)),
          'gpt2: n_head 2 is not divisible by the tensor-parallel degree 4')
    H.has(H.err(GPT, with(with(g, 'vocab_size', 30), 'tp', 4)),
          'gpt2: vocab_size 30 is not divisible by the tensor-parallel degree 4')
    H.has(H.err(GPT, with(with(with(g, 'vocab_size', 30), 'padded_vocab_size', 34), 'tp', 4)),
          'gpt2: padded_vocab_size 34 is not divisible by the tensor-parallel degree 4')
    H.has(H.err(GPT, with(g, 'tp', 0)), 'gpt2: tp must be a positive integer, got 0')
    H.has(H.err(GPT.pipe_layers, with(g, 'tp', 2)), "gpt2.pipe_layers: tp 2 needs the pipeline's topology")
    local l = { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 8, n_kv_head = 2, n_embd = 32,
                intermediate_size = 24 }
    H.has(H.err(Llama, with(l, 'tp', 4)), 'llama: n_kv_head 2 is not divisible by the tensor-parallel degree 4')
    H.has(H.err(Llama, with(with(with(l, 'n_kv_head', 4), 'intermediate_size', 30), 'tp', 4)),
          'llama: intermediate_size 30 is not divisible by the tensor-parallel degree 4')
    H.has(H.err(Llama, with(with(l, 'vocab_size', 31), 'tp', 2)),
          'llama: vocab_size 31 is not divisible by the tensor-parallel degree 2')
    -- a degree the world does not divide: the topology's error
    H.has(H.err(Llama, with(with(l, 'n_kv_head', 4), 'tp', 4)),
          'llama: topology: pipe 1 x tensor 4 x sequence 1 = 4 does not divide the world of 1 rank')
    H.has(H.err(Llama, with(with(l, 'tp', 2), 'topology', ds.topology { world_size = 1 })),
          "llama: tp 2 and the topology's tensor degree 1 differ")
  end)
end)

describe('tensor-parallel training', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  -- Tolerances: f32 over 5 steps of AdamW (lr 1e-3) or SGD with momentum;
  -- the split sums (row-parallel outputs, the vocabulary's sums) round
  -- differently from one sum, nothing more.
  local LOSS_RTOL, NORM_RTOL, WEIGHT_RTOL = 1e-5, 1e-5, 1e-5

  local runs = {}
  -- equiv.lua on np ranks with tensor degree tp (np 1: no mpirun)
  local function run(np, tp)
    local key = np .. 'x' .. tp
    if not runs[key] then
      local json = dir .. '/' .. key .. '.json'
      runs[key] = H.run_json(string.format('%s spec/tp/equiv.lua %s %d 2>&1', H.ranks_cmd(np), json, tp), json)
    end
    return runs[key]
  end

  local function same_training(case, np, tp, ref)
    local one, many = run(1, 1)[ref or case], run(np, tp)[case]
    assert.are.equal(5, #many.losses)
    for i, l in ipairs(one.losses) do
      local err = math.abs(many.losses[i] - l) / math.abs(l)
      assert.is_true(err <= LOSS_RTOL, string.format('%s tp %d on %d ranks: step %d loss %.9g vs %.9g', case, tp, np, i,
                                                     many.losses[i], l))
      -- clipping (0.05) is on at every step; a norm counting a replicated weight twice would differ
      assert.is_true(one.norms[i] > 0.05)
      err = math.abs(many.norms[i] - one.norms[i]) / one.norms[i]
      assert.is_true(err <= NORM_RTOL, string.format('%s tp %d on %d ranks: step %d gradient norm %.9g vs %.9g', case,
                                                     tp, np, i, many.norms[i], one.norms[i]))
    end
    local count = 0
    for name, w in pairs(one.weights) do
      local err = H.rel_diff(many.weights[name], w)
      assert.is_true(err <= WEIGHT_RTOL,
                     string.format('%s tp %d on %d ranks: %s differs by %.3g', case, tp, np, name, err))
      count = count + 1
    end
    assert.is_true(count >= 10)
    assert.are.equal(0, many.replicated_diff)     -- replicated weights stay equal across the tensor group
  end

  for _, tp in ipairs({ 2, 4 }) do
    it(string.format('trains GPT-2 and Llama (grouped-query) with tensor degree %d as on one rank', tp), function()
      for _, case in ipairs({ 'gpt2', 'gpt2_bias_sgd', 'llama' }) do same_training(case, tp, tp) end
      same_training('gpt2_checkpoint', tp, tp, 'gpt2')      -- activation checkpointing
    end)
  end

  it('trains tensor 2 x data 2 as on one rank, plain and ZeRO 1, 2 and 3 over the data group', function()
    for _, case in ipairs({ 'gpt2', 'llama', 'gpt2_zero1', 'llama_zero2', 'gpt2_zero3' }) do
      same_training(case, 4, 2)
    end
  end)

  it('splits a GPT-2 built whole for DeepSpeed\'s tensor_parallel.autotp_size and trains it as on one rank', function()
    same_training('gpt2_autotp', 2, 2, 'gpt2')
    same_training('gpt2_autotp', 4, 2, 'gpt2')
  end)

  it('refuses AutoTP for a model without a tensor-parallel form, naming it', function()
    local script = dir .. '/plain.lua'
    H.write(script, [[
local ds = require 'dslua'
ds.initialize { model = ds.nn.Sequential(ds.nn.Linear(4, 4)),
                config = { train_batch_size = 2, tensor_parallel = { autotp_size = 2 } } }
]])
    local out, status = H.run(H.ranks_cmd(2) .. ' ' .. script .. ' 2>&1')
    assert.are_not.equal(0, status)
    H.has(out, 'initialize: tensor_parallel.autotp_size 2: the model (Sequential) has no tensor-parallel form')
  end)

  it("refuses Lamb's trust ratios over split weights, naming the optimizer and the degree", function()
    local script = dir .. '/lamb.lua'
    H.write(script, [[
local ds = require 'dslua'
local GPT2 = require 'models.gpt2'
ds.initialize { model = GPT2 { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8 },
                config = { train_batch_size = 2, tensor_parallel = { autotp_size = 2 },
                           optimizer = { type = 'Lamb', params = { lr = 1e-3 } } } }
]])
    local out, status = H.run(H.ranks_cmd(2) .. ' ' .. script .. ' 2>&1')
    assert.are_not.equal(0, status)
    H.has(out, "initialize: Lamb under tensor parallelism (the model is split over 2 ranks): its trust ratios need "
          .. "whole weights' norms")
  end)

  it('loads Hugging Face weights into a split model: the same loss as the whole one', function()
    local script = dir .. '/hf.lua'
    H.write(script, string.format([[
local ds = require 'dslua'
local Llama = require 'models.llama'
local folder = '%s/hf'
ds.manual_seed(4)
local whole = Llama { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 4, n_kv_head = 2, n_embd = 16,
                      intermediate_size = 24 }
if ds.comm.rank() == 0 then Llama.save_hf(whole, folder) end
ds.comm.barrier()
local split = Llama.from_hf(folder, { tp = 2 })
assert(split.tensor_group:size() == 2)
local x = (ds.rand(2, 9) * 32):to('i64')
ds.comm.broadcast(x, 0)
local a = whole(x:narrow(2, 1, 8):contiguous(), x:narrow(2, 2, 8):contiguous()):item()
local b = split(x:narrow(2, 1, 8):contiguous(), x:narrow(2, 2, 8):contiguous()):item()
ds.comm.print0(string.format('losses %%.9g %%.9g', a, b))
assert(math.abs(a - b) <= 1e-5 * math.abs(a), 'losses differ')
]], dir))
    local out, status = H.run(H.ranks_cmd(2) .. ' ' .. script .. ' 2>&1')
    assert.are.equal(0, status, out)
    H.has(out, 'losses ')
  end)

  -- Per step, f32, b sequences of T tokens per data rank, width C, L layers:
  -- the tensor group all-reduces b T C values 4L + 2 times (each layer's
  -- two row-parallel outputs forward and two copied inputs backward, the
  -- embedding's lookup, the lm_head's input backward) and b T values three
  -- times (the loss's maxima, target logits, sums); the data group
  -- all-reduces the n local gradients (stage 0) or reduce-scatters them
  -- and all-gathers the n / d updated (ZeRO 1, 2).
  it('moves the bytes the formula gives per step, by group', function()
    local T, L = 8, 2
    local widths = { gpt2 = 16, llama = 32, gpt2_zero1 = 16, llama_zero2 = 32 }
    for _, r in ipairs({ { 2, 2 }, { 4, 4 }, { 4, 2 } }) do
      local np, tp = r[1], r[2]
      local d = np / tp
      local b = 8 / d
      for case, C in pairs(widths) do
        local res = run(np, tp)[case]
        local tensor = (4 * L + 2) * b * T * C * 4 + 3 * b * T * 4
        local n = res.n_local
        local data = d == 1 and 0 or case:match('zero') and (n * 4 + n / d * 4) or n * 4
        for s, c in ipairs(res.comm) do
          if s == 1 then
            print(string.format('%s tensor %d x data %d, step %d: tensor group %d bytes (%d calls), '
                                .. 'data group %d bytes', case, tp, d, s, c.tensor, c.calls.tensor_all_reduce, c.data))
          end
          assert.are.equal(tensor, c.tensor, case)
          assert.are.equal(4 * L + 5, c.calls.tensor_all_reduce, case)
          if d > 1 then assert.are.equal(data, c.data, case) end
        end
      end
    end
  end)

  it('keeps dropout masks equal where activations are replicated and apart where they are split', function()
    local json = dir .. '/rng.json'
    local res = H.run_json(string.format('%s spec/tp/rng.lua %s 2 2>&1', H.ranks_cmd(2), json), json)
    assert.are.equal(0, res.loss_spread)      -- the ranks' replicated activations agree, dropout included
    assert.are.equal(0, res.default_spread)
    assert.is_true(res.forked_spread > 0)
  end)

  it('gives the ranks of a tensor group the same batches from the engine\'s loader and the sampler block\'s, '
     .. 'in one rank\'s order', function()
    local json = dir .. '/rng.json'
    local res = H.run_json(string.format('%s spec/tp/rng.lua %s 2 2>&1', H.ranks_cmd(2), json), json)
    assert.are.equal(0, res.batch_spread)
    -- the sampler block's too: the tensor ranks are one data-parallel rank
    assert.are.equal(6, res.sampler_batches)
    assert.are.equal(0, res.sampler_spread)
    -- one rank's loader, its own shuffle
    local data = ds.data.tensors { x = ds.arange(24, 'f32'):reshape({ 24, 1 }) }
    local model = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8 }
    local _, _, loader = ds.initialize { model = model, training_data = data, config = {
      train_batch_size = 4, optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
    for _, b in loader:epoch(1) do
      assert.are.same(b.x:reshape(-1):totable(), res.first_batch)
      break
    end
  end)
end)
