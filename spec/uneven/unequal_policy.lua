-- A custom sampler policy for spec/uneven_spec.lua: rank r takes a
-- contiguous run of the epoch's permutation, data_share[r] of it (the last
-- rank the rest), in micro batches of micro_batch_per_rank[r], so ranks
-- take different numbers of steps and the ones that finish first join.
local ds = require 'dslua'

local P = {}

function P.plan(ctx)
  local n, p = ctx.dataset_len, ctx.params
  local order = ds.data.permutation(n, ctx.seed + ctx.epoch):totable()
  local first = 0
  for r = 0, ctx.rank - 1 do first = first + math.floor(n * p.data_share[r + 1]) end
  local count = ctx.rank == ctx.world_size - 1 and n - first or math.floor(n * p.data_share[ctx.rank + 1])
  local idx = {}
  for i = 1, count do idx[i] = order[first + i] end
  return { indices = idx, micro_batch = p.micro_batch_per_rank[ctx.rank + 1] }
end

return P
