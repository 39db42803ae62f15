-- ZeRO stages 0-3 on one rank on the GPU, through the step engine: the
-- tiny GPT-2 of spec/models_spec.lua trained 20 AdamW steps in fp32 and in
-- bf16; every stage follows stage 0 (fp32 within 1e-5, bf16 within 1e-2),
-- the loss falls, the masters, their gradients and the optimizer state
-- live on the GPU, and the bf16 parameters are the masters cast. Skips
-- without a GPU.
local H = require 'helpers'
local ds = H.ds
local GPT = require 'models.gpt2'

local function train(F, stage, bf16)
  ds.manual_seed(1337)
  local model = GPT(F.config)
  local engine = ds.initialize { model = model, config = {
    train_batch_size = F.batch, steps_per_print = 1e9, bf16 = { enabled = bf16 },
    optimizer = { type = 'AdamW', params = { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 } },
    zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0 } } }
  local dev = engine.device
  local losses = {}
  for step = 1, 20 do
    local loss = engine(H.token_batch(F.windows[step], F.batch, F.seq, dev))
    losses[step] = loss:item()
    engine:backward(loss)
    engine:step()
  end
  if engine.zero then
    local master = engine.zero.engine:master(1)
    assert.are.equal(dev, master:device())
    assert.are.equal(dev, engine.zero.optimizer:flat_state(1, 'exp_avg'):device())
  end
  if bf16 and stage < 3 then
    -- the optimizer's pass wrote the bf16 parameters: the masters cast
    local master, at = engine.zero.engine:master(1), 0
    for _, p in ipairs(model:parameters()) do
      H.assert_same(p:view(-1):cpu(), master:narrow(1, at + 1, p:numel()):to('bf16'):cpu(), 'bf16 parameters')
      at = at + p:numel()
    end
  end
  engine:destroy()
  return losses
end

describe('#gpu ZeRO on one GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  for _, case in ipairs({ { bf16 = false, tol = 1e-5 }, { bf16 = true, tol = 1e-2 } }) do
    local name = case.bf16 and 'bf16' or 'fp32'
    it('stages 1-3 follow stage 0 in ' .. name .. ', with every buffer on the GPU', function()
      local F = H.fixture('models_gpt2')
      local base = train(F, 0, case.bf16)
      assert.is_true(base[20] < base[1], string.format('%s loss %.4f -> %.4f', name, base[1], base[20]))
      for stage = 1, 3 do
        local got = train(F, stage, case.bf16)
        for step = 1, 20 do
          local d = math.abs(got[step] - base[step]) / math.abs(base[step])
          assert.is_true(d <= case.tol, string.format('%s stage %d step %d: %.9g vs %.9g', name, stage, step,
                                                      got[step], base[step]))
        end
      end
    end)
  end
end)
