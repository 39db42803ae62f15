-- ds.pipe: pipeline parallelism as deepspeed.pipe.
--
--   local pipe = ds.pipe
--   local model = pipe.PipelineModule {
--     layers = { pipe.LayerSpec(nn.Linear, 784, 256), nn.ReLU(), pipe.LayerSpec(nn.Linear, 256, 10) },
--     num_stages = 2, loss_fn = ds.cross_entropy, partition_method = 'parameters',
--   }
--   local engine = ds.initialize { model = model, config = cfg }
--   local loss = engine:train_batch(data_iter)
--
-- The layers split into num_stages contiguous stages; rank r holds stage
-- floor(r / dp) (DeepSpeed's pipe x data topology, pipe outermost) and
-- builds only its own stage's LayerSpecs. Each layer is built from the
-- seed base_seed + its index, so a model has the same weights however it
-- is split. A layer is a LayerSpec, a module already built, or a function
-- of the activation.
local ds = require 'dslua'
local nn = ds.nn

local M = {}

local fmt = string.format

------------------------------------------------------------------------
-- LayerSpec(cls, ...): a layer built only on the stage that runs it

local LayerSpec = {}
LayerSpec.__index = LayerSpec

function M.LayerSpec(cls, ...)
  if type(cls) ~= 'table' and type(cls) ~= 'function' then
    error('LayerSpec: expected a module class, got ' .. type(cls), 2)
  end
  return setmetatable({ cls = cls, n = select('#', ...), args = { ... } }, LayerSpec)
end

function LayerSpec:build() return self.cls(unpack(self.args, 1, self.n)) end

function LayerSpec:name() return type(self.cls) == 'table' and self.cls.__name or 'function' end

local function is_spec(l) return getmetatable(l) == LayerSpec end

local function layer_name(l)
  if is_spec(l) then return l:name() end
  if type(l) == 'table' and l.__name then return l.__name end
  return type(l)
end

------------------------------------------------------------------------
-- Partitioning: contiguous stages, each with at least one layer, the
-- largest stage weight as small as it can be (DeepSpeed's
-- partition_balanced). parts[s] is the first layer of stage s, parts[S+1]
-- one past the last.

local function partition_balanced(w, S)
  local L = #w
  local pre = { [0] = 0 }
  for i = 1, L do pre[i] = pre[i - 1] + w[i] end
  -- best[k][i]: the smallest largest weight of layers 1..i in k stages
  local best, cut = {}, {}
  best[1], cut[1] = {}, {}
  for i = 1, L do best[1][i] = pre[i] end
  for k = 2, S do
    best[k], cut[k] = {}, {}
    for i = k, L do
      local b, c = math.huge, nil
      for j = k - 1, i - 1 do
        local v = math.max(best[k - 1][j], pre[i] - pre[j])
        if v < b then b, c = v, j end
      end
      best[k][i], cut[k][i] = b, c
    end
  end
  local parts = { [S + 1] = L + 1 }
  local i = L
  for k = S, 2, -1 do
    parts[k] = cut[k][i] + 1
    i = cut[k][i]
  end
  parts[1] = 1
  return parts
end

local function numel_of(m)
  if type(m) ~= 'table' or type(m.parameters) ~= 'function' then return 0 end
  local n = 0
  for _, p in ipairs(m:parameters()) do n = n + p:numel() end
  return n
end

-- weights per layer for partition_method; build(i) builds layer i
local function layer_weights(layers, method, build)
  local w = {}
  if method == 'uniform' then
    for i = 1, #layers do w[i] = 1 end
  elseif method == 'parameters' then
    for i, l in ipairs(layers) do w[i] = numel_of(is_spec(l) and build(i) or l) end
  elseif type(method) == 'string' and method:match('^type:') then
    local pattern = method:sub(6)
    local any = false
    for i, l in ipairs(layers) do
      w[i] = layer_name(l):lower():match(pattern:lower()) and 1 or 0
      any = any or w[i] == 1
    end
    if not any then error(fmt("PipelineModule: partition_method '%s' matches no layer", method), 0) end
  else
    error(fmt("PipelineModule: partition_method must be 'parameters', 'uniform' or 'type:<regex>', got %s",
              tostring(method)), 0)
  end
  return w
end

-- ds.pipe.partition(layers, num_stages, method [, base_seed]) -> parts:
-- stage s (0-based) runs layers parts[s+1] .. parts[s+2]-1 (1-based).
-- 'parameters' builds each LayerSpec once to count its parameters.
function M.partition(layers, S, method, seed)
  local rng = ds.get_rng_state()
  local ok, w = pcall(layer_weights, layers, method, function(i)
    ds.manual_seed((seed or 1234) + i)
    return layers[i]:build()
  end)
  ds.set_rng_state(rng)
  if not ok then error(w, 0) end
  return partition_balanced(w, S)
end

------------------------------------------------------------------------
-- PipelineModule

local PipelineModule = nn.Module:extend('PipelineModule')
M.PipelineModule = PipelineModule

local OPTIONS = { layers = true, num_stages = true, loss_fn = true, partition_method = true,
                  activation_checkpoint_interval = true, base_seed = true }

function PipelineModule:init(opts)
  if type(opts) ~= 'table' then error('PipelineModule: expected a table of options', 3) end
  for k in pairs(opts) do
    if not OPTIONS[k] then error(fmt("PipelineModule: unknown option '%s'", tostring(k)), 3) end
  end
  local layers, S = opts.layers, opts.num_stages
  if type(layers) ~= 'table' or #layers == 0 then error('PipelineModule: layers must be a non-empty list', 3) end
  if type(S) ~= 'number' or S < 1 or S % 1 ~= 0 then
    error('PipelineModule: num_stages must be a positive integer, got ' .. tostring(S), 3)
  end
  if S > #layers then
    error(fmt('PipelineModule: %d stages but only %d layers; every stage needs at least one', S, #layers), 3)
  end
  local world = ds.comm.world_size()
  if world % S ~= 0 then
    error(fmt('PipelineModule: %d ranks do not split into %d stages (world size must be a multiple)', world, S), 3)
  end
  local dp = world / S
  rawset(self, 'num_stages', S)
  rawset(self, 'dp_size', dp)
  rawset(self, 'stage_id', math.floor(ds.comm.rank() / dp))
  rawset(self, 'loss_fn', opts.loss_fn)
  rawset(self, 'activation_checkpoint_interval', opts.activation_checkpoint_interval or 0)
  rawset(self, 'is_pipeline', true)
  local seed = opts.base_seed or 1234

  local parts = M.partition(layers, S, opts.partition_method or 'parameters', seed)
  rawset(self, 'parts', parts)

  -- each layer from its own seed, the caller's random stream left as it was
  local rng = ds.get_rng_state()
  local function build(i)
    ds.manual_seed(seed + i)
    return layers[i]:build()
  end
  local first, last = parts[self.stage_id + 1], parts[self.stage_id + 2] - 1
  local funcs, mods = {}, {}
  for i = first, last do
    local l = layers[i]
    if is_spec(l) then l = build(i) end
    funcs[#funcs + 1] = l
    if type(l) == 'table' and l.parameters then mods[#mods + 1] = l end
  end
  ds.set_rng_state(rng)
  rawset(self, 'funcs', funcs)
  self.layers = nn.ModuleList(mods)

  -- every stage needs parameters: the optimizer of a stage without any
  -- has nothing to do and DeepSpeed's engine fails later, less clearly
  local mine = 0
  for _, m in ipairs(mods) do mine = mine + numel_of(m) end
  local counts = {}
  for s = 1, S do counts[s] = 0 end
  counts[self.stage_id + 1] = mine
  if world > 1 then counts = (ds.comm.all_reduce(ds.tensor(counts, 'f64')) / dp):totable() end
  for s = 1, S do
    if counts[s] == 0 then
      local names = {}
      for i = parts[s], parts[s + 1] - 1 do names[#names + 1] = layer_name(layers[i]) end
      error(fmt('PipelineModule: stage %d (layers %d..%d: %s) has no parameters; use another partition_method '
                .. 'or fewer stages', s - 1, parts[s] - 1, parts[s + 1] - 2, table.concat(names, ', ')), 3)
    end
  end
end

function PipelineModule:is_first_stage() return self.stage_id == 0 end
function PipelineModule:is_last_stage() return self.stage_id == self.num_stages - 1 end

-- this stage's layers, in checkpointed segments when the interval is > 0
function PipelineModule:forward(x)
  return require('dslua.checkpointing').sequential(self.funcs, self.activation_checkpoint_interval, x)
end

-- the layer indices (0-based, as DeepSpeed prints them) of stage s
function PipelineModule:stage_layers(s)
  return self.parts[s + 1] - 1, self.parts[s + 2] - 2
end

return M
