-- ZeRO stages 0-3 on one rank on the GPU, through the step engine: the
-- tiny GPT-2 of spec/models_spec.lua trained 20 AdamW steps in fp32 and in
-- bf16; every stage follows stage 0 (fp32 within 1e-5, bf16 within 1e-2),
-- the loss falls, the masters, their gradients and the optimizer state
-- live on the GPU, and the bf16 parameters are the masters cast; with
-- clipping, the norms and losses follow the CPU's. Skips without a GPU.
local H = require 'helpers'
local ds = H.ds
local GPT = require 'models.gpt2'

local function train(F, stage, bf16, clip)
  ds.manual_seed(1337)
  local model = GPT(F.config)
  local engine = ds.initialize { model = model, config = {
    train_batch_size = F.batch, steps_per_print = 1e9, bf16 = { enabled = bf16 }, gradient_clipping = clip,
    optimizer = { type = 'AdamW', params = { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 } },
    zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0 } } }
  local dev = engine.device
  local losses, norms = {}, {}
  for step = 1, 20 do
    local loss = engine(H.token_batch(F.windows[step], F.batch, F.seq, dev))
    losses[step] = loss:item()
    engine:backward(loss)
    engine:step()
    norms[step] = engine.grad_norm
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
  return losses, norms
end

-- fn() with DSLUA_DEVICE set to device (ds.device() reads it on every call).
local ffi = require 'ffi'
ffi.cdef [[ int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name); ]]
local function on_device(device, fn)
  local before = os.getenv('DSLUA_DEVICE')
  ffi.C.setenv('DSLUA_DEVICE', device, 1)
  local ok, a, b = pcall(fn)
  if before then ffi.C.setenv('DSLUA_DEVICE', before, 1) else ffi.C.unsetenv('DSLUA_DEVICE') end
  assert(ok, a)
  return a, b
end

local function assert_follows(what, got, want, steps, tol)
  for step = 1, steps do
    local d = math.abs(got[step] - want[step]) / math.abs(want[step])
    assert.is_true(d <= tol, string.format('%s step %d: %.9g vs %.9g', what, step, got[step], want[step]))
  end
end

describe('#gpu ZeRO on one GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  for _, case in ipairs({ { bf16 = false, tol = 1e-5 }, { bf16 = true, tol = 1e-2 } }) do
    local name = case.bf16 and 'bf16' or 'fp32'
    it('stages 1-3 follow stage 0 in ' .. name .. ', with every buffer on the GPU', function()
      local F = H.fixture('models_gpt2')
      local base = train(F, 0, case.bf16)
      assert.is_true(base[20] < base[1], string.format('%s loss %.4f -> %.4f', name, base[1], base[20]))
      for stage = 1, 3 do assert_follows(name .. ' stage ' .. stage, train(F, stage, case.bf16), base, 20, case.tol) end
    end)
    -- the step engine's norm pass (16-byte loads, a fixed tree) and the
    -- clipping factor applied inside the optimizer's pass, against the CPU
    it('gradient clipping follows the CPU in ' .. name .. ': the norms and the losses', function()
      local F = H.fixture('models_gpt2')
      for _, stage in ipairs { 0, 2 } do
        local want_loss, want_norm = on_device('cpu', function() return train(F, stage, case.bf16, 0.05) end)
        local got_loss, got_norm = train(F, stage, case.bf16, 0.05)
        assert.is_true(want_norm[1] > 0.05, 'the clip must act: norm ' .. want_norm[1])
        -- the first step from the same weights; after it, the devices' roundings drift apart
        assert_follows(name .. ' stage ' .. stage .. ' norm', got_norm, want_norm, 5, case.tol * 10)
        assert_follows(name .. ' stage ' .. stage .. ' loss', got_loss, want_loss, 5, case.tol * 10)
      end
    end)
  end
end)
