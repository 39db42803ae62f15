-- One cell of the configuration matrix, trained in this process (one of
-- its ranks under mpirun): the model of spec/matrix/model.lua through
-- ds.initialize with the cell's config for settings.STEPS optimizer steps.
-- Step s reads samples (s - 1) * G + 1 .. s * G of the data (G the global
-- batch): micro step j of data-parallel rank r takes the r-th piece of
-- the j-th run of sum(micro batches) samples. The reference is a cell of
-- its own: one fp32 rank, the G samples in one micro step. A resumed
-- cell runs as two: steps 1 .. SAVE then save_checkpoint, and (another
-- launch, on resume_ranks(c) ranks) load_checkpoint then the rest.
local ds = require 'dslua'
local Model = require 'matrix.model'
local S = require 'matrix.settings'

local M = {}

-- Where data-parallel rank dp (0-based) reads micro step j of step s.
local function piece(micro, ga, s, j, dp)
  local per = 0
  for _, b in ipairs(micro) do per = per + b end
  local first = (s - 1) * per * ga + (j - 1) * per
  for r = 1, dp do first = first + micro[r] end
  return first + 1, micro[dp + 1]
end

-- The mean loss of each step over its G samples, weighted by sample count.
local function plain_steps(engine, data, micro, ga, dp, steps)
  local losses = {}
  for s = steps[1], steps[2] do
    local sum, n = 0, 0
    for j = 1, ga do
      local first, b = piece(micro, ga, s, j, dp)
      engine:backward(engine(Model.slice(data, first, b)))
      sum, n = sum + engine.last_loss * b, n + b
      engine:step()
    end
    local t = ds.tensor({ sum, n }, 'f64')
    if ds.comm.world_size() > 1 then ds.comm.all_reduce(t, 'sum') end
    local v = t:totable()
    losses[#losses + 1] = v[1] / v[2]
  end
  return losses
end

local function pipe_steps(engine, data, micro, ga, dp, steps)
  local losses = {}
  for s = steps[1], steps[2] do
    local j = 0
    losses[#losses + 1] = engine:train_batch(function()
      j = j + 1
      return Model.slice(data, piece(micro, ga, s, j, dp))
    end)
  end
  return losses
end

-- Trains a model (plain, or pipeline of `pipe` stages; split over tp
-- ranks by the config) with cfg over the micro batches `micro` (per
-- data-parallel rank) and ga micro steps a step: this rank's {losses,
-- weights, skipped}. run: {save = dir} stops after step S.SAVE and saves
-- there, {load = dir} loads and trains the steps after S.SAVE (their
-- losses only).
function M.train(cfg, micro, ga, pipe, tp, run)
  jit.flush()        -- traces keep the objects they specialised on (the last engine) alive
  require('dslua.engine').settle_garbage()
  run = run or {}
  local per = 0
  for _, b in ipairs(micro) do per = per + b end
  local data = Model.data(per * ga * S.STEPS)
  local model = pipe == 'none' and Model.plain(tp) or Model.pipeline(pipe)
  if not model.is_pipeline and tp == 1 and ds.comm.rank() > 0 then
    -- other weights than rank 0's: initialize must broadcast its own (a
    -- tensor group's ranks build the same model, as every user's do)
    ds.no_grad(function()
      for _, p in ipairs(model:parameters()) do p:add_(1) end
    end)
  end
  local engine = ds.initialize { model = model, config = cfg }
  local ok, out = pcall(function()
    if run.load then engine:load_checkpoint(run.load) end
    local steps = { run.load and S.SAVE + 1 or 1, run.save and S.SAVE or S.STEPS }
    local dp = (model.is_pipeline or model.tensor_group) and model.dp_rank or ds.comm.rank()
    local losses = (model.is_pipeline and pipe_steps or plain_steps)(engine, data, micro, ga, dp, steps)
    if run.save then engine:save_checkpoint(run.save) end
    return { losses = losses, weights = Model.weights(model), skipped = engine.skipped_steps }
  end)
  engine:destroy()
  if not ok then error(out, 0) end
  return out
end

-- The cell c (settings.lua's table; c.save or c.load: a resumed cell's
-- first or second run); nvme: a folder of its own.
function M.run(c, nvme)
  return M.train(S.config(c, nvme), S.micro_batches(c), c.ga, c.pipe, c.tp, { save = c.save, load = c.load })
end

-- The reference of c: one fp32 rank, stage 0, the global batch at once.
function M.reference(c)
  return M.train(S.reference_config(c), { S.global_batch(c) }, 1, 'none', c.tp)
end

return M
