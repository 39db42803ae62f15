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
-- floor(r / dp) (DeepSpeed's pipe x data topology, pipe outermost; or a
-- `topology` given) and builds only its own stage's LayerSpecs. The dp
-- ranks of a stage are data parallel over their own group (dp_group), where
-- the step engine reduces and ZeRO-1 partitions. Each layer is built from
-- the seed base_seed + its index, so a model has the same weights however
-- it is split. A layer is a LayerSpec, a TiedLayerSpec, a module already
-- built, or a function of the activation.
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

------------------------------------------------------------------------
-- TiedLayerSpec{key, cls, ..., forward_fn = f, tied_weight_attr = 'weight'}:
-- every layer of one key is one module on a stage (built once there), and
-- the stages that hold the key keep its tied weights equal: their
-- gradients are summed across those stages before each step. forward_fn(
-- module, x) replaces module(x) (GPT-2's lm_head reads the embedding's
-- weight). tied_weight_attr names the tied tensors: a dotted path into the
-- module, or a list of them.

local TiedLayerSpec = setmetatable({}, { __index = LayerSpec })
TiedLayerSpec.__index = TiedLayerSpec

function M.TiedLayerSpec(opts)
  if type(opts) ~= 'table' or opts[1] == nil or opts[2] == nil then
    error('TiedLayerSpec: expected {key, cls, args..., forward_fn = f, tied_weight_attr = name}', 2)
  end
  local spec = M.LayerSpec(opts[2], unpack(opts, 3, table.maxn(opts)))
  spec.key = opts[1]
  spec.forward_fn = opts.forward_fn
  local attr = opts.tied_weight_attr or 'weight'
  spec.tied_weight_attr = type(attr) == 'table' and attr or { attr }
  return setmetatable(spec, TiedLayerSpec)
end

local function is_spec(l) return getmetatable(l) == LayerSpec or getmetatable(l) == TiedLayerSpec end
local function is_tied(l) return getmetatable(l) == TiedLayerSpec end

-- module's tensor at a dotted path ('wte.weight')
local function tied_tensor(spec, module, path)
  local t = module
  for part in path:gmatch('[^.]+') do
    t = type(t) == 'table' and t[part] or nil
  end
  if not ds.is_tensor(t) then
    error(fmt("TiedLayerSpec '%s': tied_weight_attr '%s' is not a tensor of the %s", tostring(spec.key), path,
              spec:name()), 0)
  end
  return t
end

local function layer_name(l)
  if is_spec(l) then return l:name() end
  if type(l) == 'table' and l.__name then return l.__name end
  return type(l)
end

------------------------------------------------------------------------
-- Partitioning: contiguous stages, each with at least one layer, the
-- largest stage weight as small as it can be (DeepSpeed's
-- partition_balanced); among equal ones, earlier stages take as many layers
-- as they can, as DeepSpeed's left-to-right fill does (a weightless Flatten
-- goes with the Linear after it, not into a stage of its own). parts[s] is
-- the first layer of stage s, parts[S+1] one past the last.

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
        if v <= b then b, c = v, j end
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
-- PipeDataParallelTopology{num_pp, num_dp}: DeepSpeed's topology of axes
-- pipe and data, pipe outermost: rank = pipe * num_dp + data.

local Topology = {}
Topology.__index = Topology

function M.PipeDataParallelTopology(opts)
  local pp, dp = type(opts) == 'table' and opts.num_pp, type(opts) == 'table' and opts.num_dp
  for _, v in ipairs({ pp, dp }) do
    if type(v) ~= 'number' or v < 1 or v % 1 ~= 0 then
      error('PipeDataParallelTopology: expected {num_pp = n, num_dp = n}, positive integers', 2)
    end
  end
  return setmetatable({ num_pp = pp, num_dp = dp }, Topology)
end

function Topology:get_dim(axis)
  if axis == 'pipe' then return self.num_pp end
  if axis == 'data' then return self.num_dp end
  error(fmt("topology: no axis '%s' (pipe, data)", tostring(axis)), 2)
end

function Topology:world_size() return self.num_pp * self.num_dp end
function Topology:get_rank(pipe, data) return pipe * self.num_dp + data end
function Topology:get_coord(rank) return { pipe = math.floor(rank / self.num_dp), data = rank % self.num_dp } end

-- The ranks of a ds.topology (pipe x data x tensor) at one tensor index,
-- seen as a PipeDataParallelTopology: a pipeline of tensor-parallel stages
-- sends and reduces between the ranks of its own tensor index.
local function slice(full, t)
  local s = setmetatable({ num_pp = full:get_dim('pipe'), num_dp = full:get_dim('data'), tensor = t }, Topology)
  function s.world_size() return full:world_size() end
  function s.get_rank(_, pipe, data) return full:get_rank { pipe = pipe, data = data, tensor = t } end
  function s.get_coord(_, rank)
    local c = full:get_coord(rank)
    return { pipe = c.pipe, data = c.data }
  end
  return s
end

-- opts.topology as PipelineModule takes it: a PipeDataParallelTopology,
-- or a ds.topology with pipe, data and tensor axes (sequence 1): then the
-- slice at each tensor index, this rank's, and the tensor groups.
local function topologies(topo)
  if topo == nil or getmetatable(topo) == Topology then return topo end
  if type(topo) ~= 'table' or type(topo.group) ~= 'function' or type(topo.get_dim) ~= 'function' then
    error('PipelineModule: topology must be a ds.pipe.PipeDataParallelTopology or a ds.topology', 4)
  end
  if topo:get_dim('sequence') > 1 then
    error(fmt('PipelineModule: the topology has a sequence degree of %d; a pipeline takes pipe, data and tensor axes',
              topo:get_dim('sequence')), 4)
  end
  local slices, t = {}, topo:coord('tensor')
  for i = 0, topo:get_dim('tensor') - 1 do slices[i + 1] = slice(topo, i) end
  return slices[t + 1], { slices = slices, tensor_rank = t, full = topo }
end

------------------------------------------------------------------------
-- PipelineModule

local PipelineModule = nn.Module:extend('PipelineModule')
M.PipelineModule = PipelineModule

local OPTIONS = { layers = true, num_stages = true, topology = true, loss_fn = true, partition_method = true,
                  activation_checkpoint_interval = true, base_seed = true }

function PipelineModule:init(opts)
  if type(opts) ~= 'table' then error('PipelineModule: expected a table of options', 3) end
  for k in pairs(opts) do
    if not OPTIONS[k] then error(fmt("PipelineModule: unknown option '%s'", tostring(k)), 3) end
  end
  local layers, S = opts.layers, opts.num_stages
  local topo, tensor = topologies(opts.topology)
  if type(layers) ~= 'table' or #layers == 0 then error('PipelineModule: layers must be a non-empty list', 3) end
  if topo ~= nil then
    if S ~= nil and S ~= topo.num_pp then
      error(fmt('PipelineModule: num_stages %s and the topology\'s %d pipe stages differ', tostring(S), topo.num_pp), 3)
    end
    S = topo.num_pp
  end
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
  topo = topo or M.PipeDataParallelTopology { num_pp = S, num_dp = world / S }
  if topo:world_size() ~= world then
    error(fmt('PipelineModule: the topology has %d pipe x %d data = %d ranks, the world %d', topo.num_pp,
              topo.num_dp, topo:world_size(), world), 3)
  end
  local dp = topo.num_dp
  local coord = topo:get_coord(ds.comm.rank())
  rawset(self, 'topology', topo)
  rawset(self, 'num_stages', S)
  rawset(self, 'dp_size', dp)
  rawset(self, 'stage_id', coord.pipe)
  rawset(self, 'dp_rank', coord.data)
  rawset(self, 'dp_root', topo:get_rank(coord.pipe, 0))   -- the stage's first rank: broadcasts start there
  rawset(self, 'slices', tensor and tensor.slices or { topo })
  rawset(self, 'tensor_rank', tensor and tensor.tensor_rank or 0)
  if tensor and tensor.full:get_dim('tensor') > 1 then
    -- tensor-parallel stages: the norm sums over pipe x tensor, replicated weights count on tensor rank 0
    rawset(self, 'tensor_group', tensor.full:group('tensor'))
    rawset(self, 'model_parallel_group', tensor.full:group { 'pipe', 'tensor' })
  end
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
  -- a tied key's module is built from its first layer's seed, on every stage alike
  local key_first = {}
  for i, l in ipairs(layers) do
    if is_tied(l) and not key_first[l.key] then key_first[l.key] = i end
  end
  local first, last = parts[self.stage_id + 1], parts[self.stage_id + 2] - 1
  local funcs, mods, tied, tied_weights = {}, {}, {}, {}
  local layer_of = {}    -- mods[k]'s layer index (0-based; a tied key's: its first layer's)
  for i = first, last do
    local l = layers[i]
    if is_tied(l) then
      local mod = tied[l.key]
      if not mod then
        local spec = layers[key_first[l.key]]
        mod = build(key_first[l.key])
        tied[l.key] = mod
        mods[#mods + 1] = mod
        layer_of[#mods] = key_first[l.key] - 1
        tied_weights[l.key] = {}
        for _, path in ipairs(spec.tied_weight_attr) do
          table.insert(tied_weights[l.key], tied_tensor(spec, mod, path))
        end
      end
      local f = l.forward_fn
      funcs[#funcs + 1] = f and function(x) return f(mod, x) end or mod
    else
      if is_spec(l) then l = build(i) end
      funcs[#funcs + 1] = l
      if type(l) == 'table' and l.parameters then
        mods[#mods + 1] = l
        layer_of[#mods] = i - 1
      end
    end
  end
  ds.set_rng_state(rng)
  rawset(self, 'funcs', funcs)
  rawset(self, 'tied_modules', tied)   -- key -> this stage's module of it
  rawset(self, 'tied_weights', tied_weights)   -- key -> its tied tensors here
  rawset(self, 'layer_of', layer_of)
  rawset(self, 'num_layers', #layers)
  self.layers = nn.ModuleList(mods)
  self:_make_groups(layers)

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

-- The groups every rank makes alike (ds.comm.new_group), at each tensor
-- index (self.slices) the same: the data-parallel ranks of each stage
-- (dp_group, where the step engine reduces), the ranks of each data index
-- (pipe_group, over which the gradient norm sums), and for each tied key
-- held by several stages, the ranks of one data index on those stages
-- (tied_groups: {key, group, tensors, first: this stage is the key's
-- first, where the norm counts it}). This rank keeps its tensor index's.
function PipelineModule:_make_groups(layers)
  for t, topo in ipairs(self.slices) do self:_make_slice_groups(layers, topo, t - 1 == self.tensor_rank) end
end

function PipelineModule:_make_slice_groups(layers, topo, keep)
  local S, dp = self.num_stages, self.dp_size
  local function set(k, v) if keep then rawset(self, k, v) end end
  -- n groups, group i (0-based) of the ranks ranks_of(i); this rank's is group mine
  local function make(n, ranks_of, mine)
    local out
    for i = 0, n - 1 do
      local g = ds.comm.new_group(ranks_of(i))
      if i == mine and keep then out = g end
    end
    return out
  end
  -- the ranks of a list of stages at one data index
  local function at(stages)
    return function(d)
      local ranks = {}
      for _, s in ipairs(stages) do ranks[#ranks + 1] = topo:get_rank(s, d) end
      return ranks
    end
  end
  local function stage_ranks(s)
    local ranks = {}
    for d = 0, dp - 1 do ranks[#ranks + 1] = topo:get_rank(s, d) end
    return ranks
  end
  local all = {}
  for s = 0, S - 1 do all[#all + 1] = s end
  -- one rank per stage too: the step engine's nil group is the world
  if ds.comm.world_size() > 1 then set('dp_group', make(S, stage_ranks, self.stage_id)) end
  if S > 1 then set('pipe_group', make(dp, at(all), self.dp_rank)) end
  local keys, stages = {}, {}
  for s = 0, S - 1 do
    for i = self.parts[s + 1], self.parts[s + 2] - 1 do
      local k = is_tied(layers[i]) and layers[i].key
      if k then
        if not stages[k] then
          keys[#keys + 1] = k
          stages[k] = {}
        end
        if stages[k][#stages[k]] ~= s then stages[k][#stages[k] + 1] = s end
      end
    end
  end
  local groups = {}
  for _, k in ipairs(keys) do
    if #stages[k] > 1 then
      local g = make(dp, at(stages[k]), self.dp_rank)
      if self.tied_weights[k] then
        groups[#groups + 1] = { key = k, group = g, tensors = self.tied_weights[k],
                                first = stages[k][1] == self.stage_id }
      end
    end
  end
  set('tied_groups', groups)
end

-- DeepSpeed's allreduce_tied_weight_gradients: each tied weight's gradient
-- summed over the stages that hold it (before the data-parallel reduction).
function PipelineModule:allreduce_tied_weight_gradients()
  for _, t in ipairs(self.tied_groups) do
    for _, w in ipairs(t.tensors) do
      if not w.grad then
        error(fmt("pipeline: stage %d: the tied weight '%s' got no gradient in this batch", self.stage_id,
                  tostring(t.key)), 0)
      end
      ds.comm.all_reduce(w.grad, 'sum', t.group)
    end
  end
end

function PipelineModule:is_first_stage() return self.stage_id == 0 end
function PipelineModule:is_last_stage() return self.stage_id == self.num_stages - 1 end

-- this stage's layers, in checkpointed segments when the interval is > 0;
-- its blocks hand residual adds on to the norms after them, the stage's
-- last one added at its end
function PipelineModule:forward(x)
  return require('dslua.nn.checkpointing').sequential(self.funcs, self.activation_checkpoint_interval, x)
end

-- the layer indices (0-based, as DeepSpeed prints them) of stage s
function PipelineModule:stage_layers(s)
  return self.parts[s + 1] - 1, self.parts[s + 2] - 2
end

-- A state_dict name ('layers.2.weight', this stage's third module) as
-- checkpoints name it: by the layer's global index ('layer_05.weight', as
-- DeepSpeed's layer_05-model_states.pt), the same however the model is
-- split; a tied key's tensors by its first layer. Returns the name and
-- whether this stage owns it (holds that layer, so saves it).
function PipelineModule:checkpoint_name(name)
  local k, rest = name:match('^layers%.(%d+)%.(.+)$')
  local index = k and self.layer_of[tonumber(k) + 1]
  if not index then error(fmt("pipeline: '%s' is not a tensor of a layer of stage %d", name, self.stage_id), 0) end
  local first, last = self:stage_layers(self.stage_id)
  return fmt('layer_%02d.%s', index, rest), index >= first and index <= last
end

-- The layout a checkpoint records: stages, data-parallel ranks, and each
-- stage's first layer.
function PipelineModule:layout()
  local firsts = {}
  for s = 1, self.num_stages do firsts[s] = self.parts[s] - 1 end
  return { stages = self.num_stages, data_parallel = self.dp_size, layers = self.num_layers, firsts = firsts }
end

return M
