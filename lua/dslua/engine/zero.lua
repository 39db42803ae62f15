-- Mixed precision and ZeRO stages 1, 2 and 3 behind the engine: the
-- partitioned optimizer (DeepSpeed's zero_optimization, bf16 and fp16)
-- over the C step engine (core/train/ds_zero.h, which says how the
-- parameters are cut into shards, bucketed, reduced and refreshed).
--
-- Lua decides and C moves the bytes: this file converts the model to its
-- compute dtype, builds the optimizer over the engine's fp32 masters (it
-- adopts them and their gradients: one copy of each) or the nvme-streamed
-- one, installs stage 3's module hooks, and reports what each rank holds.
-- dslua/engine/step.lua drives backward and step, one call into C each,
-- for this and the flat mode alike.
local ds = require 'dslua'
local Z0 = require('dslua.core')._zero
local zinit = require 'dslua.engine.zinit'

local M = {}

local Zero = {}
Zero.__index = Zero

local DTYPES = { fp32 = 'f32', float32 = 'f32', fp16 = 'f16', float16 = 'f16', half = 'f16', bf16 = 'bf16',
                 bfloat16 = 'bf16' }

local function pack(...) return { n = select('#', ...), ... } end

-- "1,543,714,304"
local function commas(n)
  local s = string.format('%d', n)
  local out = s:reverse():gsub('(%d%d%d)', '%1,'):reverse()
  return (out:gsub('^,', ''))
end
M.commas = commas

-- Is the zero path needed for this config? (stage 0 in fp32 is plain DDP)
function M.wanted(cfg)
  return cfg.zero_optimization.stage > 0 or cfg.bf16.enabled or cfg.fp16.enabled
end

function M.model_dtype(cfg)
  if cfg.bf16.enabled then return 'bf16' end
  if cfg.fp16.enabled then return 'f16' end
  return 'f32'
end

-- Param groups as the engine got them: a list of tensors, or a list of
-- {params = ..., <options>} tables; only tensors needing grad count.
local function normalize_groups(params)
  local groups = {}
  if type(params[1]) == 'table' and not ds.is_tensor(params[1]) then
    for i, g in ipairs(params) do
      local c = {}
      for k, v in pairs(g) do if k ~= 'params' then c[k] = v end end
      c.params = {}
      local list = ds.is_tensor(g.params) and { g.params } or g.params
      if type(list) ~= 'table' then error(string.format('initialize: param group %d has no params list', i), 4) end
      for _, p in ipairs(list) do
        if p.requires_grad then c.params[#c.params + 1] = p end
      end
      if #c.params > 0 then groups[#groups + 1] = c end
    end
  else
    local c = { params = {} }
    for _, p in ipairs(params) do
      if p.requires_grad then c.params[#c.params + 1] = p end
    end
    groups[1] = c
  end
  if #groups == 0 then error('initialize: no parameter requires grad', 4) end
  return groups
end

-- The engine's options from the config's zero_optimization block.
function M.engine_options(cfg, extra)
  local zc = cfg.zero_optimization
  local o = {
    stage = zc.stage, bucket_size = zc.reduce_bucket_size,
    persistence_threshold = zc.stage3_param_persistence_threshold,
    prefetch_bucket_size = zc.stage3_prefetch_bucket_size, max_live_parameters = zc.stage3_max_live_parameters,
    max_reuse_distance = zc.stage3_max_reuse_distance,
  }
  for k, v in pairs(extra) do o[k] = v end
  return o
end

---------------------------------------------------------------- building

-- opts: model, params (model_parameters or model:parameters()), cfg, rank,
-- world_size, device, build_optimizer(groups) -> optimizer
function M.new(opts)
  local cfg = opts.cfg
  local zc = cfg.zero_optimization
  local z = setmetatable({
    stage = zc.stage, rank = opts.rank, world_size = opts.world_size,
    dtype = M.model_dtype(cfg), model = opts.model, cfg = cfg,
  }, Zero)
  local comm_dtype = cfg.communication_data_type and DTYPES[cfg.communication_data_type] or z.dtype
  z.groups = normalize_groups(opts.params)

  -- names for messages and state dicts
  local names = {}
  for _, e in ipairs(opts.model:named_parameters()) do names[e[2]] = e[1] end

  -- parameters built partitioned (ds.zero.Init): their shards, by engine
  -- index below; the parameters themselves have no data to convert
  local shards = {}
  for _, p in ipairs(opts.model:parameters()) do
    if zinit.partitioned(p) then
      if z.stage ~= 3 then
        error(string.format("initialize: parameter '%s' was built partitioned (ds.zero.Init), which needs "
                            .. 'zero_optimization.stage 3, not %d', names[p] or '?', z.stage), 3)
      end
      local threshold = zc.stage3_param_persistence_threshold
      if p:numel() <= threshold then
        error(string.format("initialize: parameter '%s' was built partitioned (ds.zero.Init) but its %d elements "
                            .. 'are within stage3_param_persistence_threshold %d, which keeps it whole: give '
                            .. 'ds.zero.Init and initialize one config', names[p] or '?', p:numel(), threshold), 3)
      end
      shards[p] = zinit.take(p)
    end
  end

  -- the model in its compute dtype, converted in place so every list of
  -- its tensors stays valid
  ds.no_grad(function()
    for _, t in pairs(shards) do
      if t:dtype() ~= z.dtype then Z0.retype(t, z.dtype) end
    end
    for _, m in ipairs(opts.model:modules()) do
      for _, list in ipairs({ m:named_parameters(), m:named_buffers() }) do
        for _, e in ipairs(list) do
          local t, dt = e[2], e[2]:dtype()
          if dt ~= z.dtype and shards[t] then
            Z0.retype(t, z.dtype, true)
          elseif dt ~= z.dtype and (dt == 'f32' or dt == 'f64' or dt == 'bf16' or dt == 'f16') then
            Z0.retype(t, z.dtype)
          end
        end
      end
    end
  end)

  -- every parameter once, with its place in the engine (1-based, groups back to back)
  z.all_params, z.index, z.names = {}, {}, {}
  local lists = {}
  for gi, g in ipairs(z.groups) do
    lists[gi] = g.params
    for k, p in ipairs(g.params) do
      if z.index[p] then error(string.format("initialize: parameter '%s' is in two param groups", names[p] or '?'), 3) end
      z.all_params[#z.all_params + 1] = p
      z.index[p] = #z.all_params
      z.names[#z.all_params] = names[p] or string.format('group %d param %d', gi, k)
    end
  end
  local by_index = {}
  for p, t in pairs(shards) do
    if not z.index[p] then
      error(string.format("initialize: parameter '%s' was built partitioned but is not trained (not in the "
                          .. 'param groups): stage 3 can only gather what it trains', names[p] or '?'), 3)
    end
    by_index[z.index[p]] = t
  end
  local off = zc.offload_optimizer
  z.offload = off and off.device or 'none'
  -- ZeRO-Offload: from a GPU the masters, their gradients and the
  -- optimizer state live in host memory and the step runs on the CPU
  local master_device = z.offload ~= 'none' and 'cpu' or (opts.device or 'cpu')
  z.engine = Z0.engine(M.engine_options(cfg, { masters = true, comm_dtype = comm_dtype, master_device = master_device,
                                               groups = lists, group = opts.model.dp_group,
                                               stages = opts.model.model_parallel_group or opts.model.pipe_group,
                                               shards = by_index }))
  z.parts = z.engine:parts()       -- the shards each parameter is cut into, as the engine cut them
  z:_build_optimizer(opts)
  if z.stage == 3 then
    z:_offload_params(zc.offload_param)
    z:_install_hooks()
  end
  -- the test hook of CPU ranks: cpu offload's pipeline and loads as from a
  -- GPU, copies made on the host when waited for, chunks of the value
  local chunk = tonumber(os.getenv('DSLUA_TEST_OFFLOAD_CPU') or '')
  if chunk and chunk >= 1 and (z.offload == 'cpu' or z.param_offload == 'cpu')
     and tostring(opts.device or 'cpu') == 'cpu' then
    z.engine:offload_on_host(chunk)
  end
  return z
end

-- offload_param: stage 3's shards in host memory, or in
-- <nvme_path>/rank<r>/params.bin (read for each gather)
function Zero:_offload_params(op)
  if op.device == 'none' then return end
  self.param_offload = op.device
  local file
  if op.device == 'nvme' then
    local dir = string.format('%s/rank%d', op.nvme_path, self.rank)
    local ok, err = require('dslua.core').aio.mkdir(dir)
    if not ok then error('config: zero_optimization.offload_param.nvme_path: ' .. err, 4) end
    file = dir .. '/params.bin'
  end
  local ok, err = pcall(self.engine.offload_params, self.engine, file)
  if not ok then error('config: zero_optimization.offload_param: ' .. tostring(err), 4) end
end

function Zero:_build_optimizer(opts)
  local groups = {}
  for gi, g in ipairs(self.groups) do
    local c = {}
    for k, v in pairs(g) do if k ~= 'params' then c[k] = v end end
    c.params = { self.engine:master(gi) }
    groups[gi] = c
  end
  local o = opts.build_optimizer(groups)
  if self.offload == 'nvme' then
    -- the optimizer's kind and hyperparameters stream through files; the
    -- in-memory one built here only said what they are
    local off = self.cfg.zero_optimization.offload_optimizer
    local path = off.nvme_path     -- a directory: ds.config refuses a missing or empty one
    local specs = {}
    for gi, g in ipairs(o.param_groups) do
      local s = {}
      for k, v in pairs(g) do if k ~= 'params' then s[k] = v end end
      s.numel = groups[gi].params[1]:numel()
      s.init = groups[gi].params[1]
      specs[gi] = s
    end
    self.optimizer = require('dslua.engine.nvme').optimizer {
      name = o.name, groups = specs, path = path, rank = self.rank,
      sub_group_size = self.cfg.zero_optimization.sub_group_size, buffer_count = off.buffer_count,
    }
    groups, specs, o = nil, nil, nil
    self.engine:stream()
    collectgarbage()
    return
  end
  self.optimizer = o
  self.engine:attach(o)
end

---------------------------------------------------------------- stage 3: module hooks

-- The forward of every module with partitioned parameters of its own
-- gathers them (and prefetches the next modules along the first
-- forward's order) and releases them after; any other read of a released
-- parameter gathers it through the engine's fetch hook.
function Zero:_install_hooks()
  local engine = self.engine
  self.hooked = {}
  for _, m in ipairs(self.model:modules()) do
    local own = {}
    for _, k in ipairs(rawget(m, '_params')) do
      local p = rawget(m, k)
      if p ~= nil and self.index[p] then own[#own + 1] = self.index[p] end
    end
    local id = #own > 0 and engine:add_module(own) or nil
    if id then
      local forward = m.forward
      rawset(m, 'forward', function(mod, ...)
        engine:pre_forward(id)
        local out = pack(forward(mod, ...))
        engine:post_forward(id)
        return unpack(out, 1, out.n)
      end)
      self.hooked[#self.hooked + 1] = m
    end
  end
end

---------------------------------------------------------------- step

-- The boundary's step: average, overflow check (fp16), unscale and clip,
-- the optimizer (or the nvme-streamed one) and the refresh. Returns
-- overflow, grad_norm (unscaled).
function Zero:step(loss_scale, clip, check_overflow)
  local streamed = self.offload == 'nvme'
  local overflow, norm = self.engine:step(not streamed and self.optimizer.param_groups or nil, loss_scale,
                                          clip or 0, check_overflow)
  if streamed and not overflow then
    local grads, out = {}, {}
    for gi = 1, #self.groups do
      grads[gi] = self.engine:master_grad(gi)
      out[gi] = ds.zeros({ grads[gi]:numel() }, 'f32'):set_category('master_weights')
    end
    self.optimizer:step(grads, out)
    self.engine:refresh(out)
  end
  return overflow, norm
end

-- Stage 3: the module hooks go; parameters stay as they are (released
-- ones keep their shapes, without data).
function Zero:close()
  for _, m in ipairs(self.hooked or {}) do rawset(m, 'forward', nil) end
  self.hooked = nil
  self.engine:close()
end

---------------------------------------------------------------- checkpoints

-- Elements per rank of parameter i's shard (padded; the whole parameter
-- when one rank holds it).
function Zero:shard(i) return self.engine:shard(i) end

-- Param group g's fp32 master shard, flat: checkpoints read and write it
-- in place.
function Zero:master(g) return self.engine:master(g) end

-- The masters were loaded: the parameters take them. masters (the fp32
-- shards by group) is for the nvme offload, whose masters live in its
-- files; otherwise the engine's own master buffers were written. Stage 3
-- writes the shards: a parameter gathered before (read outside a forward)
-- is released, or it would keep the old values through the next forward.
function Zero:masters_loaded(masters)
  if masters then self.engine:refresh(masters) else self.engine:sync_params() end
  if self.stage == 3 then self.engine:release_all() end
end

-- Calls fn with every parameter whole (stage 3 gathers them; every rank
-- must call it) and releases them again, also when fn fails. -> pcall's.
function Zero:with_gathered(fn)
  if self.stage == 3 then self.engine:gather_all() end
  local res = pack(pcall(fn))
  if self.stage == 3 then self.engine:release_all() end
  return unpack(res, 1, res.n)
end

---------------------------------------------------------------- reports

-- Elements of shard r of parameter i (1-based) that exist.
function Zero:_shard_len(i, r)
  local numel, shard = self.all_params[i]:numel(), self.engine:shard(i)
  return math.max(0, math.min(numel - r * shard, shard))
end

-- What rank r holds, in parameters' elements (padding excluded).
function Zero:holdings(r)
  local total, mine = 0, 0
  for i, p in ipairs(self.all_params) do
    total = total + p:numel()
    mine = mine + (self.parts == 1 and p:numel() or self:_shard_len(i, r))
  end
  return mine, total
end

-- DeepSpeed-style lines, printed by rank 0: what each rank holds.
function Zero:describe()
  local lines = {}
  for r = 0, self.world_size - 1 do
    local mine, total = self:holdings(r)
    local parts = { string.format('ZeRO stage %d | rank %d | optimizer holds %s of %s parameters', self.stage, r,
                                  commas(mine), commas(total)) }
    if self.stage >= 2 then parts[#parts + 1] = string.format('gradients hold %s', commas(mine)) end
    if self.stage >= 3 then
      local held = 0
      for i, p in ipairs(self.all_params) do
        held = held + (self.engine:persistent(i) and p:numel() or self:_shard_len(i, r))
      end
      parts[#parts + 1] = string.format('parameters hold %s', commas(held))
    end
    if self.dtype ~= 'f32' then parts[#parts + 1] = string.format('%s compute, fp32 master', self.dtype) end
    if self.offload ~= 'none' then parts[#parts + 1] = 'optimizer offload ' .. self.offload end
    if self.param_offload then parts[#parts + 1] = 'parameter offload ' .. self.param_offload end
    lines[#lines + 1] = table.concat(parts, ' | ')
  end
  return lines
end

-- Every parameter whole, as a state dict of model-dtype tensors (stage 3
-- gathers them; every rank must call it).
function Zero:gathered_parameters()
  local out = {}
  local ok, err = self:with_gathered(function()
    for i, p in ipairs(self.all_params) do out[self.names[i]] = p:clone() end
  end)
  if not ok then error(err, 0) end
  return out
end

return M
