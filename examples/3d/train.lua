-- 3D parallelism, the layout DeepSpeed draws for Megatron-DeepSpeed: a
-- pipeline (1F1B over micro batches) whose stages are tensor parallel
-- (Megatron's column- then row-parallel MLP blocks), data parallel with
-- ZeRO-1 across the copies of the pipeline. A student of 4 blocks
-- (blocks.lua) learns a fixed random teacher's outputs.
--   dslua -n 8 examples/3d/train.lua --config examples/3d/ds.json    # pipe 2 x tensor 2 x data 2
--   dslua examples/3d/train.lua --config examples/3d/ds.json         # one rank: the same steps
--         [--pipe N] [--tensor N] [--steps N]
-- --pipe defaults to 2 and --tensor to 2 where the world holds them (1
-- each on one rank); the data degree is the rest of the world.
local ds = require 'dslua'
package.path = (arg[0]:match('^(.*)/') or '.') .. '/?.lua;' .. package.path

local world = ds.comm.world_size()
local opts = { pipe = math.min(2, world), steps = 60 }
opts.tensor = math.min(2, world / opts.pipe)
local rest = ds.args.rest
for i = 1, #rest, 2 do
  local key, value = rest[i]:match('^%-%-(%w+)$'), rest[i + 1]
  if key ~= 'pipe' and key ~= 'tensor' and key ~= 'steps' then
    error(string.format("unknown argument '%s' (expected --pipe N, --tensor N, --steps N)", rest[i]), 0)
  end
  opts[key] = assert(tonumber(value), '--' .. key .. ' needs a number')
end

local W, BLOCKS, SAMPLES = 32, 4, 4096
-- pipe outermost, tensor innermost: a tensor group's ranks are neighbours
local topo = ds.topology { pipe = opts.pipe, tensor = opts.tensor }
local group = topo:group('tensor')

local layers = require('blocks').layers(BLOCKS, W, group)
local model = ds.pipe.PipelineModule { layers = layers, topology = topo, partition_method = 'uniform',
                                       loss_fn = function(out, y) return ds.mse_loss(out, y) end }

-- the teacher: y = tanh(x A) B, the same on every rank
ds.manual_seed(7)
local A, Bm = ds.randn(W, W) / math.sqrt(W), ds.randn(W, W) / math.sqrt(W)
local x = ds.randn(SAMPLES, W)
local data = ds.data.tensors { x = x, y = ds.matmul(ds.matmul(x, A):tanh(), Bm) }

local engine = ds.initialize { model = model, config = ds.args.config, training_data = data }
local c = topo:coord()
ds.comm.print(string.format('pipe %d x data %d x tensor %d: stage %d, data index %d, tensor rank %d, layers %d..%d',
                            opts.pipe, model.dp_size, opts.tensor, c.pipe, c.data, c.tensor,
                            model:stage_layers(model.stage_id)))
local loss
for step = 1, opts.steps do
  loss = engine:train_batch()
  if step % 20 == 0 then ds.comm.print0(string.format('step %d: loss %.6f', step, loss)) end
end
ds.comm.print0(string.format('done: %d steps, loss %.6f', opts.steps, loss))
