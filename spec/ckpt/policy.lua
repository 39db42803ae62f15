-- A custom sampler policy with state, for spec/checkpoint_spec.lua: each
-- plan shuffles with a seed drawn from a counter of the plans made so far
-- and cuts the rank's share into micro batches of 3, 2, 3, 2, ... So a
-- resumed run matches only when the counter (state_dict) and the current
-- epoch's plan come back as they were.
local P = { plans = 0 }

function P.plan(ctx)
  P.plans = P.plans + 1
  local n, W = ctx.dataset_len, ctx.world_size
  local order = require('dslua').data.permutation(n, 1000 * P.plans + ctx.seed):totable()
  local idx = {}
  for i = ctx.rank + 1, n, W do idx[#idx + 1] = order[i] end
  local mb, left, k = {}, #idx, 0
  while left > 0 do
    k = k + 1
    mb[k] = math.min(left, k % 2 == 1 and 3 or 2)
    left = left - mb[k]
  end
  return { indices = idx, micro_batch = mb }
end

function P.state_dict() return { plans = P.plans } end
function P.load_state_dict(s) P.plans = s.plans end

return P
