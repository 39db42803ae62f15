-- MNIST on ranks with their own micro batches and shares of the data:
--   dslua -n 2 examples/uneven/train.lua --config examples/uneven/ds.json
--   dslua examples/uneven/train.lua --config examples/uneven/ds_1rank.json   (the comparison)
--         [--data DIR] [--epochs N] [--steps N] [--device cpu|cuda|cuda:N]
-- Trains the MLP of examples/mnist on the first 8,000 images of the t10k
-- files (shifted at random by up to 2 pixels) and reports, on rank 0, the
-- accuracy on the last 2,000 after every epoch. With a sampler block every
-- rank prints its line per epoch; the engine weights each rank's gradient
-- by its samples, and its loader joins ranks at the end of each epoch.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
package.path = here .. '/../mnist/?.lua;' .. package.path
local mnist = require 'mnist_common'
local opts = {}
local rest = ds.args.rest
local i = 1
while i <= #rest do
  local key, value = rest[i]:match('^%-%-(%w+)$'), rest[i + 1]
  if key == 'data' then
    opts.data = assert(value, '--data needs a value')
  elseif key == 'epochs' or key == 'steps' then
    opts[key] = assert(tonumber(value), '--' .. key .. ' needs a number')
  else
    error(string.format("unknown argument '%s' (expected --data DIR, --epochs N, --steps N, --device cpu|cuda|cuda:N)",
                        rest[i]), 0)
  end
  i = i + 2
end
local dir = mnist.data_or_skip(here, opts.data)
local rank = ds.comm.rank()

ds.manual_seed(42)                 -- every rank the same init (rank 0's is broadcast anyway)
math.randomseed(42 + rank)         -- each rank its own shifts
local train, test = mnist.datasets(dir)
local model = require('models.mlp') { hidden = { 512, 256 }, dropout = 0.2 }

local engine, _, loader = ds.initialize {
  model = model, config = ds.args.config or (here .. '/ds.json'), training_data = train,
}
local cfg = engine.config
local steps = engine.sampler and engine.sampler:set_epoch(0).steps or #loader
local total = cfg.scheduler and cfg.scheduler.params.total_num_steps
local epochs = opts.epochs or (total and math.ceil(total / steps)) or 1
if rank == 0 then
  print(string.format('MNIST from %s: %d training images, %d test images; mlp with %d parameters; %d ranks, '
                      .. 'train_batch_size %d; %d epochs of %d steps; rank 0 on %s, %d threads', dir, #train, #test,
                      model:num_parameters(), engine.world_size, cfg.train_batch_size, epochs, steps, engine.device,
                      ds.num_threads()))
end

local accuracy
local t0 = ds.wall_time()
for epoch = 0, epochs - 1 do
  local sum, n = 0, 0
  for _, batch in loader:epoch(epoch) do
    engine:backward(engine:forward(mnist.augment(batch.x), batch.y))
    engine:step()
    sum, n = sum + engine.last_loss, n + 1
    if opts.steps and engine.global_steps >= opts.steps then break end
  end
  if rank == 0 then
    local correct = mnist.evaluate(engine, test)   -- rank 0: every rank holds the same weights
    accuracy = 100 * correct / #test
    print(string.format('epoch %d: rank 0 train loss %.4f, test accuracy %.2f%% (%d/%d)', epoch, sum / n, accuracy,
                        correct, #test))
  end
  if opts.steps and engine.global_steps >= opts.steps then break end
end
engine:finish()
if rank == 0 then
  print(string.format('final test accuracy %.2f%% on the last %d images after %d steps, %d samples, %.1f s', accuracy,
                      #test, engine.global_steps, engine.global_samples, ds.wall_time() - t0))
end
