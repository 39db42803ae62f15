-- Training throughput by precision on this device: the quickstart's GPT
-- (2 layers, n_embd 96, context 64, batches of 16) through ds.initialize in
-- fp32, bf16 and fp16, each for the same steps on the same data; samples/s
-- of each (the median of its timed steps) and its ratio against fp32
-- measured in this run.
--   dslua bench/precision.lua [quick]
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local quick = arg[1] == 'quick'
local STEPS, WARMUP, B, T = quick and 5 or 40, 3, 16, 64
local VOCAB = 96
local dev = ds.device()
local function sync() if dev ~= 'cpu' then ds.cuda.synchronize() end end

local function samples_per_s(precision)
  ds.manual_seed(1337)
  local model = GPT { n_layer = 2, n_head = 4, n_embd = 96, vocab_size = VOCAB, block_size = T, dropout = 0 }
  local config = {
    train_batch_size = B, steps_per_print = 1e9, gradient_clipping = 1.0,
    optimizer = { type = 'AdamW', params = { lr = 3e-3, betas = { 0.9, 0.99 }, weight_decay = 0.01 } },
  }
  if precision ~= 'fp32' then config[precision] = { enabled = true } end
  local engine = ds.initialize { model = model, config = config }
  local x = (ds.rand(B, T) * VOCAB):to('i64'):to(dev)
  local y = (ds.rand(B, T) * VOCAB):to('i64'):to(dev)
  local times = {}
  for i = 1, STEPS + WARMUP do
    sync()
    local t0 = ds.wall_time()
    engine:backward(engine { x = x, y = y })
    engine:step()
    sync()
    if i > WARMUP then times[#times + 1] = ds.wall_time() - t0 end
  end
  table.sort(times)
  return B / times[math.floor((#times + 1) / 2)]
end

print(string.format('dslua precision bench on %s, %d threads%s', dev, ds.num_threads(), quick and ' (quick)' or ''))
local ref = samples_per_s('fp32')
for _, p in ipairs({ 'fp32', 'bf16', 'fp16' }) do
  local r = p == 'fp32' and ref or samples_per_s(p)
  print(string.format('%-5s %9.1f samples/s  %5.2fx fp32', p, r, r / ref))
end
