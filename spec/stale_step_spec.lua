-- A step between forward and backward changes the weights the graph saved:
-- every writer of a parameter's bytes (the fused optimizers, the step
-- engine's copies under ZeRO, the 1-bit optimizers' compressed steps) moves
-- their version, so the backward refuses instead of giving gradients from
-- the new weights.
local H = require 'helpers'
local ds = H.ds

local MODIFIED = 'modified in place by '

describe('a step between forward and backward', function()
  for _, name in ipairs({ 'SGD', 'Adam', 'AdamW', 'Lion', 'Adagrad', 'Lamb' }) do
    it('fails the backward after ' .. name .. "'s fp32 step, naming the step", function()
      ds.manual_seed(1)
      local lin = ds.nn.Linear(3, 3)
      local x = ds.randn(2, 3):requires_grad_()
      local opt = ds.optim[name](lin:parameters(), { lr = 0.5 })
      lin(x):sum():backward()
      local loss = lin(x):sum()
      opt:step()
      H.fails(MODIFIED .. "the optimizer's step", function() loss:backward() end)
    end)
  end

  it('still lets a graph made after the step run its backward', function()
    local lin = ds.nn.Linear(3, 3)
    local x = ds.randn(2, 3):requires_grad_()
    local opt = ds.optim.SGD(lin:parameters(), { lr = 0.5 })
    lin(x):sum():backward()
    opt:step()
    x.grad = nil
    lin(x):sum():backward()
    -- d(sum(x W^T + b))/dx = the column sums of W: the weights after the step
    H.assert_close(x.grad:narrow(1, 1, 1):view(-1), lin.weight:sum(1), H.tol.f32, 'grad_x')
  end)

  local function engine_case(label, optimizer, stage, steps, writer)
    it('fails the engine backward after ' .. label, function()
      ds.manual_seed(1)
      local e = ds.initialize { model = ds.nn.Linear(3, 3), config = {
        train_batch_size = 2, steps_per_print = 1e9, optimizer = optimizer,
        zero_optimization = stage and { stage = stage } or nil } }
      local x = ds.randn(2, 3)
      for _ = 1, steps - 1 do
        e:backward(e(x):sum())
        e:step()
      end
      e:backward(e(x):sum())
      local stale = e(x):sum()
      e:step()
      local ok, err = pcall(function() e:backward(stale) end)
      e:destroy()
      assert.is_false(ok)
      assert.matches(MODIFIED .. writer, err)
    end)
  end
  local adamw = { type = 'AdamW', params = { lr = 0.1 } }
  engine_case('an fp32 step (stage 0)', adamw, nil, 1, "the optimizer's step")
  for stage = 1, 3 do
    engine_case('an fp32 ZeRO stage ' .. stage .. ' step', adamw, stage, 1, 'copy_')
  end
  -- freeze_step 1: the third step is compressed
  engine_case("OneBitAdam's compressed step", { type = 'OneBitAdam', params = { lr = 0.1, freeze_step = 1 } }, nil, 3,
              "the 1%-bit optimizer's step")
end)
