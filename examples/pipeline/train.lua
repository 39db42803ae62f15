-- DeepSpeed's pipeline tutorial on MNIST: the MLP as a PipelineModule of
-- LayerSpecs split into stages by parameter count, engine:train_batch()
-- reading the engine's own loader, 1F1B over the micro batches, then the
-- test accuracy through eval_batch.
--   dslua -n 2 examples/pipeline/train.lua --config examples/pipeline/ds.json      # 2 stages
--   dslua -n 4 examples/pipeline/train.lua --config examples/pipeline/ds.json      # 2 stages x 2 data
--         [--stages N] [--steps N] [--data DIR] [--save DIR] [--load DIR]
-- --stages defaults to 2 (1 on one rank); the other ranks are data
-- parallel. --steps defaults to one epoch of the 8,000 training images.
-- --save DIR saves a checkpoint there after the last step; --load DIR
-- resumes from its latest one and trains up to --steps.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
package.path = here .. '/../mnist/?.lua;' .. package.path
local mnist = require 'mnist_common'
local world = ds.comm.world_size()
local opts = { stages = math.min(2, world) }
local rest = ds.args.rest
for i = 1, #rest, 2 do
  local key, value = rest[i]:match('^%-%-(%w+)$'), rest[i + 1]
  if key == 'data' or key == 'save' or key == 'load' then
    opts[key] = assert(value, '--' .. key .. ' needs a value')
  elseif key == 'stages' or key == 'steps' then
    opts[key] = assert(tonumber(value), '--' .. key .. ' needs a number')
  else
    error(string.format("unknown argument '%s' (expected --stages N, --steps N, --data DIR, --save DIR, --load DIR)",
                        rest[i]), 0)
  end
end
local dir = mnist.data_or_skip(here, opts.data)

ds.manual_seed(42)
local train, test = mnist.datasets(dir)
local model = ds.pipe.PipelineModule {
  layers = require('models.mlp').pipe_layers { hidden = { 512, 256 } },
  num_stages = opts.stages, loss_fn = ds.cross_entropy, partition_method = 'parameters',
}
local engine = ds.initialize { model = model, config = ds.args.config or (here .. '/ds.json'), training_data = train }
local gas, dp = engine:gradient_accumulation_steps(), model.dp_size
local steps = opts.steps or math.floor(#train / engine:train_batch_size())

-- every stage's layers and parameter count, printed by rank 0
local counts = {}
for s = 1, model.num_stages do counts[s] = 0 end
if model.dp_rank == 0 then counts[model.stage_id + 1] = model:num_parameters() end
if world > 1 then counts = ds.comm.all_reduce(ds.tensor(counts, 'f64'), 'sum'):totable() end
if ds.comm.rank() == 0 then
  print(string.format('MNIST from %s: %d training images, %d test images; %d ranks: %d stages x %d data parallel; '
                      .. '%d micro batches of %d a step; %d steps', dir, #train, #test, world, model.num_stages, dp,
                      gas, engine:train_micro_batch_size_per_gpu(), steps))
  for s = 0, model.num_stages - 1 do
    local a, b = model:stage_layers(s)
    print(string.format('stage %d: layers %d..%d, %d parameters', s, a, b, counts[s + 1]))
  end
end

if opts.load then engine:load_checkpoint(opts.load) end
for _ = engine.global_steps + 1, steps do engine:train_batch() end
if opts.save then engine:save_checkpoint(opts.save) end

-- The test set in one eval_batch: gas x dp micro batches, this data rank's
-- share of them; the last stage counts what it classifies right.
local per = #test / (gas * dp)
local batches = ds.data.loader(test, { batch_size = per, shuffle = false })
local mine, labels = {}, {}
for k, batch in batches:epoch(1) do
  if math.floor((k - 1) / gas) == model.dp_rank then
    mine[#mine + 1] = batch
    labels[#labels + 1] = batch.y
  end
end
local i = 0
local loss, logits = engine:eval_batch(function()
  i = i + 1
  return mine[i]
end, true)
local correct = 0
for k, out in ipairs(logits or {}) do correct = correct + out:argmax(-1):eq(labels[k]):sum():item() end
if world > 1 then correct = ds.comm.all_reduce(ds.tensor({ correct }, 'f64'), 'sum'):item() end
if ds.comm.rank() == 0 then
  print(string.format('test loss %.4f, accuracy %.2f%% (%d/%d) after %d steps', loss, 100 * correct / #test, correct,
                      #test, engine.global_steps))
end
