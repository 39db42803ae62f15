-- Activation memory of one fp8 training step of a small GPT-2 in bf16
-- (engine:memory_report() on this rank's device): what the graph holds
-- after forward, and the step's peaks.
--
--   dslua bench/fp8_memory.lua [n_layer=4] [n_embd=128] [block=256] [batch=8] [recipe=current]
local ds = require 'dslua'

local o = { n_layer = 4, n_embd = 128, block = 256, batch = 8, recipe = 'current' }
for i = 1, #arg do
  local k, v = arg[i]:match('^(%w+)=(.+)$')
  if k then
    assert(o[k] ~= nil, 'fp8_memory.lua: unknown argument ' .. arg[i])
    o[k] = tonumber(v) or v
  end
end

ds.manual_seed(1)
local model = require('models.gpt2') { vocab_size = 256, block_size = o.block, n_layer = o.n_layer, n_head = 4,
                                       n_embd = o.n_embd, dropout = 0 }
local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = o.batch, steps_per_print = 1e9, bf16 = { enabled = true },
  fp8 = { enabled = true, recipe = o.recipe }, optimizer = { type = 'SGD', params = { lr = 0.01 } } } }
local ids = (ds.rand(o.batch, o.block + 1) * 255.99):to('i64')
local batch = { x = ids:narrow(2, 1, o.block):contiguous(), y = ids:narrow(2, 2, o.block):contiguous() }

local MiB = 2 ^ 20
local loss = engine(batch)
local after = engine:memory_report()[1].current
engine:backward(loss)
engine:step()
local peak = engine:memory_report()[1].peak
print(string.format('GPT-2 n_layer %d n_embd %d, batch %d x %d, bf16 + fp8 (%s): after forward activations %.2f MiB, '
                    .. 'other %.2f MiB; step peak activations %.2f MiB, total %.2f MiB', o.n_layer, o.n_embd,
                    o.batch, o.block, o.recipe, after.activations / MiB, after.other / MiB, peak.activations / MiB,
                    peak.total / MiB))
