-- The optimizer and scheduler blocks' checkers: DeepSpeed's types and their
-- parameters as dslua implements them (optim/init.lua, optim/lr.lua), their
-- "auto" values filled as Hugging Face fills them.
local json = require 'dslua.base.json'
local suggest = require 'dslua.base.suggest'
local S = require 'dslua.base.schema'
local describe, describe_value, join, unknown, problem = S.describe, S.describe_value, S.join, S.unknown, S.problem
local note, field, bool, int, num = S.note, S.field, S.bool, S.int, S.num
local enum, str, is_object, copy, check_block = S.enum, S.str, S.is_object, S.copy, S.check_block

local M = {}

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

-- The optimizer or scheduler block v checked against keys, its params
-- defaulted to {}, and whether its type is a name to look up (nil and
-- false for null and for anything not an object).
local function typed_block(ctx, path, v, keys)
  if v == json.null then return nil, false end
  if not is_object(v) then return problem(ctx, path, 'must be an object, got ' .. describe(v)), false end
  local b = check_block(ctx, path, v, keys)
  b.params = b.params or {}
  return b, type(b.type) == 'string'
end

local function check_optimizer(ctx, path, v)
  local o, typed = typed_block(ctx, path, v, OPTIMIZER_BLOCK)
  if not typed then return o end
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
  local s, typed = typed_block(ctx, path, v, SCHEDULER_BLOCK)
  if not typed then return s end
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

M.check_optimizer = check_optimizer
M.check_scheduler = check_scheduler

return M
