-- What the MNIST examples (examples/mnist, examples/uneven,
-- examples/pipeline) share: where the data is, the train/test split of the
-- t10k files, the random shifts, and the test accuracy.
local ds = require 'dslua'
local M = {}

-- --data DIR, else $DSLUA_DATA/mnist, else <project>/../shared/data/mnist
-- (seen from the script folder `here`, `dir/..` pairs folded for the log).
local function data_dir(here, data)
  if data then return data end
  if os.getenv('DSLUA_DATA') then return os.getenv('DSLUA_DATA') .. '/mnist' end
  local path, n = here .. '/../../../shared/data/mnist', 1
  while n > 0 do path, n = path:gsub('[^/.][^/]*/%.%./', '', 1) end
  return path
end

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- The folder of the t10k files (data_dir's), or: rank 0 says why the
-- example skips, and every rank exits 0.
function M.data_or_skip(here, data)
  local dir = data_dir(here, data)
  if exists(dir .. '/t10k-images-idx3-ubyte.gz') or exists(dir .. '/t10k-images-idx3-ubyte') then return dir end
  if ds.comm.rank() == 0 then print(string.format('skipping: no MNIST t10k files in %s (pass --data DIR)', dir)) end
  os.exit(0)
end

-- The first 8,000 t10k images to train on, the last 2,000 to test on.
function M.datasets(dir)
  return ds.data.mnist { path = dir, split = 'test', first = 1, count = 8000, normalize = true },
         ds.data.mnist { path = dir, split = 'test', first = 8001, count = 2000, normalize = true }
end

-- Random translations by up to 2 pixels (math.random), one per group of 8
-- images: the 8,000 images are too few for an MLP to reach 97% without it.
local background = -0.1307 / 0.3081
local function shift(x, d, dim)
  if d == 0 then return x end
  local size = x:size()
  local n = size[dim]
  size[dim] = math.abs(d)
  local fill = ds.full(size, background, x:dtype(), x:device())
  if d > 0 then return ds.cat({ fill, x:narrow(dim, 1, n - d) }, dim) end
  return ds.cat({ x:narrow(dim, 1 - d, n + d), fill }, dim)
end

function M.augment(x)
  local parts = {}
  for i = 1, x:size(1), 8 do
    local part = x:narrow(1, i, math.min(8, x:size(1) - i + 1))
    parts[#parts + 1] = shift(shift(part, math.random(-2, 2), 3), math.random(-2, 2), 4)
  end
  return ds.cat(parts, 1)
end

-- Images of `test` the engine's model classifies right, in batches of 500
-- on the engine's device, without autograd.
function M.evaluate(engine, test)
  engine:eval()
  local correct = 0
  ds.no_grad(function()
    for _, batch in ds.data.loader(test, { batch_size = 500, shuffle = false, device = engine.device }):epoch(1) do
      correct = correct + engine.module(batch.x):argmax(-1):eq(batch.y):sum():item()
    end
  end)
  engine:train()
  return correct
end

return M
