-- The training engine: DeepSpeed's initialize / forward / backward / step
-- over a dslua model, optimizer, LR scheduler and loader, with DeepSpeed's
-- config semantics and log lines.
--
-- The step itself is engine.steps (dslua/engine/step.lua), one object over
-- the C step engine for every mode: plain data parallel in fp32, or mixed
-- precision and ZeRO through dslua/engine/zero.lua.
-- engine:backward and engine:step each call the step engine once and cross
-- into C a fixed number of times (spec/engine_spec.lua counts them).
--
-- On N ranks (world_size > 1) it is data parallel: initialize broadcasts
-- the parameters and buffers from rank 0 and feeds its loader through
-- samplers/distributed.lua; the backward of each accumulation boundary
-- reduces the gradients in buckets of reduce_bucket_size elements, each
-- launched as soon as backward has completed all its gradients, and step
-- waits for them before the optimizer runs. What the last boundary's
-- reduction did is in engine.comm_stats.
--
-- With a `sampler` block (samplers/policy.lua) each rank reads its own
-- share of the data in its own micro batches, and gradients are weighted
-- by sample count (samplers/weighting.lua): every boundary all-reduces this rank's samples of the
-- accumulation window, each rank's loss is scaled by
-- samples_r * world_size / global_samples (the bucket all-reduce then
-- averages), so a step equals one step of a single process over the union
-- of every rank's samples of the step (the mean over all of them, not the
-- mean of per-rank means). Ranks that run out of steps join (engine:join,
-- which the engine's loader calls when an epoch's iterator ends): they
-- take part in the other ranks' steps with zero-weight gradients until
-- every rank is out. A window left unfinished at that point is stepped
-- with what it has, so with the sampler block no accumulation window
-- spans an epoch end of the engine's loader.
local ds = require 'dslua'
local progress = require 'dslua.io.progress'
local Step = require 'dslua.engine.step'
local report = require 'dslua.engine.report'
local log, timers = report.log, report.timers

local M = {}

local Engine = {}

-- engine.last_loss is read from the device when first asked for, not in
-- backward: waiting there for the forward to finish would be a second
-- host synchronisation per step. Asked after engine:step(), whose
-- gradient norm waits anyway, it costs nothing.
--
-- engine.zero: the ZeRO view of the step (dslua/engine/zero.lua: what each
-- rank holds, its masters, gathers), nil in plain fp32 data parallel.
function Engine.__index(self, key)
  if key == 'zero' then return rawget(self, 'steps') and self.steps.zero end
  if key ~= 'last_loss' then return Engine[key] end
  local pending = rawget(self, 'pending_loss')
  if not pending then return nil end
  self.pending_loss = nil
  local v = pending:item()
  rawset(self, 'last_loss', v)
  return v
end
Engine.methods = Engine   -- what the REPL completes, __index being a function
for k, f in pairs(report.methods) do Engine[k] = f end   -- its logs, timers and memory report
M.settle_garbage = report.settle_garbage

local now = ds.wall_time

local function build_optimizer(opts, cfg, params)
  local o = opts.optimizer
  if type(o) == 'function' then o = o(params) end
  if o ~= nil then
    if type(o) ~= 'table' or o._h == nil or type(o.param_groups) ~= 'table' then
      error('initialize: optimizer must be a ds.optim optimizer (SGD, Adam, AdamW, Adagrad, Lamb, Lion) or a '
            .. 'function returning one', 3)
    end
    return o
  end
  if cfg.optimizer then return ds.optim.from_config(params, cfg.optimizer) end
  error("initialize: no optimizer: pass `optimizer` or set an 'optimizer' block in the config", 3)
end

-- DeepSpeed's _configure_lr_scheduler: a scheduler passed to initialize
-- wins over the config's, and rank 0 says which it uses.
local function build_scheduler(opts, cfg, optimizer, rank)
  local s = opts.lr_scheduler
  if s ~= nil and cfg.scheduler and rank == 0 then
    io.stdout:write(string.format("[Rank 0] using the client LR scheduler passed to initialize, not the config's "
                                  .. 'scheduler %s (as DeepSpeed since August 2024; before, the config\'s won)\n',
                                  tostring(cfg.scheduler.type)))
    io.stdout:flush()
  end
  if type(s) == 'function' then return ds.lr.lambda(optimizer, s) end
  if s ~= nil then
    if type(s) ~= 'table' or type(s.step) ~= 'function' then
      error('initialize: lr_scheduler must be a scheduler (with step()) or a function(step) -> lr', 3)
    end
    return s
  end
  if cfg.scheduler then return ds.lr.from_config(optimizer, cfg.scheduler) end
  return nil
end

-- A config file's "lua" schedule path is taken from its folder (a table
-- config's from the working directory).
local function schedule_path(cfg, source)
  local sched = cfg.scheduler
  local dir = type(source) == 'string' and source:match('^(.*)/[^/]*$')
  if dir and sched and sched.type == 'lua' and type(sched.params.path) == 'string'
     and sched.params.path:sub(1, 1) ~= '/' then
    sched.params.path = dir .. '/' .. sched.params.path
  end
end

-- What initialize builds from the config alone (the loss scaler, the
-- optimizer, the scheduler), on a stand-in parameter: --check-config runs
-- it after ds.config.check, so it refuses what initialize would. source:
-- the config file.
function M.check_builds(cfg, source)
  schedule_path(cfg, source)
  if cfg.fp16.enabled then require('dslua.engine.loss_scaler').from_config(cfg.fp16) end
  local params = { ds.zeros(1):requires_grad_() }
  local optimizer = cfg.optimizer and build_optimizer({}, cfg, params) or ds.optim.SGD(params, { lr = 0 })
  build_scheduler({}, cfg, optimizer)
end

-- model_parameters (tensors, or groups {params = {...}, ...}) with every
-- tensor that model:to(device) replaced swapped for its replacement.
local function moved_params(list, moved)
  local function swap(ts)
    local out = {}
    for i, t in ipairs(ts) do out[i] = moved[t] or t end
    return out
  end
  if not ds.is_tensor(list[1]) and type(list[1]) == 'table' then
    local groups = {}
    for i, g in ipairs(list) do
      local c = {}
      for k, v in pairs(g) do c[k] = v end
      c.params = type(g.params) == 'table' and swap(g.params) or g.params
      groups[i] = c
    end
    return groups
  end
  return swap(list)
end

-- What the config's "auto" values resolve from (ds.config.check's given):
-- the optimizer passed in (its first group), the params the scheduler
-- passed in was built with, the micro batch passed in (batch_size) and the
-- model's hidden size.
-- This rank's GPU when other ranks share it ({gpu, first, last}), else nil.
local function shared_gpu()
  local s = ds.cuda.shared()
  return s and s.first < s.last and s or nil
end

local function config_given(opts, model)
  local o, s, c = opts.optimizer, opts.lr_scheduler, rawget(model, 'config')
  return { optimizer = type(o) == 'table' and type(o.param_groups) == 'table' and o.param_groups[1] or nil,
           scheduler = type(s) == 'table' and type(s.params) == 'table' and s.params or nil,
           optimizer_function = type(o) == 'function', batch_size = opts.batch_size,
           hidden_size = type(c) == 'table' and (c.hidden_size or c.n_embd) or nil,
           tensor = model.tensor_group and model.tensor_group:size() or nil }
end

-- DeepSpeed's tensor_parallel.autotp_size (or tp.tp_size) above 1 splits
-- a model built whole through its parallelize (the config checker has
-- seen that the degree divides the world).
local function split_for_autotp(model, cfg)
  local t = cfg.tensor_parallel
  local size = t and math.max(t.autotp_size, t.tp.tp_size) or 1
  if size <= 1 or model.tensor_group then return end
  if type(model.parallelize) ~= 'function' then
    error(string.format('initialize: tensor_parallel.autotp_size %d: the model (%s) has no tensor-parallel form; '
                        .. 'models.gpt2 and models.llama have one (docs/parallel.md)', size,
                        tostring(model.__name or type(model))), 3)
  end
  model:parallelize(size)
end

-- The config's sequence_parallel_size is the model's (DeepSpeed's engine
-- builds the groups from it; here the model did, from its own setting).
local function check_sequence_parallel(cfg, model)
  local P, mine = cfg.sequence_parallel_size, model.sequence_parallel or 1
  if P ~= mine then
    error(string.format('initialize: sequence_parallel_size is %d in the config but the model splits its sequences '
                        .. 'over %d ranks (its sequence_parallel)', P, mine), 3)
  end
  if P > 1 and model.tensor_group then
    error('initialize: sequence_parallel_size ' .. P .. ' cannot combine with tensor parallelism (the model is split '
          .. 'over ' .. model.tensor_group:size() .. ' ranks)', 3)
  end
  if P > 1 and cfg.sampler then
    error('initialize: the sampler block sets each rank\'s own batches, but the ranks of a sequence group '
          .. '(sequence_parallel_size ' .. P .. ') must read the same ones', 3)
  end
end

-- Lamb's trust ratio |w| / |u| is a whole parameter's: a tensor rank holds
-- a piece of each split weight and the pieces' norms are not summed over
-- the tensor group, so its steps would not be one rank's.
local function check_lamb_split(model, optimizer)
  local t = model.tensor_group and model.tensor_group:size() or 1
  if t > 1 and optimizer.name == 'Lamb' then
    error(string.format('initialize: %s under tensor parallelism (the model is split over %d ranks): its trust '
                        .. "ratios need whole weights' norms, and each tensor rank holds a piece of a split weight; "
                        .. 'use AdamW or Adam', optimizer.onebit and 'OneBitLamb' or 'Lamb', t), 3)
  end
end

local KNOWN_OPTS = {
  model = true, config = true, config_params = true, training_data = true, model_parameters = true,
  optimizer = true, lr_scheduler = true, collate_fn = true, args = true, batch_size = true,
}

-- ds.initialize{model, config, training_data, model_parameters, optimizer,
-- lr_scheduler, collate_fn, batch_size} -> engine, optimizer, loader,
-- scheduler; batch_size: the micro batch per rank the script uses, which
-- an "auto" train_micro_batch_size_per_gpu takes (as Hugging Face's does)
function M.initialize(opts)
  if type(opts) ~= 'table' then error('initialize: expected a table of options', 2) end
  for k in pairs(opts) do
    if not KNOWN_OPTS[k] then error(string.format("initialize: unknown option '%s'", tostring(k)), 2) end
  end
  local bs = opts.batch_size
  if bs ~= nil and not (type(bs) == 'number' and bs >= 1 and bs == math.floor(bs) and bs < math.huge) then
    error('initialize: batch_size must be a positive integer, got ' .. tostring(bs), 2)
  end
  local model = opts.model
  if type(model) ~= 'table' or type(model.parameters) ~= 'function' then
    error('initialize: model must be a ds.nn module', 2)
  end
  local source = opts.config or opts.config_params or (opts.args and opts.args.config) or ds.args.config
  if source == nil then
    error('initialize: no config: pass `config` (a path or a table) or run with --config ds.json', 2)
  end
  local world_size = ds.comm and ds.comm.world_size() or 1
  -- a pipeline's ranks split into stages: data parallel runs across dp_size
  if model.is_pipeline then world_size = model.dp_size end
  -- a tensor-parallel model's (the config sees its tensor and data ranks)
  if model.tensor_group then world_size = model.dp_size * model.tensor_group:size() end
  local cfg, notes = ds.config.load(source, { world_size = world_size, given = config_given(opts, model) })
  split_for_autotp(model, cfg)
  if model.tensor_group then world_size = model.dp_size end
  schedule_path(cfg, source)
  check_sequence_parallel(cfg, model)
  -- a sequence group reads one batch: the data indices are the batch's
  -- replicas; gradients are reduced over dp_group (nil: the world), data x sequence
  world_size = world_size / cfg.sequence_parallel_size
  local reduce_size = ds.comm and ds.comm.world_size(model.dp_group) or 1
  require('dslua.nn.checkpointing').configure(cfg.activation_checkpointing)
  require('dslua.base.guard').budget = cfg.reload.budget     -- before the schedule file runs

  if cfg.comms_logger.enabled then ds.comm.configure_logger(cfg.comms_logger) end
  if cfg.fp32.allow_tf32 ~= nil then ds.backends.cuda.matmul.allow_tf32 = cfg.fp32.allow_tf32 end

  -- this rank's device (ds.device(): --device, DSLUA_DEVICE, else the GPU
  -- LOCAL_RANK picks when there is one, else the CPU), before any
  -- collective: too many ranks for the GPUs is an error here, not NCCL's
  local ok, device = pcall(ds.device)
  if not ok then error('initialize: ' .. (tostring(device):gsub('^[^\n]-:%d+: ', '')), 2) end
  -- the backend of device tensors (dist_backend, DSLUA_COMM_BACKEND, else
  -- MPI where ranks share a GPU), said at start and checked before any collective
  if cfg.dist_backend then ds.comm.set_backend(cfg.dist_backend, 'dist_backend') end
  if device ~= 'cpu' then
    local chosen, err = pcall(ds.comm.backend)
    if not chosen then error('initialize: ' .. (tostring(err):gsub('^[^\n]-:%d+: ', '')), 2) end
  end
  local _, moved = model:to(device)
  local params = opts.model_parameters and moved_params(opts.model_parameters, moved) or model:parameters()
  local rank = ds.comm and ds.comm.rank() or 0
  if rank == 0 and #notes > 0 then      -- once: what dslua does not act on, "auto" as resolved
    io.stdout:write(table.concat(notes, '\n'), '\n')
    io.stdout:flush()
  end
  if rank == 0 and cfg.fp16.enabled and tostring(device) == 'cpu' then
    io.stderr:write('dslua: fp16 on the CPU: oneDNN 2.x has no f16 matmul, so matmuls widen to f32 and round back, '
                    .. 'slower than fp32 and bf16 (bench/precision.lua); bf16 is the CPU\'s 16-bit type\n')
  end
  if model.is_pipeline then require('dslua.engine.pipe').check(model, cfg) end
  -- the step's mode, chosen once: every later question is the step's
  local steps = Step.new { model = model, params = params, cfg = cfg, rank = rank, world_size = reduce_size,
                           device = device, optimizer = opts.optimizer,
                           build_optimizer = function(ps) return build_optimizer(opts, cfg, ps) end }
  local optimizer = steps.optimizer
  check_lamb_split(model, optimizer)
  local scheduler = build_scheduler(opts, cfg, optimizer, rank)
  -- one resolved config and one first lr on every rank (a difference in
  -- lr or gradient_clipping would train on, the ranks drifting apart)
  if ds.comm and ds.comm.world_size() > 1 then
    local firsts, num = {}, require('dslua.base.json').number
    for i, g in ipairs(optimizer.param_groups) do
      firsts[i] = string.format('(the first lr of param group %d) = %s', i, num(g.lr) or tostring(g.lr))
    end
    -- ranks on two backends would wait on each other for ever
    if device ~= 'cpu' then firsts[#firsts + 1] = '(the backend of device tensors) = ' .. ds.comm.backend() end
    ds.config.agree(cfg, firsts)
  end

  local self = setmetatable({
    module = model, config = cfg, optimizer = optimizer, lr_scheduler = scheduler, steps = steps, device = device,
    scaler = cfg.fp16.enabled and require('dslua.engine.loss_scaler').from_config(cfg.fp16) or nil,
    rank = rank, world_size = world_size, reduce_size = reduce_size,
    shared_gpu = device ~= 'cpu' and shared_gpu() or nil,   -- each rank's memory in the log
    micro_steps = 0, global_steps = 0, global_samples = 0, skipped_steps = 0,
    timers = cfg.wall_clock_breakdown and timers() or nil,
    busy_time = 0,
    weighted = cfg.sampler ~= nil,            -- gradients weighted by sample count (the sampler block)
    -- this rank's samples and compute time in the current window
    window = require('samplers.weighting').new(world_size, cfg.sampler ~= nil),
  }, Engine)
  -- the fp8 block: every Linear but those marked fp8 = false, by name
  if cfg.fp8.enabled then self.fp8 = ds.fp8.recipe(cfg.fp8):register(model) end
  -- csv_monitor, tensorboard, wandb, comet: their directories checked now
  self.monitor = require('dslua.io.monitor').new(cfg, rank)
  self.flops_profiler = require('dslua.nn.flops').new(self)   -- flops_profiler, at profile_step

  if self.fp8 and rank == 0 then
    io.stdout:write(self.fp8:describe(), '\n')
    io.stdout:flush()
  end
  local zero = steps.zero
  if zero and rank == 0 then
    for _, line in ipairs(zero:describe()) do io.stdout:write(line, '\n') end
    if zero.offload == 'cpu' and device == 'cpu' then
      io.stdout:write('ZeRO | offload_optimizer device cpu: the optimizer already runs on the CPU here (no-op)\n')
    end
    if zero.param_offload == 'cpu' and device == 'cpu' then
      io.stdout:write('ZeRO | offload_param device cpu: the parameter shards are in host memory already here (no-op)\n')
    end
    io.stdout:flush()
  end

  -- the engine's loader hands out batches on the device; on a GPU two
  -- threads gather them into page-locked memory and each batch goes up
  -- while the step before it runs
  local on = { device = device, num_workers = device ~= 'cpu' and 2 or nil, collate_fn = opts.collate_fn }
  local loader
  if opts.training_data ~= nil and cfg.sampler then
    -- the sampler block's policy: this rank's indices and micro batches,
    -- a line per rank and epoch
    local P = require 'samplers.policy'
    self.sampler = P.new(cfg.sampler, { dataset = opts.training_data, rank = model.dp_rank or self.rank,
                                        world_size = world_size,
                                        source = type(source) == 'string' and source or nil })
    loader = P.loader(opts.training_data, self.sampler, on)
    self:_watch_loader(loader)
  elseif opts.training_data ~= nil then
    -- DeepSpeed's loader: a DistributedSampler (shuffle, seed 0) on N
    -- ranks; on one rank the loader's own shuffle, the same order
    local sampler = world_size > 1 and require('samplers.distributed').new(opts.training_data, {
      num_replicas = world_size, rank = model.dp_rank or self.rank,
    }) or nil
    loader = ds.data.loader(opts.training_data, {
      batch_size = cfg.train_micro_batch_size_per_gpu, shuffle = sampler == nil, sampler = sampler,
      collate_fn = on.collate_fn, device = on.device, num_workers = on.num_workers,
    })
    self:_watch_loader(loader)
  end
  self.training_dataloader = loader
  -- live reload, hooks and `dslua attach` (dslua/live/reload.lua), at each step boundary
  self.reload = require('dslua.live.reload').session(self, cfg)
  self:train()
  if cfg.dump_state then require('dslua.io.monitor').dump_state(self) end
  return self, optimizer, loader, scheduler
end

---------------------------------------------------------------- finish and destroy

-- The end of training: prints the comms logger's summary (DeepSpeed's
-- table) when the config enables it. Every rank calls it.
function Engine:finish()
  self:join()
  if self.config.comms_logger.enabled then ds.comm.log_summary() end
end

-- DeepSpeed's destroy(): the engine lets go of the model's hooks (ZeRO
-- stage 3 gathers parameters no more) so it and its buffers can be freed.
function Engine:destroy()
  if self.training_dataloader then self.training_dataloader.epoch = nil end   -- the engine's wrapper goes
  if self.steps then self.steps:close() end
  if self.reload then self.reload:close() end
  if self.monitor then self.monitor:close() end
  self.steps, self.optimizer, self.lr_scheduler = nil, nil, nil
  -- the verbs that need what went say so, rather than index a nil field
  for _, verb in ipairs({ 'backward', 'step', 'join' }) do
    self[verb] = function()
      error('engine:' .. verb .. ': the engine was destroyed (engine:destroy()); make a new one with ds.initialize', 2)
    end
  end
end

---------------------------------------------------------------- loader

-- Each epoch of the engine's own loader gets a progress bar on a terminal.
-- With a sampler, each step's batch size is noted for the weighting and
-- the end of an epoch joins (engine:join) the ranks still running.
function Engine:_watch_loader(loader)
  local epoch = loader.epoch
  local engine = self
  local sampler = self.sampler
  loader.epoch = function(l, e)
    e = e or (l.current_epoch or 0) + 1
    engine.epoch = e
    local it
    if sampler then it = epoch(l, e) end
    local steps = math.floor((sampler and sampler:steps() or #l) / engine:gradient_accumulation_steps())
    -- under mpirun a rank's stdout is a pty of mpirun's, not the user's
    -- terminal: multi-rank runs print plain lines
    if steps > 0 and engine.rank == 0 and ds.comm.world_size() == 1 and ds.isatty(1) then
      engine.bar = progress.new { total = steps, label = string.format('epoch %s', tostring(e)),
                                  unit = 'samples', tty = true }
      engine.bar_first_step = engine.global_steps
      engine.bar_first_samples = engine.global_samples
    else
      engine.bar = nil
    end
    if not sampler then return epoch(l, e) end
    local step = l.position and l.position.epoch == e and l.position.step or 0    -- resumed (loader:resume)
    return require('samplers.join').epoch(engine, engine.window, sampler, it, step)
  end
end

-- a PipelineModule's verbs (dslua.engine.pipe.lua)
function Engine:train_batch(data_iter) return require('dslua.engine.pipe').train_batch(self, data_iter) end
function Engine:eval_batch(data_iter, return_logits)
  return require('dslua.engine.pipe').eval_batch(self, data_iter, return_logits)
end

function Engine:train_batch_size() return self.config.train_batch_size end
function Engine:train_micro_batch_size_per_gpu() return self.config.train_micro_batch_size_per_gpu end
function Engine:gradient_accumulation_steps() return self.config.gradient_accumulation_steps end

function Engine:train()
  self.module:train()
  self.training = true
end

function Engine:eval()
  self.module:eval()
  self.training = false
  if self.reload then self.reload:hook('on_eval', self) end
end

-- The samples of a micro step: the batch's first dimension (batch.x or
-- the first tensor argument), else the sampler's size of the step.
local function batch_samples(a)
  if type(a) == 'table' and ds.is_tensor(a.x) and a.x:dim() > 0 then return a.x:size(1) end
  if ds.is_tensor(a) and a:dim() > 0 then return a:size(1) end
  return nil
end

-- Tensor arguments (and tensors one level inside a table argument) on the
-- engine's device, float ones in the model's dtype under bf16/fp16, as
-- the user's .to(device) and .half() in DeepSpeed.
local FLOATS = { f32 = true, f64 = true, bf16 = true, f16 = true }

local function place(device, dtype, v)
  if ds.is_tensor(v) then
    if v:device() ~= device then v = v:to(device) end
    if dtype and FLOATS[v:dtype()] and v:dtype() ~= dtype then v = v:to(dtype) end
    return v
  end
  if type(v) == 'table' and getmetatable(v) == nil then
    local c = {}
    for k, x in pairs(v) do c[k] = ds.is_tensor(x) and place(device, dtype, x) or x end
    return c
  end
  return v
end

M.place = place

local function place_inputs(device, dtype, ...)
  local args = { n = select('#', ...), ... }
  for i = 1, args.n do args[i] = place(device, dtype, args[i]) end
  return unpack(args, 1, args.n)
end

function Engine:forward(...)
  self:_start('forward')
  local t0 = now()
  -- throughput counts from a window's first forward to its step's end, as
  -- DeepSpeed's ThroughputTimer: evaluation and data waits between stay out
  self.busy_since = self.busy_since or t0
  self.window:batch(batch_samples((...)))
  -- a rank that runs out of data under stage 3 repeats the last forward
  -- with zero weight, so its gathers match the others'
  local steps = self.steps                    -- nil after destroy(): the module still runs forward
  if self.weighted and steps and steps.stage == 3 then self.last_inputs = { n = select('#', ...), ... } end
  local out
  local dtype = steps and steps.dtype ~= 'f32' and steps.dtype or nil
  local module = self.module
  local function run(...) return module:forward(...) end
  if self.fp8 then run = function(...) return ds.fp8.autocast(self.fp8, module.forward, module, ...) end end
  if dtype or self.device ~= 'cpu' then
    out = run(place_inputs(self.device, dtype, ...))
  else
    out = run(...)
  end
  self.window:time(now() - t0)
  self:_stop('forward')
  return out
end

Engine.__call = Engine.forward

-- The loss is divided by gradient_accumulation_steps, so the accumulated
-- gradient is the mean over the global batch, as DeepSpeed scales it.
-- allreduce_gradients false: the boundary's reduction is left to the caller
-- (engine:_backward(nil, true)), as DeepSpeed's backward(loss, allreduce_gradients).
function Engine:backward(loss, allreduce_gradients)
  if not ds.is_tensor(loss) then error('backward: expected the loss tensor, got ' .. type(loss), 2) end
  if loss:numel() ~= 1 then
    error(string.format('backward: the loss must hold one value, got %d', loss:numel()), 2)
  end
  self:_start('backward')
  self.last_loss, self.pending_loss = nil, loss:detach()
  if self.monitor then self.monitor:loss(self.pending_loss) end
  local boundary = self:is_gradient_accumulation_boundary()
  -- fp32 from here under mixed precision (DeepSpeed's loss.float() * scale)
  if self.steps.zero then loss = loss:to('f32') end
  if self.weighted then
    loss = self:_weighted_loss(loss, boundary)
  else
    local gas = self:gradient_accumulation_steps()
    if gas > 1 then loss = loss / gas end
    self.window:add(self:train_micro_batch_size_per_gpu())
  end
  if self.scaler then loss = loss * self.scaler.cur_scale end
  local t0 = now()
  self:_backward(loss, boundary and allreduce_gradients ~= false)
  if self.weighted then self.window:time(now() - t0) end
  self:_stop('backward')
  return loss
end

-- One backward through the step engine (loss nil: none, for a rank that
-- has run out of data); at the boundary the gradients are reduced.
function Engine:_backward(loss, boundary) self.steps:backward(loss, boundary) end

---------------------------------------------------------------- weighting by samples

-- This micro step's loss and the window's earlier gradients weighted by
-- sample count (samplers/weighting.lua).
function Engine:_weighted_loss(loss, boundary)
  local f, earlier = self.window:weigh(boundary)
  if not f then
    error('backward: cannot tell how many samples this micro step has: pass the batch ({x = ...} or x first) '
          .. 'to engine:forward, or read batches from the engine\'s loader', 3)
  end
  self.steps:scale_grads(earlier)
  if f ~= 1 then loss = loss * f end
  return loss
end

-- engine:join(): for a rank whose data has run out (samplers/join.lua
-- runs the protocol). Every rank calls it, any number of times (the
-- engine's loader calls it at the end of each epoch; call it after a loop
-- over your own batches). Without a sampler block: nothing. A loop whose
-- ranks take different numbers of steps must not run its own per-step
-- collectives (averaging the loss, say): the joined ranks only match the
-- engine's.
function Engine:join()
  if self.weighted then require('samplers.join').join(self, self.window) end
end

-- The join's moves: a micro step's backward without a step; the window's
-- last backward and its step, its gradients times f; a window dropped.
function Engine:_idle_micro_step(loss)
  self:_backward(loss, false)
  self.micro_steps = self.micro_steps + 1
end

function Engine:_join_step(loss, f)
  local gas = self:gradient_accumulation_steps()
  self.steps:scale_grads(f)
  self:_backward(loss, true)
  self.micro_steps = self.micro_steps - self.micro_steps % gas + gas - 1      -- the window's last micro step
  self:step()
end

function Engine:_drop_window()
  self.micro_steps = self.micro_steps - self.micro_steps % self:gradient_accumulation_steps()
end

-- Stage 3 gathers parameters in forward: a rank with no data runs the
-- last forward again for a loss of zero weight (nil below stage 3).
function Engine:_shadow_loss()
  if self.steps.stage ~= 3 then return nil end
  local args = self.last_inputs
  if not args then
    error(string.format('join: rank %d ran out of data before its first step; with zero_optimization.stage 3 '
                        .. 'every rank needs at least one batch', self.rank), 2)
  end
  local out = self.module:forward(unpack(args, 1, args.n))
  if type(out) == 'table' and not ds.is_tensor(out) then out = out.loss or out[1] end
  return out:to('f32'):sum() * 0
end

function Engine:is_gradient_accumulation_boundary()
  return (self.micro_steps + 1) % self:gradient_accumulation_steps() == 0
end

function Engine:get_lr()
  local out = {}
  for i, g in ipairs(self.optimizer.param_groups) do out[i] = g.lr end
  return out
end

function Engine:get_mom()
  local out = {}
  for i, g in ipairs(self.optimizer.param_groups) do out[i] = g.betas or g.momentum or 0 end
  return out
end

-- The samples of the window on every data-parallel rank, which read as
-- many (DistributedSampler pads): global_samples counts them, so an epoch
-- adds its length on any world size. DeepSpeed adds train_batch_size each
-- step, a short last batch too; rank 0 says so the first time they differ.
-- Without engine:backward (a pipeline's train_batch) train_batch_size.
function Engine:_samples_read()
  local tbs = self:train_batch_size()
  if self.window.samples == 0 then return tbs end
  local read = self.window.samples * tbs / (self:train_micro_batch_size_per_gpu() * self:gradient_accumulation_steps())
  if read ~= tbs and not self.said_samples then
    self.said_samples = true
    log(self, 'global_samples counts the samples read: %d at step %d (DeepSpeed adds train_batch_size, %d, every step)',
        read, self.global_steps, tbs)
  end
  return read
end

function Engine:step()
  self:_start('step')
  local boundary = self:is_gradient_accumulation_boundary()
  if boundary then
    self:_take_step()
    self.global_steps = self.global_steps + 1
    -- weighted: the samples of every rank's window, told the auto policy
    local read = not self.weighted and self:_samples_read()
    local stepped = self.window:stepped(self.sampler)
    self.global_samples = self.global_samples + (read or stepped)
  end
  self.micro_steps = self.micro_steps + 1
  self:_stop('step')
  if boundary then
    self.busy_time = self.busy_time + (now() - (self.busy_since or now()))
    self.busy_since = nil
    self:_report()
    if self.reload then self.reload:boundary() end
  end
end

-- The step engine's step: the reduction waited for, clipping (DeepSpeed's
-- unscale-and-clip under ZeRO and mixed precision, torch's
-- clip_grad_norm_ otherwise), the optimizer. With fp16, or bf16 with
-- check_grad_overflow, an inf or NaN gradient on any rank skips it:
-- counted in skipped_steps, fp16's scale drops, the scheduler does not
-- step (DeepSpeed's _take_model_step).
function Engine:_take_step()
  local clip = self.config.gradient_clipping or 0
  local scaler = self.scaler
  local check = scaler ~= nil or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow)
  local steps = self.steps
  local overflow, norm = steps:step(scaler and scaler.cur_scale or 1, clip, check)
  -- the next step's fp8 scales, skipped step or not; amaxes agree over the
  -- ranks that hold the same layers and see other data
  if self.fp8 then self.fp8:update(self.module.dp_group) end
  if self.reduce_size > 1 then self.comm_stats = steps:stats() end
  self.onebit_stats = steps:onebit_stats() or nil
  if ds.comm.logging() then
    for _, r in ipairs(steps:comm_records()) do ds.comm.log_collective(r[1], r[2], r[3]) end
  end
  self.overflow = overflow
  if overflow then
    self.skipped_steps = self.skipped_steps + 1
    local message = require('dslua.engine.loss_scaler').overflow_line { rank = self.rank }
    if scaler then
      scaler:update_scale(true)
      message = scaler.message
    end
    if self.rank == 0 and message then
      io.stdout:write(message, '\n')
      io.stdout:flush()
    end
    return
  end
  if norm then self.grad_norm = norm end
  if scaler then scaler:update_scale(false) end
  if self.lr_scheduler then self.lr_scheduler:step() end
end

-- The whole model as a state dict of its (16-bit under bf16/fp16) weights;
-- under ZeRO stage 3 every rank calls it (the parameters are gathered),
-- and it needs stage3_gather_16bit_weights_on_model_save, as DeepSpeed's
-- save_16bit_model.
function Engine:module_state_dict()
  if self.steps.stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save then
    error('module_state_dict: zero_optimization.stage3_gather_16bit_weights_on_model_save is false: the '
          .. 'stage 3 weights stay partitioned (set it to gather them)', 2)
  end
  return self.steps:gathered_parameters(self.module)
end

-- DeepSpeed's set_train_batch_size: the micro batch stays, the number of
-- accumulation steps changes. n is checked as the config's
-- train_batch_size is.
function Engine:set_train_batch_size(n)
  local why = ds.config.field_problem('train_batch_size', n, 'set_train_batch_size')
  if why or n <= 0 then error(why or string.format('Train batch size: %d has to be greater than 0', n), 2) end
  local mb = self:train_micro_batch_size_per_gpu()
  if n % (mb * self.world_size) ~= 0 then
    error('Train batch size must be divisible by micro-batch data parallelism', 2)
  end
  self.config.gradient_accumulation_steps = n / (mb * self.world_size)
  self.config.train_batch_size = n
end

-- The step counters, as a checkpoint keeps them. engine.global_steps and
-- the others stay readable fields, as DeepSpeed's are; only the step and
-- restore_counters write them.
local COUNTERS = { 'global_steps', 'global_samples', 'micro_steps', 'skipped_steps' }

function Engine:counters()
  local t = { epoch = self.epoch }
  for _, k in ipairs(COUNTERS) do t[k] = self[k] end
  return t
end

-- Sets the counters from counters() of a run saved at an accumulation
-- boundary with saved_gas accumulation steps: micro_steps becomes as many
-- windows of this run's length (another number of data-parallel ranks
-- changes it), and the throughput report starts from the restored samples.
function Engine:restore_counters(t, saved_gas)
  if type(t) ~= 'table' then error('restore_counters: counters must be a table, got ' .. type(t), 2) end
  local function count(k, v)
    if type(v) ~= 'number' or v < 0 or v ~= math.floor(v) then
      error(string.format('restore_counters: %s must be a non-negative integer, got %s', k, tostring(v)), 3)
    end
  end
  for _, k in ipairs(COUNTERS) do count(k, t[k]) end
  if t.epoch ~= nil then count('epoch', t.epoch) end
  local gas = self:gradient_accumulation_steps()
  saved_gas = saved_gas or gas
  if type(saved_gas) ~= 'number' or saved_gas < 1 or saved_gas ~= math.floor(saved_gas) then
    error('restore_counters: saved gradient_accumulation_steps must be a positive integer, got '
          .. tostring(saved_gas), 2)
  end
  self.global_steps, self.global_samples, self.skipped_steps, self.epoch =
    t.global_steps, t.global_samples, t.skipped_steps, t.epoch
  self.micro_steps = math.floor(t.micro_steps / saved_gas) * gas
  self.resumed_samples = t.global_samples
  self.last_report = { busy = self.busy_time, samples = t.global_samples }
end

-- DeepSpeed's checkpoint verbs (dslua/io/checkpoint/): every rank calls
-- them. save_checkpoint(dir [, tag [, client_state [, save_latest]]]) ->
-- true, the tag defaulting to global_step<N>; load_checkpoint(dir [, tag [, {
-- load_optimizer_states, load_lr_scheduler_states, load_module_only,
-- load_module_strict}]]) -> path, client_state, the tag defaulting to the
-- one dir/latest names (nil, nil when there is none).
function Engine:save_checkpoint(dir, tag, client_state, save_latest)
  if self.reload then self.reload:hook('on_save', self, dir, tag) end
  return require('dslua.io.checkpoint').save(self, dir, tag, client_state, save_latest)
end

function Engine:load_checkpoint(dir, tag, opts)
  return require('dslua.io.checkpoint').load(self, dir, tag, opts)
end

-- DeepSpeed's save_16bit_model: the whole model in its compute dtype
-- (fp32 without bf16/fp16) in one safetensors file, nanoGPT's key names,
-- written by rank 0 (every rank calls it). -> true
function Engine:save_16bit_model(dir, filename)
  return require('dslua.io.checkpoint').save_model(self, dir .. '/' .. (filename or 'model.safetensors'))
end

return M
