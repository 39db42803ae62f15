-- ds.topology: the ranks of a job laid out on four axes, DeepSpeed's
-- ProcessTopology / PipeModelDataParallelTopology with a sequence axis.
--
--   local topo = ds.topology { tensor = 2, pipe = 2 }   -- data: what is left of the world
--   topo:coord()              -- this rank's {pipe =, data =, sequence =, tensor =} (0-based)
--   topo:group('tensor')      -- this rank's tensor group (a ds.comm group)
--   topo:group{'pipe', 'tensor'}   -- the ranks that differ only on those axes
--
-- Axes run pipe, data, sequence, tensor, outermost first: rank =
-- ((pipe * D + data) * S + sequence) * T + tensor, so the T ranks of a
-- tensor group are neighbours and stay inside a node (a node's ranks are
-- consecutive under the launcher); with T = S = 1 this is ds.pipe's
-- PipeDataParallelTopology. Every group of every combination of axes is
-- made when the topology is (ds.comm.new_group is collective: every rank
-- makes the same topology, in the same order).
local ds = require 'dslua'

local M = {}

local fmt = string.format

M.AXES = { 'pipe', 'data', 'sequence', 'tensor' }
local AXIS = { pipe = 1, data = 2, sequence = 3, tensor = 4 }

local Topology = {}
Topology.__index = Topology

local function check_degree(name, v)
  if v ~= nil and (type(v) ~= 'number' or v < 1 or v % 1 ~= 0) then
    error(fmt('topology: %s must be a positive integer, got %s', name, tostring(v)), 3)
  end
end

-- the axis list of a name or a list of names, in topology order
local function axes_of(spec)
  local list = type(spec) == 'table' and spec or { spec }
  local seen = {}
  for _, a in ipairs(list) do
    if not AXIS[a] then error(fmt("topology: no axis '%s' (pipe, data, sequence, tensor)", tostring(a)), 3) end
    seen[a] = true
  end
  local out = {}
  for _, a in ipairs(M.AXES) do if seen[a] then out[#out + 1] = a end end
  return out
end

-- ds.topology{data =, pipe =, tensor =, sequence =, world_size =}: degrees
-- left out are 1, data the world over the rest. world_size: the world
-- (default ds.comm.world_size()).
function M.new(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then error('topology: expected a table {data =, pipe =, tensor =, sequence =}', 2) end
  for k in pairs(opts) do
    if not AXIS[k] and k ~= 'world_size' and k ~= 'groups' then
      error(fmt("topology: unknown key '%s' (data, pipe, tensor, sequence, world_size)", tostring(k)), 2)
    end
  end
  for _, a in ipairs(M.AXES) do check_degree(a, opts[a]) end
  check_degree('world_size', opts.world_size)
  local W = opts.world_size or ds.comm.world_size()
  local p, t, s = opts.pipe or 1, opts.tensor or 1, opts.sequence or 1
  local model = p * t * s
  local d = opts.data
  if d == nil then
    if W % model ~= 0 then
      error(fmt('topology: pipe %d x tensor %d x sequence %d = %d does not divide the world of %d rank%s',
                p, t, s, model, W, W == 1 and '' or 's'), 2)
    end
    d = W / model
  end
  if p * d * s * t ~= W then
    error(fmt('topology: pipe %d x data %d x sequence %d x tensor %d = %d ranks, the world has %d',
              p, d, s, t, p * d * s * t, W), 2)
  end
  local self = setmetatable({ dims = { p, d, s, t }, world = W, groups = {}, rank = ds.comm.rank() }, Topology)
  if opts.groups ~= false then self:_make_groups() end
  return self
end

function Topology:get_dim(axis) return self.dims[AXIS[axes_of(axis)[1]]] end
function Topology:world_size() return self.world end

-- get_rank{pipe =, data =, sequence =, tensor =} (missing coordinates 0)
function Topology:get_rank(c)
  local r = 0
  for i, a in ipairs(M.AXES) do
    local v = c[a] or 0
    if v < 0 or v >= self.dims[i] then
      error(fmt('topology: %s coordinate %s out of range 0..%d', a, tostring(v), self.dims[i] - 1), 2)
    end
    r = r * self.dims[i] + v
  end
  return r
end

function Topology:get_coord(rank)
  if type(rank) ~= 'number' or rank < 0 or rank >= self.world or rank % 1 ~= 0 then
    error(fmt('topology: rank %s out of range 0..%d', tostring(rank), self.world - 1), 2)
  end
  local c = {}
  for i = #M.AXES, 1, -1 do
    c[M.AXES[i]] = rank % self.dims[i]
    rank = math.floor(rank / self.dims[i])
  end
  return c
end

-- this rank's coordinates, or its coordinate on one axis
function Topology:coord(axis)
  local c = self:get_coord(self.rank)
  if axis ~= nil then return c[axes_of(axis)[1]] end
  return c
end

-- The ranks that share rank's coordinates off `axes` (a name or a list),
-- in rank order: its group along them.
function Topology:group_ranks(axes, rank)
  axes = axes_of(axes)
  local c = self:get_coord(rank or self.rank)
  local free = {}
  for _, a in ipairs(axes) do free[a] = true end
  local out = {}
  for r = 0, self.world - 1 do
    local o, same = self:get_coord(r), true
    for _, a in ipairs(M.AXES) do
      if not free[a] and o[a] ~= c[a] then same = false; break end
    end
    if same then out[#out + 1] = r end
  end
  return out
end

-- DeepSpeed's get_axis_comm_lists(axis): every group along the axis, each
-- a list of ranks, in the order of the first rank of each.
function Topology:get_axis_comm_lists(axes)
  local lists, seen = {}, {}
  for r = 0, self.world - 1 do
    if not seen[r] then
      local g = self:group_ranks(axes, r)
      for _, q in ipairs(g) do seen[q] = true end
      lists[#lists + 1] = g
    end
  end
  return lists
end

-- the key of a set of axes: the axes of degree above 1 it holds, joined
local function key(self, axes)
  local parts = {}
  for _, a in ipairs(axes) do
    if self.dims[AXIS[a]] > 1 then parts[#parts + 1] = a end
  end
  return table.concat(parts, '+')
end

-- Every combination of the axes of degree above 1 (the empty one: this
-- rank alone), bit patterns in increasing order, each group of it in the
-- order of its first rank; this rank keeps its own.
function Topology:_make_groups()
  local big = {}
  for i, a in ipairs(M.AXES) do if self.dims[i] > 1 then big[#big + 1] = a end end
  for bits = 0, 2 ^ #big - 1 do
    local axes = {}
    for i, a in ipairs(big) do
      if math.floor(bits / 2 ^ (i - 1)) % 2 == 1 then axes[#axes + 1] = a end
    end
    local k = key(self, axes)
    for _, ranks in ipairs(self:get_axis_comm_lists(axes_of(axes))) do
      local g = ds.comm.new_group(ranks)
      if g:rank() >= 0 then self.groups[k] = g end
    end
  end
end

-- group(axes): this rank's ds.comm group along `axes` (a name or a list),
-- for any collective and for the step engine.
function Topology:group(axes)
  local k = key(self, axes_of(axes))
  local g = self.groups[k]
  if not g then error("topology: made with groups = false, it has no groups", 2) end
  return g
end

-- the number of ranks along axes
function Topology:size(axes)
  local n = 1
  for _, a in ipairs(axes_of(axes)) do n = n * self.dims[AXIS[a]] end
  return n
end

function Topology:__tostring()
  return fmt('topology: pipe %d x data %d x sequence %d x tensor %d', unpack(self.dims))
end

setmetatable(M, { __call = function(_, opts) return M.new(opts) end })

return M
