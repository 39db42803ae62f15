-- The zero_optimization block's checker (DeepSpeed keeps it beside ZeRO as
-- zero/config.py): the block resolved with every default, its deprecated
-- keys, what dslua does not act on, and the settings it refuses. engine/
-- zero.lua trusts what this returns and checks none of it again.
local json = require 'dslua.base.json'
local S = require 'dslua.base.schema'
local describe, join, problem, note, bool = S.describe, S.join, S.problem, S.note, S.bool
local int, num, enum, str, any = S.int, S.num, S.enum, S.str, S.any
local block, is_object, check_block = S.block, S.is_object, S.check_block

local M = {}

-- zero/offload_config.py
local DEVICES = { 'none', 'cpu', 'nvme' }
local OFFLOAD_OPTIMIZER = { auto = true, fields = {
  device = enum('none', DEVICES),
  nvme_path = str({ nullable = true }),
  buffer_count = int(4, 0),
  pin_memory = bool(false),
  pipeline_read = bool(false),
  pipeline_write = bool(false),
  fast_init = bool(false),
  ratio = num(1.0, 0, { max = 1 }),
} }
local OFFLOAD_PARAM = { auto = true, fields = {
  device = enum('none', DEVICES),
  nvme_path = str({ nullable = true }),
  buffer_count = int(5, 0),
  buffer_size = int(1e8, 0),
  max_in_cpu = int(1e9, 0),
  pin_memory = bool(false),
} }

-- zero/config.py DeepSpeedZeroConfig; stage3_* are the aliases DeepSpeed
-- documents, the resolved config uses them, the field names are accepted too.
local ZERO = { auto = true, fields = {
  stage = enum(0, { 0, 1, 2, 3 }),
  contiguous_gradients = bool(true),
  reduce_scatter = bool(true),
  reduce_bucket_size = int(5e8, 0),
  use_multi_rank_bucket_allreduce = bool(true),
  allgather_partitions = bool(true),
  allgather_bucket_size = int(5e8, 0),
  overlap_comm = bool(nil, { nullable = true }),        -- nil: stage == 3
  load_from_fp32_weights = bool(true),
  elastic_checkpoint = bool(false),
  offload_param = block(OFFLOAD_PARAM, { nullable = true }),
  offload_optimizer = block(OFFLOAD_OPTIMIZER, { nullable = true }),
  sub_group_size = int(1e9, 0),
  stage3_prefetch_bucket_size = int(5e7, 0),
  stage3_param_persistence_threshold = int(1e5, 0),
  stage3_model_persistence_threshold = int(2 ^ 63 - 1, 0),   -- sys.maxsize
  stage3_max_live_parameters = int(1e9, 0),
  stage3_max_reuse_distance = int(1e9, 0),
  stage3_gather_16bit_weights_on_model_save = bool(false),
  stage3_module_granularity_threshold = int(0),
  stage3_use_all_reduce_for_fetch_params = bool(false),
  ignore_unused_parameters = bool(true),
  legacy_stage1 = bool(false),
  round_robin_gradients = bool(false),
  zero_hpz_partition_size = int(1, 0),
  zero_quantized_weights = bool(false),
  zero_quantized_nontrainable_weights = bool(false),
  zero_quantized_gradients = bool(false),
  zeropp_loco_param = any({ nullable = true }),
  mics_shard_size = int(-1),
  mics_hierarchical_params_gather = bool(false),
  memory_efficient_linear = bool(true),
  pipeline_loading_checkpoint = bool(false),
  override_module_apply = bool(true),
  log_trace_cache_warnings = bool(false),
  zenflow = any({ nullable = true }),
  -- deprecated, mapped onto their replacements below
  cpu_offload = bool(nil, { nullable = true }),
  cpu_offload_param = bool(nil, { nullable = true }),
  cpu_offload_use_pin_memory = bool(nil, { nullable = true }),
  stage3_gather_fp16_weights_on_model_save = bool(nil, { nullable = true }),
}, aliases = {
  prefetch_bucket_size = 'stage3_prefetch_bucket_size',
  param_persistence_threshold = 'stage3_param_persistence_threshold',
  model_persistence_threshold = 'stage3_model_persistence_threshold',
  max_live_parameters = 'stage3_max_live_parameters',
  max_reuse_distance = 'stage3_max_reuse_distance',
  gather_16bit_weights_on_model_save = 'stage3_gather_16bit_weights_on_model_save',
  module_granularity_threshold = 'stage3_module_granularity_threshold',
  use_all_reduce_for_fetch_params = 'stage3_use_all_reduce_for_fetch_params',
} }

-- DeepSpeedConfigModel._process_deprecated_field: the old key sets the new
-- one, and giving both is an error.
local DEPRECATED_ZERO = {
  { 'cpu_offload', 'offload_optimizer', function(z) z.offload_optimizer.device = 'cpu' end },
  { 'cpu_offload_param', 'offload_param', function(z) z.offload_param.device = 'cpu' end },
  { 'stage3_gather_fp16_weights_on_model_save', 'stage3_gather_16bit_weights_on_model_save',
    function(z, old) z.stage3_gather_16bit_weights_on_model_save = old end },
}

-- The first of keys that the object v (as given) sets, or nil.
local function first_set(v, keys)
  for _, k in ipairs(keys) do
    if is_object(v) and v[k] ~= nil then return k end
  end
end

-- Settings DeepSpeed acts on and dslua does not (noted when set): the key
-- (or a function of the resolved block z and the block as given, g,
-- giving the key set, nil when none is), and what dslua does instead.
local ZERO_INERT = {
  { function(z) return z.offload_param.device ~= 'none' and z.stage ~= 3 and 'offload_param' end,
    'read at stage 3 only (as DeepSpeed): the parameters stay whole on the device' },
  { function(z, g)
      local k = z.stage == 3 and first_set(g.offload_param, { 'buffer_count', 'buffer_size', 'max_in_cpu' })
      return k and 'offload_param.' .. k
    end,
    'dslua reads each shard into a buffer of its own as its module gathers it: buffer_count, buffer_size and '
    .. 'max_in_cpu do not apply' },
  { function(z) return z.zero_quantized_weights and 'zero_quantized_weights' end,
    'ZeRO++ quantized weights are not in dslua: parameters are gathered in the compute dtype' },
  { function(z) return z.zero_quantized_nontrainable_weights and 'zero_quantized_nontrainable_weights' end,
    'ZeRO++ quantized frozen weights are not in dslua: they are kept in the compute dtype' },
  { function(z) return z.zero_quantized_gradients and 'zero_quantized_gradients' end,
    'ZeRO++ quantized gradients are not in dslua: gradients travel in communication_data_type' },
  { function(z) return z.zero_hpz_partition_size > 1 and 'zero_hpz_partition_size' end,
    'ZeRO++ hierarchical partitioning is not in dslua: parameters are gathered across every rank' },
  { function(z) return z.mics_shard_size > 0 and 'mics_shard_size' end,
    'MiCS is not in dslua: shards span every rank' },
  { function(z) return z.zenflow ~= nil and 'zenflow' end,
    'ZenFlow is not in dslua: every parameter is stepped at every step (no top-k selection, no deferred updates)' },
  -- what dslua always does, noted where a config asks otherwise
  { function(_, g) return g.overlap_comm == false and 'overlap_comm' end,
    'dslua launches each bucket\'s reduction while backward runs whatever it says (the same gradients)' },
  { function(z) return not z.contiguous_gradients and 'contiguous_gradients' end,
    'dslua always copies gradients into one flat buffer per group as they complete' },
  { function(z) return not z.reduce_scatter and 'reduce_scatter' end,
    'dslua reduce-scatters the gradients from stage 1 whatever it says (the same gradients)' },
  { function(z) return not z.allgather_partitions and 'allgather_partitions' end,
    'dslua all-gathers the updated parameters from stage 1 whatever it says (the same parameters)' },
  { function(_, g) return g.allgather_bucket_size ~= nil and 'allgather_bucket_size' end,
    'dslua all-gathers the updated parameters in the buckets of reduce_bucket_size' },
  { function(z) return not z.memory_efficient_linear and 'memory_efficient_linear' end,
    'dslua\'s linear layers keep no gathered stage 3 weight for backward whatever it says (backward gathers it again)' },
  { function(z, g)
      for _, name in ipairs({ 'offload_optimizer', 'offload_param' }) do
        if is_object(g[name]) and g[name].pin_memory ~= nil then return name .. '.pin_memory' end
      end
    end,
    'not acted on: dslua page-locks the host memory it offloads to from a GPU whatever it says' },
}

local function check_zero(ctx, path, v)
  if type(v) == 'boolean' then        -- read_zero_config_deprecated
    note(ctx, path, 'true/false is DeepSpeed\'s deprecated form, read as {"stage": ' .. (v and 1 or 0) .. '}')
    v = { stage = v and 1 or 0 }
  elseif v == json.null then
    v = nil
  elseif v ~= nil and not is_object(v) then
    problem(ctx, path, 'must be an object, got ' .. describe(v))
    v = nil
  end
  local z, given = check_block(ctx, path, v, ZERO)
  for _, name in ipairs({ 'offload_param', 'offload_optimizer' }) do   -- None reads as device "none"
    if z[name] == nil then z[name] = check_block(ctx, join(path, name), nil, ZERO.fields[name].schema) end
  end
  for _, d in ipairs(DEPRECATED_ZERO) do
    local old, new, apply = d[1], d[2], d[3]
    if given[old] then
      if given[new] then
        problem(ctx, join(path, old), string.format(
          "Cannot provide deprecated parameter '%s' and replacing parameter '%s' together", old, new))
      else
        note(ctx, join(path, old), "deprecated, use '" .. new .. "' instead")
        if z[old] then apply(z, z[old]) end
      end
    end
    z[old] = nil
  end
  if given.cpu_offload_use_pin_memory then
    note(ctx, join(path, 'cpu_offload_use_pin_memory'),
         "deprecated and ignored, use 'pin_memory' of offload_param or offload_optimizer")
  end
  z.cpu_offload_use_pin_memory = nil
  for _, name in ipairs({ 'offload_param', 'offload_optimizer' }) do
    if z[name].device == 'nvme' and z[name].nvme_path == nil then
      problem(ctx, join(join(path, name), 'nvme_path'), 'missing: required when device is "nvme"')
    elseif z[name].device == 'nvme' and z[name].nvme_path == '' then
      problem(ctx, join(join(path, name), 'nvme_path'), 'must name a directory when device is "nvme", got ""')
    end
  end
  if z.overlap_comm == nil then z.overlap_comm = z.stage == 3 end
  for _, inert in ipairs(ZERO_INERT) do
    local key = inert[1](z, is_object(v) and v or {})
    if key then note(ctx, join(path, key), inert[2]) end
  end
  if z.offload_optimizer.ratio < 1 and z.stage ~= 3 then
    problem(ctx, join(path, 'offload_optimizer.ratio'), 'Partial offloading only supported for ZeRO Stage 3.')
  end
  return z
end

M.check = check_zero

return M
