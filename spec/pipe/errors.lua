-- Run by spec/pipe_spec.lua under mpirun on 2 ranks: arg[1] names the
-- mistake; the run must fail with a message that names it.
local ds = require 'dslua'
local nn = ds.nn
local LayerSpec = ds.pipe.LayerSpec

local case = assert(arg[1], 'usage: errors.lua no_params|shapes|layout')
if case == 'no_params' then
  ds.pipe.PipelineModule { layers = { LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.ReLU), LayerSpec(nn.ReLU),
                                      LayerSpec(nn.Tanh) }, num_stages = 2, partition_method = 'uniform' }
elseif case == 'layout' then
  -- a pipeline's checkpoint loaded into the same layers as one model
  local config = { train_micro_batch_size_per_gpu = 3, optimizer = { type = 'SGD', params = { lr = 0.1 } } }
  local dir = arg[2]
  local model = ds.pipe.PipelineModule { layers = { LayerSpec(nn.Linear, 4, 6), LayerSpec(nn.Linear, 6, 2) },
                                         num_stages = 2 }
  ds.initialize { model = model, config = config }:save_checkpoint(dir, 'pipe')
  local plain = ds.initialize { model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), config = config }
  plain:load_checkpoint(dir, 'pipe')
else
  -- stage 0 ends in a [B, 6] activation, stage 1 starts with a Linear of 5 inputs
  local model = ds.pipe.PipelineModule {
    layers = { LayerSpec(nn.Linear, 4, 6), LayerSpec(nn.Linear, 5, 2) }, num_stages = 2,
    loss_fn = function(out) return out:sum() end,
  }
  local engine = ds.initialize { model = model, config = {
    train_micro_batch_size_per_gpu = 3, optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
  engine:train_batch(function() return { x = ds.randn(3, 4), y = ds.zeros(3) } end)
end
