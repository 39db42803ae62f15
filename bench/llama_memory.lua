-- Activation memory a Llama forward keeps for its backward: ds.memory_stats'
-- activations after the forward of a 2-layer Llama (TinyLlama's MLP ratio:
-- n_embd 512, intermediate_size 1408; 8 heads over 2) on B x T tokens in
-- f32, the loss alive; `unfused` runs the MLP as silu(gate) * up.
--   dslua bench/llama_memory.lua [fused|unfused [T]]
local ds = require 'dslua'

local mode, T = arg[1] or 'fused', tonumber(arg[2] or 512)
if mode == 'unfused' then ds.swiglu = function(g, u) return ds.silu(g) * u end end
ds.manual_seed(1)
local model = require('models.llama') { vocab_size = 256, block_size = T, n_layer = 2, n_head = 8, n_kv_head = 2,
                                        n_embd = 512, intermediate_size = 1408 }
local x = (ds.rand(1, T) * 256):to('i64')
local y = (ds.rand(1, T) * 256):to('i64')
local before = ds.memory_stats().current.activations
local loss = model { x = x, y = y }
local held = ds.memory_stats().current.activations - before
print(string.format('result llama_memory %s T %d activations %.2f MiB', mode, T, held / 2 ^ 20))
loss:backward()
