-- MNIST on ranks with their own micro batches and shares of the data:
--   dslua -n 2 examples/uneven/train.lua --config examples/uneven/ds.json
--   dslua examples/uneven/train.lua --config examples/uneven/ds_1rank.json   (the comparison)
--         [--data DIR] [--epochs N] [--steps N]
-- Trains the MLP of examples/mnist on the first 8,000 images of the t10k
-- files (shifted at random by up to 2 pixels) and reports, on rank 0, the
-- accuracy on the last 2,000 after every epoch. With a sampler block every
-- rank prints its line per epoch; the engine weights each rank's gradient
-- by its samples, and its loader joins ranks at the end of each epoch.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
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
    error(string.format("unknown argument '%s' (expected --data DIR, --epochs N, --steps N)", rest[i]), 0)
  end
  i = i + 2
end
-- <project>/../shared/data/mnist, with `dir/..` pairs folded for the log
local function shared_data()
  local path, n = here .. '/../../../shared/data/mnist', 1
  while n > 0 do path, n = path:gsub('[^/.][^/]*/%.%./', '', 1) end
  return path
end
local dir = opts.data or (os.getenv('DSLUA_DATA') and os.getenv('DSLUA_DATA') .. '/mnist') or shared_data()

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end
local rank = ds.comm.rank()
if not exists(dir .. '/t10k-images-idx3-ubyte.gz') and not exists(dir .. '/t10k-images-idx3-ubyte') then
  if rank == 0 then print(string.format('skipping: no MNIST t10k files in %s (pass --data DIR)', dir)) end
  os.exit(0)
end

ds.manual_seed(42)                 -- every rank the same init (rank 0's is broadcast anyway)
math.randomseed(42 + rank)         -- each rank its own shifts
local train = ds.data.mnist { path = dir, split = 'test', first = 1, count = 8000, normalize = true }
local test = ds.data.mnist { path = dir, split = 'test', first = 8001, count = 2000, normalize = true }
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
                      .. 'train_batch_size %d; %d epochs of %d steps; %d threads', dir, #train, #test,
                      model:num_parameters(), engine.world_size, cfg.train_batch_size, epochs, steps, ds.num_threads()))
end

-- Accuracy on the held-out 2,000 (rank 0: every rank holds the same weights).
local function evaluate()
  engine:eval()
  local correct = 0
  ds.no_grad(function()
    for _, batch in ds.data.loader(test, { batch_size = 500, shuffle = false }):epoch(1) do
      correct = correct + model(batch.x):argmax(-1):eq(batch.y):sum():item()
    end
  end)
  engine:train()
  return correct
end

-- Random translations by up to 2 pixels, one per group of 8 images.
local background = -0.1307 / 0.3081
local function shift(x, d, dim)
  if d == 0 then return x end
  local size = x:size()
  local n = size[dim]
  size[dim] = math.abs(d)
  local fill = ds.full(size, background)
  if d > 0 then return ds.cat({ fill, x:narrow(dim, 1, n - d) }, dim) end
  return ds.cat({ x:narrow(dim, 1 - d, n + d), fill }, dim)
end
local function augment(x)
  local parts = {}
  for k = 1, x:size(1), 8 do
    local part = x:narrow(1, k, math.min(8, x:size(1) - k + 1))
    parts[#parts + 1] = shift(shift(part, math.random(-2, 2), 3), math.random(-2, 2), 4)
  end
  return ds.cat(parts, 1)
end

local accuracy
local t0 = ds.wall_time()
for epoch = 0, epochs - 1 do
  local sum, n = 0, 0
  for _, batch in loader:epoch(epoch) do
    engine:backward(engine:forward(augment(batch.x), batch.y))
    engine:step()
    sum, n = sum + engine.last_loss, n + 1
    if opts.steps and engine.global_steps >= opts.steps then break end
  end
  if rank == 0 then
    local correct = evaluate()
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
