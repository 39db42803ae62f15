-- The step phase of mixed-precision training (run by bench/step.sh): GPT-2
-- in bf16 with fp32 masters and AdamW through ds.initialize on one rank, at
-- a ZeRO stage; the median time of engine:step() after backward, with the
-- device synchronized before and after (what the step engine costs: the
-- gradient pass, the agreement, unscale and clip, the fused optimizer and
-- the copy back into bf16).
--   dslua bench/step.lua STAGE [quick]
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local stage = tonumber(arg[1] or 0)
local quick = arg[2] == 'quick'
local size = quick and { n_layer = 2, n_embd = 192, vocab = 1024, T = 64, B = 2, steps = 5 }
                    or { n_layer = 12, n_embd = 768, vocab = 50257, T = 1024, B = 8, steps = 10 }
local dev = ds.device()
local function sync() if dev ~= 'cpu' then ds.cuda.synchronize() end end

ds.manual_seed(1)
local model = GPT { vocab_size = size.vocab, block_size = size.T, n_layer = size.n_layer, n_head = 12,
                    n_embd = size.n_embd, bias = true }
local engine = ds.initialize { model = model, config = {
  train_batch_size = size.B, steps_per_print = 1e9, gradient_clipping = 1.0, bf16 = { enabled = true },
  optimizer = { type = 'AdamW', params = { lr = 3e-4, weight_decay = 0.1, betas = { 0.9, 0.95 } } },
  zero_optimization = { stage = stage },
} }
local x = (ds.rand(size.B, size.T) * size.vocab):to('i64'):to(dev)
local y = (ds.rand(size.B, size.T) * size.vocab):to('i64'):to(dev)
local times = {}
for i = 1, size.steps + 2 do
  engine:backward(engine { x = x, y = y })
  sync()
  local t0 = ds.wall_time()
  engine:step()
  sync()
  if i > 2 then times[#times + 1] = ds.wall_time() - t0 end
end
table.sort(times)
print(string.format('result dslua step %s %d %.3f ms', dev, model:num_parameters(),
                    1000 * times[math.floor((#times + 1) / 2)]))
