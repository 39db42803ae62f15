-- The verdict on one matrix cell against its reference (one fp32 rank,
-- stage 0, the global batch in one micro step, the counterpart optimizer).
--
-- Tolerances, from what the arithmetic guarantees:
-- f32: the cell sums the same per-token gradients as the reference in
-- another order (micro steps, ranks, buckets): at most 10^3 additions of
-- 2^-24 relative error each, 6e-5 of the terms' magnitude at the very
-- worst and ~2e-6 (sqrt(n) 2^-24) as rounding goes; AdamW with eps 1e-3
-- passes a gradient error on magnified at most lr / eps = 10 times a
-- step, over 3 steps: weights within the project's f32 tolerance (atol
-- 1e-5 + rtol 1e-4), losses within 1e-4 relative.
-- bf16, fp16: the forward and backward round to 2^-8 (2^-11), so a
-- gradient element near zero may take either sign, and Adam's normalised
-- step moves it by up to lr * |m / sqrt(v)| either way: at most 1.004 lr
-- a step over 3 steps with bias correction, 5 lr without (the 1-bit
-- counterparts; Cauchy-Schwarz over beta1^2 / beta2). Weights are then
-- stored rounded: |w - ref| <= 2 * STEPS * bound * lr + 2^-8 (2^-11) |ref|.
-- Losses: logits of |z| <= ~4 rounded at 2^-8 (2^-11) each: relative
-- 2^-5 (2^-8) covers them and the weights' drift.
-- fp8 (every Linear's operands cast to e4m3 forward, gradients to e5m2,
-- each scaled by its own amax): the reference is fp8 too, but its casts
-- see the whole global batch where the cell's see a micro batch, so their
-- scales, and the roundings, differ: 2^-4 relative (e4m3's unit; e5m2's
-- 2^-3 reaches the weights only through Adam's normalised step). The
-- 16-bit bound carries over with 2^-4 for the unit of the forward: the
-- weights within 2 * STEPS * bound * lr (+ f32's 1e-4 |ref|, or the
-- 16-bit storage unit), the losses within 8 * 2^-4 relative.
-- Exact: an f32 cell on one rank with one micro step sums what the
-- reference sums in the same order (stages, buckets, offload and the
-- 1-bit warm-up change where the bytes live, not the arithmetic), fp8
-- casts included (the same amaxes); unless resumed on other ranks.
-- Every cell: data-parallel replicas and tied copies hold the same weight
-- to the bit, and no fp16 step is skipped (the reference skips none).
local S = require 'matrix.settings'

local M = {}

local UNIT = { bf16 = 2 ^ -8, fp16 = 2 ^ -11 }
local E4M3 = 2 ^ -4

function M.tolerance(c)
  if c.dtype == 'f32' and c.ranks == 1 and c.ga == 1 and c.pipe == 'none' and c.ckpt == 'none' then
    return { atol = 0, rtol = 0, loss = 0, exact = true }
  end
  if c.dtype == 'f32' and c.fp8 == 'none' then return { atol = 1e-5, rtol = 1e-4, loss = 1e-4 } end
  local step = c.onebit == 'none' and 1.004 or 5
  local unit = c.fp8 == 'none' and UNIT[c.dtype] or E4M3
  return { atol = 2 * S.STEPS * step * S.LR, rtol = UNIT[c.dtype] or 1e-4, loss = unit * 8 }
end

-- Cells of one key share a reference: global batch, optimizer, clipping,
-- the model's width (tensor degree) and the fp8 block.
function M.reference_key(c)
  return string.format('%d %s %s %d %s', S.global_batch(c), c.onebit, c.clip, c.tp, c.fp8)
end

-- Every rank's weights merged by name; the largest difference between
-- two copies of one weight (replicas, pipeline stages holding a tied one).
local function merge(lines)
  local w, spread = {}, 0
  for _, line in ipairs(lines) do
    for name, v in pairs(line.weights) do
      local have = w[name]
      if have then
        for k = 1, #v do spread = math.max(spread, math.abs(v[k] - have[k])) end
      else
        w[name] = v
      end
    end
  end
  return w, spread
end

-- The largest |a - b| / (atol + rtol |b|) over weights (<= 1: within),
-- and the largest |a - b|.
local function weight_error(w, ref, tol)
  local ratio, abs = 0, 0
  for name, r in pairs(ref.weights) do
    local v = w[name]
    if not v or #v ~= #r then return math.huge, math.huge, name end
    for k = 1, #r do
      local d = math.abs(v[k] - r[k])
      if d ~= d then return math.huge, math.huge, name end
      abs = math.max(abs, d)
      if d > 0 then ratio = math.max(ratio, d / (tol.atol + tol.rtol * math.abs(r[k]))) end
    end
  end
  return ratio, abs
end

local function loss_error(losses, ref)
  local worst = 0
  for s = 1, S.STEPS do
    local l = losses[s]
    if type(l) ~= 'number' or l ~= l then return math.huge end
    worst = math.max(worst, math.abs(l - ref.losses[s]) / math.abs(ref.losses[s]))
  end
  return worst
end

-- {cell, name, verdict = 'pass' | 'refused' | 'FAIL', why, loss_err,
-- weight_err (absolute), within (the worst weight error over its tolerance),
-- exact (held to equality)}
function M.row(c, got, ref)
  local row = { cell = c, name = S.name(c) }
  local expected = S.refusal(c)
  local function fail(why)
    row.verdict, row.why = 'FAIL', why
    return row
  end
  if got.crash then return fail('crashed: ' .. got.crash) end
  local errors = {}
  for _, line in ipairs(got) do
    if not line.ok then errors[#errors + 1] = line.error end
  end
  if expected then
    if #errors < #got then return fail('trained; expected the error "' .. expected .. '"') end
    for _, e in ipairs(errors) do
      if not e:find(expected, 1, true) then return fail('expected the error "' .. expected .. '", got: ' .. e) end
    end
    row.verdict, row.why = 'refused', expected
    return row
  end
  if #errors > 0 then
    -- the rank that raised it, not one that met the failed collective after
    table.sort(errors, function(a, b)
      return not a:find('an earlier collective failed', 1, true) and b:find('an earlier collective failed', 1, true)
    end)
    return fail('error: ' .. errors[1])
  end
  local tol = M.tolerance(c)
  local w, spread = merge(got)
  for _, line in ipairs(got) do
    if line.skipped ~= 0 then return fail(line.skipped .. ' steps skipped (fp16 overflow)') end
  end
  if spread ~= 0 then return fail(string.format('copies of a weight differ by %.3g', spread)) end
  local within, abs, missing = weight_error(w, ref, tol)
  if missing then return fail('weight ' .. missing .. ' missing or of another size') end
  row.loss_err, row.weight_err, row.within = loss_error(got[1].losses, ref), abs, within
  row.exact = tol.exact
  if tol.exact and (row.loss_err > 0 or abs > 0) then
    return fail(string.format('an exact cell: losses differ by %.3g relative, weights by %.3g', row.loss_err, abs))
  end
  if row.loss_err > tol.loss then
    return fail(string.format('loss off by %.3g relative (tolerance %g)', row.loss_err, tol.loss))
  end
  if within > 1 then return fail(string.format('weights off by %.3g (%.3g x the tolerance)', abs, within)) end
  row.verdict = 'pass'
  return row
end

return M
