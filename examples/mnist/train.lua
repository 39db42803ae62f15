-- MNIST digits with the DeepSpeed tutorial's recipe (SGD + WarmupDecayLR):
-- train on the first 8,000 images of the t10k files (shifted at random by
-- up to 2 pixels), report the accuracy on the last 2,000 after every epoch.
--   dslua examples/mnist/train.lua --config examples/mnist/ds.json
--         [--model mlp|cnn] [--data DIR] [--epochs N] [--steps N] [--device cpu|cuda|cuda:N]
-- --epochs defaults to what the scheduler's total_num_steps covers;
-- --steps stops after that many optimizer steps (a quick check); --device
-- (or DSLUA_DEVICE) overrides the default, this rank's GPU if there is one.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
package.path = here .. '/?.lua;' .. package.path
local mnist = require 'mnist_common'
local opts = { model = 'mlp' }
local rest = ds.args.rest
local i = 1
while i <= #rest do
  local key, value = rest[i]:match('^%-%-(%w+)$'), rest[i + 1]
  if key == 'model' or key == 'data' then
    opts[key] = assert(value, '--' .. key .. ' needs a value')
  elseif key == 'epochs' or key == 'steps' then
    opts[key] = assert(tonumber(value), '--' .. key .. ' needs a number')
  else
    error(string.format("unknown argument '%s' (expected --model mlp|cnn, --data DIR, --epochs N, --steps N, "
                        .. "--device cpu|cuda|cuda:N)", rest[i]), 0)
  end
  i = i + 2
end
local dir = mnist.data_or_skip(here, opts.data)

ds.manual_seed(42)
math.randomseed(42)
local train, test = mnist.datasets(dir)

local model
if opts.model == 'mlp' then
  model = require('models.mlp') { hidden = { 512, 256 }, dropout = 0.2 }
elseif opts.model == 'cnn' then
  model = require('models.cnn') { in_channels = 1, image_size = 28, channels = { 16, 32 }, hidden = 128 }
else
  error(string.format("--model must be mlp or cnn, got '%s'", opts.model), 0)
end

local engine, _, loader = ds.initialize {
  model = model, config = ds.args.config or (here .. '/ds.json'), training_data = train,
}
local sched = engine.config.scheduler
local total = sched and sched.params.total_num_steps
local epochs = opts.epochs or (total and math.ceil(total / #loader)) or 1
print(string.format('MNIST from %s: %d training images, %d test images; %s with %d parameters; %d epochs of %d steps; '
                    .. 'on %s, %d threads', dir, #train, #test, opts.model, model:num_parameters(), epochs, #loader,
                    engine.device, ds.num_threads()))

local accuracy
for epoch = 1, epochs do
  local sum, n = 0, 0
  for _, batch in loader:epoch(epoch) do
    local loss = engine:forward(mnist.augment(batch.x), batch.y)
    engine:backward(loss)
    engine:step()
    sum, n = sum + engine.last_loss, n + 1
    if opts.steps and engine.global_steps >= opts.steps then break end
  end
  local correct = mnist.evaluate(engine, test)
  accuracy = 100 * correct / #test
  print(string.format('epoch %d: train loss %.4f, test accuracy %.2f%% (%d/%d)', epoch, sum / n, accuracy, correct,
                      #test))
  if opts.steps and engine.global_steps >= opts.steps then break end
end
print(string.format('final test accuracy %.2f%% on the last %d images after %d steps', accuracy, #test,
                    engine.global_steps))
