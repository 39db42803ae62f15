-- The compressed all-reduce alone (ds.core._onebit over a flat engine):
-- each rank reduces its own vector K times; writes, from rank 0, the exact
-- mean, the first result, the mean of the K results (error feedback makes
-- it approach the exact mean), whether every rank got the same result,
-- and the bytes one call sent. allreduce.lua OUT.json N K
local ds = require 'dslua'
local C = require 'dslua.core'
local out, n, K = arg[1], tonumber(arg[2]), tonumber(arg[3])
local rank, W = ds.comm.rank(), ds.comm.world_size()
ds.manual_seed(100 + rank)
local p = ds.zeros(n):requires_grad_()
local opt = ds.optim.AdamW({ p }, { bias_correction = false })
local engine = C._zero.engine { stage = 0, masters = false, optimizer = opt, groups = { { p } } }
local b = C._onebit.new(engine, opt, { kind = 'OneBitAdam' })
local mine = ds.randn(n) + rank
local exact = mine:clone()
ds.comm.all_reduce(exact, 'avg')
local sum, first, same = ds.zeros(n), nil, true
for k = 1, K do
  local x = mine:clone()
  b:allreduce(1, x)
  if k == 1 then
    first = x:clone()
    for _, other in ipairs(ds.comm.all_gather(x)) do same = same and (other - x):abs():sum():item() == 0 end
  end
  sum = sum + x
end
local bytes = b:stats().bytes / K    -- counted since the last step began: none was taken
if rank == 0 then
  local f = assert(io.open(out, 'w'))
  f:write(ds.json.encode({ exact = exact:totable(), first = first:totable(), mean = (sum / K):totable(), same = same,
                           world_size = W, bytes = bytes }))
  f:close()
end
b:close()
engine:close()
