-- Partitioned construction (DeepSpeed's deepspeed.zero.Init): a model
-- built inside ds.zero.Init(config, fn) holds, for each parameter larger
-- than stage3_param_persistence_threshold, only this rank's shard (stage
-- 3's layout: ceil(n / P) elements per rank, the last padded with zeros),
-- drawn from the counters a whole build would give those elements, so the
-- values are the whole build's. The parameter itself is a placeholder of
-- its shape without data until ds.initialize's stage 3 takes the shards.
--
--   local model = ds.zero.Init('ds.json', function() return GPT(cfg) end)
--   local engine = ds.initialize { model = model, config = 'ds.json' }
local ds = require 'dslua'
local Z0 = require('dslua.core')._zero
local file_io = require 'dslua.base.file'
local base = require 'dslua.nn.module'

local M = {}
local fmt = string.format

-- Shards of the parameters built partitioned and not yet taken by an
-- engine, by tensor key: {param, shard, numel, lo, len, name}.
local built = {}

local function fail(level, msg, ...) error(fmt('ds.zero.Init: ' .. msg, ...), level) end

local function shape_str(s) return '[' .. table.concat(s, 'x') .. ']' end

-- The zero_optimization block of a config (a table or a JSON file) and
-- its tensor-parallel degree.
local function zero_block(config)
  if type(config) == 'string' then
    local text, why = file_io.text(config)
    if not text then fail(4, "cannot read '%s': %s", config, why) end
    local ok, v = pcall(ds.json.decode, text, config)
    if not ok or type(v) ~= 'table' then fail(4, "'%s' is not a JSON object: %s", config, tostring(v)) end
    config = v
  end
  if type(config) ~= 'table' then fail(4, 'expected a config (a table or a JSON file), got %s', type(config)) end
  local z, t = config.zero_optimization, config.tensor_parallel
  local tp = type(t) == 'table' and math.max(tonumber(t.autotp_size) or 1, type(t.tp) == 'table'
                                                 and tonumber(t.tp.tp_size) or 1) or 1
  return type(z) == 'table' and z or {}, tp
end

---------------------------------------------------------------- the scope

local Scope = {}
Scope.__index = Scope

-- A parameter's tensor as a layer asks for it (nn.Module's empty): small
-- ones whole, as stage 3 keeps them; others a placeholder and its shard,
-- on this rank's device, where initialize moves a whole model (a
-- placeholder cannot move).
function Scope:empty(shape, opts)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  if n <= self.threshold then return ds.zeros(shape, opts.dtype or 'f32', opts.device) end
  local shard_n = math.ceil(n / self.parts)
  local shard = ds.zeros({ shard_n }, opts.dtype or 'f32', self.device)
  local t = Z0.placeholder(shard, shape)
  local lo = math.min(self.rank * shard_n, n)
  built[Z0.key(t)] = { param = t, shard = shard, numel = n, lo = lo, len = math.min(shard_n, n - lo),
                       name = shape_str(shape) }
  return t
end

function Scope:owns(t) return built[Z0.key(t)] end

-- A layer registered t as key: the name its errors give.
function Scope:named(t, who, key)
  local rec = built[Z0.key(t)]
  if rec then rec.name = fmt("%s '%s' %s", who, tostring(key), shape_str(t:size())) end
end

-- nn.init's random fill of t, drawn for this rank's elements only:
-- draw(shape) * scale + shift, element by element as the whole one.
function Scope:fill(t, normal, scale, shift)
  local rec = built[Z0.key(t)]
  ds.no_grad(function()
    local r = Z0.draw(normal, rec.numel, rec.lo, rec.len, rec.shard)
    if rec.len == 0 then return end
    if scale ~= 1 then r:mul_(scale) end
    if shift ~= 0 then r:add_(shift) end
    rec.shard:narrow(1, 1, rec.len):copy_(r)
  end)
end

function Scope:constant(t, v)
  local rec = built[Z0.key(t)]
  if rec.len > 0 then ds.no_grad(function() rec.shard:narrow(1, 1, rec.len):fill_(v) end) end
end

local open = nil

-- Every rank draws from rank 0's generator state, as the whole build
-- rank 0 broadcasts would be drawn; the state of this rank's own generator
-- is returned, to be moved on by as many counters afterwards.
local function share_generator()
  local mine = ds.get_rng_state()
  local codes = {}
  for i = 1, #mine do codes[i] = mine:byte(i) end
  local t = ds.tensor(codes, 'i32')
  ds.comm.broadcast(t, 0)
  local chars = {}
  for i, c in ipairs(t:totable()) do chars[i] = string.char(c) end
  local first = table.concat(chars)
  ds.set_rng_state(first)
  return mine, first
end

local function offset_of(state) return tonumber(state:sub(17), 16) end

-- This rank's own generator, moved on by the counters drawn since first.
local function restore_generator(mine, first)
  local drawn = offset_of(ds.get_rng_state()) - offset_of(first)
  ds.set_rng_state(mine:sub(1, 16) .. fmt('%016x', offset_of(mine) + drawn))
end

-- Init(config, fn, ...) -> fn(...)'s results, with every parameter made
-- meanwhile partitioned over the job's ranks. config: the one initialize
-- will get (its zero_optimization: stage 3, the persistence threshold).
function M.Init(config, fn, ...)
  if open then fail(2, 'a partitioned-construction scope is open already: scopes do not nest') end
  if type(fn) ~= 'function' then fail(2, 'expected Init(config, function() ... return model end), got %s', type(fn)) end
  local z, tp = zero_block(config)
  if z.stage ~= 3 then
    fail(2, 'zero_optimization.stage is %s: partitioned construction is for stage 3, where the parameters '
         .. 'stay partitioned', tostring(z.stage))
  end
  if tp > 1 then
    fail(2, 'tensor_parallel.autotp_size %d splits a model built whole; partitioned construction cuts it over '
         .. 'every rank: not both', tp)
  end
  local threshold = z.stage3_param_persistence_threshold or z.param_persistence_threshold or 1e5
  if type(threshold) ~= 'number' then
    fail(2, 'zero_optimization.stage3_param_persistence_threshold must be a number here (initialize resolves '
         .. '"auto" from the built model), got %s', tostring(threshold))
  end
  if not ds.comm.launched() then
    fail(2, 'not a launched job: run the script with dslua -n N (or mpirun) so that each rank builds its shard')
  end
  local scope = setmetatable({ threshold = threshold, rank = ds.comm.rank(), parts = ds.comm.world_size(),
                                device = ds.device() }, Scope)
  local mine, first = share_generator()
  open = scope
  base.set_partition(scope)
  Z0.set_fetch(function(t)
    local rec = built[Z0.key(t)]
    if rec then
      error(fmt('%s is built partitioned (ds.zero.Init): its values exist only as shards until ds.initialize '
                .. 'takes them, so a module cannot read them while it is built', rec.name), 0)
    end
  end)
  local res = { pcall(fn, ...) }
  Z0.set_fetch(nil)
  base.set_partition(nil)
  open = nil
  restore_generator(mine, first)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Is a scope open?
function M.active() return open ~= nil end

---------------------------------------------------------------- the engine's side

-- The shard of parameter p if it was built partitioned (the engine takes
-- it: it leaves this list), else nil.
function M.take(p)
  local k = Z0.key(p)
  local rec = built[k]
  built[k] = nil
  return rec and rec.shard
end

-- Is p built partitioned and not yet taken by an engine?
function M.partitioned(p) return built[Z0.key(p)] ~= nil end

-- The records of a model's parameters built partitioned: {name, rec}
-- pairs, for loaders that fill the shards (from_hf).
function M.shards_of(model)
  local out = {}
  for _, e in ipairs(model:named_parameters()) do
    local rec = built[Z0.key(e[2])]
    if rec then out[#out + 1] = { e[1], rec } end
  end
  return out
end

return M
