-- Training throughput of dslua through the engine: GPT-2 124M (B=4, T=128,
-- AdamW) and the MNIST MLP (SGD), on random batches made up front. Every
-- step is engine:forward, engine:backward, engine:step. Prints
--   result dslua <model> <shape> <value> <unit>
-- lines (tokens/s, samples/s: the median over the timed samples) for
-- bench/train.sh; bench/train_torch.py prints the same rows for PyTorch.
--
--   dslua bench/train.lua [gpt2|mlp|all] [quick]
local ds = require 'dslua'

local which, quick = 'all', false
for _, a in ipairs(ds.args.rest or {}) do
  if a == 'quick' then quick = true else which = a end
end
if which ~= 'all' and which ~= 'gpt2' and which ~= 'mlp' then
  io.stderr:write("bench/train.lua: expected gpt2, mlp or all, got '" .. which .. "'\n")
  os.exit(2)
end

local median = require('bench.util').median

-- Runs `warmup` steps, then `samples` samples of `k` steps each; returns
-- the median seconds per step.
local function time_steps(step, warmup, samples, k)
  for i = 1, warmup do step(i) end
  collectgarbage()
  local times, i = {}, warmup
  for s = 1, samples do
    local t0 = ds.wall_time()
    for _ = 1, k do i = i + 1; step(i) end
    times[s] = (ds.wall_time() - t0) / k
  end
  return median(times)
end

local function train(model, optimizer_block, batch_size, batches, warmup, samples, k)
  local engine = ds.initialize {
    model = model,
    config = {
      train_batch_size = batch_size,
      train_micro_batch_size_per_gpu = batch_size,
      optimizer = optimizer_block,
      steps_per_print = 1000000,
    },
  }
  local loss
  local sec = time_steps(function(i)
    loss = engine:forward(batches[(i - 1) % #batches + 1])
    engine:backward(loss)
    engine:step()
  end, warmup, samples, k)
  return sec, engine.last_loss
end

print(string.format('info\tdslua\tthreads\t%d', ds.num_threads()))
ds.manual_seed(0)

if which == 'all' or which == 'gpt2' then
  local B, T = 4, 128
  local model = require('models.gpt2')('gpt2')
  local V = model.config.vocab_size
  local batches = {}
  for i = 1, 4 do
    local ids = (ds.rand({ B, T + 1 }) * V):to('i64')
    batches[i] = { x = ids:narrow(2, 1, T):contiguous(), y = ids:narrow(2, 2, T):contiguous() }
  end
  local sec, loss = train(model, { type = 'AdamW', params = { lr = 3e-4, betas = { 0.9, 0.95 }, eps = 1e-8,
                                                                weight_decay = 0.1 } },
                          B, batches, quick and 1 or 2, quick and 2 or 5, 1)
  io.stderr:write(string.format('bench/train.lua: gpt2 %.3f s/step, last loss %.4f\n', sec, loss))
  print(string.format('result\tdslua\tgpt2_124M\tB%dxT%d\t%.2f\ttokens/s', B, T, B * T / sec))
  model, batches = nil, nil
  collectgarbage()
  collectgarbage()
end

if which == 'all' or which == 'mlp' then
  local B = 128
  local model = require('models.mlp')()
  local batches = {}
  for i = 1, 8 do
    batches[i] = { x = ds.randn({ B, 1, 28, 28 }), y = (ds.rand({ B }) * 10):to('i64') }
  end
  local sec, loss = train(model, { type = 'SGD', params = { lr = 0.01, momentum = 0.9 } },
                          B, batches, quick and 5 or 20, quick and 3 or 11, quick and 5 or 20)
  io.stderr:write(string.format('bench/train.lua: mlp %.3f ms/step, last loss %.4f\n', sec * 1000, loss))
  print(string.format('result\tdslua\tmlp_784-256-10\tB%d\t%.2f\tsamples/s', B, B / sec))
end
