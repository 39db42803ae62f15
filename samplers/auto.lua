-- The "auto" sampler policy: measures each rank's samples per second and
-- gives faster ranks bigger micro batches and bigger shares.
--
--   "sampler": { "policy": "auto", "micro_batch_per_rank": [32, 32],
--                "max_micro_batch_per_rank": [64, 64], "measure_steps": 10, "skip_steps": 1 }
--
-- The global micro batch B = sum(micro_batch_per_rank) stays what the
-- config says (so train_batch_size does too); what moves is how it is
-- split. Until every rank has measure_steps observations (after skipping
-- its first skip_steps, which carry warm-up) epochs run the configured
-- plan. At each later epoch boundary the speed of rank r is
-- v_r = samples / seconds over its last measure_steps observations, and
-- the plan becomes micro_r proportional to v_r within [1, cap_r]
-- (M.allocate: capped ranks get their cap and the rest share what is
-- left, again in proportion; rounded by largest remainder), data_share_r
-- = micro_r / B, cut as the uneven policy cuts (equal steps on every
-- rank). When the caps sum to less than B the global batch is their sum.
--
-- Observations come from the engine, which all-gathers every rank's
-- {samples, seconds} and calls observe for each rank on every rank, so
-- every rank holds the same numbers and plans the same split.
local U = require 'samplers.uneven'

local M = {}

local floor = math.floor
local KEEP = 256       -- observations kept per rank (the last ones)

-- allocate(B, speeds, caps) -> micro batches summing to min(B, sum caps),
-- each in [1, cap_r], in proportion to speeds.
function M.allocate(B, speeds, caps)
  local W = #speeds
  local cap_total = 0
  for r = 1, W do cap_total = cap_total + caps[r] end
  if cap_total < B then B = cap_total end
  local fixed, x = {}, {}
  while true do
    local left, vsum = B, 0
    for r = 1, W do
      if fixed[r] then left = left - fixed[r] else vsum = vsum + speeds[r] end
    end
    for r = 1, W do
      if not fixed[r] then x[r] = vsum > 0 and left * speeds[r] / vsum or left / W end
    end
    local over, under = false, false
    for r = 1, W do
      if not fixed[r] and x[r] > caps[r] then fixed[r], over = caps[r], true end
    end
    if not over then
      for r = 1, W do
        if not fixed[r] and x[r] < 1 then fixed[r], under = 1, true end
      end
    end
    if not over and not under then break end
  end
  local out, sum, frac = {}, 0, {}
  for r = 1, W do
    local v = fixed[r] or x[r]
    out[r] = math.max(1, math.min(caps[r], floor(v + 1e-9)))
    frac[r] = v - out[r]
    sum = sum + out[r]
  end
  local by = {}
  for r = 1, W do by[r] = r end
  table.sort(by, function(a, b)
    if frac[a] ~= frac[b] then return frac[a] > frac[b] end
    return a < b
  end)
  while sum < B do
    for _, r in ipairs(by) do
      if sum < B and out[r] < caps[r] then out[r], sum = out[r] + 1, sum + 1 end
    end
  end
  while sum > B do
    for k = W, 1, -1 do
      local r = by[k]
      if sum > B and out[r] > 1 then out[r], sum = out[r] - 1, sum - 1 end
    end
  end
  return out
end

local function fmt_list(values, f)
  local parts = {}
  for i, v in ipairs(values) do parts[i] = string.format(f, v) end
  return table.concat(parts, ', ')
end

---------------------------------------------------------------- the policy

local Policy = {}
Policy.__index = Policy

function M.new()
  return setmetatable({ window = {}, seen = {} }, Policy)
end

-- observe{rank = r (0-based), samples = n, seconds = t}: one step of rank r.
function Policy:observe(o)
  if type(o) ~= 'table' then error('auto policy: observe expects {rank=, samples=, seconds=}, got a ' .. type(o), 2) end
  local r, n, t = o.rank, o.samples, o.seconds
  if type(r) ~= 'number' or r < 0 or r ~= floor(r) then
    error('auto policy: observe: rank must be a rank number (0-based), got ' .. tostring(r), 2)
  end
  if type(n) ~= 'number' or n < 0 then error('auto policy: observe: samples must be >= 0, got ' .. tostring(n), 2) end
  if type(t) ~= 'number' or t < 0 or t ~= t then
    error('auto policy: observe: seconds must be >= 0, got ' .. tostring(t), 2)
  end
  local key = r + 1
  self.seen[key] = (self.seen[key] or 0) + 1
  local w = self.window[key] or {}
  self.window[key] = w
  w[#w + 1] = { n, t, self.seen[key] }
  while #w > KEEP do table.remove(w, 1) end
end

-- The engine asks before each exchange; the answer is the same on every rank.
function Policy:observing() return true end

-- speeds(W, K, skip) -> samples per second per rank over its last K
-- observations after its first skip, or nil while a rank has fewer.
function Policy:speeds(W, K, skip)
  local v = {}
  for r = 1, W do
    local w = self.window[r] or {}
    local first = #w - K + 1
    if first < 1 or w[first][3] <= skip then return nil end
    local n, t = 0, 0
    for i = first, #w do n, t = n + w[i][1], t + w[i][2] end
    if t <= 0 then return nil end
    v[r] = n / t
  end
  return v
end

-- How many usable observations the slowest-reporting rank has.
function Policy:measured(W, skip)
  local have = math.huge
  for r = 1, W do
    local w, k = self.window[r] or {}, 0
    for i = #w, 1, -1 do
      if w[i][3] <= skip then break end
      k = k + 1
    end
    have = math.min(have, k)
  end
  return have
end

function Policy:plan(ctx)
  local p, W = ctx.params, ctx.world_size
  local B = 0
  for _, m in ipairs(p.micro_batch_per_rank) do B = B + m end
  local caps = {}
  for r = 1, W do caps[r] = p.max_micro_batch_per_rank and p.max_micro_batch_per_rank[r] or B end
  local micro, share, note
  local v = self:speeds(W, p.measure_steps, p.skip_steps)
  if v then
    micro = M.allocate(B, v, caps)
    local total = 0
    for _, m in ipairs(micro) do total = total + m end
    share = {}
    for r = 1, W do share[r] = micro[r] / total end
    self.micro_batch_per_rank, self.data_share, self.samples_per_sec = micro, share, v
    note = string.format('auto plan | epoch %s | samples/s %s | micro batch %s | data share %s | global batch %d',
                         tostring(ctx.epoch), fmt_list(v, '%.1f'), fmt_list(micro, '%d'), fmt_list(share, '%.4f'),
                         total)
  else
    micro = self.micro_batch_per_rank or p.micro_batch_per_rank
    share = self.data_share or p.data_share
    local have = math.min(self:measured(W, p.skip_steps), p.measure_steps)
    note = string.format('auto plan | epoch %s | measuring (%d of %d steps) | micro batch %s | data share %s',
                         tostring(ctx.epoch), have, p.measure_steps, fmt_list(micro, '%d'), fmt_list(share, '%.4f'))
  end
  local L = U.layout(ctx.dataset_len, micro, share, p.drop_last)
  self.layout = L
  return {
    indices = U.indices(L, ctx.rank, U.order(ctx.dataset_len, p.shuffle, ctx.seed, ctx.epoch)),
    micro_batch = U.micro_batch(L, ctx.rank),
    note = note,
  }
end

function Policy:state_dict()
  local window = {}
  for r, w in pairs(self.window) do
    local copy = {}
    for i, o in ipairs(w) do copy[i] = { o[1], o[2], o[3] } end
    window[r] = copy
  end
  local seen = {}
  for r, n in pairs(self.seen) do seen[r] = n end
  return {
    window = window, seen = seen,
    micro_batch_per_rank = self.micro_batch_per_rank, data_share = self.data_share,
    samples_per_sec = self.samples_per_sec,
  }
end

function Policy:load_state_dict(sd)
  if type(sd) ~= 'table' then error('auto policy: load_state_dict expects a table, got a ' .. type(sd), 2) end
  self.window, self.seen = {}, {}
  for r, w in pairs(sd.window or {}) do
    local copy = {}
    for i, o in ipairs(w) do copy[i] = { o[1], o[2], o[3] } end
    self.window[tonumber(r)] = copy
  end
  for r, n in pairs(sd.seen or {}) do self.seen[tonumber(r)] = n end
  self.micro_batch_per_rank, self.data_share = sd.micro_batch_per_rank, sd.data_share
  self.samples_per_sec = sd.samples_per_sec
end

return M
