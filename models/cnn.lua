-- A CIFAR-style convolutional classifier: per stage Conv2d (same padding)
-- + ReLU + MaxPool2d, then Linear + ReLU (+ dropout) + Linear. The default
-- takes 3x32x32 images; { in_channels = 1, image_size = 28 } takes MNIST.
-- Parameters are "features.0.weight", ..., "classifier.0.weight", ...
--
--   local model = require('models.cnn'){ channels = { 32, 64, 128 } }
--   local loss = model{ x = images, y = labels }   -- images [B,C,H,W] f32, labels i64 [B]; logits without y
local ds = require 'dslua'
local nn = ds.nn

local M = {}

M.defaults = {
  in_channels = 3,
  image_size = 32,          -- a number or {h, w}
  channels = { 32, 64 },    -- output channels of each conv stage
  kernel_size = 3,          -- odd: padded to keep the size
  pool = 2,                 -- max-pool window and stride after each stage
  hidden = 128,             -- width of the classifier's hidden layer
  num_classes = 10,
  dropout = 0,              -- before the last Linear when > 0
  dtype = 'f32', device = 'cpu',
}

local function positive(v, what)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    error(string.format('cnn: %s must be a positive integer, got %s', what, tostring(v)), 0)
  end
  return v
end

function M.config(cfg)
  cfg = cfg or {}
  if type(cfg) ~= 'table' then error('cnn: config must be a table, got ' .. type(cfg), 0) end
  local out = {}
  for k, v in pairs(M.defaults) do out[k] = v end
  for k, v in pairs(cfg) do
    if M.defaults[k] == nil then
      error(string.format("cnn: unknown config key '%s' (expected channels, dropout, dtype, device, hidden, "
                          .. 'image_size, in_channels, kernel_size, num_classes, pool)', tostring(k)), 0)
    end
    out[k] = v
  end
  if type(out.image_size) == 'number' then out.image_size = { out.image_size, out.image_size } end
  for _, k in ipairs({ 'in_channels', 'kernel_size', 'pool', 'hidden', 'num_classes' }) do positive(out[k], k) end
  positive(out.image_size[1], 'image_size')
  positive(out.image_size[2], 'image_size')
  for i, c in ipairs(out.channels) do positive(c, 'channels[' .. i .. ']') end
  if out.kernel_size % 2 ~= 1 then error('cnn: kernel_size must be odd, got ' .. out.kernel_size, 3) end
  return out
end

local CNN = nn.Module:extend('CNN')
M.CNN = CNN

function CNN:init(cfg)
  cfg = M.config(cfg)
  self.config = cfg
  local where = { dtype = cfg.dtype, device = cfg.device }
  local conv = { padding = (cfg.kernel_size - 1) / 2, dtype = cfg.dtype, device = cfg.device }
  local features, c, h, w = {}, cfg.in_channels, cfg.image_size[1], cfg.image_size[2]
  for _, out in ipairs(cfg.channels) do
    features[#features + 1] = nn.Conv2d(c, out, cfg.kernel_size, conv)
    features[#features + 1] = nn.ReLU()
    features[#features + 1] = nn.MaxPool2d(cfg.pool)
    c, h, w = out, math.floor(h / cfg.pool), math.floor(w / cfg.pool)
    if h < 1 or w < 1 then
      error(string.format('cnn: %d pooling stages shrink a %dx%d image to nothing', #cfg.channels,
                          cfg.image_size[1], cfg.image_size[2]), 0)
    end
  end
  self.features = nn.Sequential(features)
  self.shape = { cfg.in_channels, cfg.image_size[1], cfg.image_size[2] }
  self.flat = c * h * w
  local classifier = { nn.Linear(self.flat, cfg.hidden, where), nn.ReLU() }
  if cfg.dropout > 0 then classifier[#classifier + 1] = nn.Dropout(cfg.dropout) end
  classifier[#classifier + 1] = nn.Linear(cfg.hidden, cfg.num_classes, where)
  self.classifier = nn.Sequential(classifier)
end

-- forward(batch) with batch = {x = images, y = labels} or forward(x [, y]):
-- the mean cross-entropy and the logits with labels, else the logits [B, classes].
function CNN:forward(x, y)
  if type(x) == 'table' then x, y = x.x, x.y end
  local s = self.shape
  if not ds.is_tensor(x) or x:dim() ~= 4 or x:size(2) ~= s[1] or x:size(3) ~= s[2] or x:size(4) ~= s[3] then
    error(string.format('CNN: expected images [B, %d, %d, %d], got %s', s[1], s[2], s[3],
                        ds.is_tensor(x) and ('[' .. table.concat(x:size(), 'x') .. ']') or type(x)), 2)
  end
  local f = self.features(x)
  local logits = self.classifier(f:reshape({ x:size(1), self.flat }))
  if y == nil then return logits end
  return ds.cross_entropy(logits, y), logits
end

return setmetatable(M, { __call = function(_, cfg) return CNN(cfg) end })
