-- Progress for long work: a redrawn bar with rate and ETA on a terminal,
-- a plain line every `every` updates in a pipe or log file.
--   local p = progress.new{ total = 1000, label = 'train', unit = 'samples' }
--   p:update(step, { loss = 0.31 }, samples_done)
--   p:finish()
local core = require 'dslua.core'

local M = {}
M.__index = M

local clock = core.wall_time

-- the bar last drawn on a terminal, its line not ended yet
local live

local function fmt_time(s)
  if s ~= s or s == math.huge then return '?' end
  s = math.floor(s + 0.5)
  if s >= 3600 then return string.format('%dh%02dm', s / 3600, (s % 3600) / 60) end
  if s >= 60 then return string.format('%dm%02ds', s / 60, s % 60) end
  return string.format('%ds', s)
end

function M.new(opts)
  local self = setmetatable({}, M)
  self.total = assert(opts.total, 'progress: total is required')
  self.label = opts.label or ''
  self.unit = opts.unit or 'it'
  self.out = opts.out or io.stdout
  self.tty = opts.tty
  if self.tty == nil then self.tty = core.isatty(1) and os.getenv('TERM') ~= 'dumb' end
  self.every = opts.every or math.max(1, math.floor(self.total / 20))
  self.start = clock()
  self.count = 0
  return self
end

-- i: steps done (of total); fields: extra values shown (sorted by name);
-- count: units processed so far for the rate (defaults to i).
function M:update(i, fields, count)
  self.count = count or i
  if not self.tty and i % self.every ~= 0 and i ~= self.total then return end
  local elapsed = clock() - self.start
  local rate = elapsed > 0 and self.count / elapsed or 0
  local eta = i > 0 and elapsed * (self.total - i) / i or math.huge
  local parts = {}
  local names = {}
  for k in pairs(fields or {}) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local v = fields[k]
    parts[#parts + 1] = type(v) == 'number' and string.format('%s %.4g', k, v) or (k .. ' ' .. tostring(v))
  end
  local info = string.format('%s | %.1f %s/s | eta %s', table.concat(parts, ' | '), rate, self.unit, fmt_time(eta))
  if self.tty then
    local width = 24
    local filled = math.floor(width * i / self.total)
    self.out:write(string.format('\r%s [%s%s] %d/%d %s\27[K', self.label, string.rep('=', filled),
                                 string.rep(' ', width - filled), i, self.total, info))
    live = self
  else
    self.out:write(string.format('%s %d/%d %s\n', self.label, i, self.total, info))
  end
  self.out:flush()
end

function M:finish()
  if self.tty then self.out:write('\n') end
  if live == self then live = nil end
  return clock() - self.start
end

-- progress.clear(): the line of a bar drawn on a terminal is erased, so
-- that a log line or an error printed next starts on a line of its own
-- (the bar's next update draws it again below).
function M.clear()
  if not live then return end
  live.out:write('\r\27[K')
  live.out:flush()
  live = nil
end

return M
