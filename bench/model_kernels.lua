-- Kernels of a training step (ds.kernel_calls) through its forward,
-- backward and step: a GPT-2 or a Llama (grouped-query, 4 heads over 2)
-- of n_embd 64 and N_LAYER layers (12 by default) through ds.initialize,
-- AdamW with clipping, the third step of one batch of 2 x 32 tokens.
--   dslua bench/model_kernels.lua gpt2|llama [f32|bf16 [N_LAYER]]
local ds = require 'dslua'

local name, dtype, n_layer = arg[1] or 'gpt2', arg[2] or 'f32', tonumber(arg[3] or 12)
local cfg = { vocab_size = 256, block_size = 32, n_layer = n_layer, n_head = 4, n_embd = 64 }
if name == 'llama' then cfg.n_kv_head = 2 end
ds.manual_seed(1)
local model = require(name == 'llama' and 'models.llama' or 'models.gpt2')(cfg)
local engine = ds.initialize { model = model, config = {
  train_batch_size = 2, steps_per_print = 1e9, gradient_clipping = 1.0, bf16 = { enabled = dtype == 'bf16' },
  optimizer = { type = 'AdamW', params = { lr = 1e-3, weight_decay = 0.1 } } } }
local dev = ds.device()
local x, y = (ds.rand(2, 32) * 256):to('i64'):to(dev), (ds.rand(2, 32) * 256):to('i64'):to(dev)
local counts
for _ = 1, 3 do
  local k0 = ds.kernel_calls()
  local loss = engine { x = x, y = y }
  local k1 = ds.kernel_calls()
  engine:backward(loss)
  local k2 = ds.kernel_calls()
  engine:step()
  counts = { k1 - k0, k2 - k1, ds.kernel_calls() - k2 }
end
print(string.format('result kernels %s %s layers %d forward %d backward %d step %d', name, dtype, n_layer,
                    counts[1], counts[2], counts[3]))
engine:destroy()
