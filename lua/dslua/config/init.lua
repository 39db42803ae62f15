-- ds.config: a DeepSpeed ds_config.json read with the meaning DeepSpeed's
-- code gives it (deepspeed/runtime/config.py, constants.py, the pydantic
-- models of precision_config.py, zero/config.py, zero/offload_config.py,
-- comm/config.py), every default filled in under DeepSpeed's key names.
-- Every problem is collected, each naming the file and the key path, and
-- reported at once. dslua's own blocks (M.extension_keys) pass through.
local json = require 'dslua.base.json'
local suggest = require 'dslua.base.suggest'
local file = require 'dslua.base.file'

local M = {}

-- dslua's own top-level blocks, DeepSpeed does not use them: accepted and
-- passed through as given (the issues that give them meaning validate them).
M.extension_keys = { 'sampler', 'reload', 'hooks' }

-- DeepSpeed top-level keys for I/O tuning, autotuning and CUDA
-- knobs that dslua accepts and does not act on (a note says so).
M.ignored_keys = {
  'aio', 'autotuning',
  'data_types', 'dataloader_drop_last', 'disable_allgather',
  'memory_breakdown', 'sparse_gradients', 'vocabulary_size',
  'zero_allow_untested_optimizer', 'zero_force_ds_cpu_optimizer',
}

-- DeepSpeed features dslua does not implement: accepted only switched off.
M.unsupported_keys = {
  'amp', 'curriculum_learning', 'eigenvalue', 'elasticity',
  'hybrid_engine', 'progressive_layer_drop', 'quantize_training',
  'torch_autocast',
}

-- Blocks DeepSpeed's engine only stores for code outside it to read:
-- accepted as they are, with what dslua does instead.
M.stored_keys = {
  sparse_attention = "DeepSpeed's engine only stores it for models built on its sparse attention kernels; "
    .. "dslua's attention is dense",
  weight_quantization = "DeepSpeed reads it to quantize weights for ZeRO-Inference; dslua keeps weights in the "
    .. 'compute dtype',
}

-- DeepSpeed libraries dslua does not have yet (later work), by what they
-- are: refused while anything in them is enabled.
M.later_work = {
  compression_training = "DeepSpeed's model compression library (quantization-aware training, pruning of "
    .. 'weights, attention heads, rows and channels, layer reduction)',
  data_efficiency = "DeepSpeed's data efficiency library (curriculum data sampling, random layerwise token "
    .. 'dropping)',
}

------------------------------------------------------------------------
-- Messages

local function describe(v)
  local t = type(v)
  if v == json.null then return 'null' end
  if t == 'string' then return json.encode(v) end
  if t == 'number' then return json.number(v) or tostring(v) end
  if t == 'boolean' then return tostring(v) end
  if t == 'table' then
    return (json.is_array(v) or (#v > 0 and next(v, #v) == nil)) and 'a list' or 'an object'
  end
  return 'a ' .. t
end

-- A resolved value as JSON writes it.
local function describe_value(v)
  if type(v) == 'table' then return json.encode(json.array({ unpack(v) })) end
  return json.encode(v)
end

-- A key in a path: as it is, or quoted when it would not show (empty, or
-- with control bytes), or cut with its length when long.
local function join(path, key)
  if type(key) == 'number' then return path .. '[' .. key .. ']' end
  if #key > 64 then
    return string.format('%s[%s... (%d bytes)]', path, json.encode(key:sub(1, 40)):sub(1, -2), #key)
  end
  if key == '' or key:find('[%z\1-\31\127]') then return path .. '[' .. json.encode(key) .. ']' end
  return path == '' and key or path .. '.' .. key
end

local function unknown(word, candidates, what)
  local s = suggest.did_you_mean(word, candidates)
  local msg = 'unknown ' .. (what and what .. ' ' .. describe(word) or 'key')
  if s then return msg .. ', ' .. s end
  if #candidates <= 12 then
    local sorted = { unpack(candidates) }
    table.sort(sorted)
    return msg .. ' (expected one of: ' .. table.concat(sorted, ', ') .. ')'
  end
  return msg
end

local function problem(ctx, path, msg)
  ctx.problems[#ctx.problems + 1] = { path = path, msg = msg }
  ctx.bad[path] = true
end

local function note(ctx, path, msg, kind)
  ctx.notes[#ctx.notes + 1] = { path = path, msg = msg, kind = kind }
end

------------------------------------------------------------------------
-- Fields: a kind, a default, and the checks DeepSpeed's types imply

local function field(kind, default, opts)
  local f = opts or {}
  f.kind, f.default = kind, default
  return f
end
local function bool(default, opts) return field('bool', default, opts) end
local function int(default, min, opts)
  local f = field('int', default, opts)
  f.min = min
  return f
end
local function num(default, min, opts)
  local f = field('num', default, opts)
  f.min = f.min or min
  return f
end
local function enum(default, values, opts)
  local f = field('enum', default, opts)
  f.values = values
  return f
end
local function str(opts) return field('str', nil, opts) end
local function strlist() return field('strlist', function() return json.array({}) end) end
local function any(opts) return field('any', nil, opts) end
local function block(schema, opts)
  local f = field('block', nil, opts)
  f.schema = schema
  return f
end

local function is_list(v)
  if type(v) ~= 'table' then return false end
  if json.is_array(v) then return true end
  return next(v) == nil or (#v > 0 and next(v, #v) == nil)
end

local function is_object(v)
  return type(v) == 'table' and not json.is_array(v) and (next(v) == nil or #v == 0)
end

local function copy(v)
  if type(v) ~= 'table' then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = copy(x) end
  return setmetatable(c, getmetatable(v))
end

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

local function in_range(ctx, path, v, f)
  local lo, hi, above = f.min, f.max, f.above
  local bad = (lo and v < lo) or (hi and v > hi) or (above and v <= above)
  if not bad then return v end
  local want
  if f.range_msg then want = f.range_msg
  elseif lo and hi then want = string.format('must be between %s and %s', json.number(lo), json.number(hi))
  elseif above then want = 'must be > ' .. json.number(above)
  elseif lo == 1 and f.kind == 'int' then want = 'must be a positive integer'
  elseif lo then want = 'must be >= ' .. json.number(lo)
  else want = 'must be <= ' .. json.number(hi) end
  problem(ctx, path, want .. ', got ' .. describe(v))
end

local check_block

-- The checked value, or nil after recording a problem.
local function check_value(ctx, path, v, f)
  local k = f.kind
  if k == 'bool' then
    if type(v) == 'boolean' then return v end
    problem(ctx, path, 'must be true or false, got ' .. describe(v))
  elseif k == 'int' then
    -- past 2^63 a whole double is no integer C can hold (1e308); 2^63 itself
    -- is how JSON's 9223372036854775807 (Python's sys.maxsize) reads
    if finite(v) and v == math.floor(v) and v >= -2 ^ 63 and v <= 2 ^ 63 then return in_range(ctx, path, v, f) end
    problem(ctx, path, 'must be an integer' .. (finite(v) and v == math.floor(v)
            and ' between -2^63 and 2^63 - 1' or '') .. ', got ' .. describe(v))
  elseif k == 'num' then
    if finite(v) then return in_range(ctx, path, v, f) end
    problem(ctx, path, 'must be a number, got ' .. describe(v))
  elseif k == 'numlist' then    -- a number, or one per parameter group
    if finite(v) then return in_range(ctx, path, v, f) end
    if is_list(v) and #v > 0 then
      local out = json.array({})
      for i, x in ipairs(v) do
        if not finite(x) then
          return problem(ctx, join(path, i - 1), 'must be a number, got ' .. describe(x))
        end
        out[i] = in_range(ctx, join(path, i - 1), x, f)
      end
      return out
    end
    problem(ctx, path, 'must be a number or a list of numbers (one per parameter group), got ' .. describe(v))
  elseif k == 'betas' then
    if is_list(v) and #v == 2 and finite(v[1]) and finite(v[2]) then
      for i = 1, 2 do
        if v[i] < 0 or v[i] >= 1 then
          return problem(ctx, path, string.format('Invalid beta parameter at index %d: %s (must be in [0, 1))',
                                                  i - 1, json.number(v[i])))
        end
      end
      return json.array({ v[1], v[2] })
    end
    problem(ctx, path, 'must be a list of two numbers [beta1, beta2], got ' .. describe(v))
  elseif k == 'enum' then
    for _, x in ipairs(f.values) do
      if v == x then return v end
    end
    local shown = {}
    for i, x in ipairs(f.values) do shown[i] = describe(x) end
    local msg = 'must be ' .. table.concat(shown, ', ', 1, #shown - 1) .. ' or ' .. shown[#shown]
                .. ', got ' .. describe(v)
    if type(v) == 'string' then
      local s = suggest.did_you_mean(v, f.values)
      if s then msg = msg .. ', ' .. s end
    end
    problem(ctx, path, msg)
  elseif k == 'str' then
    if type(v) == 'string' then return v end
    problem(ctx, path, 'must be a string, got ' .. describe(v))
  elseif k == 'strlist' then
    if is_list(v) then
      local out = json.array({})
      for i, x in ipairs(v) do
        if type(x) ~= 'string' then
          return problem(ctx, join(path, i - 1), 'must be a string, got ' .. describe(x))
        end
        out[i] = x
      end
      return out
    end
    problem(ctx, path, 'must be a list of strings, got ' .. describe(v))
  elseif k == 'object' then
    if is_object(v) then return copy(v) end
    problem(ctx, path, 'must be an object, got ' .. describe(v))
  elseif k == 'any' then
    return copy(v)
  elseif k == 'block' then
    if v == json.null or is_object(v) then return (check_block(ctx, path, v ~= json.null and v or nil, f.schema)) end
    problem(ctx, path, 'must be an object, got ' .. describe(v))
  elseif k == 'custom' then
    return f.check(ctx, path, v)
  end
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

-- Checks the object v (nil: absent) against schema = {fields = {name =
-- field}, aliases = {other_name = name}, auto = true for DeepSpeed's
-- pydantic models (they drop "auto" values, left for Hugging Face to fill;
-- a field's own auto = true does the same for it; resolve_autos fills them),
-- Unknown keys of a block weighed against its names (edit distances) one
-- by one; past them a runaway config (200,000 keys) costs no more, and one
-- line counts the rest.
local UNKNOWN_MAX = 100

-- The names of a block's fields and their aliases.
local function block_names(schema)
  local names = {}
  for n in pairs(schema.fields) do names[#names + 1] = n end
  for a in pairs(schema.aliases or {}) do names[#names + 1] = a end
  return names
end

-- The line for a block's unknown keys past UNKNOWN_MAX: a warning where
-- DeepSpeed ignores them, else a problem.
local function unknown_rest(ctx, path, schema, n)
  if n <= 0 then return end
  local what = string.format('%d more unknown keys', n)
  if schema.lenient then
    note(ctx, path, what .. ', ignored (as DeepSpeed ignores them) and not weighed as near misses of known keys',
         'warning')
  else
    problem(ctx, path, what)
  end
end

-- nofill = true to keep only the given keys, open = true to pass unknown keys
-- through, lenient = true to warn of unknown keys that are no near miss
-- of a known one}. Returns the resolved table and {name = the key given}.
check_block = function(ctx, path, v, schema)
  local out, given = {}, {}
  local fields, aliases = schema.fields, schema.aliases or {}
  local names, unknowns = nil, 0
  v = v or {}
  for _, key in ipairs(sorted_keys(v)) do
    local x, kp = v[key], join(path, tostring(key))
    local name = aliases[key] or key
    local f = type(key) == 'string' and fields[name]
    if type(key) ~= 'string' then
      problem(ctx, kp, 'keys must be strings, got ' .. describe(key))
    elseif not f and schema.open then
      out[key] = copy(x)
    elseif not f and unknowns >= UNKNOWN_MAX then
      unknowns = unknowns + 1           -- counted, not weighed: unknown_rest
    elseif not f then
      unknowns = unknowns + 1
      names = names or block_names(schema)
      if schema.lenient and not suggest.nearest(key, names) then
        -- DeepSpeed reads such a block key by key and never sees the rest
        note(ctx, kp, string.format("unknown key, ignored (as DeepSpeed ignores it); the nearest known key is '%s'",
                                    suggest.closest(key, names)), 'warning')
      else
        problem(ctx, kp, unknown(key, names))
      end
    elseif given[name] then
      problem(ctx, kp, string.format("give only one of '%s' and '%s'", given[name], key))
    else
      given[name] = key
      if (schema.auto or f.auto) and x == 'auto' then
        ctx.autos[#ctx.autos + 1] = { path = kp, key = join(path, name), block = out, name = name }
      elseif not (x == json.null and f.nullable) then
        out[name] = check_value(ctx, kp, x, f)
      end
    end
  end
  unknown_rest(ctx, path, schema, unknowns - UNKNOWN_MAX)
  for _, name in ipairs(sorted_keys(fields)) do
    local f = fields[name]
    if f.required and given[name] == nil and not ctx.bad[join(path, name)] then
      problem(ctx, join(path, name), 'missing: required' .. (schema.what and ' by ' .. schema.what or ''))
    end
    if out[name] == nil and not schema.nofill then
      if f.kind == 'block' and not f.nullable then out[name] = check_block(ctx, join(path, name), nil, f.schema)
      elseif f.kind == 'custom' and f.fill then out[name] = f.check(ctx, join(path, name), nil)
      elseif type(f.default) == 'function' then out[name] = f.default()   -- a fresh table
      else out[name] = f.default end
    end
  end
  return out, given
end

------------------------------------------------------------------------
-- The blocks, as DeepSpeed's config classes define them

-- precision_config.py DeepSpeedFP16Config
local FP16 = { auto = true, fields = {
  enabled = bool(false),
  auto_cast = bool(false),
  loss_scale = num(0, 0, { range_msg = 'must be >= 0 (0 enables dynamic loss scaling)' }),
  initial_scale_power = int(16, 0),
  loss_scale_window = int(1000, 1),
  hysteresis = int(2, 1),
  consecutive_hysteresis = bool(false),
  min_loss_scale = int(1, 0),
  fp16_master_weights_and_grads = bool(false),
} }

-- precision_config.py DeepSpeedBF16Config
local BF16 = { auto = true, fields = {
  enabled = bool(false),
  immediate_grad_update = bool(false),
  check_grad_overflow = bool(false),
  bf16_master_weights_and_grads = bool(false),
  bf16_optimizer_states = bool(false),
} }

-- comm/config.py CommsLoggerConfig, comm/constants.py defaults
local COMMS = { fields = {
  enabled = bool(false),
  verbose = bool(false),
  prof_all = bool(true),
  debug = bool(false),
  prof_ops = strlist(),
} }

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
    'not acted on: dslua keeps offloaded shards in ordinary (pageable) host memory' },
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

-- params without their "auto" values, each resolved by fill(k) -> value,
-- how (noted), or nil, why not (a problem naming the key).
local function resolve_param_autos(ctx, path, params, fill)
  local out = {}
  for k, x in pairs(params) do
    if x ~= 'auto' then
      out[k] = x
    else
      local v, how = fill(k)
      if v ~= nil then
        note(ctx, join(path, k), '"auto" resolved to ' .. describe_value(v) .. ' (' .. how .. ')')
        out[k] = copy(v)
      else
        problem(ctx, join(path, k), how)
      end
    end
  end
  return out
end

-- "auto" optimizer params, as Hugging Face fills lr, betas, eps and
-- weight_decay from its arguments: from the optimizer passed to initialize
-- (ctx.given.optimizer, its first param group), else the value the block
-- would get without the key.
local function optimizer_auto(ctx, kind)
  return function(k)
    local from = ctx.given.optimizer
    if from and from[k] ~= nil then return from[k], 'from the optimizer passed to initialize' end
    local v = require('dslua.optim').config_default(kind, k)
    if v == nil then return nil, '"auto": nothing passed to initialize sets it and it has no default; give a value' end
    return v, ctx.given.optimizer_function and 'the default; the optimizer function passed to initialize builds '
                                                .. 'what steps, not this block'
                                            or "the optimizer's default: no optimizer passed to initialize sets it"
  end
end

-- Parameter names per optimizer: the keyword arguments of what DeepSpeed's
-- engine._configure_basic_optimizer builds for the type (FusedAdam,
-- torch.optim.SGD and Adagrad, FusedLamb, FusedLion), as dslua implements them.
local lr, wd, eps = num(nil, 0), num(nil, 0), num(nil, 0)
local betas = field('betas')
local ADAM = { nofill = true, fields = {
  lr = lr, betas = betas, eps = eps, weight_decay = wd, bias_correction = bool(), amsgrad = bool(),
  adam_w_mode = bool(), torch_adam = bool(), set_grad_none = bool(),
} }
local OPTIMIZERS = {
  adam = { name = 'Adam', schema = ADAM },
  adamw = { name = 'AdamW', schema = ADAM },
  sgd = { name = 'SGD', schema = { nofill = true, fields = {
    lr = lr, momentum = num(nil, 0), dampening = num(), weight_decay = wd, nesterov = bool(),
  } } },
  adagrad = { name = 'Adagrad', schema = { nofill = true, fields = {
    lr = lr, lr_decay = num(nil, 0), weight_decay = wd, initial_accumulator_value = num(nil, 0), eps = eps,
  } } },
  lamb = { name = 'Lamb', schema = { nofill = true, fields = {
    lr = lr, betas = betas, eps = eps, weight_decay = wd, bias_correction = bool(), eps_inside_sqrt = bool(),
    max_coeff = num(nil, 0), min_coeff = num(nil, 0), amsgrad = bool(),
  } } },
  lion = { name = 'Lion', schema = { nofill = true, fields = {
    lr = lr, betas = betas, weight_decay = wd, set_grad_none = bool(),
  } } },
}
-- deepspeed/runtime/fp16/onebit: adam.py OnebitAdam, zoadam.py ZeroOneAdam, lamb.py OnebitLamb
local ONEBIT_COMMON = { lr = lr, betas = betas, eps = eps, weight_decay = wd, bias_correction = bool(),
                        eps_inside_sqrt = bool(), amsgrad = bool(), cuda_aware = bool(),
                        comm_backend_name = enum(nil, { 'nccl', 'mpi', 'hccl', 'compressed' }) }
local function onebit(name, own)
  local fields = {}
  for k, f in pairs(ONEBIT_COMMON) do fields[k] = f end
  for k, f in pairs(own) do fields[k] = f end
  return { name = name, onebit = true, schema = { nofill = true, fields = fields } }
end
OPTIMIZERS.onebitadam = onebit('OneBitAdam', { freeze_step = int(nil, 0) })
OPTIMIZERS.zerooneadam = onebit('ZeroOneAdam', { var_freeze_step = int(nil, 0), var_update_scaler = int(nil, 1),
                                                 local_step_scaler = int(nil, 1), local_step_clipper = int(nil, 1) })
OPTIMIZERS.onebitlamb = onebit('OneBitLamb', { freeze_step = int(nil, 0), max_coeff = num(nil, 0), min_coeff = num(nil, 0),
                                               coeff_beta = num(nil, 0, { max = 1 }), factor_max = num(nil, 0),
                                               factor_min = num(nil, 0), factor_threshold = num(nil, 0) })
local OPTIMIZER_NAMES = { 'Adam', 'AdamW', 'SGD', 'Adagrad', 'Lamb', 'Lion', 'OneBitAdam', 'ZeroOneAdam', 'OneBitLamb' }
-- in DeepSpeed's DEEPSPEED_OPTIMIZERS, not in dslua
local DEEPSPEED_ONLY = { muadam = true, muadamw = true, musgd = true, muon = true }

local OPTIMIZER_BLOCK = { fields = {
  type = str({ required = true }),
  params = field('object', function() return {} end),
  legacy_fusion = bool(nil),
}, nofill = true }

local function check_optimizer(ctx, path, v)
  if v == json.null then return nil end
  if not is_object(v) then return problem(ctx, path, 'must be an object, got ' .. describe(v)) end
  local o = check_block(ctx, path, v, OPTIMIZER_BLOCK)
  o.params = o.params or {}
  if type(o.type) ~= 'string' then return o end
  local spec = OPTIMIZERS[o.type:lower()]
  if not spec then
    problem(ctx, join(path, 'type'), DEEPSPEED_ONLY[o.type:lower()]
            and describe(o.type) .. ' is a DeepSpeed optimizer dslua does not implement (dslua has '
                .. table.concat(OPTIMIZER_NAMES, ', ') .. ')'
            or unknown(o.type, OPTIMIZER_NAMES, 'optimizer'))
    return o
  end
  local params = o.params
  if params.max_grad_norm ~= nil then    -- raised by engine._configure_basic_optimizer
    problem(ctx, join(path, 'params.max_grad_norm'), "'max_grad_norm' is not supported as an optimizer "
            .. "parameter, please switch to using the deepspeed parameter 'gradient_clipping'")
    params = copy(params)
    params.max_grad_norm = nil
  end
  local pp = join(path, 'params')
  params = resolve_param_autos(ctx, pp, params, optimizer_auto(ctx, o.type:lower()))
  o.params = check_block(ctx, pp, params, spec.schema)
  ctx.optimizer_lr = o.params.lr or require('dslua.optim').config_default(o.type:lower(), 'lr')
  if o.params.amsgrad then
    problem(ctx, join(pp, 'amsgrad'), spec.onebit and spec.name .. ' does not support the AMSGrad variant.'
            or string.format('Fused%s does not support the AMSGrad variant.', spec.name == 'Lamb' and 'Lamb' or 'Adam'))
  end
  if spec.onebit then
    ctx.onebit = spec.name
    for _, k in ipairs({ 'cuda_aware', 'comm_backend_name' }) do
      if o.params[k] ~= nil then
        note(ctx, join(pp, k), "dslua's collectives pick their transport by the tensors' device (MPI for host "
             .. 'memory, NCCL for GPU memory); this setting changes nothing')
      end
    end
    for _, k in ipairs({ 'bias_correction', 'eps_inside_sqrt' }) do
      if o.params[k] ~= nil then
        note(ctx, join(pp, k), spec.name .. ' takes it and reads it nowhere (as in DeepSpeed): no bias correction, '
             .. 'eps outside the square root')
      end
    end
  end
  if o.params.nesterov and ((o.params.momentum or 0) <= 0 or (o.params.dampening or 0) ~= 0) then
    problem(ctx, join(pp, 'nesterov'), 'Nesterov momentum requires a momentum and zero dampening')
  end
  return o
end

-- Parameter names per scheduler: the constructor arguments of
-- deepspeed/runtime/lr_schedules.py; "lua" is dslua's own.
local last = int(nil, -1)
local warmup_type = enum(nil, { 'log', 'linear' })
local warmup_steps = int(nil, 1)
local function with(base, extra)
  local t = { nofill = true, fields = {} }
  for k, v in pairs(base.fields) do t.fields[k] = v end
  for k, v in pairs(extra) do t.fields[k] = v end
  return t
end
local WARMUP = { nofill = true, fields = {
  warmup_min_lr = field('numlist', nil, { min = 0 }),
  warmup_max_lr = field('numlist', nil, { min = 0, nullable = true }),
  warmup_num_steps = warmup_steps, warmup_type = warmup_type, last_batch_iteration = last,
} }
local SCHEDULERS = {
  LRRangeTest = { nofill = true, fields = {
    lr_range_test_min_lr = field('numlist', nil, { min = 0 }),
    lr_range_test_step_size = int(nil, 1),
    lr_range_test_step_rate = num(),
    lr_range_test_staircase = bool(),
    last_batch_iteration = last,
  } },
  OneCycle = { nofill = true, fields = {
    cycle_min_lr = num(nil, 0, { required = true }),
    cycle_max_lr = num(nil, 0, { required = true }),
    decay_lr_rate = num(),
    cycle_first_step_size = num(nil, nil, { above = 0 }),
    cycle_second_step_size = num(nil, nil, { above = 0, nullable = true }),
    cycle_first_stair_count = int(),
    cycle_second_stair_count = int(nil, nil, { nullable = true }),
    decay_step_size = int(nil, 0),
    cycle_momentum = bool(),
    cycle_min_mom = num(),
    cycle_max_mom = num(),
    decay_mom_rate = num(),
    last_batch_iteration = last,
  } },
  WarmupLR = WARMUP,
  WarmupDecayLR = with(WARMUP, { total_num_steps = int(nil, 0, { required = true }) }),
  WarmupCosineLR = { nofill = true, fields = {
    total_num_steps = int(nil, 0, { required = true }),
    warmup_min_ratio = num(),
    warmup_num_steps = warmup_steps,
    cos_min_ratio = num(),
    warmup_type = warmup_type,
    last_batch_iteration = last,
  } },
  lua = { nofill = true, open = true, fields = { path = str({ required = true }) } },
}
for name, schema in pairs(SCHEDULERS) do schema.what = name end
local SCHEDULER_NAMES = { 'LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'lua' }

local SCHEDULER_BLOCK = { fields = {
  type = str({ required = true }),
  params = field('object', function() return {} end),
}, nofill = true }

-- "auto" scheduler params: from the scheduler passed to initialize (the
-- params it was built with, ctx.given.scheduler), else as Hugging Face
-- fills them: the warmup's lowest lr 0 and its highest the optimizer's lr;
-- the step counts Hugging Face takes from its trainer's length, which
-- dslua cannot know.
local SCHEDULER_AUTO = {
  warmup_min_lr = function() return 0, "Hugging Face's value" end,
  warmup_max_lr = function(ctx)
    local o = ctx.given.optimizer
    if o and o.lr then return o.lr, "the lr of the optimizer passed to initialize" end
    return ctx.optimizer_lr, "the optimizer block's lr"
  end,
}

local function scheduler_auto(ctx)
  return function(k)
    local from = ctx.given.scheduler
    if from and from[k] ~= nil then return from[k], 'from the scheduler passed to initialize' end
    if SCHEDULER_AUTO[k] then
      local v, how = SCHEDULER_AUTO[k](ctx)
      if v ~= nil then return v, how end
    end
    if k == 'warmup_num_steps' or k == 'total_num_steps' then
      return nil, "\"auto\" is filled by Hugging Face's Trainer from its own step count, which dslua cannot know; "
                  .. 'give the number of steps'
    end
    return nil, '"auto": nothing passed to initialize sets it; give a value'
  end
end

local function check_scheduler(ctx, path, v)
  if v == json.null then return nil end
  if not is_object(v) then return problem(ctx, path, 'must be an object, got ' .. describe(v)) end
  local s = check_block(ctx, path, v, SCHEDULER_BLOCK)
  s.params = s.params or {}
  if type(s.type) ~= 'string' then return s end
  local schema = SCHEDULERS[s.type]
  if not schema then          -- engine._scheduler_from_config's assertion
    local sug = suggest.did_you_mean(s.type, SCHEDULER_NAMES)
    problem(ctx, join(path, 'type'), 'DeepSpeed does not recognize LR scheduler ' .. s.type
            .. (sug and ', ' .. sug or ' (dslua has ' .. table.concat(SCHEDULER_NAMES, ', ') .. ')'))
    return s
  end
  local pp = join(path, 'params')
  s.params = check_block(ctx, pp, resolve_param_autos(ctx, pp, s.params, scheduler_auto(ctx)), schema)
  return s
end

local function check_unsupported(ctx, path, v)
  if is_object(v) and v.enabled == false then
    note(ctx, path, 'a DeepSpeed feature dslua does not implement; accepted as it is off')
    return copy(v)
  end
  problem(ctx, path, 'a DeepSpeed feature dslua does not implement (accepted only with "enabled": false)')
end

local function check_stored(ctx, path, v)
  note(ctx, path, M.stored_keys[path] .. '; passed through')
  return copy(v)
end

local function check_ignored(ctx, path, v)
  note(ctx, path, 'a DeepSpeed setting dslua does not act on; passed through')
  return copy(v)
end

local function any_enabled(v)
  if type(v) ~= 'table' then return false end
  if v.enabled == true then return true end
  for _, x in pairs(v) do
    if any_enabled(x) then return true end
  end
  return false
end

-- Whether a library block turns a feature on: its own "enabled" is a
-- master switch that alone turns nothing on (every feature defaults off).
local function library_on(v)
  if not is_object(v) or v.enabled == false then return false end
  for k, x in pairs(v) do
    if k ~= 'enabled' and any_enabled(x) then return true end
  end
  return false
end

local function check_later_work(ctx, path, v)
  local what = M.later_work[path]
  if v == json.null or (is_object(v) and not library_on(v)) then
    note(ctx, path, what .. ': dslua does not have it; accepted as nothing in it is enabled')
    return copy(v)
  end
  problem(ctx, path, what .. ': dslua does not have it yet (later work); remove the block, or switch off '
          .. 'everything in it ("enabled": false)')
end

-- Newer DeepSpeed blocks dslua accepts and does not act on. DeepSpeed's
-- models forbid unknown keys, but their fields change from release to
-- release: only the switches that matter here are checked.
local COMPILE = { open = true, fields = { deepcompile = bool(false) } }

local function check_compile(ctx, path, v)
  local c = check_value(ctx, path, v, block(COMPILE))
  if c then
    note(ctx, path, 'DeepCompile (compiled ZeRO graphs) is not in dslua; the model runs op by op'
         .. (c.deepcompile and ', the same training' or ' (deepcompile is off anyway)'))
  end
  return c
end

local TENSOR_PARALLEL = { open = true, fields = {
  autotp_size = int(0, 0), tp = block({ open = true, fields = { tp_size = int(1, 1) } }),
} }

local function check_tensor_parallel(ctx, path, v)
  local t = check_value(ctx, path, v, block(TENSOR_PARALLEL))
  if not t then return nil end
  local size = math.max(t.autotp_size, t.tp.tp_size)
  if size > 1 then
    return problem(ctx, path, string.format('tensor parallelism over %d ranks (AutoTP): dslua has none, every '
                   .. 'rank holds whole layers; use "autotp_size": 0 (data parallel over every rank)', size))
  end
  note(ctx, path, 'AutoTP is off (size <= 1): nothing for dslua to do')
  return t
end

local function check_sequence_parallel(ctx, path, v)
  local n = check_value(ctx, path, v, int(1, 1))
  if n and n > 1 then
    return problem(ctx, path, string.format('sequence parallelism over %d ranks (DeepSpeed-Ulysses): dslua has '
                   .. 'none, every rank holds whole sequences; use 1', n))
  end
  return n
end

local function check_cuda_visible_devices(ctx, path, v)
  note(ctx, path, "read by DeepSpeed's launcher scripts, not its engine; dslua picks each rank's GPU with "
       .. '--device, DSLUA_DEVICE or CUDA_VISIBLE_DEVICES in the environment')
  return copy(v)
end

-- runtime/config.py get_checkpoint_* and checkpoint_engine's constants:
-- tag_validation is read in any case (DeepSpeed upper-cases it).
local TAG_MODES = { 'IGNORE', 'WARN', 'FAIL' }

local function check_tag_validation(ctx, path, v)
  if v == nil then return 'WARN' end
  local up = type(v) == 'string' and v:upper()
  for _, m in ipairs(TAG_MODES) do
    if up == m then return m end
  end
  problem(ctx, path, 'must be "Ignore", "Warn" or "Fail" (any case), got ' .. describe(v))
end

local function has_effect_note(what)
  return function(ctx, path, v)
    if v ~= true and v ~= false then return check_value(ctx, path, v, bool(false)) end
    if v then note(ctx, path, what) end
    return v
  end
end

-- DeepSpeed reads the checkpoint, activation_checkpointing and
-- flops_profiler blocks key by key (get_scalar_param): an unknown key is a
-- warning there, as at the top level.
local CHECKPOINT = { lenient = true, fields = {
  tag_validation = field('custom', nil, { check = check_tag_validation, fill = true }),
  load_universal = field('custom', false, { check = has_effect_note(
    "dslua's checkpoints load on any world size and ZeRO stage already; nothing changes") }),
  use_node_local_storage = bool(false),
  parallel_write = block({ fields = {
    pipeline_stage = field('custom', false, { check = has_effect_note(
      'every rank writes its own file in parallel anyway') }),
  } }),
  checkpoint_serialization = bool(true),     -- torch.save's zipfile format: dslua writes safetensors
  writer = any({ nullable = true }),         -- DeepSpeed's writer engines: dslua has its own
} }

-- runtime/activation_checkpointing/config.py: the block configures
-- ds.checkpointing; checkpointing itself is what the model asks for.
local ACT_CKPT_NOTE = 'dslua keeps a checkpointed block\'s inputs where they are (no model parallelism to partition over)'
local ACT_CKPT = { lenient = true, fields = {
  partition_activations = field('custom', false, { check = has_effect_note(ACT_CKPT_NOTE) }),
  contiguous_memory_optimization = field('custom', false, { check = has_effect_note(ACT_CKPT_NOTE) }),
  cpu_checkpointing = field('custom', false, { check = has_effect_note(ACT_CKPT_NOTE) }),
  number_checkpoints = int(nil, 1, { nullable = true }),
  synchronize_checkpoint_boundary = bool(false),
  profile = bool(false),
} }

-- runtime/config.py get_pipeline_config's keys. stages ('auto' or the
-- PipelineModule's num_stages) and activation_checkpoint_interval (for a
-- module that sets none) are checked against the model at initialize;
-- partition and seed_layers are the module's to decide (partition_method,
-- base_seed), as in DeepSpeed; the partitioned keys split activations over
-- tensor-parallel ranks, which dslua has none of.
local function check_stages(ctx, path, v)
  if v == 'auto' or (type(v) == 'number' and v >= 1 and v % 1 == 0) then return v end
  problem(ctx, path, 'must be "auto" or a number of stages, got ' .. describe(v))
end

local function module_decides(f)
  return field('custom', f.default, { check = function(ctx, path, v)
    v = check_value(ctx, path, v, f)
    note(ctx, path, "the PipelineModule decides this (partition_method, base_seed); no effect, as in DeepSpeed")
    return v
  end })
end

local PIPELINE = { fields = {
  stages = field('custom', 'auto', { check = check_stages }),
  partition = module_decides(field('str', 'best')),
  seed_layers = module_decides(bool(false)),
  activation_checkpoint_interval = int(0, 0),
  pipe_partitioned = bool(true),
  grad_partitioned = bool(true),
} }

-- The monitors: deepspeed/monitor/config.py's pydantic models (extra keys
-- forbidden); dslua/io/monitor.lua writes them.
local function str_default(default) return field('str', default) end
local TENSORBOARD = { fields = {
  enabled = bool(false), output_path = str_default(''), job_name = str_default('DeepSpeedJobName'),
} }
local WANDB = { fields = {
  enabled = bool(false), group = str({ nullable = true }), team = str({ nullable = true }),
  project = str_default('deepspeed'),
} }
local COMET = { fields = {
  enabled = bool(false), samples_log_interval = int(100, 1),
  project = str({ nullable = true }), workspace = str({ nullable = true }), api_key = str({ nullable = true }),
  experiment_name = str({ nullable = true }), experiment_key = str({ nullable = true }),
  online = bool(nil, { nullable = true }), mode = str({ nullable = true }),
} }

-- profiling/config.py (DeepSpeedFlopsProfilerConfig); dslua/nn/flops.lua runs it.
local FLOPS_PROFILER = { lenient = true, fields = {
  enabled = bool(false), recompute_fwd_factor = num(0.0, 0), profile_step = int(1, 1),
  module_depth = int(-1, -1), top_modules = int(1, 1), detailed = bool(true),
  output_file = str({ nullable = true }),
} }

-- Top level: runtime/config.py get_* helpers and constants.py defaults.
-- The batch triple has no default: DeepSpeed fills it (resolve_batch).
-- Batch sizes count samples and steps: past 2^31 - 1 they are a mistake
-- (a step that never comes), not a size.
local BATCH_MAX = 2 ^ 31 - 1
local TOP = { lenient = true, fields = {
  train_batch_size = int(nil, nil, { nullable = true, max = BATCH_MAX, auto = true }),
  train_micro_batch_size_per_gpu = int(nil, nil, { nullable = true, max = BATCH_MAX, auto = true }),
  gradient_accumulation_steps = int(nil, nil, { nullable = true, max = BATCH_MAX, auto = true }),
  steps_per_print = int(10, 1),
  gradient_clipping = num(0, 0, { auto = true }),
  wall_clock_breakdown = bool(false),
  dump_state = bool(false),
  prescale_gradients = bool(false),
  -- the dtype gradients travel in; null: the model's (fp16, bf16 or fp32)
  communication_data_type = enum(nil, { 'fp32', 'fp16', 'bf16' }, { nullable = true }),
  gradient_predivide_factor = num(1.0, nil, { above = 0 }),
  fp16 = block(FP16),
  bf16 = block(BF16),
  comms_logger = block(COMMS),
  checkpoint = block(CHECKPOINT),
  activation_checkpointing = block(ACT_CKPT),
  pipeline = block(PIPELINE),
  tensorboard = block(TENSORBOARD),
  csv_monitor = block(TENSORBOARD),
  wandb = block(WANDB),
  comet = block(COMET),
  flops_profiler = block(FLOPS_PROFILER),
  zero_optimization = field('custom', nil, { check = check_zero, fill = true }),
  optimizer = field('custom', nil, { check = check_optimizer }),
  scheduler = field('custom', nil, { check = check_scheduler }),
}, aliases = { bfloat16 = 'bf16' } }   -- precision_config.py BFLOAT16_OLD
for _, k in ipairs(M.extension_keys) do TOP.fields[k] = any() end
for _, k in ipairs(M.ignored_keys) do TOP.fields[k] = field('custom', nil, { check = check_ignored }) end
for _, k in ipairs(M.unsupported_keys) do TOP.fields[k] = field('custom', nil, { check = check_unsupported }) end
for k in pairs(M.later_work) do TOP.fields[k] = field('custom', nil, { check = check_later_work }) end
for k in pairs(M.stored_keys) do TOP.fields[k] = field('custom', nil, { check = check_stored }) end
TOP.fields.compile = field('custom', nil, { check = check_compile })
TOP.fields.tensor_parallel = field('custom', nil, { check = check_tensor_parallel })
TOP.fields.sequence_parallel_size = field('custom', 1, { check = check_sequence_parallel })
TOP.fields.cuda_visible_devices = field('custom', nil, { check = check_cuda_visible_devices })

------------------------------------------------------------------------
-- The batch triple: DeepSpeedConfig._set_batch_related_parameters, then
-- _batch_assertion, with their messages.

local function floordiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 end
  return q
end

-- The top-level batch keys given as "auto", in DeepSpeed's order and by name.
local function batch_autos(ctx)
  local out = {}
  for _, name in ipairs({ 'train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps' }) do
    for _, a in ipairs(ctx.autos) do
      if a.key == name then out[#out + 1], out[name] = name, true end
    end
  end
  return out
end

local function resolve_batch(ctx, cfg, ws)
  local tb, mb, ga = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
  local autos = batch_autos(ctx)
  if mb == nil and ctx.given.batch_size and autos.train_micro_batch_size_per_gpu then
    mb = ctx.given.batch_size       -- as Hugging Face fills it from per_device_train_batch_size
    ctx.batch_given = true
  end
  -- a given value that is not positive fails _batch_assertion whatever the fill computes
  local ok = true
  if tb and tb <= 0 then
    problem(ctx, 'train_batch_size', string.format('Train batch size: %d has to be greater than 0', tb))
    ok = false
  end
  if mb and mb <= 0 then
    problem(ctx, 'train_micro_batch_size_per_gpu',
            string.format('Micro batch size per gpu: %d has to be greater than 0', mb))
    ok = false
  end
  if ga and ga <= 0 then
    problem(ctx, 'gradient_accumulation_steps',
            string.format('Gradient accumulation steps: %d has to be greater than 0', ga))
    ok = false
  end
  if not ok then return end
  local how
  if tb and mb and ga then
    how = nil
  elseif tb and mb then
    ga = floordiv(floordiv(tb, mb), ws)
    how = string.format('gradient_accumulation_steps = %d // %d // %d', tb, mb, ws)
  elseif tb and ga then
    mb = floordiv(floordiv(tb, ws), ga)
    how = string.format('train_micro_batch_size_per_gpu = %d // %d // %d', tb, ws, ga)
  elseif mb and ga then
    tb = mb * ga * ws
  elseif tb then
    ga, mb = 1, floordiv(tb, ws)
    how = string.format('gradient_accumulation_steps = 1, train_micro_batch_size_per_gpu = %d // %d', tb, ws)
  elseif mb then
    tb, ga = mb * ws, 1
  elseif #autos > 0 then
    return problem(ctx, autos[1], '"auto" has nothing to resolve from: Hugging Face\'s Trainer fills the batch '
                   .. 'sizes from per_device_train_batch_size; give a number, or the micro batch as batch_size to '
                   .. 'ds.initialize')
  else
    return problem(ctx, 'train_batch_size', 'Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided')
  end
  local hint = how and ' (' .. how .. ', world_size ' .. ws .. ')' or ''
  if mb <= 0 then
    return problem(ctx, 'train_micro_batch_size_per_gpu',
                   string.format('Micro batch size per gpu: %d has to be greater than 0', mb) .. hint)
  end
  if ga <= 0 then
    return problem(ctx, 'gradient_accumulation_steps',
                   string.format('Gradient accumulation steps: %d has to be greater than 0', ga) .. hint)
  end
  if tb ~= mb * ga * ws then
    return problem(ctx, 'train_batch_size', string.format(
      'Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * '
      .. 'gradient_acc_step * world_size %d != %d * %d * %d', tb, mb, ga, ws) .. hint)
  end
  cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tb, mb, ga
end

-- Hugging Face fills these "auto" values (trainer_config_process and
-- _finalize) from what the trainer knows; here from what initialize was
-- given (ctx.given.hidden_size: the model's). -> value, how; nil: the
-- default stays.
local HF_AUTO = {
  gradient_clipping = function() return 1.0, "Hugging Face's max_grad_norm default" end,
  ['zero_optimization.reduce_bucket_size'] = function(h) return h and h * h, 'hidden size^2' end,
  ['zero_optimization.stage3_prefetch_bucket_size'] = function(h)
    return h and math.floor(0.9 * h * h), '0.9 * hidden size^2'
  end,
  ['zero_optimization.stage3_param_persistence_threshold'] = function(h) return h and 10 * h, '10 * hidden size' end,
}

-- Every "auto" value dropped while checking, now resolved (the batch triple
-- from the other two and the world size, the rest by HF_AUTO or the default).
local function resolve_autos(ctx, cfg)
  for _, a in ipairs(ctx.autos) do
    local fill = HF_AUTO[a.key]
    local v, how
    if fill then v, how = fill(ctx.given.hidden_size) end
    if v ~= nil then
      a.block[a.name] = v
    else
      v = a.block[a.name]
      if a.block == cfg and a.name == 'train_micro_batch_size_per_gpu' and ctx.batch_given then
        how = 'the batch_size passed to initialize'
      elseif a.block == cfg and (a.name == 'train_batch_size' or a.name == 'train_micro_batch_size_per_gpu'
                             or a.name == 'gradient_accumulation_steps') then
        how = string.format('train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * '
                            .. 'world size = %d * %d * %d', cfg.train_micro_batch_size_per_gpu or 0,
                            cfg.gradient_accumulation_steps or 0, ctx.world_size)
      else
        how = "DeepSpeed's default"
      end
    end
    if v ~= nil then note(ctx, a.path, '"auto" resolved to ' .. describe_value(v) .. ' (' .. how .. ')') end
  end
end

-- A directory dslua will make under path: its nearest existing ancestor
-- must be a directory this process can write (probed as make_dir probes).
-- nil, or why not.
local function unwritable(path)
  local at = path == '' and '.' or path
  while true do
    local probe = at .. '/.dslua-write-check'
    local ok, why = pcall(require('dslua.core').file.append, probe, '')
    if ok then
      os.remove(probe)
      return nil
    end
    if require('dslua.core').ckpt.exists(at) then
      return string.format('%s is not a directory this process can write (%s)', at, why)
    end
    local parent = at:match('^(.*)/[^/]*$')
    if not parent then parent = '.' elseif parent == '' then parent = '/' end
    if parent == at then return string.format('%s is not a directory this process can write', at) end
    at = parent
  end
end

-- The folders a run writes (the monitors', the nvme offloads') checked
-- with the config, so --check-config refuses what initialize would.
local function check_paths(ctx, cfg)
  local list = {}
  for _, d in pairs(require('dslua.io.monitor').dirs(cfg)) do list[#list + 1] = d end
  for _, name in ipairs({ 'offload_optimizer', 'offload_param' }) do
    local o = cfg.zero_optimization[name]
    if o.device == 'nvme' and type(o.nvme_path) == 'string' then
      list[#list + 1] = { 'zero_optimization.' .. name .. '.nvme_path', o.nvme_path }
    end
  end
  table.sort(list, function(a, b) return a[1] < b[1] end)
  for _, d in ipairs(list) do
    local why = unwritable(d[2])
    if why then problem(ctx, d[1], string.format('cannot create "%s": %s', d[2], why)) end
  end
end

-- DeepSpeedConfig._initialize_params and _do_error_check across blocks.
local function cross_checks(ctx, cfg)
  if cfg.fp16.enabled and cfg.bf16.enabled then
    problem(ctx, 'fp16.enabled', 'bfloat16 and fp16 modes cannot be simultaneously enabled')
  end
  local stage = cfg.zero_optimization.stage
  if ctx.onebit and stage > 0 then
    problem(ctx, 'optimizer.type', string.format('%s runs at ZeRO stage 0 (its compressed all-reduce takes '
            .. 'whole momenta, which ZeRO partitions): drop zero_optimization.stage, or use %s with it', ctx.onebit,
            ctx.onebit == 'OneBitLamb' and 'Lamb' or 'Adam'))
  end
  -- stage 0 has no partitioned optimizer to move: fp32 would train with
  -- the optimizer left in place, bf16/fp16 would offload; refuse both
  local offload = cfg.zero_optimization.offload_optimizer.device
  if offload ~= 'none' and stage == 0 then
    problem(ctx, 'zero_optimization.offload_optimizer', string.format('ZeRO-Offload needs zero_optimization.stage '
            .. '1, 2 or 3 (device "%s" moves the partitioned optimizer; stage 0 has none)', offload))
  end
  if cfg.zero_optimization.offload_optimizer.device == 'nvme' and cfg.optimizer
     and type(cfg.optimizer.type) == 'string' and cfg.optimizer.type:lower() == 'lamb' then
    problem(ctx, 'optimizer.type', 'Lamb cannot be streamed from nvme (offload_optimizer.device): its trust '
            .. 'ratio needs whole parameters; use Adam, AdamW, SGD, Adagrad or Lion, or offload to "cpu"')
  end
  if cfg.fp16.fp16_master_weights_and_grads and stage == 0 then
    problem(ctx, 'fp16.fp16_master_weights_and_grads',
            'Fp16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3.')
  end
  if cfg.bf16.bf16_master_weights_and_grads and stage == 0 then
    problem(ctx, 'bf16.bf16_master_weights_and_grads',
            'Bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3.')
  end
  if cfg.bf16.bf16_optimizer_states then
    if stage == 0 then
      problem(ctx, 'bf16.bf16_optimizer_states', 'bf16_optimizer_states is only supported with ZeRO Stage 1, 2, or 3.')
    elseif not cfg.bf16.bf16_master_weights_and_grads then
      problem(ctx, 'bf16.bf16_optimizer_states',
              'bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled.')
    end
  end
end

------------------------------------------------------------------------
-- The sampler block (dslua's own; samplers/policy.lua runs it): which
-- policy gives each rank its indices and micro batch. Checked here with
-- the world size; the batch triple then resolves from the per-rank micro
-- batches (resolve_sampler_batch).
--
--   policy                    "uneven" (default), "auto", "distributed", or
--                             a path to a Lua file (tried as given, then
--                             next to the config file); a Lua config may
--                             give the policy table itself
--   micro_batch_per_rank      one positive integer per rank (default: every
--                             rank train_micro_batch_size_per_gpu)
--   data_share                one number > 0 per rank, summing to 1 within
--                             1e-6 (default: micro_batch_per_rank / its sum)
--   shuffle, seed, drop_last  true, 0, false
--   auto only: max_micro_batch_per_rank (a number or one per rank; default
--   no cap), measure_steps (10, at most 256), skip_steps (1)
--   custom policies only: params (an object handed to the policy)

M.sampler_policies = { 'auto', 'distributed', 'uneven' }
M.share_tolerance = 1e-6     -- how far from 1 the shares may sum

local SAMPLER_KEYS = { 'policy', 'micro_batch_per_rank', 'data_share', 'shuffle', 'seed', 'drop_last' }
local SAMPLER_OWN = { max_micro_batch_per_rank = 'auto', measure_steps = 'auto', skip_steps = 'auto',
                      params = 'custom' }

local function policy_file(name, source)
  local exists = require('dslua.core').ckpt.exists
  local tried = { name }
  if exists(name) then return name, tried end
  local dir = type(source) == 'string' and source:match('^(.*)/[^/]*$')
  if dir and name:sub(1, 1) ~= '/' then
    local other = dir .. '/' .. name
    tried[2] = other
    if exists(other) then return other, tried end
  end
  return nil, tried
end

-- Why the Lua file at path (what: 'policy', 'hooks') cannot be used: it
-- cannot be read through the guarded open (a FIFO, a device, a planted
-- link) or does not compile. nil when it can.
local function lua_file_problem(path, what)
  local text, why = file.text(path)
  if not text then return string.format('cannot read the %s file %s: %s', what, describe(path), why) end
  local _, cerr = loadstring(text, '@' .. path)
  return cerr and string.format('the %s file does not compile: %s', what, cerr)
end

-- The policy's kind ('uneven', 'auto', 'distributed' or 'custom') and the
-- value to keep, or nil after recording a problem.
local function check_policy(ctx, path, v)
  if type(v) == 'table' and type(v.plan) == 'function' then return 'custom', v end
  if type(v) ~= 'string' then
    return problem(ctx, path, 'must be a policy name (' .. table.concat(M.sampler_policies, ', ')
                   .. ') or the path of a Lua file, got ' .. describe(v))
  end
  for _, name in ipairs(M.sampler_policies) do
    if v == name then return name, v end
  end
  if not (v:find('/', 1, true) or v:match('%.lua$')) then
    local s = suggest.did_you_mean(v, M.sampler_policies)
    return problem(ctx, path, 'unknown policy ' .. describe(v) .. (s and ', ' .. s or '')
                   .. ' (built in: ' .. table.concat(M.sampler_policies, ', ') .. '; or the path of a .lua file)')
  end
  local found, tried = policy_file(v, ctx.source)
  if not found then
    return problem(ctx, path, 'cannot read the policy file ' .. describe(v) .. ' (tried ' .. table.concat(tried, ', ') .. ')')
  end
  local why = lua_file_problem(found, 'policy')
  if why then return problem(ctx, path, why) end
  return 'custom', found
end

-- A list of one value per rank; check(x, p) -> x or nil after a problem.
local function per_rank(ctx, path, v, what, check)
  local ws = ctx.world_size or 1
  if not is_list(v) or #v == 0 then
    return problem(ctx, path, string.format('must be a list of %d %s (one per rank), got %s', ws, what, describe(v)))
  end
  local out, ok = json.array({}), true
  if #v ~= ws then
    problem(ctx, path, string.format('has %d entr%s, the world size is %d (one per rank)', #v, #v == 1 and 'y' or 'ies', ws))
    ok = false
  end
  for i, x in ipairs(v) do
    out[i] = check(x, join(path, i - 1))
    if out[i] == nil then ok = false end
  end
  return ok and out or nil
end

local function positive_int(ctx)
  return function(x, p)
    if finite(x) and x == math.floor(x) and x >= 1 then return x end
    problem(ctx, p, 'must be a positive integer, got ' .. describe(x))
  end
end

local function all_equal(list)
  for _, x in ipairs(list) do
    if x ~= list[1] then return false end
  end
  return true
end

local function check_sampler(ctx, path, v)
  if v == json.null then return nil end
  if not is_object(v) then return problem(ctx, path, 'must be an object, got ' .. describe(v)) end
  ctx.sampler_sets_batch = v.micro_batch_per_rank ~= nil
  local kind, policy = 'uneven', 'uneven'
  if v.policy ~= nil then
    kind, policy = check_policy(ctx, join(path, 'policy'), v.policy)
    if not kind then return nil end
  end
  local known, common = {}, {}
  for _, k in ipairs(SAMPLER_KEYS) do known[#known + 1], common[k] = k, true end
  for k, owner in pairs(SAMPLER_OWN) do
    if owner == kind then known[#known + 1] = k end
  end
  local out, ok = { policy = policy }, true
  for _, key in ipairs(sorted_keys(v)) do
    local kp = join(path, tostring(key))
    local owner = SAMPLER_OWN[key]
    if type(key) ~= 'string' then
      problem(ctx, kp, 'keys must be strings, got ' .. describe(key))
      ok = false
    elseif owner and owner ~= kind then
      problem(ctx, kp, owner == 'custom' and 'only a policy loaded from a Lua file reads it'
                       or "only the '" .. owner .. "' policy reads it")
      ok = false
    elseif not owner and not common[key] then
      problem(ctx, kp, unknown(key, known) .. (kind == 'custom' and " (a custom policy's own settings go in "
                                                .. join(path, 'params') .. ')' or ''))
      ok = false
    end
  end
  local function get(key, f)
    if v[key] == nil then return f.default end
    local x = check_value(ctx, join(path, key), v[key], f)
    if x == nil then ok = false end
    return x
  end
  out.shuffle = get('shuffle', bool(true))
  out.seed = get('seed', int(0, 0))
  out.drop_last = get('drop_last', bool(false))
  local mp, sp = join(path, 'micro_batch_per_rank'), join(path, 'data_share')
  if v.micro_batch_per_rank ~= nil then
    out.micro_batch_per_rank = per_rank(ctx, mp, v.micro_batch_per_rank, 'positive integers', positive_int(ctx))
    if not out.micro_batch_per_rank then
      ok = false
    elseif kind == 'distributed' and not all_equal(out.micro_batch_per_rank) then
      problem(ctx, mp, "the distributed policy gives every rank the same micro batch, got "
                       .. table.concat(out.micro_batch_per_rank, ', ') .. " (policy 'uneven' takes one per rank)")
      ok = false
    end
  end
  if v.data_share ~= nil then
    out.data_share = per_rank(ctx, sp, v.data_share, 'numbers > 0', function(x, p)
      if finite(x) and x > 0 then return x end
      problem(ctx, p, 'must be a number > 0 (every rank takes a share), got ' .. describe(x))
    end)
    if out.data_share then
      local sum = 0
      for _, x in ipairs(out.data_share) do sum = sum + x end
      if math.abs(sum - 1) > M.share_tolerance then
        problem(ctx, sp, string.format('the shares sum to %s, they must sum to 1 (within %s)', json.number(sum),
                                       (string.format('%.0e', M.share_tolerance):gsub('e%-0*', 'e-'))))
        out.data_share = nil
      elseif kind == 'distributed' and not all_equal(out.data_share) then
        problem(ctx, sp, "the distributed policy gives every rank an equal share (policy 'uneven' takes one per rank)")
        out.data_share = nil
      end
    end
    if not out.data_share then ok = false end
  end
  if kind == 'auto' then
    out.measure_steps = get('measure_steps', int(10, 1, { max = 256 }))   -- samplers/auto.lua keeps 256
    out.skip_steps = get('skip_steps', int(1, 0))
    local cp = join(path, 'max_micro_batch_per_rank')
    local cap = v.max_micro_batch_per_rank
    if finite(cap) then
      local x = positive_int(ctx)(cap, cp)
      if x then
        out.max_micro_batch_per_rank = json.array({})
        for r = 1, ctx.world_size or 1 do out.max_micro_batch_per_rank[r] = x end
      end
    elseif cap ~= nil then
      out.max_micro_batch_per_rank = per_rank(ctx, cp, cap, 'positive integers', positive_int(ctx))
    end
    if cap ~= nil and not out.max_micro_batch_per_rank then ok = false end
  elseif kind == 'custom' then
    local pp = join(path, 'params')
    out.params = v.params == nil and {} or check_value(ctx, pp, v.params, field('object'))
    if out.params == nil then
      ok = false
    else
      for _, k in ipairs(sorted_keys(out.params)) do
        if common[k] or SAMPLER_OWN[k] then
          problem(ctx, join(pp, tostring(k)), 'is a key of the sampler block itself; set it at ' .. join(path, tostring(k)))
          ok = false
        end
      end
    end
  end
  return ok and out or nil
end

-- The uneven policy steps every rank together, so the rank that needs the
-- most steps for its share (share / micro batch largest) sets how many;
-- a rank whose share is thinner fills only part of its micro batch each
-- step, and the batch is not the train_batch_size the config reads. An
-- error per such rank, with shares and micro batches that agree. -> ok
local function check_layout(ctx, micro, share)
  local most, by = 0, 1
  for r, m in ipairs(micro) do
    if share[r] / m > most then most, by = share[r] / m, r end
  end
  local fit, prop, sum = {}, {}, 0
  for _, m in ipairs(micro) do sum = sum + m end
  for r, m in ipairs(micro) do
    fit[r] = math.max(1, math.floor(share[r] / most + 0.5))
    prop[r] = json.number(m / sum)
  end
  local ok = true
  for r, m in ipairs(micro) do
    local batch = share[r] / most
    if batch < m * (1 - M.share_tolerance) then
      ok = false
      problem(ctx, string.format('sampler.data_share[%d]', r - 1), string.format(
        'rank %d: its share %s fills about %s of its micro batch %d each step (rank %d, share %s in micro '
        .. 'batches of %d, sets the number of steps), so its batch would be cut; give shares in proportion to '
        .. 'the micro batches (%s) or micro_batch_per_rank %s', r - 1, json.number(share[r]),
        json.number(math.floor(batch * 100 + 0.5) / 100), m, by - 1, json.number(share[by]), micro[by],
        table.concat(prop, ', '), table.concat(fit, ', ')))
    end
  end
  return ok
end

-- The per-rank micro batches set the batch: train_batch_size =
-- sum(micro_batch_per_rank) * gradient_accumulation_steps (DeepSpeed's
-- micro * accumulation * world size when the micro batches are equal).
-- train_micro_batch_size_per_gpu resolves to the largest micro batch (the
-- most one rank holds); given, it must be that.
-- Returns false when the sampler block does not set the micro batches
-- (true when it tried and failed: its problem is recorded already).
local function resolve_sampler_batch(ctx, cfg)
  local s = cfg.sampler
  if type(s) ~= 'table' or not s.micro_batch_per_rank then return ctx.sampler_sets_batch == true end
  local micro = s.micro_batch_per_rank
  local sum, largest = 0, 0
  for _, m in ipairs(micro) do sum, largest = sum + m, math.max(largest, m) end
  local tb, mb, ga = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
  local mp = 'sampler.micro_batch_per_rank'
  if ga and ga <= 0 then
    return true, problem(ctx, 'gradient_accumulation_steps',
                         string.format('Gradient accumulation steps: %d has to be greater than 0', ga))
  end
  if tb and tb <= 0 then
    return true, problem(ctx, 'train_batch_size', string.format('Train batch size: %d has to be greater than 0', tb))
  end
  if mb ~= nil and mb ~= largest then
    return true, problem(ctx, 'train_micro_batch_size_per_gpu', string.format(
      'is %d, but %s gives each rank its own (%s): leave it out, or give the largest (%d)', mb, mp,
      table.concat(micro, ', '), largest))
  end
  local how = ''
  if not ga then
    if tb then
      if tb % sum ~= 0 then
        return true, problem(ctx, 'train_batch_size', string.format(
          '%d is not a multiple of sum(%s) = %d (train_batch_size = sum(micro_batch_per_rank) '
          .. '* gradient_accumulation_steps)', tb, mp, sum))
      end
      ga = tb / sum
      how = string.format(' (gradient_accumulation_steps = %d / %d)', tb, sum)
    else
      ga = 1
    end
  end
  if tb and tb ~= sum * ga then
    return true, problem(ctx, 'train_batch_size', string.format(
      '%d != sum(%s) * gradient_accumulation_steps = %d * %d', tb, mp, sum, ga))
  end
  if s.policy == 'uneven' and s.data_share and not check_layout(ctx, micro, s.data_share) then return true end
  cfg.train_batch_size, cfg.gradient_accumulation_steps = sum * ga, ga
  cfg.train_micro_batch_size_per_gpu = largest
  note(ctx, 'train_batch_size', string.format('%d = sum(%s) * gradient_accumulation_steps = (%s) * %d%s',
                                              sum * ga, mp, table.concat(micro, ' + '), ga, how))
  return true
end

-- Defaults that depend on the resolved batch: the micro batches (every
-- rank train_micro_batch_size_per_gpu), the shares (in proportion to the
-- micro batches), and the auto policy's caps against its micro batches.
local function finish_sampler(ctx, cfg)
  local s = cfg.sampler
  if type(s) ~= 'table' then return end
  local ws = ctx.world_size or 1
  local mp = 'sampler.micro_batch_per_rank'
  if not s.micro_batch_per_rank then
    local mb = cfg.train_micro_batch_size_per_gpu
    if not mb then
      return problem(ctx, mp, 'missing: needed when train_micro_batch_size_per_gpu does not set the micro batch')
    end
    s.micro_batch_per_rank = json.array({})
    for r = 1, ws do s.micro_batch_per_rank[r] = mb end
  end
  local micro = s.micro_batch_per_rank
  if not micro then return end
  if not s.data_share then
    local sum = 0
    for _, m in ipairs(micro) do sum = sum + m end
    s.data_share = json.array({})
    for r, m in ipairs(micro) do s.data_share[r] = m / sum end
  end
  if s.max_micro_batch_per_rank then
    for r, cap in ipairs(s.max_micro_batch_per_rank) do
      if micro[r] and cap < micro[r] then
        problem(ctx, 'sampler.max_micro_batch_per_rank[' .. (r - 1) .. ']', string.format(
          '%d is below %s[%d] = %d (the cap bounds the micro batch)', cap, mp, r - 1, micro[r]))
      end
    end
  end
end

-- checked from here on, no longer passed through as M.extension_keys are
TOP.fields.sampler = field('custom', nil, { check = check_sampler })

------------------------------------------------------------------------
-- The reload and hooks blocks (dslua's own; dslua/live/reload.lua runs them):
-- live reload of Lua code and the `dslua attach` socket.
--
--   "reload": {
--     enabled   true: the files the config names (a "lua" scheduler's
--               path, a sampler policy file, the hooks file) and modules
--               loaded with ds.reload.require reload when they change
--     every     1: rank 0 looks at them (and attach requests are taken)
--               every this many global steps
--     attach    true: the job serves `dslua attach` on a Unix socket
--     budget    5: seconds a reloaded file's loading and checks, a Lua
--               schedule's get_lr and attach input may run (dslua/base/guard.lua)
--   }
--   "hooks": the path of a Lua file returning {on_step =, on_log =,
--            on_eval =, on_save =} (tried as given, then next to the config
--            file; it reloads), or, in a Lua config, that table itself

M.hook_names = { 'on_step', 'on_log', 'on_eval', 'on_save' }

TOP.fields.reload = block({ fields = { enabled = bool(true), every = int(1, 1), attach = bool(true),
                                       budget = num(5, nil, { above = 0, max = 86400,
                                                              range_msg = 'must be a number of seconds > 0 and <= 86400' }) } })

local function check_hooks(ctx, path, v)
  if v == json.null then return nil end
  if type(v) == 'string' then
    local found, tried = policy_file(v, ctx.source)
    if not found then
      return problem(ctx, path, 'cannot read the hooks file ' .. describe(v) .. ' (tried ' .. table.concat(tried, ', ') .. ')')
    end
    local why = lua_file_problem(found, 'hooks')
    if why then return problem(ctx, path, why) end
    return found
  end
  if not is_object(v) then
    return problem(ctx, path, 'must be the path of a Lua file or a table of hook functions, got ' .. describe(v))
  end
  local known, ok = {}, true
  for _, n in ipairs(M.hook_names) do known[n] = true end
  for _, k in ipairs(sorted_keys(v)) do
    if not known[k] then
      problem(ctx, join(path, tostring(k)), unknown(k, M.hook_names, 'hook'))
      ok = false
    elseif type(v[k]) ~= 'function' then
      problem(ctx, join(path, k), 'must be a function, got ' .. describe(v[k]))
      ok = false
    end
  end
  return ok and v or nil
end
TOP.fields.hooks = field('custom', nil, { check = check_hooks })

-- check_sampler(block [, {world_size = 1, micro_batch = n, source = config
-- path}]) -> the resolved sampler block, or nil and the
-- problems (lines naming sampler.<key>). micro_batch stands for
-- train_micro_batch_size_per_gpu when the block has no micro_batch_per_rank.
function M.check_sampler(v, opts)
  opts = opts or {}
  local ctx = { problems = {}, notes = {}, bad = {}, autos = {}, given = {}, source = opts.source,
                world_size = opts.world_size or 1 }
  local s = check_sampler(ctx, 'sampler', v)
  if s then finish_sampler(ctx, { sampler = s, train_micro_batch_size_per_gpu = opts.micro_batch }) end
  if #ctx.problems > 0 or not s then
    local lines = {}
    for i, p in ipairs(ctx.problems) do
      lines[i] = (opts.source and opts.source .. ': ' or '') .. p.path .. ': ' .. p.msg
    end
    return nil, lines
  end
  return s, {}
end

------------------------------------------------------------------------
-- Loading

local function read_source(ctx, src)
  if type(src) == 'table' then return src end
  if type(src) ~= 'string' then
    return problem(ctx, '', 'the config must be a file name or a table, got ' .. describe(src))
  end
  -- the guarded open: a FIFO, a device or a planted link is refused
  -- instead of blocking or being followed
  local text, why = file.text(src)
  if not text then return problem(ctx, '', 'cannot read: ' .. why) end
  local ok, v, dups = pcall(json.decode, text, src, true)
  if not ok then
    ctx.raw_error = v
    return nil
  end
  for _, d in ipairs(dups) do
    local path, msg = d:match('^(.-): (.*)$')
    problem(ctx, path, msg)
  end
  return v
end

-- Problems as "source: path: msg"; notes as "note: ..." or "warning: ...".
local function render(ctx, list)
  local lines = {}
  for i, p in ipairs(list) do
    lines[i] = (p.kind and p.kind .. ': ' or '') .. ctx.source .. ': ' .. (p.path ~= '' and p.path .. ': ' or '')
               .. p.msg
  end
  return lines
end

-- check(path_or_table [, {world_size = 1, source = name, given = {optimizer
-- = the first param group of the optimizer passed to initialize,
-- batch_size = the micro batch passed to it (fills an "auto" one),
-- optimizer_function = true when a function builds it, scheduler = the
-- params the scheduler passed to it was built with, hidden_size = the
-- model's}}]) -> resolved or nil, problems (list of
-- lines), notes (list of lines: what dslua does not act on, "auto" values
-- as resolved, unknown top-level keys). Never raises. initialize and
-- --check-config both run it, and nothing else checks the config.
-- Unknown top-level keys are warnings (DeepSpeed reads the top level key by
-- key), errors when a near miss of a known key; inside a block DeepSpeed
-- validates they are errors.
function M.check(src, opts)
  opts = opts or {}
  local ctx = { problems = {}, notes = {}, bad = {}, autos = {}, given = opts.given or {},
                source = opts.source or (type(src) == 'string' and src) or 'config' }
  local ws = opts.world_size or 1
  if not (finite(ws) and ws >= 1 and ws == math.floor(ws)) then
    problem(ctx, 'world_size', 'must be a positive integer, got ' .. describe(ws))
    ws = 1
  end
  ctx.world_size = ws
  local raw = read_source(ctx, src)
  if ctx.raw_error then return nil, { ctx.raw_error }, {} end
  local cfg
  if raw ~= nil then
    if not is_object(raw) then
      problem(ctx, '', 'the config must be a JSON object, got ' .. describe(raw))
    else
      cfg = check_block(ctx, '', raw, TOP)
      if not (ctx.bad.train_batch_size or ctx.bad.train_micro_batch_size_per_gpu
              or ctx.bad.gradient_accumulation_steps) then
        if not resolve_sampler_batch(ctx, cfg) then resolve_batch(ctx, cfg, ws) end
        finish_sampler(ctx, cfg)
      end
      resolve_autos(ctx, cfg)
      cross_checks(ctx, cfg)
      check_paths(ctx, cfg)
    end
  end
  for _, n in ipairs(ctx.notes) do n.kind = n.kind or 'note' end
  if #ctx.problems > 0 then return nil, render(ctx, ctx.problems), render(ctx, ctx.notes) end
  return cfg, {}, render(ctx, ctx.notes)
end

-- field_problem(key, v, source) -> what check would say of v as the value
-- of the top-level key (one line, prefixed by source), or nil: the checks
-- of a value set after initialize (engine:set_train_batch_size).
function M.field_problem(key, v, source)
  local ctx = { problems = {}, notes = {}, bad = {}, source = source }
  check_value(ctx, key, v, TOP.fields[key])
  return ctx.problems[1] and render(ctx, ctx.problems)[1]
end

-- A resolved value as "path = value" lines, one per leaf, in key order.
local function value_lines(v, path, out)
  if type(v) == 'table' then
    local keys = sorted_keys(v)
    if #keys == 0 then out[#out + 1] = path .. ' = {}' end
    for _, k in ipairs(keys) do value_lines(v[k], join(path, k), out) end
  else
    local shown = type(v) == 'number' and (json.number(v) or tostring(v))
    out[#out + 1] = path .. ' = ' .. (shown or type(v) == 'string' and json.encode(v) or tostring(v))
  end
  return out
end

-- "path = value" lines as their paths in order and a map path -> value.
local function parse_lines(lines)
  local order, map = {}, {}
  for i, l in ipairs(lines) do
    local k, v = l:match('^(.-) = (.*)$')
    order[i], map[k] = k, v
  end
  return order, map
end

-- The first path, in lines' order then others', given another value by
-- others: path, this value, the other ('absent' where a side lacks it).
local function first_difference(lines, others)
  local order, mine = parse_lines(lines)
  local extra, theirs = parse_lines(others)
  for _, k in ipairs(order) do
    if mine[k] ~= theirs[k] then return k, mine[k], theirs[k] or 'absent' end
  end
  for _, k in ipairs(extra) do
    if mine[k] == nil then return k, 'absent', theirs[k] end
  end
end

-- agree(cfg, extra): every rank's resolved config, with extra lines
-- (what it built from it: the schedule's first lrs), against rank 0's by
-- SHA-256, one small all_gather; where they differ every rank learns
-- every rank's lines and raises naming, per rank that differs, the first
-- key and both values. Every rank calls it.
function M.agree(cfg, extra)
  local ds = require 'dslua'
  local core = require 'dslua.core'
  local lines = value_lines(cfg, '', {})
  for _, l in ipairs(extra or {}) do lines[#lines + 1] = l end
  local text = table.concat(lines, '\n')
  local hash = core.ckpt.sha256(text)
  local words = {}
  for i = 1, 8 do words[i] = tonumber(hash:sub(8 * i - 7, 8 * i), 16) end
  local hashes = ds.comm.all_gather(ds.tensor(words, 'f64'), { log_name = 'config' })
  local same = true
  for r = 1, #hashes do same = same and table.concat(hashes[r]:totable(), ',') == table.concat(words, ',') end
  if same then return end
  local texts = ds.comm.all_gather(core._reload.to_bytes(text), { log_name = 'config' })
  local first, msgs = nil, {}
  for r, t in ipairs(texts) do
    local theirs = {}
    for l in (core._reload.from_bytes(t) .. '\n'):gmatch('(.-)\n') do theirs[#theirs + 1] = l end
    if r == 1 then
      first = theirs
    else
      local key, v, v0 = first_difference(theirs, first)
      if key then msgs[#msgs + 1] = string.format('%s is %s on rank %d, %s on rank 0', key, v, r - 1, v0) end
    end
  end
  error('initialize: the resolved config differs across ranks (every rank must run the same one): '
        .. table.concat(msgs, '; '), 0)
end

-- load(path_or_table [, {world_size = 1}]) -> resolved config, notes.
-- Raises one error listing every problem, one per line.
function M.load(src, opts)
  local cfg, problems, notes = M.check(src, opts)
  if not cfg then error(table.concat(problems, '\n'), 0) end
  return cfg, notes
end

-- `dslua --check-config FILE [--world-size N]`: the resolved config as
-- JSON on stdout (notes on stderr), or the problems on stderr. Returns
-- whether the config is valid.
function M.check_cli(path, world_size)
  local ws = 1
  if world_size ~= nil then
    ws = tonumber(world_size)
    if not (ws and ws >= 1 and ws == math.floor(ws)) then
      io.stderr:write('dslua: --world-size must be a positive integer, got ', tostring(world_size), '\n')
      return false
    end
  end
  local cfg, problems, notes = M.check(path, { world_size = ws })
  for _, n in ipairs(notes) do io.stderr:write(n, '\n') end
  if cfg then
    local ok, err = pcall(require('dslua.engine').check_builds, cfg, path)
    if not ok then cfg, problems = nil, { path .. ': ' .. tostring(err):gsub('^[^\n]-:%d+: ', '') } end
  end
  if not cfg then
    for _, p in ipairs(problems) do io.stderr:write(p, '\n') end
    return false
  end
  io.stdout:write(json.encode(cfg, 2), '\n')
  return true
end

return M
