-- A covering subset of the configuration matrix: every pair of values of
-- two factors in at least one cell, deterministic (a fixed LCG; greedy:
-- for each pair not yet held, the best of 40 cells that hold it). A pair some trainable cell holds is covered by a trainable cell;
-- a pair only refused cells hold (1-bit with stage 2, say) by a refused
-- cell, built so that one refusal applies where it can. The cells that
-- found a bug follow, whether the cover holds them or not.
local S = require 'matrix.settings'

local M = {}

local F = S.FACTORS
local CANDIDATES = 40

-- Park-Miller, so the subset is the same on every machine and LuaJIT.
local function lcg(seed)
  local x = seed
  return function(n)
    x = (x * 16807) % 2147483647
    return x % n + 1
  end
end

-- The cell (settings' table) of a list of value indices.
function M.cell_of(values)
  local c = {}
  for f, spec in ipairs(F) do c[spec[1]] = spec[2][values[f]] end
  return c
end
local cell_of = M.cell_of

local function key(f, a, g, b) return f .. ':' .. a .. ':' .. g .. ':' .. b end

-- Every cell of the full product (value indices), in order.
function M.product()
  local out, idx = {}, {}
  local function rec(f)
    if f > #F then
      local v = {}
      for k = 1, #F do v[k] = idx[k] end
      out[#out + 1] = v
      return
    end
    for a = 1, #F[f][2] do
      idx[f] = a
      rec(f + 1)
    end
  end
  rec(1)
  return out
end

local function pairs_of(v, fn)
  for f = 1, #F - 1 do
    for g = f + 1, #F do fn(key(f, v[f], g, v[g])) end
  end
end

-- How many of the refusals apply to cell c.
function M.refusals(c)
  local n = 0
  for _, r in ipairs(S.REFUSALS) do
    if r[1](c) then n = n + 1 end
  end
  return n
end

local function gain(v, want)
  local n = 0
  pairs_of(v, function(k) if want[k] then n = n + 1 end end)
  return n
end

-- Greedy cover of the pairs in `want` by cells of `pool` (value index
-- lists): for each pair in turn, up to CANDIDATES cells of the pool that
-- hold it, drawn at random, the one covering most uncovered pairs (plus
-- bonus(cell)) taken.
local function cover(rand, want, pool, bonus, out)
  local list = {}
  for k in pairs(want) do list[#list + 1] = k end
  table.sort(list)
  for _, k in ipairs(list) do
    if want[k] then
      local f, a, g, b = k:match('^(%d+):(%d+):(%d+):(%d+)$')
      f, a, g, b = tonumber(f), tonumber(a), tonumber(g), tonumber(b)
      local holding = {}
      for _, v in ipairs(pool) do
        if v[f] == a and v[g] == b then holding[#holding + 1] = v end
      end
      local best, best_score
      for _ = 1, math.min(CANDIDATES, #holding) do
        local v = holding[rand(#holding)]
        local score = gain(v, want) + bonus(cell_of(v))
        if not best or score > best_score then best, best_score = v, score end
      end
      pairs_of(best, function(p) want[p] = nil end)
      out[#out + 1] = cell_of(best)
    end
  end
end

-- A cell from the settings given, the plain value of every other factor.
function M.cell(t)
  local c = {}
  for _, spec in ipairs(F) do c[spec[1]] = spec[2][1] end
  for k, v in pairs(t) do c[k] = v end
  return c
end

-- Cells that failed once, each for its own cause (lest the cover drift off them).
M.FOUND = {
  { stage = 3, ranks = 2, tp = 2, ckpt = 'resume' },            -- a stage 3 load left gathered weights stale
  { ranks = 2, tp = 2, sampler = 'uneven' },                    -- the sampler counted tensor ranks as data ranks
  { ranks = 2, pipe = 2, fp8 = 'current', ckpt = 'resume' },    -- stage 0's fp8 layers alone were saved
  { ranks = 2, pipe = 2, onebit = 'OneBitLamb', ckpt = 'resume' },  -- and its OneBitLamb state alone
}

-- The covering subset: trainable cells first, then refused ones, then FOUND.
function M.cells()
  local trainable, refused, ok, bad = {}, {}, {}, {}
  for _, v in ipairs(M.product()) do
    local fine = S.refusal(cell_of(v)) == nil
    table.insert(fine and ok or bad, v)
    pairs_of(v, function(k) (fine and trainable or refused)[k] = true end)
  end
  for k in pairs(trainable) do refused[k] = nil end
  local rand, out = lcg(20261128), {}
  cover(rand, trainable, ok, function() return 0 end, out)
  cover(rand, refused, bad, function(c) return M.refusals(c) == 1 and 100 or 0 end, out)
  -- each refusal alone at least once: the first such cell of the product
  -- (unless the cover holds it already)
  local have = {}
  for _, c in ipairs(out) do have[S.name(c)] = true end
  for _, rule in ipairs(S.REFUSALS) do
    for _, v in ipairs(bad) do
      local c = cell_of(v)
      if rule[1](c) and M.refusals(c) == 1 then
        if not have[S.name(c)] then out[#out + 1], have[S.name(c)] = c, true end
        break
      end
    end
  end
  for _, t in ipairs(M.FOUND) do
    local c = M.cell(t)
    if not have[S.name(c)] then out[#out + 1], have[S.name(c)] = c, true end
  end
  return out
end

-- The pairs of values no cell of `cells` holds, as "factor=value factor=value".
function M.uncovered(cells)
  local seen = {}
  for _, c in ipairs(cells) do
    local v = {}
    for f, spec in ipairs(F) do
      for x, val in ipairs(spec[2]) do if val == c[spec[1]] then v[f] = x end end
    end
    pairs_of(v, function(k) seen[k] = true end)
  end
  local out = {}
  for f = 1, #F - 1 do
    for g = f + 1, #F do
      for a = 1, #F[f][2] do
        for b = 1, #F[g][2] do
          if not seen[key(f, a, g, b)] then
            out[#out + 1] = string.format('%s=%s %s=%s', F[f][1], tostring(F[f][2][a]), F[g][1], tostring(F[g][2][b]))
          end
        end
      end
    end
  end
  return out
end

return M
