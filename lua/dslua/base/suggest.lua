-- dslua.base.suggest: the "did you mean" of a misspelt name, one rule for every
-- message that offers one (config keys and values, LR scheduler names and
-- params, data options).
local M = {}

-- Optimal string alignment distance (edits, adjacent swaps), case-blind.
local function distance(a, b)
  a, b = a:lower(), b:lower()
  local d = {}
  for i = 0, #a do d[i] = { [0] = i } end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local v = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        v = math.min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[#a][#b]
end

local function words(s)
  local set, n = {}, 0
  for w in s:lower():gmatch('[^_]+') do set[w], n = true, n + 1 end
  return set, n
end

-- The most edits a suggestion may be away from word.
local function reach(word) return math.max(2, math.floor(#word / 3)) end

-- nearest(word, candidates) -> the candidate word most likely meant, or
-- nil: the shortest candidate holding all of word's _-separated parts
-- (warmup_steps: warmup_num_steps), else the nearest by edit distance when
-- near enough, else the shortest candidate with a part that starts with
-- word (block: block_size, worker: num_workers). Only string candidates
-- are names.
function M.nearest(word, candidates)
  local sorted, longest = {}, 0
  for _, c in ipairs(candidates) do
    if type(c) == 'string' then
      sorted[#sorted + 1] = c
      longest = math.max(longest, #c)
    end
  end
  -- The edit distance is at least the difference in length, so a word far
  -- longer than every candidate (a runaway key) is near none of them: no
  -- pass over it, which would cost its length times theirs.
  if #word - longest > reach(word) then return nil end
  table.sort(sorted)
  local mine, n = words(word)
  local best, bd
  if n >= 2 then
    for _, c in ipairs(sorted) do
      local theirs, all = words(c), true
      for w in pairs(mine) do all = all and theirs[w] end
      if all and c ~= word and (not best or #c < #best) then best = c end
    end
    if best then return best end
  end
  for _, c in ipairs(sorted) do
    local least = math.abs(#word - #c)   -- the distance is at least this
    if least <= reach(word) and (not bd or least < bd) then
      local dd = distance(word, c)
      if not bd or dd < bd then best, bd = c, dd end
    end
  end
  if bd and bd <= reach(word) then return best end
  if #word < 4 then return nil end      -- too short to single out a part
  best = nil
  local lower = word:lower()
  for _, c in ipairs(sorted) do
    for w in pairs(words(c)) do
      if w:sub(1, #lower) == lower and (not best or #c < #best) then best = c end
    end
  end
  return best
end

-- closest(word, candidates) -> the candidate fewest edits away, however
-- far (ties: the first in sorted order); nil without candidates.
function M.closest(word, candidates)
  local sorted = {}
  for _, c in ipairs(candidates) do
    if type(c) == 'string' then sorted[#sorted + 1] = c end
  end
  table.sort(sorted)
  local best, bd
  for _, c in ipairs(sorted) do
    local dd = distance(word:sub(1, 256), c)    -- a runaway key costs no more than a long one
    if not bd or dd < bd then best, bd = c, dd end
  end
  return best
end

-- typo(word, candidates) -> the candidate one slip from word (an edit or
-- a swap of neighbours; two for words of 8 letters or more), or nil: a
-- stricter test than nearest, for a name that may be meant as written (a
-- field a module never set, looked up beside its methods).
function M.typo(word, candidates)
  if #word < 4 then return nil end
  local most = #word >= 8 and 2 or 1
  local best, bd
  for _, c in ipairs(candidates) do
    if type(c) == 'string' and c ~= word and math.abs(#c - #word) <= most then
      local dd = distance(word, c)
      if dd <= most and (not bd or dd < bd or (dd == bd and c < best)) then best, bd = c, dd end
    end
  end
  return best
end

-- "did you mean 'x'?" for the nearest candidate, or nil.
function M.did_you_mean(word, candidates)
  local s = M.nearest(word, candidates)
  return s and "did you mean '" .. s .. "'?" or nil
end

return M
