-- ds.config: a DeepSpeed ds_config.json read with the meaning DeepSpeed's
-- code gives it (deepspeed/runtime/config.py, constants.py, the pydantic
-- models of precision_config.py, zero/config.py, zero/offload_config.py,
-- comm/config.py), every default filled in under DeepSpeed's key names.
-- Every problem is collected, each naming the file and the key path, and
-- reported at once. dslua's own blocks (M.extension_keys) pass through.
local json = require 'dslua.base.json'
local file = require 'dslua.base.file'
local S = require 'dslua.base.schema'
local describe, describe_value, join, problem, note = S.describe, S.describe_value, S.join, S.problem, S.note
local field, bool, int, num, enum = S.field, S.bool, S.int, S.num, S.enum
local str, strlist, any, block, is_object = S.str, S.strlist, S.any, S.block, S.is_object
local copy, finite, check_value = S.copy, S.finite, S.check_value
local sorted_keys, check_block = S.sorted_keys, S.check_block
local zero_config = require 'dslua.engine.zero_config'
local optim_config = require 'dslua.optim.config'
local sampler_config = require 'samplers.config'
local live_config = require 'dslua.live.config'
local fp8_config = require 'dslua.nn.fp8_config'

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

------------------------------------------------------------------------
-- The blocks, as DeepSpeed's config classes define them

-- dslua's own: f32 matmuls on TF32 tensor cores, PyTorch's
-- torch.backends.cuda.matmul.allow_tf32; unset leaves ds.backends' switch
local FP32 = { fields = {
  allow_tf32 = bool(nil, { nullable = true }),
} }

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

-- AutoTP's size acts on a model with a tensor-parallel form: initialize
-- splits it (ctx.tensor), and the batch triple counts the data-parallel
-- ranks, the world over it. ctx.given.tensor: the degree the model passed
-- to initialize is split into already.
local function check_tensor_parallel(ctx, path, v)
  local t = check_value(ctx, path, v, block(TENSOR_PARALLEL))
  if not t then return nil end
  local size, split = math.max(t.autotp_size, t.tp.tp_size), ctx.given.tensor or 1
  if size <= 1 then
    note(ctx, path, 'AutoTP is off (size <= 1): nothing for dslua to do')
    return t
  end
  if split > 1 and split ~= size then
    return problem(ctx, path, string.format('tensor parallelism over %d ranks: the model is split across %d ranks '
                   .. 'already (its tp)', size, split))
  end
  if ctx.world_size % size ~= 0 then
    return problem(ctx, path, string.format('tensor parallelism over %d ranks does not divide the world of %d rank%s',
                   size, ctx.world_size, ctx.world_size == 1 and '' or 's'))
  end
  note(ctx, path, string.format('tensor parallelism over %d ranks: initialize splits a model with a tensor-parallel '
       .. 'form (models.gpt2, models.llama; docs/parallel.md), data parallel over the world / %d', size, size))
  ctx.tensor = size
  return t
end

-- DeepSpeed-Ulysses' degree: the model splits its sequences
-- (sequence_parallel in models.gpt2 and models.llama; initialize checks
-- that the two agree), the batch counts data indices (data_world).
local function check_sequence_parallel(ctx, path, v)
  return check_value(ctx, path, v, int(1, 1))
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
  -- the backend of device tensors, as deepspeed.init_distributed's dist_backend:
  -- nccl, mpi (through host memory; gloo is the same), null: auto (ds.comm.backend)
  dist_backend = enum(nil, { 'nccl', 'mpi', 'gloo', 'auto' }, { nullable = true }),
  gradient_predivide_factor = num(1.0, nil, { above = 0 }),
  fp16 = block(FP16),
  bf16 = block(BF16),
  fp32 = block(FP32),
  comms_logger = block(COMMS),
  checkpoint = block(CHECKPOINT),
  activation_checkpointing = block(ACT_CKPT),
  pipeline = block(PIPELINE),
  tensorboard = block(TENSORBOARD),
  csv_monitor = block(TENSORBOARD),
  wandb = block(WANDB),
  comet = block(COMET),
  flops_profiler = block(FLOPS_PROFILER),
  fp8 = block(fp8_config.SCHEMA),     -- dslua's own: linear layers in FP8 (nn/fp8.lua)
  zero_optimization = field('custom', nil, { check = zero_config.check, fill = true }),
  optimizer = field('custom', nil, { check = optim_config.check_optimizer }),
  scheduler = field('custom', nil, { check = optim_config.check_scheduler }),
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

-- checked from here on, no longer passed through as M.extension_keys are
TOP.fields.sampler = field('custom', nil, { check = sampler_config.check })
TOP.fields.reload = live_config.reload
TOP.fields.hooks = field('custom', nil, { check = live_config.check_hooks })

-- the blocks' own names, as ds.config has always given them
M.sampler_policies, M.share_tolerance = sampler_config.sampler_policies, sampler_config.share_tolerance
M.check_sampler = sampler_config.check_sampler
M.hook_names = live_config.hook_names

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

-- The ranks the batch triple counts, the data-parallel ones (DeepSpeed's
-- world size): the world over the tensor degree (the model's split, or
-- AutoTP's) and over sequence_parallel_size (a sequence group, DeepSpeed-
-- Ulysses', reads one batch).
local function data_world(ctx, cfg, ws)
  local tp = math.max(ctx.tensor or 1, ctx.given.tensor or 1)
  if ws % tp == 0 then ws = ws / tp end
  local sp = cfg.sequence_parallel_size or 1
  if ws % sp ~= 0 then
    problem(ctx, 'sequence_parallel_size', string.format('%d ranks per sequence do not divide the world of %d rank%s',
                                                         sp, ws, ws == 1 and '' or 's'))
  else
    ws = ws / sp
  end
  ctx.world_size = ws
  return ws
end

-- check(path_or_table [, {world_size = 1, source = name, given = {optimizer
-- = the first param group of the optimizer passed to initialize, tensor =
-- the degree the model is split into (world_size counts its ranks),
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
      ws = data_world(ctx, cfg, ws)
      if not (ctx.bad.train_batch_size or ctx.bad.train_micro_batch_size_per_gpu
              or ctx.bad.gradient_accumulation_steps) then
        if not sampler_config.resolve_batch(ctx, cfg) then resolve_batch(ctx, cfg, ws) end
        sampler_config.finish(ctx, cfg)
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
