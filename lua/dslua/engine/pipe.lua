-- The pipeline engine's verbs, for an engine whose model is a
-- ds.pipe.PipelineModule: train_batch runs gradient_accumulation_steps
-- micro batches through DeepSpeed's 1F1B schedule (TrainSchedule), then
-- the optimizer steps; eval_batch runs them forward only.
--
-- Activations go stage to stage with ds.comm: a small header (dtype code,
-- ndim, dims) then the tensor; gradients come back shaped like the
-- activation that was sent. Sends are asynchronous (waited for at the end
-- of the batch), receives block: with blocking sends two neighbouring
-- stages could both wait in a send (one an activation, the other a
-- gradient). The first and last stage read the data iterator (inputs and
-- labels), once per micro batch; each data-parallel rank of a stage talks
-- to the rank of its own data index on the next stage. Tied weights'
-- gradients are summed across their stages after the last backward, before
-- the data-parallel reduction (DeepSpeed's ReduceTiedGrads, ReduceGrads).
local ds = require 'dslua'

local M = {}

local fmt = string.format
local DTYPES = { 'f32', 'f64', 'f16', 'bf16', 'i64', 'i32' }
local CODE = {}
for i, d in ipairs(DTYPES) do CODE[d] = i end
local HEADER = 10    -- code, ndim, up to 8 dims

-- DeepSpeed's TrainSchedule for one stage: S - stage - 1 forwards to fill
-- the pipe, then one forward and one backward in turn, then the rest of
-- the backwards. {'F' | 'B', micro batch}.
function M.schedule(stage, S, gas)
  local out, f, b = {}, 0, 0
  for _ = 1, math.min(S - stage - 1, gas) do
    f = f + 1
    out[#out + 1] = { 'F', f }
  end
  while b < gas do
    if f < gas then
      f = f + 1
      out[#out + 1] = { 'F', f }
    end
    b = b + 1
    out[#out + 1] = { 'B', b }
  end
  return out
end

-- What initialize checks of a pipeline's config, and the pipeline block
-- it applies: ZeRO-1 over the data-parallel ranks of each stage at most
-- (DeepSpeed's PipelineEngine refuses gradient partitioning).
function M.check(m, cfg)
  local stage = cfg.zero_optimization.stage
  if stage >= 2 then
    error(fmt('initialize: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (zero_optimization.stage '
              .. 'is %d): use stage 0 or 1', stage), 0)
  end
  if cfg.sampler then
    error('initialize: the sampler block does not run with a pipeline (every stage reads the same micro batches)', 0)
  end
  local p = cfg.pipeline
  if p.stages ~= 'auto' and p.stages ~= m.num_stages then
    error(fmt('initialize: pipeline.stages is %d, the PipelineModule has %d stages', p.stages, m.num_stages), 0)
  end
  if m.activation_checkpoint_interval == 0 then
    rawset(m, 'activation_checkpoint_interval', p.activation_checkpoint_interval)
  end
end

local function shape_str(t) return '[' .. table.concat(t:size(), 'x') .. ']' end

-- the rank of this data index on another stage
local function peer(m, stage) return m.topology:get_rank(stage, m.dp_rank) end

local function send_activation(t, dst, sends)
  local code = CODE[t:dtype()]
  if not code then error(fmt('pipeline: cannot send a %s activation between stages', t:dtype()), 0) end
  local size = t:size()
  if #size > HEADER - 2 then error(fmt('pipeline: an activation of %d dims, at most %d', #size, HEADER - 2), 0) end
  local h = { code, #size }
  for i = 1, HEADER - 2 do h[#h + 1] = size[i] or 0 end
  local header = ds.tensor(h, 'i64')
  local data = t:detach():contiguous()
  sends[#sends + 1] = { ds.comm.isend(header, dst), header }
  sends[#sends + 1] = { ds.comm.isend(data, dst), data }
end

local function recv_activation(src)
  local header = ds.comm.recv(ds.zeros({ HEADER }, 'i64'), src):totable()
  local shape = {}
  for i = 1, header[2] do shape[i] = header[2 + i] end
  return ds.comm.recv(ds.zeros(shape, DTYPES[header[1]]), src)
end

-- the iterator's batch: one value, or inputs and labels as two (x, y)
local function next_batch(data_iter, who)
  local batch, labels = data_iter()
  if batch == nil then error(who .. ': the data iterator ran out', 0) end
  if labels ~= nil then
    if not ds.is_tensor(batch) then
      error(fmt('%s: the data iterator returned a %s and a %s: return {x, y}, {x = .., y = ..} or x, y (tensors)',
                who, type(batch), type(labels)), 0)
    end
    return { batch, labels }
  end
  return batch
end

-- the inputs and labels of a batch: {x = .., y = ..} or {inputs, labels},
-- on the engine's device, floats in its compute dtype (as engine:forward)
local function split(engine, batch)
  local x, y = batch, nil
  if type(batch) == 'table' and not ds.is_tensor(batch) then
    if batch.x ~= nil then x, y = batch.x, batch.y else x, y = batch[1], batch[2] end
  end
  local place = require('dslua.engine').place
  local dtype = engine.steps.dtype ~= 'f32' and engine.steps.dtype or nil
  return place(engine.device, dtype, x), place(engine.device, dtype, y)
end

-- one micro batch forward on this stage (in the engine's fp8 scope where
-- its fp8 block is on): the output, and the loss on the last
local function forward(m, x, mb, labels, fp8)
  local ok, out
  if fp8 then
    ok, out = pcall(ds.fp8.autocast, fp8, m.forward, m, x)
  else
    ok, out = pcall(m.forward, m, x)
  end
  if not ok then
    if m.stage_id == 0 then error(out, 0) end
    local first = m:stage_layers(m.stage_id)
    error(fmt('pipeline: stage %d (from layer %d) failed on the %s activation stage %d sent (micro batch %d): %s',
              m.stage_id, first, shape_str(x), m.stage_id - 1, mb, tostring(out)), 0)
  end
  if m.stage_id < m.num_stages - 1 then return out end
  if m.loss_fn then
    if labels == nil then
      error(fmt('pipeline: micro batch %d has no labels for loss_fn: the data iterator returns {x, y}, '
                .. '{x = .., y = ..} or x, y', mb), 0)
    end
    return out, m.loss_fn(out, labels)
  end
  return out, out
end

-- The engine's training loader, repeated epoch after epoch (DeepSpeed's
-- RepeatingLoader), as an iterator of batches.
local function loader_iter(engine, who)
  local loader = engine.training_dataloader
  if not loader then
    error(who .. ': no data iterator given and no training_data given to ds.initialize', 3)
  end
  if not engine.pipe_data then
    local it
    engine.pipe_data = function()
      for _ = 1, 2 do
        it = it or loader:epoch()
        local step, batch = it()
        if step ~= nil then return batch end
        it = nil
      end
      error(who .. ': the training loader has no batch', 0)
    end
  end
  return engine.pipe_data
end

local function check_iter(engine, data_iter, who)
  if not engine.module.is_pipeline then
    error(fmt('%s: the model is not a ds.pipe.PipelineModule; train it with engine:forward, backward and step', who), 3)
  end
  if data_iter == nil and who == 'train_batch' then return loader_iter(engine, who) end
  if type(data_iter) ~= 'function' then
    error(fmt('%s: expected a data iterator (a function returning the next batch), got %s', who, type(data_iter)), 3)
  end
  return data_iter
end

-- The mean loss over the micro batches and data-parallel ranks, on every
-- rank (DeepSpeed's _aggregate_total_loss): only last stages add theirs,
-- of tensor-parallel ones tensor rank 0.
local function mean_loss(m, total, gas)
  if ds.comm.world_size() == 1 then return total / gas end
  local last = m.stage_id == m.num_stages - 1 and m.tensor_rank == 0
  local t = ds.tensor({ last and total / (gas * m.dp_size) or 0 }, 'f64')
  return ds.comm.all_reduce(t, 'sum'):item()
end

-- A tied weight counts once in the gradient norm: on its first stage.
local function exclude_tied(engine, m)
  if engine.pipe_norm_set then return end
  engine.pipe_norm_set = true
  local steps = engine.steps
  for _, t in ipairs(m.tied_groups) do
    if not t.first then
      for _, w in ipairs(t.tensors) do steps:exclude_from_norm(w) end
    end
  end
end

function M.train_batch(engine, data_iter)
  data_iter = check_iter(engine, data_iter, 'train_batch')
  local m = engine.module
  exclude_tied(engine, m)
  -- tied weights: their gradients are summed across stages before the
  -- data-parallel reduction, which then starts after the last backward
  local tied = #m.tied_groups > 0
  local gas = engine:gradient_accumulation_steps()
  local first, last = m.stage_id == 0, m.stage_id == m.num_stages - 1
  local inputs, outputs, losses, sends = {}, {}, {}, {}
  local total = 0
  engine:train()
  engine.busy_since = engine.busy_since or ds.wall_time()
  for _, action in ipairs(M.schedule(m.stage_id, m.num_stages, gas)) do
    local kind, mb = action[1], action[2]
    if kind == 'F' then
      local x, labels
      if first or last then x, labels = split(engine, next_batch(data_iter, 'train_batch')) end
      if not first then
        x = recv_activation(peer(m, m.stage_id - 1))
        if x:dtype():match('^b?f') then x:requires_grad_(true) end
      end
      local out, loss = forward(m, x, mb, labels, engine.fp8)
      inputs[mb] = x
      if last then
        losses[mb] = loss
      else
        outputs[mb] = out
        send_activation(out, peer(m, m.stage_id + 1), sends)
      end
    else
      local boundary = engine:is_gradient_accumulation_boundary()
      if last then
        total = total + losses[mb]:item()
        engine:backward(losses[mb], not tied)
      else
        local out = outputs[mb]
        local g = ds.comm.recv(ds.zeros(out:size(), out:dtype()), peer(m, m.stage_id + 1))
        -- d/d out of sum(out * g) is g itself: backward with the gradient
        -- the next stage sent, through the step engine like any loss
        engine:_backward((out * g):sum(), boundary and not tied)
      end
      if not first then
        local gx = inputs[mb].grad
        if not gx then gx = ds.zeros(inputs[mb]:size(), inputs[mb]:dtype()) end
        sends[#sends + 1] = { ds.comm.isend(gx, peer(m, m.stage_id - 1)), gx }
      end
      -- after the send: the stage before may still wait for that gradient
      if tied and boundary then
        m:allreduce_tied_weight_gradients()
        engine:_backward(nil, true)
      end
      inputs[mb], outputs[mb], losses[mb] = nil, nil, nil
      engine:step()
    end
  end
  for _, s in ipairs(sends) do s[1]:wait() end
  local loss = mean_loss(m, total, gas)
  engine.last_loss = loss
  return loss
end

-- eval_batch(data_iter [, return_logits]) -> the mean loss [, on the last
-- stage the list of each micro batch's outputs (nil elsewhere)]
function M.eval_batch(engine, data_iter, return_logits)
  data_iter = check_iter(engine, data_iter, 'eval_batch')
  local m = engine.module
  local gas = engine:gradient_accumulation_steps()
  local first, last = m.stage_id == 0, m.stage_id == m.num_stages - 1
  local sends, total, outputs = {}, 0, {}
  engine:eval()
  ds.no_grad(function()
    for mb = 1, gas do
      local x, labels
      if first or last then x, labels = split(engine, next_batch(data_iter, 'eval_batch')) end
      if not first then x = recv_activation(peer(m, m.stage_id - 1)) end
      local out, loss = forward(m, x, mb, labels, engine.fp8)
      if last then
        total = total + loss:item()
        outputs[mb] = out
      else
        send_activation(out, peer(m, m.stage_id + 1), sends)
      end
    end
  end)
  for _, s in ipairs(sends) do s[1]:wait() end
  engine:train()
  local loss = mean_loss(m, total, gas)
  if return_logits then return loss, last and outputs or nil end
  return loss
end

return M
