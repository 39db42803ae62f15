-- The training step of every mode, one object over the one C step engine
-- (core/train/ds_zero.h). The mode is chosen here, once, when the engine
-- is built: flat fp32 data parallel (the optimizer over the model's own
-- parameters), or fp32 masters for bf16, fp16 and ZeRO (dslua/engine/zero.lua
-- converts the model and builds the optimizer over the masters). The 1-bit
-- optimizers ride on either. Everything later asks this object: does this
-- micro step reduce (step:reduces), what holds the fp32 weights a
-- checkpoint keeps (step:holds), where the master of a group is.
-- step.engine is the C step engine itself (its buckets, for benchmarks);
-- step.zero the ZeRO wrapper (nil in plain fp32), which engine.zero reads.
local ds = require 'dslua'
local Zero = require 'dslua.engine.zero'
local zinit = require 'dslua.engine.zinit'
local C = require('dslua.core')

local M = {}

local Step = {}
Step.__index = Step

-- DeepSpeed's _broadcast_model: every rank starts from rank 0's weights.
-- A parameter built partitioned (ds.zero.Init) has no whole to send: its
-- shards were drawn from rank 0's generator state on every rank.
local function broadcast_model(model)
  for _, list in ipairs({ model:named_parameters(), model:named_buffers() }) do
    for _, entry in ipairs(list) do
      if not zinit.partitioned(entry[2]) then ds.comm.broadcast(entry[2], model.dp_root or 0, model.dp_group) end
    end
  end
end

-- The optimizer's own parameters, their gradients reduced in place.
local function flat_engine(cfg, model, optimizer)
  local lists = {}
  for gi, g in ipairs(optimizer.param_groups) do
    lists[gi] = {}
    for _, p in ipairs(g.params) do
      if p.requires_grad then lists[gi][#lists[gi] + 1] = p end
    end
  end
  return C._zero.engine(Zero.engine_options(cfg, {
    masters = false, optimizer = optimizer, groups = lists, group = model.dp_group,
    stages = model.model_parallel_group or model.pipe_group,
    prescale = cfg.prescale_gradients, predivide = cfg.gradient_predivide_factor,
  }))
end

-- opts: model, params, cfg, rank, world_size, device, optimizer (what
-- initialize was given), build_optimizer(params or groups) -> optimizer.
function M.new(opts)
  local cfg, model = opts.cfg, opts.model
  local s = setmetatable({ dtype = Zero.model_dtype(cfg), stage = cfg.zero_optimization.stage }, Step)
  if opts.world_size > 1 then broadcast_model(model) end
  if Zero.wanted(cfg) then
    if type(opts.optimizer) == 'table' then
      error('initialize: with bf16, fp16 or zero_optimization.stage >= 1 the optimizer is built over the fp32 '
            .. 'master weights: give it in the config or as a function(params) returning one', 3)
    end
    s.zero = Zero.new { model = model, params = opts.params, cfg = cfg, rank = opts.rank,
                        world_size = opts.world_size, device = opts.device, build_optimizer = opts.build_optimizer }
    s.optimizer, s.engine = s.zero.optimizer, s.zero.engine
  else
    s.optimizer = opts.build_optimizer(opts.params)
    s.engine = flat_engine(cfg, model, s.optimizer)
  end
  -- a parameter replicated across a tensor group counts once in the gradient norm: on tensor rank 0
  if model.tensor_group then
    for _, p in ipairs(ds.nn.parallel.norm_excluded(model, model.tensor_group)) do s.engine:exclude_from_norm(p) end
  end
  -- the answers are the engine's, fixed when it is built: asked once, not per backward
  s.reduce_in_window, s.reduce_at_boundary = s.engine:reduces(false), s.engine:reduces(true)
  if cfg.comms_logger.enabled then s.engine:set_logging(true) end
  -- the 1-bit optimizers step through the step engine (stage 0), and say when backward reduces
  if s.optimizer.onebit then s.onebit = C._onebit.new(s.engine, s.optimizer, s.optimizer.onebit) end
  return s
end

-- Does a backward reduce? boundary: it ends an accumulation window.
function Step:reduces(boundary)
  if boundary then return self.reduce_at_boundary end
  return self.reduce_in_window
end

-- loss's backward (nil: none, for a rank without data that still takes
-- part). At the boundary a 1-bit optimizer's compressed step takes this
-- rank's own gradients instead of reduced ones.
function Step:backward(loss, boundary)
  local reduce = boundary and (not self.onebit or self.onebit:reduces())
  self.local_grads = boundary and not reduce
  self.engine:backward(loss, self:reduces(reduce))
end

-- Multiplies the gradients accumulated so far by f (sample weighting).
function Step:scale_grads(f)
  if f ~= 1 then self.engine:scale_grads(f) end
end

-- The boundary's step: the reduction waited for, overflow check, unscale
-- and clip, the optimizer, the refresh. -> overflow, grad_norm (unscaled).
function Step:step(loss_scale, clip, check_overflow)
  if self.zero then
    if self.local_grads then self.engine:take_local_grads() end
    return self.zero:step(loss_scale, clip, check_overflow)
  end
  return self.engine:step(self.optimizer.param_groups, 1, clip, check_overflow)
end

-- param stays out of the gradient norm: a pipeline's tied weight on
-- every stage but the first that holds it (a tensor group's replicated
-- weights are left out when the step is built).
function Step:exclude_from_norm(param) self.engine:exclude_from_norm(param) end

-- The reduced backwards' statistics since the last step (nil before any).
function Step:stats() return self.engine:stats() end
function Step:onebit_stats() return self.onebit and self.onebit:stats() end
function Step:comm_records() return self.engine:comm_records() end

---------------------------------------------------------------- checkpoints

-- What holds the fp32 weights a checkpoint keeps: 'flat' (the optimizer's
-- own buffers over the parameters), 'masters' (the engine's), 'streamed'
-- (the nvme optimizer's files).
function Step:holds() return self.engine:holds() end

-- Param group g's fp32 weights, flat: checkpoints read and write them in place.
function Step:master(g)
  if self.zero then return self.zero:master(g) end
  return self.optimizer:flat_params(g)
end

-- The fp32 weights were loaded: the parameters take them (masters: the
-- nvme optimizer's, by group; nil: the engine's own were written).
function Step:masters_loaded(masters)
  if self.zero then self.zero:masters_loaded(masters) end
end

-- The whole model as a state dict of its compute-dtype weights (stage 3
-- gathers them: every rank calls it).
function Step:gathered_parameters(model)
  if not self.zero then return model:state_dict() end
  return self.zero:gathered_parameters()
end

function Step:close()
  if self.zero then self.zero:close() end
  if self.onebit then self.onebit:close() end
  if not self.zero then self.engine:close() end
end

return M
