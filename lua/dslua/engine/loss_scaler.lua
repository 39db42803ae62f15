-- dslua.engine.loss_scaler: DeepSpeed's fp16 loss scaling, the LossScaler and
-- DynamicLossScaler of deepspeed/runtime/fp16/loss_scaler.py as the ZeRO
-- stage 1/2/3 optimizers build them (CreateLossScaler) and step them
-- (stage_1_and_2.py / stage3.py step(): check_overflow, then
-- _update_scale(overflow) -> loss_scaler.update_scale(overflow), then skip
-- the step when it overflowed).
--
--   local S = require 'dslua.engine.loss_scaler'
--   local scaler = S.from_config(cfg.fp16)      -- cfg from dslua.config
--   loss_for_backward = scaler:scale_loss(loss)  -- loss * scaler.cur_scale
--   local overflow = S.has_overflow(grads)       -- then all ranks agree (MAX)
--   scaler:update_scale(overflow)                -- may raise at the minimum
--   if scaler.message then print it on rank 0 end
--   if overflow then skip the optimizer step end
--
-- The dynamic algorithm, in DeepSpeed's order (DynamicLossScaler.update_scale):
--   overflow:
--     if delayed_shift == 1 or cur_hysteresis == 1:
--       if cur_scale == min_scale and raise_error_at_min_scale: raise
--       cur_scale = max(cur_scale / 2, min_scale)
--     else: cur_hysteresis -= 1 (the scale stays)
--     last_overflow_iter = cur_iter
--   no overflow:
--     if consecutive_hysteresis: cur_hysteresis = delayed_shift
--     stable = cur_iter - last_overflow_iter - 1
--     if stable > 0 and stable % scale_window == 0:
--       if not consecutive_hysteresis: cur_hysteresis = delayed_shift
--       cur_scale *= 2
--   cur_iter += 1 (not when it raised)
-- So the scale doubles on the (scale_window + 1)-th clean step after an
-- overflow (or after the start: last_overflow_iter starts at -1), there is
-- no upper bound, and without consecutive_hysteresis the hysteresis only
-- refills when the scale grows.
--
-- Defaults. DeepSpeed's docs (config-json: fp16) give initial_scale_power 16,
-- loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false,
-- min_loss_scale 1. Older code disagreed: constants.py had
-- FP16_INITIAL_SCALE_POWER_DEFAULT = 32, and get_dynamic_loss_scale_args
-- returned None when the fp16 block named none of the scaling keys, so the
-- optimizer fell back to its own 2**32. The current code
-- (precision_config.py DeepSpeedFP16Config: initial_scale_power 16,
-- loss_scale_window 1000, hysteresis 2, consecutive_hysteresis False,
-- min_loss_scale 1; dynamic_loss_scale_args() always returns the dict,
-- which the engine passes to the ZeRO optimizers) agrees with the docs.
-- dslua follows that current code, i.e. the values dslua.config fills in:
-- 2^16, 1000, 2, false, 1. The scale factor is always 2 (the constructor's
-- `self.scale_factor = 2.0`).
-- raise_error_at_min_scale: CreateLossScaler never passes it, so the ZeRO
-- optimizers get the constructor default True: an overflow that would
-- lower the scale while it already equals min_loss_scale ends the run with
-- "Current loss scale already at minimum - cannot decrease scale anymore.
-- Exiting run." dslua raises that text as a Lua error and names
-- fp16.min_loss_scale. DeepSpeed's stage-0 FP16_Optimizer (fused_optimizer.py
-- _update_scale, current code) runs the same algorithm but floors at the
-- minimum instead of raising, and logs other text: pass
-- { raise_error_at_min_scale = false } to from_config for its arithmetic.
-- Validation as loss_scale_validation.py / DeepSpeedFP16Config: the initial
-- scale and min_loss_scale positive and finite, scale_window and hysteresis
-- positive integers, a static loss_scale positive and finite.
-- When fp16 is off (bf16 or fp32) CreateLossScaler makes a static scaler of
-- 1.0, and so does from_config.
--
-- Log text. DynamicLossScaler.update_scale logs on rank 0 (logger.info):
--   [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
--   [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1
--   Consecutive hysteresis is enabled. Restoring hysteresis to 2     (every clean step, when enabled)
-- with the scales printed as Python's int() of the float. The static scaler
-- logs nothing (its update_scale is `pass`) though the step is still skipped.
-- update_scale leaves the line DeepSpeed would log in scaler.message (nil when
-- it logs nothing); S.overflow_line builds the overflow lines directly.
--
-- Checkpoints. ZeRO saves the scaler object itself (LOSS_SCALER) and loading
-- puts the saved object in place of the configured one, so every field comes
-- back from the checkpoint, the settings as well as the counters, and a static
-- scaler can replace a dynamic one. state_dict/load_state_dict do the same
-- with plain numbers and booleans.
local ds = require 'dslua'

local M = {}

local fmt = string.format

M.SCALE_FACTOR = 2

local MIN_SCALE_MSG = 'Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.'

local Static, Dynamic = {}, {}
Static.__index, Dynamic.__index = Static, Dynamic

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local function positive_finite(name, v)
  if type(v) ~= 'number' or not finite(v) or v <= 0 then
    error(fmt('loss_scaler: %s must be a positive finite number, got %s', name, tostring(v)), 3)
  end
  return v
end

local function positive_int(name, v)
  if type(v) ~= 'number' or v ~= math.floor(v) or v <= 0 or not finite(v) then
    error(fmt('loss_scaler: %s must be a positive integer, got %s', name, tostring(v)), 3)
  end
  return v
end

-- Python's int() of a positive float, digit for digit (2^70 included).
local function int_text(x) return fmt('%.0f', math.floor(x)) end

-- DeepSpeed's overflow line for a skipped step. opts: rank (default 0),
-- scale (the attempted loss scale), and either next_scale (the scale was
-- lowered) or hysteresis (the hysteresis before it was lowered). With
-- neither, the bare line DeepSpeed prints when the dtype is not fp16.
function M.overflow_line(opts)
  local line = fmt('[deepspeed] OVERFLOW! Rank %d Skipping step.', opts.rank or 0)
  if opts.next_scale ~= nil then
    return fmt('%s Attempted loss scale: %s, reducing to %s', line, int_text(opts.scale), int_text(opts.next_scale))
  elseif opts.hysteresis ~= nil then
    return fmt('%s Attempted loss scale: %s, but hysteresis is %d. Reducing hysteresis to %d', line,
               int_text(opts.scale), opts.hysteresis, opts.hysteresis - 1)
  end
  return line
end

-- A fixed scale (LossScaler): update_scale does nothing.
function M.static(scale)
  return setmetatable({ cur_scale = positive_finite('fp16.loss_scale', scale), dynamic = false }, Static)
end

-- DynamicLossScaler. opts: init_scale, scale_window, min_scale, delayed_shift
-- (DeepSpeed's names for 2^initial_scale_power, loss_scale_window,
-- min_loss_scale, hysteresis), consecutive_hysteresis,
-- raise_error_at_min_scale (default true).
function M.dynamic(opts)
  local s = setmetatable({
    cur_scale = positive_finite('fp16 initial loss scale (2^initial_scale_power)', opts.init_scale),
    scale_window = positive_int('fp16.loss_scale_window', opts.scale_window),
    min_scale = positive_finite('fp16.min_loss_scale', opts.min_scale),
    delayed_shift = positive_int('fp16.hysteresis', opts.delayed_shift),
    consecutive_hysteresis = opts.consecutive_hysteresis and true or false,
    raise_error_at_min_scale = opts.raise_error_at_min_scale ~= false,
    scale_factor = M.SCALE_FACTOR,
    cur_iter = 0,
    last_overflow_iter = -1,
    dynamic = true,
  }, Dynamic)
  s.cur_hysteresis = s.delayed_shift
  return s
end

-- The scaler DeepSpeed's engine gives the ZeRO optimizers for this resolved
-- fp16 block: static 1.0 when fp16 is off, static loss_scale when it is > 0,
-- dynamic otherwise. opts.raise_error_at_min_scale: see the header.
function M.from_config(fp16, opts)
  opts = opts or {}
  if type(fp16) ~= 'table' then error('loss_scaler.from_config: expected the resolved fp16 config block', 2) end
  if not fp16.enabled then return M.static(1.0) end
  local ls = fp16.loss_scale or 0
  if type(ls) ~= 'number' or not finite(ls) or ls < 0 then
    error(fmt('loss_scaler: fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling), got %s', tostring(ls)), 2)
  end
  if ls > 0 then return M.static(ls) end
  local power = fp16.initial_scale_power or 16
  return M.dynamic {
    init_scale = 2 ^ power,
    scale_window = fp16.loss_scale_window or 1000,
    min_scale = fp16.min_loss_scale or 1,
    delayed_shift = fp16.hysteresis or 2,
    consecutive_hysteresis = fp16.consecutive_hysteresis,
    raise_error_at_min_scale = opts.raise_error_at_min_scale,
  }
end

function Static:update_scale() self.message = nil end

function Dynamic:update_scale(overflow)
  if overflow then
    if self.delayed_shift == 1 or self.cur_hysteresis == 1 then
      if self.cur_scale == self.min_scale and self.raise_error_at_min_scale then
        error(fmt('loss_scaler: %s (loss scale %s is fp16.min_loss_scale and gradients still overflow)',
                  MIN_SCALE_MSG, int_text(self.cur_scale)), 2)
      end
      local next_scale = math.max(self.cur_scale / self.scale_factor, self.min_scale)
      self.message = M.overflow_line { scale = self.cur_scale, next_scale = next_scale }
      self.cur_scale = next_scale
    else
      self.message = M.overflow_line { scale = self.cur_scale, hysteresis = self.cur_hysteresis }
      self.cur_hysteresis = self.cur_hysteresis - 1
    end
    self.last_overflow_iter = self.cur_iter
  else
    self.message = nil
    if self.consecutive_hysteresis then
      self.message = fmt('Consecutive hysteresis is enabled. Restoring hysteresis to %d', self.delayed_shift)
      self.cur_hysteresis = self.delayed_shift
    end
    local stable = self.cur_iter - self.last_overflow_iter - 1
    if stable > 0 and stable % self.scale_window == 0 then
      if not self.consecutive_hysteresis then self.cur_hysteresis = self.delayed_shift end
      self.cur_scale = self.cur_scale * self.scale_factor
    end
  end
  self.cur_iter = self.cur_iter + 1
end

-- LossScalerBase.scale_loss: the loss backward starts from.
function Static:scale_loss(loss) return loss * self.cur_scale end
Dynamic.scale_loss = Static.scale_loss

local DYNAMIC_FIELDS = { 'cur_scale', 'cur_iter', 'last_overflow_iter', 'cur_hysteresis', 'scale_factor',
                         'scale_window', 'min_scale', 'delayed_shift', 'consecutive_hysteresis',
                         'raise_error_at_min_scale' }

function Static:state_dict() return { dynamic = false, cur_scale = self.cur_scale } end

function Dynamic:state_dict()
  local sd = { dynamic = true }
  for _, k in ipairs(DYNAMIC_FIELDS) do sd[k] = self[k] end
  return sd
end

-- Puts the saved scaler in place of this one, settings and counters both, as
-- DeepSpeed's checkpoint loading does; a missing field is an error.
local function load_state_dict(self, sd)
  if type(sd) ~= 'table' or type(sd.dynamic) ~= 'boolean' then
    error('loss_scaler:load_state_dict: expected a table from state_dict() with a boolean `dynamic`', 2)
  end
  for k in pairs(self) do self[k] = nil end
  local fields = sd.dynamic and DYNAMIC_FIELDS or { 'cur_scale' }
  for _, k in ipairs(fields) do
    if sd[k] == nil then error(fmt("loss_scaler:load_state_dict: the state has no '%s'", k), 2) end
    self[k] = sd[k]
  end
  self.dynamic = sd.dynamic
  setmetatable(self, sd.dynamic and Dynamic or Static)
end
Static.load_state_dict, Dynamic.load_state_dict = load_state_dict, load_state_dict

------------------------------------------------------------------------
-- Overflow check

local FLOAT = { f32 = true, f64 = true, f16 = true, bf16 = true }
local SPLIT_MIN = 1048576   -- elements from which the sum runs as row sums, one row per thread
local SPLIT_ROWS = 64

-- Sum of all elements, accumulated in double by the reduce kernel. Large
-- tensors are summed as rows first so the threads share the work.
local function total(t)
  local flat = t:reshape(-1)
  local n = flat:numel()
  if n < SPLIT_MIN then return flat:sum():item() end
  local m = math.floor(n / SPLIT_ROWS)
  local s = flat:narrow(1, 1, SPLIT_ROWS * m):view(SPLIT_ROWS, m):sum(2):sum():item()
  if SPLIT_ROWS * m < n then s = s + flat:narrow(1, SPLIT_ROWS * m + 1, n - SPLIT_ROWS * m):sum():item() end
  return s
end

local function has_inf_or_nan(t)
  if not FLOAT[t:dtype()] or t:numel() == 0 then return false end
  -- f16 sums would stop at 65504 (scaled grads get there): sum as f32, as
  -- DeepSpeed's x.float().sum()
  if t:dtype() == 'f16' then t = t:to('f32') end
  -- DeepSpeed's test: a sum that is inf, -inf or nan. Any inf or nan makes
  -- the sum inf or nan, so a finite sum clears the tensor.
  if finite(total(t)) then return false end
  -- A sum of huge finite values can overflow (to inf, or to nan when both
  -- signs overflow); the extremes tell those apart from a real inf or nan.
  local hi, lo = t:amax():item(), t:amin():item()
  return hi ~= hi or hi == math.huge or lo == -math.huge
end

-- True when any tensor holds an inf or a nan. Takes a tensor or a list of
-- tensors; nil entries (params without a grad) are skipped, as DeepSpeed
-- skips `p.grad is None`; integer and bool tensors never overflow.
function M.has_overflow(tensors)
  if ds.is_tensor(tensors) then tensors = { tensors } end
  if type(tensors) ~= 'table' then
    error('loss_scaler.has_overflow: expected a tensor or a list of tensors, got ' .. type(tensors), 2)
  end
  return ds.no_grad(function()
    for i = 1, table.maxn(tensors) do
      local t = tensors[i]
      if t ~= nil and not ds.is_tensor(t) then
        error(fmt('loss_scaler.has_overflow: item %d is a %s, not a tensor', i, type(t)), 0)
      end
      if t ~= nil and has_inf_or_nan(t) then return true end
    end
    return false
  end)
end

return M
