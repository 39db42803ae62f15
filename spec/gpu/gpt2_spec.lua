-- The tiny GPT-2 of spec/models_spec.lua trained on the GPU and on the CPU
-- from the same initial weights and batches: the first 20 AdamW losses
-- agree within 1e-4 relative in f32 (the GPU's lm_head padded to 128
-- columns by the model). Skips without a GPU.
local H = require 'helpers'
local ds = H.ds
local GPT = require 'models.gpt2'

-- pad: rows of wte/lm_head; the padded model starts from the unpadded
-- one's weights (zero rows below), so both follow the same losses.
local function train(F, dev, steps, pad)
  ds.manual_seed(1337)
  local model = GPT(F.config)
  if pad then
    local cfg = {}
    for k, v in pairs(F.config) do cfg[k] = v end
    cfg.padded_vocab_size = pad
    local padded, sd = GPT(cfg), model:state_dict()
    local wte = ds.zeros({ pad, cfg.n_embd })
    wte:narrow(1, 1, cfg.vocab_size):copy_(sd['transformer.wte.weight'])
    sd['transformer.wte.weight'], sd['lm_head.weight'] = wte, wte
    padded:load_state_dict(sd)
    model = padded
  end
  model = model:to(dev)
  local opt = ds.optim.AdamW(model:parameters(), { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
  local losses = {}
  for step = 1, steps do
    local loss = model(H.token_batch(F.windows[step], F.batch, F.seq, dev))
    assert.are.equal(dev, loss:device())
    losses[step] = loss:item()
    opt:zero_grad()
    loss:backward()
    opt:step()
  end
  for _, p in ipairs(model:named_parameters()) do assert.are.equal(dev, p.tensor:device(), p.name) end
  return losses
end

describe('#gpu models.gpt2 on the GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  it('follows the CPU\'s loss over 20 AdamW steps within 1e-4 relative', function()
    local F = H.fixture('models_gpt2')
    local cpu = train(F, 'cpu', 20)
    local gpu = train(F, ds.device(), 20)
    local worst = 0
    for step = 1, 20 do
      local d = math.abs(gpu[step] - cpu[step]) / math.abs(cpu[step])
      assert.is_true(d < 1e-4, string.format('step %d: GPU loss %.9g, CPU %.9g (rel diff %.3g)', step, gpu[step],
                                             cpu[step], d))
      worst = math.max(worst, d)
    end
    assert.is_true(gpu[20] < gpu[1] - 0.1, 'the loss falls')
    print(string.format('gpt2 GPU parity: 20 AdamW steps, loss %.4f -> %.4f, max relative diff from the CPU %.3g',
                        gpu[1], gpu[20], worst))
  end)

  it('with a padded vocab (65 -> 128 rows) follows the unpadded CPU model\'s loss within 1e-4 relative', function()
    local F = H.fixture('models_gpt2')
    local cpu = train(F, 'cpu', 10)
    local gpu = train(F, ds.device(), 10, 128)
    for step = 1, 10 do
      local d = math.abs(gpu[step] - cpu[step]) / math.abs(cpu[step])
      assert.is_true(d < 1e-4, string.format('step %d: padded GPU loss %.9g, CPU %.9g (rel diff %.3g)', step, gpu[step],
                                             cpu[step], d))
    end
  end)

  it('pads the lm_head\'s GEMM itself (pad_vocab = \'auto\'): 65 -> 128 columns on the GPU, none on the CPU, '
     .. 'the parameter of 65 rows', function()
    local F = H.fixture('models_gpt2')
    local model = GPT(F.config)
    local x = ds.randn({ 2, F.config.n_embd })
    assert.are.equal(65, model.lm_head(x):size(2))
    model = model:to(ds.device())
    assert.are.equal(128, model.lm_head(x:to(ds.device())):size(2))
    assert.are.same({ 65, F.config.n_embd }, model:state_dict()['lm_head.weight']:size())
  end)

  it('generates from CPU ids on the model\'s GPU, returning CPU ids as the CPU model does (GPT-2 and Llama)', function()
    local Llama = require 'models.llama'
    local models = {
      { GPT, { n_layer = 2, n_head = 2, n_embd = 32, vocab_size = 17, block_size = 8 } },
      { Llama, { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 32, vocab_size = 17, block_size = 8 } },
    }
    local start = ds.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, 'i64')
    for _, m in ipairs(models) do
      ds.manual_seed(7)
      local cpu = m[1](m[2])
      ds.manual_seed(7)
      local gpu = m[1](m[2]):to(ds.device())
      assert.are.equal(ds.device(), gpu:device())
      local want = cpu:generate(start, 12, { temperature = 0 })
      local got = gpu:generate(start, 12, { temperature = 0 })
      assert.are.equal('cpu', got:device())
      assert.are.same(want:totable(), got:totable())
      local on = gpu:generate(start:to(ds.device()), 4, { temperature = 0.8, top_k = 5 })
      assert.are.equal(ds.device(), on:device())
      assert.are.same({ 2, 7 }, on:size())
    end
  end)
end)
