-- ds.pipe: the 1F1B schedule, partitioning, errors, and a 2-stage pipeline
-- training the MLP exactly as one rank does (spec/pipe/equiv.lua).
local H = require 'helpers'
local ds = H.ds
local nn = ds.nn
local pipe = ds.pipe
local schedule = require('dslua.pipe.engine').schedule
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

  it("'parameters' balances parameter counts", function()
    assert.are.same({ 1, 3, 7 }, pipe.partition(layers, 2, 'parameters'))
  end)

  it("'uniform' balances layer counts, 'type:<regex>' the layers whose class matches", function()
    assert.are.same({ 1, 4, 7 }, pipe.partition(layers, 2, 'uniform'))
    assert.are.same({ 1, 3, 5, 7 }, pipe.partition(layers, 3, 'type:linear'))
  end)

  it('names what is wrong', function()
    local ok, err = pcall(pipe.partition, layers, 2, 'type:conv')
    assert.is_false(ok)
    assert.matches("partition_method 'type:conv' matches no layer", err)
    ok, err = pcall(pipe.partition, layers, 2, 'best')
    assert.is_false(ok)
    assert.matches("partition_method must be 'parameters', 'uniform' or 'type:<regex>', got best", err)
    ok, err = pcall(pipe.PipelineModule, { layers = { pipe.LayerSpec(nn.ReLU) }, num_stages = 2 })
    assert.is_false(ok)
    assert.matches('2 stages but only 1 layers; every stage needs at least one', err)
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

describe('ds.pipe across ranks', function()
  if not H.have_mpirun() then
    it('skips: mpirun is not on PATH', function() print('skipping: mpirun is not on PATH') end)
    return
  end
  local dir = H.tmpdir()

  it('trains the MLP in 2 stages as on one rank (1F1B, 3 micro batches, AdamW) and evaluates alike', function()
    local one = H.run_json(H.ranks_cmd(1) .. ' spec/pipe/equiv.lua ' .. dir .. '/1.json 2>&1', dir .. '/1.json')
    local two = H.run_json(H.ranks_cmd(2) .. ' spec/pipe/equiv.lua ' .. dir .. '/2.json 2>&1', dir .. '/2.json')
    assert.are.same({ 0, 5 }, one.stages)
    assert.are.same({ 0, 1 }, two.stages)   -- stage 0: Flatten and the first Linear
    assert.are.equal(4, #one.losses)
    for i, l in ipairs(one.losses) do
      assert(math.abs(two.losses[i] - l) <= 1e-5 * math.abs(l), string.format('step %d: %.9g vs %.9g', i, two.losses[i], l))
    end
    assert(math.abs(two.eval - one.eval) <= 1e-5 * math.abs(one.eval))
    local count = 0
    for name, w in pairs(one.weights) do
      local v = assert(two.weights[name], name)
      for i = 1, #w do assert(math.abs(v[i] - w[i]) <= 1e-5, name) end
      count = count + 1
    end
    assert.are.equal(6, count)
  end)

  local function fails(case, want)
    local out, status = H.run('DSLUA_COMM_TIMEOUT=20 ' .. H.ranks_cmd(2) .. ' spec/pipe/errors.lua ' .. case .. ' 2>&1')
    assert.are_not.equal(0, status)
    assert.matches(want, out)
  end

  it('refuses a stage without parameters, naming it', function()
    fails('no_params', 'stage 1 %(layers 2%.%.3: ReLU, Tanh%) has no parameters')
  end)

  it('names both stages and the shape when an activation does not fit the next stage', function()
    fails('shapes', 'stage 1 %(from layer 1%) failed on the %[3x6%] activation stage 0 sent %(micro batch 1%)')
  end)
end)
