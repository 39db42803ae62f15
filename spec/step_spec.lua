local H = require 'helpers'
local ds = H.ds

-- The step object (dslua/engine/step.lua): the mode is chosen once, at
-- initialize, and the engine, its join and its checkpoints ask it.
local Reg = H.two_layer('StepReg')

local function engine_for(extra)
  ds.manual_seed(3)
  local c = { train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 2, steps_per_print = 1000,
              optimizer = { type = 'Adam', params = { lr = 0.01 } } }
  for k, v in pairs(extra) do c[k] = v end
  return (ds.initialize { model = Reg(), config = c })
end

describe('the step object', function()
  local dir
  after_each(function()
    if dir then os.execute('rm -rf ' .. dir) end
    dir = nil
  end)

  -- mode: config, what holds the fp32 weights, reduces at the boundary and inside a window (one rank)
  local MODES = {
    { 'fp32', {}, 'flat', false, false },
    { 'bf16', { bf16 = { enabled = true } }, 'masters', true, false },
    { 'ZeRO-1', { zero_optimization = { stage = 1 } }, 'masters', true, false },
    { 'ZeRO-2', { zero_optimization = { stage = 2 } }, 'masters', true, true },
    { 'ZeRO-3', { zero_optimization = { stage = 3 } }, 'masters', true, true },
  }
  for _, m in ipairs(MODES) do
    it(m[1] .. ': one object answers what the mode holds and when a backward reduces', function()
      local e = engine_for(m[2])
      assert.are.equal(m[3], e.steps:holds())
      assert.are.equal(m[4], e.steps:reduces(true))
      assert.are.equal(m[5], e.steps:reduces(false))
      assert.are.equal(e.steps.zero, e.zero)           -- the ZeRO view is the step's
      assert.are.equal(e.optimizer, e.steps.optimizer)
      e:destroy()
    end)
  end

  it('streams the masters through the nvme optimizer and says so', function()
    dir = H.tmpdir()
    local e = engine_for { zero_optimization = { stage = 1, offload_optimizer = { device = 'nvme', nvme_path = dir } } }
    assert.are.equal('streamed', e.steps:holds())
    e:destroy()
  end)

  it('takes a step in every mode through the same calls', function()
    ds.manual_seed(7)
    local x, y = ds.randn(4, 6), ds.randn(4, 2)
    for _, m in ipairs(MODES) do
      local e = engine_for(m[2])
      local before = e.module.fc1.weight:to('f32'):clone()
      for _ = 1, 2 do
        e:backward(e:forward { x = x, y = y })
        e:step()
      end
      assert.are.equal(1, e.global_steps, m[1])
      assert.is_true((e.module.fc1.weight:to('f32') - before):abs():amax():item() > 0, m[1] .. ': the weights moved')
      e:destroy()
    end
  end)
end)
