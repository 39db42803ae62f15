-- What an engine reports: DeepSpeed's log lines (log_dist) at each
-- steps_per_print boundary, with wall_clock_breakdown's timers, and the
-- memory report. The methods below are the engine's (engine/init.lua takes
-- them into its class).
local ds = require 'dslua'
local progress = require 'dslua.io.progress'

local M = {}
local Engine = {}
M.methods = Engine

local now = ds.wall_time

-- log_dist as DeepSpeed prints it: rank 0 only, rank in the line.
local function log(engine, fmt, ...)
  if engine.rank ~= 0 then return end
  progress.clear()
  io.stdout:write(string.format('[Rank %d] ' .. fmt .. '\n', engine.rank, ...))
  io.stdout:flush()
end

-- Python's list repr of numbers (and of betas pairs as tuples), as in
-- DeepSpeed's `lr=[0.001], mom=[(0.9, 0.999)]`.
local function repr(v)
  if type(v) == 'table' then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = repr(x) end
    return '(' .. table.concat(parts, ', ') .. ')'
  end
  if v == math.floor(v) and math.abs(v) < 1e15 then return string.format('%.1f', v) end
  for digits = 15, 16 do     -- the shortest text that reads back exactly, as Python's repr
    local s = string.format('%.' .. digits .. 'g', v)
    if tonumber(s) == v then return s end
  end
  return string.format('%.17g', v)
end

local function list_repr(values)
  local parts = {}
  for i, v in ipairs(values) do parts[i] = repr(v) end
  return '[' .. table.concat(parts, ', ') .. ']'
end

-- Wall-clock timers for wall_clock_breakdown: time summed per name since
-- the last report, and the number of global steps it covers.
local function timers()
  return { total = {}, started = {} }
end

function Engine:_start(name)
  if self.timers then self.timers.started[name] = now() end
end

function Engine:_stop(name)
  local t = self.timers
  if not t then return end
  t.total[name] = (t.total[name] or 0) + (now() - t.started[name])
end

-- Bytes by category on every rank (every rank calls it): a list indexed by
-- rank + 1 of {current = {...}, peak = {...}} with parameters, gradients,
-- master_weights, optimizer_state, activations, other and total.
-- Tensors only Lua's collector still holds are not live: collect until
-- a cycle frees nothing more (finalizers free what they held one cycle later).
local function settle_garbage()
  local last
  for _ = 1, 10 do
    collectgarbage()
    local now_bytes = ds.memory_stats().current.total
    if now_bytes == last then return end
    last = now_bytes
  end
end
M.settle_garbage = settle_garbage

local REPORT_KEYS = { 'parameters', 'gradients', 'master_weights', 'optimizer_state', 'activations', 'other', 'total' }

function Engine:memory_report()
  settle_garbage()
  local st = ds.memory_stats()
  local values = {}
  for _, part in ipairs({ 'current', 'peak' }) do
    for _, k in ipairs(REPORT_KEYS) do values[#values + 1] = st[part][k] end
  end
  local rows = { ds.tensor(values, 'f64') }
  if self.world_size > 1 then rows = ds.comm.all_gather(rows[1]) end
  local out = {}
  for r, t in ipairs(rows) do
    local v = t:totable()
    local entry = { rank = r - 1, current = {}, peak = {} }
    for i, k in ipairs(REPORT_KEYS) do
      entry.current[k] = v[i]
      entry.peak[k] = v[#REPORT_KEYS + i]
    end
    out[r] = entry
  end
  return out
end

-- Ranks sharing a GPU: each says its own share of it (the progress line
-- is rank 0's alone), from its caching allocator.
local function shared_memory_line(engine)
  local m, s = ds.cuda.memory_info(), engine.shared_gpu
  progress.clear()
  io.stdout:write(string.format('[Rank %d] %s shared by ranks %d-%d: this rank MemAllocated=%.2fGB, '
                                .. 'MaxMemAllocated=%.2fGB, cached=%.2fGB\n', engine.rank, engine.device, s.first,
                                s.last, m.allocated / 2^30, m.peak / 2^30, m.cached / 2^30))
  io.stdout:flush()
end

-- DeepSpeed's logs at each steps_per_print boundary: the progress line, the
-- throughput line and, with wall_clock_breakdown, the timers; on a
-- terminal the epoch's progress bar as well.
function Engine:_report()
  if self.monitor then self.monitor:step(self) end
  if self.flops_profiler then self.flops_profiler:boundary() end
  if self.bar then
    local fields = { loss = self.last_loss }
    self.bar:update(self.global_steps - self.bar_first_step, fields, self.global_samples - self.bar_first_samples)
    if self.global_steps - self.bar_first_step >= self.bar.total then self.bar:finish() end
  end
  local every = self.config.steps_per_print
  if self.global_steps % every ~= 0 then return end
  log(self, 'step=%d, skipped=%d, lr=%s, mom=%s', self.global_steps, self.skipped_steps,
      list_repr(self:get_lr()), list_repr(self:get_mom()))
  local last = self.last_report or { busy = 0, samples = 0 }
  local elapsed = self.busy_time - last.busy
  local samples = self.global_samples - last.samples
  log(self, 'epoch=%s/micro_step=%d/global_step=%d, RunningAvgSamplesPerSec=%.3f, CurrSamplesPerSec=%.3f, '
          .. 'MemAllocated=%.2fGB, MaxMemAllocated=%.2fGB',
      tostring(self.epoch or 0), self.micro_steps, self.global_steps,
      (self.global_samples - (self.resumed_samples or 0)) / self.busy_time,
      samples / elapsed, ds.memory_stats().current.total / 2^30, ds.memory_stats().peak.total / 2^30)
  if self.shared_gpu then shared_memory_line(self) end
  if self.timers then
    local tt = self.timers.total
    log(self, 'time (ms) | forward: %.2f | backward: %.2f | step: %.2f  (mean per global step over %d)',
        1000 * (tt.forward or 0) / every, 1000 * (tt.backward or 0) / every, 1000 * (tt.step or 0) / every, every)
    self.timers.total = {}
  end
  self.last_report = { busy = self.busy_time, samples = self.global_samples }
end

M.log, M.timers = log, timers

return M
