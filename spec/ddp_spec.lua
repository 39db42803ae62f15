-- Data-parallel training: the step engine's gradient buckets in this process,
-- then spec/ddp/equiv.lua on 1 rank and under mpirun on 2 and 4 ranks: the
-- MLP and a tiny GPT-2 trained through ds.initialize on the same global
-- batches give the same losses and final weights on every world size.
local H = require 'helpers'
local ds = H.ds

-- Tolerances: f32 training over 12 steps; a sum of N partial gradients
-- rounds differently from one sum over the whole batch, nothing more.
local LOSS_RTOL = 1e-5        -- |loss_N - loss_1| <= LOSS_RTOL * |loss_1|, every step
local WEIGHT_RTOL = 1e-5      -- ||w_N - w_1|| <= WEIGHT_RTOL * ||w_1||, every parameter tensor

local function fails(pattern, fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  assert.truthy(tostring(err):find(pattern, 1, true), tostring(err))
end

describe('gradient buckets', function()
  local Z0 = require('dslua.core')._zero

  -- four parameters of 6, 4, 10 and 3 elements in one optimizer
  local function setup(bucket_size)
    local p = {}
    for k, n in ipairs({ 6, 4, 10, 3 }) do p[k] = ds.ones(n):requires_grad_() end
    local opt = ds.optim.SGD(p, { lr = 0.1 })
    return p, opt, Z0.engine { optimizer = opt, groups = { p }, bucket_size = bucket_size }
  end

  -- sum over k of k * sum(p[k]), built from the last parameter back
  local function loss_of(p, skip)
    local loss
    for k = #p, 1, -1 do
      if k ~= skip then
        local t = (p[k] * k):sum()
        loss = loss and t + loss or t
      end
    end
    return loss
  end

  it('cut the optimizer\'s flat gradients from the last parameter, each holding at least bucket_size', function()
    local _, _, z = setup(8)
    assert.are.equal(2, z:buckets())
    assert.are.same({ 3, 2, 13 }, { z:bucket(1) })
    assert.are.same({ 1, 2, 10 }, { z:bucket(2) })
    local _, _, every = setup(0)
    assert.are.equal(4, every:buckets())
    local _, _, one = setup(5e8)
    assert.are.equal(1, one:buckets())
  end)

  it('launch in bucket order during backward, reduce in place, and step', function()
    local p, opt, z = setup(8)
    z:backward(loss_of(p), true)
    z:step(opt.param_groups, 1, 0, false)
    local s = z:stats()
    assert.are.equal(2, s.buckets)
    assert.are.equal(2, s.launched_in_backward)
    assert.are.equal(2, s.leaves_after_first_launch)
    assert.are.equal(23 * 4, s.bytes)
    for k = 1, 4 do assert.are.same(ds.full({ p[k]:numel() }, 1 - 0.1 * k):totable(), p[k]:totable()) end
    -- a parameter without gradient holds its bucket (and the ones after) until backward returns
    z:backward(loss_of(p, 3), true)
    z:step(opt.param_groups, 1, 0, false)
    assert.are.equal(0, z:stats().launched_in_backward)
  end)

  it('clip as torch\'s clip_grad_norm_ and report the norm', function()
    local p, opt, z = setup(8)
    z:backward(loss_of(p), true)
    local overflow, norm = z:step(opt.param_groups, 1, 1.0, false)
    local want = math.sqrt(6 * 1 + 4 * 4 + 10 * 9 + 3 * 16)
    assert.is_false(overflow)
    assert.is_true(math.abs(norm - want) < 1e-9 * want)
    local coef = 1.0 / (want + 1e-6)
    assert.is_true(math.abs(p[4]:totable()[1] - (1 - 0.1 * 4 * coef)) < 1e-6)
  end)

  it('name bad parameters and refuse use after close', function()
    local p, _, z = setup(8)
    z:close()
    fails('step engine: used after close()', z.buckets, z)
    local x = ds.ones(2):requires_grad_()
    local function engine(list) return Z0.engine { masters = true, groups = { list } } end
    fails('step engine: parameter 2 is not a leaf that requires grad', engine, { x, x * 2 })
    fails('step engine: parameter 2 is the same tensor as parameter 1', engine, { x, x })
    fails('step engine: group 1 item 1 is a number, not a tensor', engine, { 3 })
    fails('step engine: no parameters', engine, {})
    fails('step engine: parameter 1 is not in group 1 of the optimizer', Z0.engine,
          { optimizer = ds.optim.SGD({ x }, { lr = 1 }), groups = { { p[1] } } })
    local m = engine({ ds.ones(5):requires_grad_(), ds.ones(3):requires_grad_() })
    fails('step engine: refresh: 0 masters for 1 param groups', m.refresh, m, {})
    fails('step engine: refresh: master 1 is f32 [2], not a contiguous 1-D f32 tensor of 8 elements', m.refresh, m,
          { ds.zeros(2) })
    fails('step engine: modules are for stage 3', m.add_module, m, { 1 })
    fails('step engine: master_device: unknown device \'tpu\'', Z0.engine,
          { masters = true, master_device = 'tpu', groups = { { x } } })
  end)
end)

describe('the engine on one rank', function()
  it('reduces nothing and keeps no comm_stats', function()
    local model = require('models.mlp') { input_size = 4, hidden = { 8 }, num_classes = 2 }
    local engine = ds.initialize { model = model, config = {
      train_batch_size = 2, optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
    local loss = engine { x = ds.randn(2, 4), y = ds.tensor({ 0, 1 }, 'i64') }
    engine:backward(loss)
    engine:step()
    assert.is_nil(engine.steps:stats())          -- no bucket was launched
    assert.is_nil(engine.comm_stats)
    engine:finish()
  end)
end)

describe('data-parallel training', function()
  if H.skip_without_mpirun() then return end

  local dir = H.tmpdir()

  -- equiv.lua on np ranks (1: no mpirun), its JSON results and its output;
  -- the comm agreement (on by default): every rank must launch the same buckets in the same order
  local run = H.runs_by_np(dir, function(np, json)
    return H.ranks_cmd(np) .. ' spec/ddp/equiv.lua ' .. json .. ' 2>&1'
  end)

  local function same_training(case, np)
    local one, many = run(1)[case], run(np)[case]
    assert.are.equal(8 / np, many.micro_batch * (case == 'mlp_gas2_clip' and 2 or 1))
    assert.are.equal(12, #one.losses)
    assert.are.equal(12, #many.losses)
    for i, l in ipairs(one.losses) do
      local err = math.abs(many.losses[i] - l) / math.abs(l)
      assert.is_true(err <= LOSS_RTOL, string.format('%s on %d ranks: step %d loss %.9g vs %.9g', case, np, i,
                                                     many.losses[i], l))
    end
    local count = 0
    for name, w in pairs(one.weights) do
      local err = H.rel_diff(many.weights[name], w)
      assert.is_true(err <= WEIGHT_RTOL, string.format('%s on %d ranks: %s differs by %.3g', case, np, name, err))
      count = count + 1
    end
    assert.is_true(count >= 6)
    assert.are.equal(0, many.rank_diff)       -- every rank holds rank 0's weights exactly
  end

  for _, np in ipairs({ 2, 4 }) do
    it('trains the MLP on ' .. np .. ' ranks as on 1 (AdamW, SGD, accumulation with clipping)', function()
      for _, case in ipairs({ 'mlp', 'mlp_sgd', 'mlp_gas2_clip' }) do same_training(case, np) end
    end)

    it('trains a tiny GPT-2 on ' .. np .. ' ranks as on 1 (one bucket, several, checkpointed blocks)', function()
      for _, case in ipairs({ 'gpt2', 'gpt2_buckets', 'gpt2_checkpoint' }) do same_training(case, np) end
    end)

    it('trains a checkpointed GPT-2 on ' .. np .. ' ranks as the same GPT-2 without checkpointing', function()
      local plain, ckpt = run(np).gpt2_buckets, run(np).gpt2_checkpoint
      for i, l in ipairs(plain.losses) do assert.are.equal(l, ckpt.losses[i]) end
      for name, w in pairs(plain.weights) do
        for i = 1, #w do assert(math.abs(ckpt.weights[name][i] - w[i]) <= 1e-6, name) end
      end
    end)

    it('honours prescale_gradients and gradient_predivide_factor on ' .. np .. ' ranks', function()
      for _, case in ipairs({ 'mlp_prescale', 'mlp_predivide', 'gpt2_predivide', 'gpt2_prescale_predivide' }) do
        same_training(case, np)
      end
    end)
  end

  it('launches buckets while backward runs', function()
    for _, np in ipairs({ 2, 4 }) do
      local s = run(np).gpt2_buckets.stats
      assert.is_true(s.buckets >= 3, 'buckets ' .. s.buckets)
      assert.are.equal(s.buckets, s.launched_in_backward)
      assert.is_true(s.leaves_after_first_launch > 0)
      assert.are.equal(1, run(np).gpt2.stats.buckets)          -- reduce_bucket_size's default: 5e8 elements
      assert.are.equal(run(np).gpt2.stats.bytes, s.bytes)
    end
    assert.is_false(run(1).gpt2.stats)
  end)

  it('all-reduces only at accumulation boundaries, logs to the comms logger, prints on rank 0', function()
    local many, out = run(2)
    local bytes = tostring(many.mlp_gas2_clip.stats.bytes)
    assert.are.equal(12, many.mlp_gas2_clip.logged.all_reduce[bytes])     -- 12 steps of 2 micro steps
    local broadcasts = 0
    for _, n in pairs(many.mlp_gas2_clip.logged.broadcast) do broadcasts = broadcasts + n end
    assert.are.equal(6, broadcasts)                                     -- 3 Linears' weights and biases
    local _, tables = out:gsub('Comm%. Op +Message Size +Count', '')
    assert.are.equal(1, tables, out)
    assert.truthy(out:find('\nall_reduce\n', 1, true), out)
    assert.truthy(out:find('[Rank 0] step=12, skipped=0, lr=[0.01]', 1, true), out)
    assert.falsy(out:find('[Rank 1]', 1, true), out)
    os.execute('rm -rf ' .. dir)
  end)
end)
