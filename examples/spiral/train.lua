-- Three interleaved spirals, classified by a two-layer MLP trained with
-- plain autograd and SGD with momentum, no engine. The data is generated
-- here, so the run needs no download.
--   dslua examples/spiral/train.lua [--steps N] [--device cpu|cuda|cuda:N]
-- Every tensor goes to ds.device(): this rank's GPU if there is one, else
-- the CPU (--device or DSLUA_DEVICE choose).
local ds = require 'dslua'
local progress = require 'dslua.io.progress'

local opts = { steps = 1000, hidden = 128, lr = 0.1, momentum = 0.9, points = 1000, seed = 0 }
local rest = ds.args.rest
local i = 1
while rest[i] do
  local key = rest[i]:match('^%-%-([%w_]+)$')
  if not key or opts[key] == nil or not tonumber(rest[i + 1]) then
    io.stderr:write('usage: train.lua [--steps N] [--hidden N] [--lr X] [--momentum X] [--points N] [--seed N] '
                    .. '[--device cpu|cuda|cuda:N]\n')
    os.exit(2)
  end
  opts[key] = tonumber(rest[i + 1])
  i = i + 2
end
local dev = ds.device()
ds.manual_seed(opts.seed)

-- n points per class along each arm, angle noise from dslua's generator;
-- every fifth point is held out for evaluation.
local function spirals(n, classes)
  local noise = ds.randn(n * classes):totable()
  local sets = { train = { x = {}, y = {} }, test = { x = {}, y = {} } }
  for c = 0, classes - 1 do
    for j = 0, n - 1 do
      local r = j / n
      local theta = 4 * r + c * 2 * math.pi / classes + 0.2 * noise[c * n + j + 1]
      local set = j % 5 == 0 and sets.test or sets.train
      set.x[#set.x + 1] = { r * math.sin(theta), r * math.cos(theta) }
      set.y[#set.y + 1] = c
    end
  end
  for _, s in pairs(sets) do s.x, s.y = ds.tensor(s.x):to(dev), ds.tensor(s.y, 'i64'):to(dev) end
  return sets.train, sets.test
end

local classes = 3
local train, test = spirals(opts.points, classes)

-- drawn on the CPU and moved, so every device starts from the same weights
local function param(...)
  local fan_in = select(-1, ...)
  return (ds.randn(...) * math.sqrt(2 / fan_in)):to(dev):requires_grad_()
end
local params = {
  w1 = param(opts.hidden, 2), b1 = ds.zeros({ opts.hidden }, 'f32', dev):requires_grad_(),
  w2 = param(classes, opts.hidden), b2 = ds.zeros({ classes }, 'f32', dev):requires_grad_(),
}
local velocity = {}
for k, p in pairs(params) do
  p:set_category('parameters')
  velocity[k] = ds.zeros(p:size(), 'f32', dev):set_category('optimizer_state')
end

local function forward(x)
  local h = ds.linear(x, params.w1, params.b1):relu()
  return ds.linear(h, params.w2, params.b2)
end

local function accuracy(set)
  return ds.no_grad(function()
    return forward(set.x):argmax(2):eq(set.y):to('f32'):mean():item()
  end)
end

print(string.format('spirals: %d train / %d test points, MLP 2-%d-%d, on %s, %d threads',
                    train.x:size(1), test.x:size(1), opts.hidden, classes, dev, ds.num_threads()))
local bar = progress.new { total = opts.steps, label = 'train', unit = 'samples' }
local n = train.x:size(1)
local loss
for step = 1, opts.steps do
  loss = ds.cross_entropy(forward(train.x), train.y)
  loss:backward()
  ds.no_grad(function()
    for k, p in pairs(params) do
      velocity[k]:mul_(opts.momentum):add_(p.grad)
      p:sub_(velocity[k] * opts.lr)
      p.grad = nil
    end
  end)
  bar:update(step, { loss = loss:item() }, step * n)
end
local seconds = bar:finish()
local mem = ds.memory_stats()
print(string.format('done in %.2fs: loss %.4f, train accuracy %.1f%%, test accuracy %.1f%%',
                    seconds, loss:item(), 100 * accuracy(train), 100 * accuracy(test)))
print(string.format('memory: parameters %d B, optimizer state %d B, peak %d B',
                    mem.current.parameters, mem.current.optimizer_state, mem.peak.total))
