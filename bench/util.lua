-- Shared by the bench/*.lua programs, which the drivers run from the
-- project root (require 'bench.util').
local ds = require 'dslua'

local M = {}

-- The median of xs, sorted in place; of an even count, the mean of the
-- middle two.
function M.median(xs)
  table.sort(xs)
  local n = #xs
  return n % 2 == 1 and xs[(n + 1) / 2] or (xs[n / 2] + xs[n / 2 + 1]) / 2
end

-- A formatted line on rank 0 alone, flushed at once (the driver's pipe
-- shows it as it comes).
function M.say(fmt, ...)
  if ds.comm.rank() == 0 then
    io.stdout:write(string.format(fmt, ...), '\n')
    io.stdout:flush()
  end
end

return M
