-- The "uneven" sampler policy: each rank its own micro batch and its own
-- share of every epoch, all ranks taking the same number of steps.
--
--   "sampler": { "policy": "uneven", "micro_batch_per_rank": [48, 16],
--                "data_share": [0.75, 0.25], "shuffle": true, "seed": 0, "drop_last": false }
--
-- The epoch's order is ds.data.permutation(n, seed + epoch) (0 .. n-1
-- without shuffle), the order ds.data.loader's own shuffle gives, each
-- rank's share held as a ds.data.order (its runs of positions, M.runs). How it is
-- cut (M.layout), with M = sum of the micro batches and W ranks:
--
-- 1. Targets: rank r's share of the n indices, rounded by largest
--    remainder (ties to the lower rank), so they sum to n.
-- 2. Steps: S = the fewest steps in which every target fits its micro
--    batch, max(ceil(n / M), ceil(target_r / micro_r)). Every rank takes
--    at least one sample a step, so S is at most floor(n / W); a larger S
--    is cut to that (the shares bend). When no S fits at all (n < W, or
--    all micro batches 1 and W does not divide n) the order is padded by
--    repeating it from its start until every rank has one sample a step,
--    fewer than W indices, as PyTorch's DistributedSampler pads.
-- 3. Counts: each target clamped into [S, S * micro_r]; what that adds or
--    removes is moved one index at a time to (from) the rank furthest
--    below (above) its exact share. Shares consistent with the micro
--    batches (0.75 / 0.25 with 48 / 16) are met to the rounding of step 1.
-- 4. Batches: a rank takes its micro batch every step and the rest in its
--    last step (micro_batch is a number; a loader with that batch size
--    yields exactly S batches). A rank whose count is too small for that
--    (its share is thinner than its micro batch allows) takes the largest
--    batch b <= micro_r that still fills S steps, or when none does,
--    batches of b and b - 1 (micro_batch is then the list of S sizes).
-- 5. Layout: step-major. Step j takes the next positions of the order,
--    rank 0's batch first, then rank 1's, ... So the union of all ranks'
--    step j is a contiguous run of the order, the batch a single process
--    with batch size sum(step j's sizes) reads at that step.
-- 6. drop_last: when the last step is incomplete (some rank's last batch
--    is smaller than its micro batch, or the order was padded) it is
--    dropped on every rank: the tail of the order, fewer indices than one
--    global batch, is not used that epoch. Without drop_last every index
--    is used exactly once (plus the padding of step 2).
local ds = require 'dslua'

local M = {}

local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max

-- Integer parts of n in proportion to shares (normalised), largest
-- remainder first, ties to the lower rank.
function M.apportion(n, shares)
  local total = 0
  for _, s in ipairs(shares) do total = total + s end
  local out, exact, left = {}, {}, n
  for r, s in ipairs(shares) do
    exact[r] = n * s / total
    out[r] = floor(exact[r])
    left = left - out[r]
  end
  local by = {}
  for r = 1, #shares do by[r] = r end
  table.sort(by, function(a, b)
    local fa, fb = exact[a] - out[a], exact[b] - out[b]
    if fa ~= fb then return fa > fb end
    return a < b
  end)
  for k = 1, left do
    local r = by[(k - 1) % #by + 1]
    out[r] = out[r] + 1
  end
  return out, exact
end

-- A rank's batches as two runs: n1 steps of b1 then n2 steps of b2.
local function runs_for(c, S, m)
  if S == 0 then return { b1 = m, n1 = 0, b2 = m, n2 = 0, full = true } end
  local b = S == 1 and m or min(m, ceil(c / (S - 1)) - 1)
  if b >= 1 and b * S >= c then          -- b every step, the rest last
    local last = c - (S - 1) * b
    return { b1 = b, n1 = S - 1, b2 = last, n2 = 1, full = last == b, fixed = true }
  end
  b = ceil(c / S)
  local d = S * b - c
  return { b1 = b, n1 = S - d, b2 = b - 1, n2 = d, full = true }
end

local function size_at(run, j)
  if j <= run.n1 then return run.b1 end
  if j <= run.n1 + run.n2 then return run.b2 end
  return 0
end

local function count_of(run) return run.b1 * run.n1 + run.b2 * run.n2 end

-- layout(n, micro_batch_per_rank, data_share, drop_last) -> {
--   steps = S, counts = {...}, runs = {...} (per rank, 1-based),
--   n = n, used = positions of the order taken (padding included),
--   pad = repeated indices, dropped = indices not used }
function M.layout(n, micro, shares, drop_last)
  local W = #micro
  local total = 0
  for _, m in ipairs(micro) do total = total + m end
  local L = { n = n, counts = {}, runs = {}, pad = 0, dropped = 0 }
  if n == 0 then
    L.steps, L.used = 0, 0
    for r = 1, W do L.counts[r], L.runs[r] = 0, runs_for(0, 0, micro[r]) end
    return L
  end
  local targets, exact = M.apportion(n, shares)
  local S = ceil(n / total)
  for r = 1, W do S = max(S, ceil(targets[r] / micro[r])) end
  local used = n
  local smax = floor(n / W)
  if S > smax then
    if ceil(n / total) <= smax then
      S = smax
    else
      S = ceil(n / total)
      used = W * S
    end
  end
  local counts = {}
  if used ~= n then
    for r = 1, W do counts[r] = S end
  else
    local sum = 0
    for r = 1, W do
      counts[r] = min(max(targets[r], S), S * micro[r])
      sum = sum + counts[r]
    end
    local diff = n - sum
    while diff ~= 0 do        -- to the rank furthest from its exact share
      local best, gap
      for r = 1, W do
        local g = exact[r] - counts[r]
        if diff > 0 and counts[r] < S * micro[r] and (not best or g > gap) then best, gap = r, g end
        if diff < 0 and counts[r] > S and (not best or g < gap) then best, gap = r, g end
      end
      local step = diff > 0 and 1 or -1
      counts[best] = counts[best] + step
      diff = diff - step
    end
  end
  local runs, incomplete = {}, used ~= n
  for r = 1, W do
    runs[r] = runs_for(counts[r], S, micro[r])
    incomplete = incomplete or not runs[r].full
  end
  if drop_last and incomplete then
    for r = 1, W do
      local run = runs[r]
      if run.fixed then
        run.n1, run.n2, run.b2 = S - 1, 0, run.b1
      elseif run.n2 > 0 then
        run.n2 = run.n2 - 1
      else
        run.n1 = run.n1 - 1
      end
      run.full = true
      counts[r] = count_of(run)
    end
    S = S - 1
    used = 0
    for r = 1, W do used = used + counts[r] end
  end
  L.steps, L.counts, L.runs, L.used = S, counts, runs, used
  L.pad = max(0, used - n)
  L.dropped = max(0, n - used)
  return L
end

-- Rank r's (0-based) batch sizes: a number b (every step b, the last one
-- possibly fewer: what a loader with batch size b gives) or the list.
function M.micro_batch(L, rank)
  local run = L.runs[rank + 1]
  if run.fixed or run.n2 == 0 or run.b1 == run.b2 then return run.b1 end
  local out = {}
  for j = 1, L.steps do out[j] = size_at(run, j) end
  return out
end

-- The size of rank r's batch at step j (1-based).
function M.size_at(L, rank, j) return size_at(L.runs[rank + 1], j) end

-- The global batch of every step: the sum over ranks of step j's sizes.
function M.global_sizes(L)
  local out = {}
  for j = 1, L.steps do
    local s = 0
    for r = 1, #L.runs do s = s + size_at(L.runs[r], j) end
    out[j] = s
  end
  return out
end

-- The positions of the order rank r (0-based) takes, as ds.data.order's
-- runs: one run per stretch of steps in which no rank's batch size
-- changes (at most 2W + 1), its steps G positions apart, G the stretch's
-- global batch.
function M.runs(L, rank)
  local cuts, W = { [0] = true, [L.steps] = true }, #L.runs
  for q = 1, W do
    local run = L.runs[q]
    cuts[min(run.n1, L.steps)], cuts[min(run.n1 + run.n2, L.steps)] = true, true
  end
  local steps = {}
  for j in pairs(cuts) do steps[#steps + 1] = j end
  table.sort(steps)
  local out = {}
  for k = 2, #steps do
    local a, b = steps[k - 1], steps[k]
    local base, G, offset = 0, 0, 0
    for q = 1, W do
      local run = L.runs[q]
      base = base + min(a, run.n1) * run.b1 + max(0, min(a - run.n1, run.n2)) * run.b2
      if q == rank + 1 then offset = G end
      G = G + size_at(run, a + 1)
    end
    local s = size_at(L.runs[rank + 1], a + 1)
    if s > 0 then out[#out + 1] = { base + offset, G, s, b - a } end
  end
  return out
end

-- Rank r's 0-based dataset indices: a ds.data.order over its runs of the
-- epoch's order (M.order's; nil: 0 .. n-1); positions past n wrap around
-- (the padding).
function M.indices(L, rank, order)
  return (order or ds.data.order(L.n)):cut(M.runs(L, rank))
end

-- The epoch's order: ds.data.permutation(n, seed + epoch) with shuffle, as
-- a ds.data.order.
function M.order(n, shuffle, seed, epoch)
  if not shuffle or n == 0 then return nil end
  return ds.data.order(n, { seed = seed + epoch })
end

---------------------------------------------------------------- the policy

local Policy = {}
Policy.__index = Policy

function M.new() return setmetatable({}, Policy) end

-- plan(ctx): ctx.params is the resolved sampler block.
function Policy:plan(ctx)
  local p = ctx.params
  local L = M.layout(ctx.dataset_len, p.micro_batch_per_rank, p.data_share, p.drop_last)
  self.layout = L
  return {
    indices = M.indices(L, ctx.rank, M.order(ctx.dataset_len, p.shuffle, ctx.seed, ctx.epoch)),
    micro_batch = M.micro_batch(L, ctx.rank),
  }
end

return M
