-- Run by spec/tp_spec.lua under mpirun: makes ds.topology of the degrees
-- in arg[2] ("pipe,data,sequence,tensor") and, over every group of every
-- combination of axes, all-reduces this rank's number; each rank writes
-- what it saw as JSON to arg[1].<rank>: {coord, groups = {key = {size, sum}}}.
local ds = require 'dslua'

local out_path, dims = assert(arg[1]), assert(arg[2])
local p, d, s, t = dims:match('^(%d+),(%d+),(%d+),(%d+)$')
local topo = ds.topology { pipe = tonumber(p), data = tonumber(d), sequence = tonumber(s), tensor = tonumber(t) }

local mine = { coord = topo:coord(), groups = {} }
for bits = 1, 15 do
  local axes = {}
  for i, a in ipairs(ds.topology.AXES) do
    if math.floor(bits / 2 ^ (i - 1)) % 2 == 1 then axes[#axes + 1] = a end
  end
  local g = topo:group(axes)
  local v = ds.tensor({ ds.comm.rank() }, 'f64')
  ds.comm.all_reduce(v, 'sum', g)
  mine.groups[table.concat(axes, '+')] = { size = g:size(), sum = v:item() }
end

local f = assert(io.open(out_path .. '.' .. ds.comm.rank(), 'w'))
f:write(ds.json.encode(mine))
f:close()
