-- Run by spec/sp_spec.lua under mpirun on 2 ranks: ds.sequence's
-- all-to-alls against slices of one tensor every rank knows whole, their
-- gradients, and the errors a sequence-parallel model gives. Rank 0
-- writes JSON to arg[1]: the largest differences and the error messages.
local ds = require 'dslua'

local out_path = assert(arg[1], 'usage: ops.lua out.json')
local sp = ds.sequence.new(2)
local r, B, T, A, H, D = sp.rank, 2, 4, 3, 4, 2
local Tl, Hl = T / 2, H / 2

ds.manual_seed(5)
local full, w = ds.randn(B, T, A, H, D), ds.randn(B, T, A, H, D)
local function diff(a, b) return (a - b):abs():amax():item() end
local mine = sp:chunk(full)                                  -- this rank's tokens, every head
local heads = full:narrow(4, r * Hl + 1, Hl):contiguous()    -- every token, this rank's heads

local out = {}
local x = mine:clone():requires_grad_()
local y = sp:seq_to_heads(x)
out.to_heads = diff(y, heads)
out.back = diff(sp:heads_to_seq(y:detach()), mine)
-- d/dx of sum over ranks of (y_r * w's heads of rank r): w's tokens of this rank
ds.sum(y * w:narrow(4, r * Hl + 1, Hl)):backward()
out.to_heads_grad = diff(x.grad, sp:chunk(w))
local z = heads:clone():requires_grad_()
ds.sum(sp:heads_to_seq(z) * sp:chunk(w)):backward()
out.to_seq_grad = diff(z.grad, w:narrow(4, r * Hl + 1, Hl))

local function err(fn)
  local ok, e = pcall(fn)
  return ok and 'no error' or tostring(e)
end
out.bad_heads = err(function() sp:seq_to_heads(ds.zeros({ B, Tl, A, 3, D })) end)
local GPT = require 'models.gpt2'
local gpt = GPT { vocab_size = 16, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8, sequence_parallel = 2 }
out.bad_length = err(function() gpt(ds.zeros({ 1, 7 }, 'i64')) end)
out.mismatch = err(function()
  ds.initialize { model = gpt, config = { train_micro_batch_size_per_gpu = 1, optimizer = { type = 'SGD' } } }
end)

if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode(out))
  f:close()
end
