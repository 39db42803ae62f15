-- ds.pipe: the 1F1B schedule, partitioning, errors, and a 2-stage pipeline
-- training the MLP exactly as one rank does (spec/pipe/equiv.lua).
local H = require 'helpers'
local ds = H.ds
local nn = ds.nn
local pipe = ds.pipe
local schedule = require('dslua.engine.pipe').schedule
local MLP = require 'models.mlp'

local function order(stage, S, gas)
  local out = {}
  for i, a in ipairs(schedule(stage, S, gas)) do out[i] = a[1] .. a[2] end
  return table.concat(out, ' ')
end

describe('ds.pipe schedule (1F1B)', function()
  it("fills the pipe, then alternates, then drains, as DeepSpeed's TrainSchedule", function()
    assert.are.equal('F1 F2 B1 F3 B2 F4 B3 B4', order(0, 2, 4))
    assert.are.equal('F1 B1 F2 B2 F3 B3 F4 B4', order(1, 2, 4))
    assert.are.equal('F1 F2 F3 F4 B1 B2 B3 B4', order(0, 4, 4))
    assert.are.equal('F1 F2 B1 B2', order(0, 4, 2))   -- fewer micro batches than stages
  end)
end)

describe('ds.pipe.partition', function()
  local layers = MLP.pipe_layers { input_size = 784, hidden = { 256, 256 }, num_classes = 10 }
  -- Flatten, Linear 784x256, ReLU, Linear 256x256, ReLU, Linear 256x10

  it("'parameters' balances parameter counts, earlier stages filled first among equal splits", function()
    assert.are.same({ 1, 4, 7 }, pipe.partition(layers, 2, 'parameters'))
    -- not Flatten alone in stage 0 (a stage without parameters), as DeepSpeed's fill
    assert.are.same({ 1, 4, 6, 7 }, pipe.partition(layers, 3, 'parameters'))
  end)

  it("'uniform' balances layer counts, 'type:<regex>' the layers whose class matches", function()
    assert.are.same({ 1, 4, 7 }, pipe.partition(layers, 2, 'uniform'))
    assert.are.same({ 1, 4, 6, 7 }, pipe.partition(layers, 3, 'type:linear'))
    -- GPT-2's layers: the token embedding, positions, 2 blocks, ln_f, the lm_head (the embedding again)
    local gpt = require('models.gpt2').pipe_layers { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 32,
                                                     block_size = 8 }
    assert.are.same({ 1, 4, 7 }, pipe.partition(gpt, 2, 'type:block'))
  end)

  it('names what is wrong', function()
    H.fails("partition_method 'type:conv' matches no layer", pipe.partition, layers, 2, 'type:conv')
    H.fails("partition_method must be 'parameters', 'uniform' or 'type:<regex>', got best",
            pipe.partition, layers, 2, 'best')
    H.fails('2 stages but only 1 layers; every stage needs at least one',
            pipe.PipelineModule, { layers = { pipe.LayerSpec(nn.ReLU) }, num_stages = 2 })
  end)
end)

describe('ds.pipe.PipelineModule on one rank', function()
  it('builds every layer from its own seed: the same weights however it is split', function()
    local function weights()
      local m = pipe.PipelineModule { layers = MLP.pipe_layers { input_size = 8, hidden = { 4 }, num_classes = 3 },
                                      num_stages = 1, loss_fn = ds.cross_entropy }
      return m.funcs[2].weight:clone()
    end
    ds.manual_seed(1)
    local a = weights()
    local rng = ds.get_rng_state()
    ds.manual_seed(2)
    local b = weights()
    assert.are.equal(0, (a - b):abs():amax():item())
    ds.manual_seed(1)
    weights()
    assert.are.equal(rng, ds.get_rng_state())   -- the caller's random stream is left alone
  end)
end)

describe('ds.pipe.PipeDataParallelTopology', function()
  it("numbers ranks pipe outermost, as DeepSpeed's, and must cover the world", function()
    local topo = pipe.PipeDataParallelTopology { num_pp = 2, num_dp = 3 }
    assert.are.same({ pipe = 1, data = 2 }, topo:get_coord(5))
    assert.are.equal(4, topo:get_rank(1, 1))
    assert.are.equal(3, topo:get_dim('data'))
    local layers = MLP.pipe_layers { input_size = 8, hidden = { 4 }, num_classes = 3 }
    H.fails_plain('the topology has 1 pipe x 3 data = 3 ranks, the world 1', pipe.PipelineModule,
                  { layers = layers, topology = pipe.PipeDataParallelTopology { num_pp = 1, num_dp = 3 } })
    local m = pipe.PipelineModule { layers = layers, topology = pipe.PipeDataParallelTopology { num_pp = 1, num_dp = 1 } }
    assert.are.equal(1, m.num_stages)
  end)
end)

describe('ds.pipe.TiedLayerSpec', function()
  local function lin(forward_fn)
    return pipe.TiedLayerSpec { 'w', nn.Linear, 4, 4, forward_fn = forward_fn }
  end

  it('builds one module per key on a stage, the later layers through forward_fn', function()
    local calls = 0
    local m = pipe.PipelineModule { layers = { lin(), pipe.LayerSpec(nn.Tanh), lin(function(mod, x)
      calls = calls + 1
      return ds.linear(x, mod.weight)
    end) }, num_stages = 1 }
    assert.are.equal(2, #m:parameters())   -- one Linear: weight and bias
    local x = ds.randn(3, 4)
    local w = m.tied_modules.w
    local want = ds.linear(w(x):tanh(), w.weight)
    assert.are.equal(0, (m(x) - want):abs():amax():item())
    assert.are.equal(1, calls)
  end)

  it('names a spec without key or class, and a tied_weight_attr that is not a tensor', function()
    H.fails_plain('expected {key, cls, args..., forward_fn = f, tied_weight_attr = name}', pipe.TiedLayerSpec, { 'w' })
    H.fails_plain("TiedLayerSpec 'w': tied_weight_attr 'weight.t' is not a tensor of the Linear", pipe.PipelineModule,
                  { layers = { pipe.TiedLayerSpec { 'w', nn.Linear, 4, 4, tied_weight_attr = 'weight.t' } },
                    num_stages = 1 })
  end)
end)

describe('ds.pipe with the engine on one rank', function()
  local function model(opts)
    local o = { layers = MLP.pipe_layers { input_size = 8, hidden = { 4 }, num_classes = 3 }, num_stages = 1,
                loss_fn = ds.cross_entropy }
    for k, v in pairs(opts or {}) do o[k] = v end
    return pipe.PipelineModule(o)
  end
  local function config(extra)
    local c = { train_micro_batch_size_per_gpu = 2, steps_per_print = 1000, optimizer = { type = 'SGD', params = { lr = 0.1 } } }
    for k, v in pairs(extra or {}) do c[k] = v end
    return c
  end

  it("refuses ZeRO-2 and ZeRO-3, and a pipeline.stages that is not the module's", function()
    H.fails_plain('ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (zero_optimization.stage is 2)',
                  ds.initialize, { model = model(), config = config { zero_optimization = { stage = 2 } } })
    H.fails_plain('pipeline.stages is 2, the PipelineModule has 1 stages',
                  ds.initialize, { model = model(), config = config { pipeline = { stages = 2 } } })
  end)

  it("takes the pipeline block's activation_checkpoint_interval when the module sets none", function()
    local m = model()
    ds.initialize { model = m, config = config { pipeline = { activation_checkpoint_interval = 2 } } }
    assert.are.equal(2, m.activation_checkpoint_interval)
    m = model { activation_checkpoint_interval = 1 }
    ds.initialize { model = m, config = config { pipeline = { activation_checkpoint_interval = 2 } } }
    assert.are.equal(1, m.activation_checkpoint_interval)
  end)

  it('train_batch() reads the engine\'s training loader, epoch after epoch; both verbs want a pipeline', function()
    ds.manual_seed(3)
    local data = ds.data.tensors { x = ds.randn(6, 8), y = (ds.rand(6) * 2.99):to('i64') }
    local function run(with_loader)
      ds.manual_seed(5)
      local engine = ds.initialize { model = model(), config = config(), training_data = with_loader and data or nil }
      local loader = ds.data.loader(data, { batch_size = 2 })   -- the engine's order on one rank
      local it, e = nil, 0
      local function batches()
        local step, batch = (it or function() end)()
        if step == nil then
          e = e + 1
          it = loader:epoch(e)
          step, batch = it()
        end
        return batch
      end
      local losses = {}
      for i = 1, 5 do losses[i] = with_loader and engine:train_batch() or engine:train_batch(batches) end
      return losses
    end
    assert.are.same(run(false), run(true))
    local engine = ds.initialize { model = model(), config = config() }
    -- an iterator returning x, y (two values) reads as {x, y}
    ds.manual_seed(5)
    local a = ds.initialize { model = model(), config = config() }
    ds.manual_seed(5)
    local b = ds.initialize { model = model(), config = config() }
    local x, y = ds.randn(2, 8), ds.tensor({ 0, 2 }, 'i64')
    assert.are.equal(a:train_batch(function() return { x, y } end), b:train_batch(function() return x, y end))
    local e = H.err(engine.train_batch, engine, function() return x end)
    assert.matches('micro batch 1 has no labels for loss_fn', e, 1, true)
    H.fails_plain('no data iterator given and no training_data given to ds.initialize', engine.train_batch, engine)
    engine = ds.initialize { model = MLP { input_size = 8, hidden = { 4 }, num_classes = 3 }, config = config() }
    H.fails_plain('eval_batch: the model is not a ds.pipe.PipelineModule', engine.eval_batch, engine, function() end)
  end)
end)

describe('ds.pipe across ranks', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()

  -- equiv.lua's JSON for a model on np ranks in `stages` stages with ZeRO
  -- stage zero, gradient_clipping clip and precision (fp16, bf16, fp8 or fp32)
  -- and activation checkpointing every `interval` layers
  local function run(model, np, stages, zero, clip, precision, interval)
    local path = string.format('%s/%s-%d-%d-%d-%g-%s-%d.json', dir, model, np, stages, zero or 0, clip or 0,
                               precision or 'fp32', interval or 0)
    return H.run_json(string.format('%s spec/pipe/equiv.lua %s %s %d %d %g %s %d 2>&1', H.ranks_cmd(np), path, model,
                                    stages, zero or 0, clip or 0, precision or 'fp32', interval or 0), path)
  end

  -- losses, weights and norm within tol (relative; weights absolute)
  local function same(one, other, what, tol)
    tol = tol or 1e-5
    assert.are.equal(#one.losses, #other.losses)
    for i, l in ipairs(one.losses) do
      assert(math.abs(other.losses[i] - l) <= tol * math.abs(l),
             string.format('%s, step %d: %.9g vs %.9g', what, i, other.losses[i], l))
    end
    assert(math.abs(other.eval - one.eval) <= tol * math.abs(one.eval), what .. ': eval loss')
    local count = 0
    for name, w in pairs(one.weights) do
      local v = assert(other.weights[name], name)
      for i = 1, #w do assert(math.abs(v[i] - w[i]) <= tol, string.format('%s: %s[%d]', what, name, i)) end
      count = count + 1
    end
    assert.are.equal(0, other.spread, what .. ': copies of a weight differ')   -- replicas and tied copies
    if one.norm then assert(math.abs(other.norm - one.norm) <= tol * one.norm, what .. ': gradient norm') end
    return count
  end

  it('trains the MLP in 2 stages, and 2 stages x 2 data ranks with and without ZeRO-1, as on one rank', function()
    local one = run('mlp', 1, 1)
    assert.are.same({ 0, 5 }, one.stages)
    local two = run('mlp', 2, 2)
    assert.are.same({ 0, 2 }, two.stages)   -- stage 0: Flatten, the first Linear and its ReLU
    assert.are.equal(6, same(one, two, '2 stages'))
    same(one, run('mlp', 4, 2), '2x2')
    same(one, run('mlp', 4, 2, 1), '2x2 ZeRO-1')
  end)

  it('trains a tiny GPT-2 with its tied embedding in 2 stages, with ZeRO-1 too, and 2x2 with ZeRO-1, as on one rank',
     function()
    local one = run('gpt', 1, 1)
    local two = run('gpt', 2, 2)
    assert.are.same({ 0, 2 }, two.stages)   -- wte, positions, block 1 | block 2, ln_f, lm_head (wte)
    assert.is_not_nil(two.weights['tied.wte.weight'])
    same(one, two, '2 stages')
    same(one, run('gpt', 2, 2, 1), '2 stages ZeRO-1')
    same(one, run('gpt', 2, 2, 0, 0, 'fp32', 1), '2 stages, every layer checkpointed')
    same(one, run('gpt', 4, 2, 1), '2x2 ZeRO-1')
  end)

  it('clips by the norm of the whole model, the tied weight counted once, as one rank does', function()
    local one = run('gpt', 1, 1, 0, 0.05)
    assert(one.norm > 0.1, 'the norm is not above the clip: nothing is clipped')
    same(one, run('gpt', 2, 2, 0, 0.05), '2 stages, clipped')
    same(one, run('gpt', 4, 2, 1, 0.05), '2x2 ZeRO-1, clipped')
  end)

  it('runs fp16 (the overflow check agreed across stages) and bf16, tracking one rank', function()
    -- 16-bit sums in another order round otherwise: a looser match
    for _, precision in ipairs({ 'fp16', 'bf16' }) do
      same(run('gpt', 1, 1, 0, 0.05, precision), run('gpt', 4, 2, 1, 0.05, precision), precision, 2e-2)
    end
  end)

  -- fp8 in each stage (the engine's scope around each stage's forward, the
  -- amaxes agreed over the stage's data group): the losses track one
  -- rank's as bf16's do. Not each weight: a code that the other order of
  -- a sum moves across a rounding boundary changes a gradient by a
  -- format's step, and AdamW's first steps move a weight by lr whatever its
  -- gradient's size.
  it("runs fp8 in each stage, its losses tracking one rank's", function()
    local one = run('gpt', 1, 1, 0, 0.05, 'fp8')
    for _, c in ipairs({ { 2, 2, 0 }, { 4, 2, 1 } }) do
      local other = run('gpt', c[1], c[2], c[3], 0.05, 'fp8')
      for i, l in ipairs(one.losses) do
        assert(math.abs(other.losses[i] - l) <= 2e-2 * l, string.format('%d ranks, step %d: %.9g vs %.9g', c[1], i,
                                                                        other.losses[i], l))
      end
      assert.are.equal(0, other.spread, 'copies of a weight differ')
      assert(other.losses[1] ~= run('gpt', c[1], c[2], c[3], 0.05, 'bf16').losses[1], 'the stages ran in bf16')
    end
  end)

  -- equiv.lua's run that saves a checkpoint after step 1 (in dir/<name>),
  -- and runs that load it on np ranks in `stages` stages with ZeRO stage
  -- zero (fp32, or precision with clipping at 0.05)
  local function with_ckpt(mode, ckpt, path, model, np, stages, zero, precision)
    return H.run_json(string.format('%s spec/pipe/equiv.lua %s %s %d %d %g %s 0 %s:%s 2>&1', H.ranks_cmd(np), path,
                                    model, stages, zero, precision and 0.05 or 0, precision or 'fp32', mode, ckpt), path)
  end
  local function saved(model, np, stages, zero, precision)
    local ckpt = string.format('%s/ckpt-%s-%d-%d-%s', dir, model, np, zero, precision or 'fp32')
    return with_ckpt('save', ckpt, ckpt .. '.json', model, np, stages, zero, precision), ckpt
  end
  local function resumed(ckpt, model, np, stages, zero, precision)
    local path = string.format('%s-on-%d-%d-%d.json', ckpt, np, stages, zero)
    return with_ckpt('load', ckpt, path, model, np, stages, zero, precision)
  end

  -- the run that resumed at step 2 ended as the one that went on: losses
  -- (of steps 2 and 3), evaluation and weights within tol
  local function same_end(went_on, resumed_run, what, tol)
    assert.are.same({ step = 1 }, resumed_run.client)    -- client_state
    assert.are.equal(3, #went_on.losses)
    local one = { losses = { went_on.losses[2], went_on.losses[3] }, eval = went_on.eval, weights = went_on.weights }
    return same(one, resumed_run, what, tol)
  end

  it('checkpoints 2 stages and 2x2 with ZeRO-1: resumed exactly on the same layout (after a killed save too) and on '
     .. 'one rank; save_16bit_model and zero_to_fp32 load into models.gpt2', function()
    local mlp, mlp_dir = saved('mlp', 2, 2, 0)
    assert.are.equal(6, same_end(mlp, resumed(mlp_dir, 'mlp', 2, 2, 0), 'MLP, 2 stages', 1e-6))
    same_end(mlp, resumed(mlp_dir, 'mlp', 1, 1, 0), 'MLP, 2 stages loaded on one rank', 1e-5)
    local gpt, gpt_dir = saved('gpt', 4, 2, 1)
    local m = ds.json.decode(assert(io.open(gpt_dir .. '/global_step1/manifest.json')):read('*a'))
    assert.are.same({ stages = 2, data_parallel = 2, layers = 6, firsts = { 0, 3 } }, m.pipeline)
    local wte = m.parameters[1]     -- the tied embedding once, in stage 0's files
    assert.are.same({ 'layer_00.weight', { 0, 1 } }, { wte.name, wte.ranks })
    assert.are.equal(28, #m.parameters)   -- every weight once, as the JSON counts them (the tied one by key)
    assert.are.equal(28, same_end(gpt, resumed(gpt_dir, 'gpt', 4, 2, 1), 'GPT-2, 2x2 ZeRO-1', 1e-6))
    -- stage 1's first rank killed halfway through its file while the same
    -- run saves global_step1 again: the saved checkpoint stays whole
    local mpirun = H.ranks_cmd(4, { 'DSLUA_CKPT_KILL' })
    local _, status = H.run(string.format('DSLUA_CKPT_KILL=2:half %s spec/pipe/equiv.lua %s/killed.json gpt 2 1 0 fp32 '
                                          .. '0 save:%s 2>&1', mpirun, dir, gpt_dir))
    assert.are_not.equal(0, status)
    same_end(gpt, resumed(gpt_dir, 'gpt', 4, 2, 1), 'GPT-2, 2x2 ZeRO-1, after a killed save', 1e-6)
    same_end(gpt, resumed(gpt_dir, 'gpt', 1, 1, 0), 'GPT-2, 2x2 ZeRO-1 loaded on one rank', 1e-5)

    -- save_16bit_model: every layer once on rank 0, into models.gpt2 by from_pipe_state_dict
    local GPT = require 'models.gpt2'
    local sd = ds.checkpoint.load_file(gpt_dir .. '/model.safetensors')
    local n = 0
    for name, t in pairs(sd) do
      local k, rest = name:match('^layer_(%d+)%.(.+)$')
      local want = assert(gpt.weights[(k == '00' and 'tied.wte' or tostring(tonumber(k))) .. '.' .. rest], name)
      for i, v in ipairs(t:reshape({ -1 }):totable()) do assert(math.abs(v - want[i]) <= 1e-6, name) end
      n = n + 1
    end
    assert.are.equal(28, n)
    local model = GPT { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 32, block_size = 8 }
    model:load_state_dict(GPT.from_pipe_state_dict(sd))     -- strict: every tensor of the model given
    local c_fc = model.transformer.h[2].mlp.c_fc.weight        -- the second block: layer 3
    assert.are.same(gpt.weights['3.mlp.c_fc.weight'], c_fc:to('f64'):reshape({ -1 }):totable())
    -- zero_to_fp32 consolidates the step 1 checkpoint under the same names
    local fp32 = ds.checkpoint.load_file(ds.checkpoint.zero_to_fp32(gpt_dir, dir .. '/fp32.safetensors'))
    model:load_state_dict(GPT.from_pipe_state_dict(fp32))
    assert.are.same(fp32['layer_00.weight']:totable(), model.lm_head.weight:totable())
  end)

  it("resumes fp8 in 2 stages exactly and on one rank: every stage's fp8 layers, named by layer", function()
    local went_on, ckpt = saved('gpt', 2, 2, 0, 'fp8')
    local m = ds.json.decode(assert(io.open(ckpt .. '/global_step1/manifest.json')):read('*a'))
    local names = {}
    for name in pairs(m.fp8.layers) do names[#names + 1] = name end
    table.sort(names)
    assert.are.same({ 'layer_02.attn.c_attn', 'layer_02.attn.c_proj', 'layer_02.mlp.c_fc', 'layer_02.mlp.c_proj',
                      'layer_03.attn.c_attn', 'layer_03.attn.c_proj', 'layer_03.mlp.c_fc', 'layer_03.mlp.c_proj' },
                    names)     -- the two blocks, one a stage
    same_end(went_on, resumed(ckpt, 'gpt', 2, 2, 0, 'fp8'), 'GPT-2 fp8, 2 stages', 1e-6)
    same_end(went_on, resumed(ckpt, 'gpt', 1, 1, 0, 'fp8'), 'GPT-2 fp8, 2 stages loaded on one rank', 2e-2)
  end)

  it('resumes fp16 in 2x2 with ZeRO-1 and clipping exactly: fp32 masters, the loss scaler', function()
    local went_on, ckpt = saved('gpt', 4, 2, 1, 'fp16')
    same_end(went_on, resumed(ckpt, 'gpt', 4, 2, 1, 'fp16'), 'GPT-2 fp16, 2x2 ZeRO-1', 1e-6)
  end)

  local function fails(case, want)
    local out, status = H.run('DSLUA_COMM_TIMEOUT=20 ' .. H.ranks_cmd(2) .. ' spec/pipe/errors.lua ' .. case .. ' '
                              .. dir .. ' 2>&1')
    assert.are_not.equal(0, status)
    assert.matches(want, out)
  end

  it('refuses a stage without parameters, naming it', function()
    fails('no_params', 'stage 1 %(layers 2%.%.3: ReLU, Tanh%) has no parameters')
  end)

  it('refuses to load a pipeline checkpoint into a model that is not one, naming both layouts', function()
    fails('layout', "load_checkpoint: '[^']*/pipe' was saved from a pipeline of 2 layers in 2 stages %(layers 0%.%.0 | "
                    .. '1%.%.1%) x 1 data parallel; this engine runs a model on 2 ranks, not a pipeline')
  end)

  it('names both stages and the shape when an activation does not fit the next stage', function()
    fails('shapes', 'stage 1 %(from layer 1%) failed on the %[3x6%] activation stage 0 sent %(micro batch 1%)')
  end)
end)
