-- Runs cells of the configuration matrix on this process's ranks (every
-- cell of the list has world_size ranks): batch.lua CELLS.json OUT_PREFIX
-- NVME_DIR FIRST. From cell FIRST on, every rank appends a JSON line per
-- cell to OUT_PREFIX.<rank>.jsonl: {i, ok = true, losses, weights,
-- skipped} or {i, ok = false, error}. A cell every rank refused (an error
-- on all of them) is followed by the next; an error on some ranks only
-- leaves the collectives out of step, so the process exits (status 3) and
-- the caller starts the rest again.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local Cell = require 'matrix.cell'

local cells_path, prefix, nvme, first = arg[1], arg[2], arg[3], tonumber(arg[4] or 1)
assert(cells_path and prefix and nvme, 'usage: batch.lua CELLS.json OUT_PREFIX NVME_DIR [FIRST]')
local f = assert(io.open(cells_path))
local cells = ds.json.decode(f:read('*a'))
f:close()
local rank, world = ds.comm.rank(), ds.comm.world_size()
local out = assert(io.open(prefix .. '.' .. rank .. '.jsonl', 'a'))

local function write(t)
  out:write(ds.json.encode(t), '\n')
  out:flush()
end

for i = first, #cells do
  local dir = nvme .. '/' .. i
  if rank == 0 then assert(os.execute('mkdir -p ' .. dir) == 0) end
  if world > 1 then ds.comm.barrier() end
  local ok, res = pcall(Cell.run, cells[i], dir)
  if ok then
    res.i, res.ok = i, true
    write(res)
  else
    write({ i = i, ok = false, error = tostring(res) })
    local agreed, n = pcall(function()
      local t = ds.tensor({ 1 }, 'f64')
      if world > 1 then ds.comm.all_reduce(t, 'sum') end
      return t:item()
    end)
    if not agreed or n ~= world then os.exit(3) end
  end
  if rank == 0 then os.execute('rm -rf ' .. dir) end
end
out:close()
