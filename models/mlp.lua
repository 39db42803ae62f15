-- A multilayer perceptron classifier, by default MNIST's 784-256-10:
-- the input is flattened, then Linear + activation (+ dropout) per hidden
-- layer and a final Linear. Parameters are "net.0.weight", "net.2.weight", ...
--
--   local model = require('models.mlp'){ hidden = { 512, 256 } }
--   local loss = model{ x = images, y = labels }   -- images [B,1,28,28] f32, labels i64 [B]; logits without y
local ds = require 'dslua'
local nn = ds.nn

local M = {}

M.defaults = {
  input_size = 784,       -- features after flattening all but the batch dim
  hidden = { 256 },       -- widths of the hidden layers (a number for one)
  num_classes = 10,
  activation = 'relu',    -- relu, gelu, silu or tanh
  dropout = 0,            -- after each hidden activation when > 0
  dtype = 'f32', device = 'cpu',
}

local ACTIVATIONS = { relu = nn.ReLU, gelu = nn.GELU, silu = nn.SiLU, tanh = nn.Tanh }

local function positive(v, what)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    error(string.format('mlp: %s must be a positive integer, got %s', what, tostring(v)), 0)
  end
  return v
end

function M.config(cfg)
  cfg = cfg or {}
  if type(cfg) ~= 'table' then error('mlp: config must be a table, got ' .. type(cfg), 0) end
  local out = {}
  for k, v in pairs(M.defaults) do out[k] = v end
  for k, v in pairs(cfg) do
    if M.defaults[k] == nil then
      error(string.format("mlp: unknown config key '%s' (expected activation, dropout, dtype, device, hidden, "
                          .. 'input_size, num_classes)', tostring(k)), 0)
    end
    out[k] = v
  end
  if type(out.hidden) == 'number' then out.hidden = { out.hidden } end
  positive(out.input_size, 'input_size')
  positive(out.num_classes, 'num_classes')
  for i, h in ipairs(out.hidden) do positive(h, 'hidden[' .. i .. ']') end
  if not ACTIVATIONS[out.activation] then
    error(string.format("mlp: activation must be relu, gelu, silu or tanh, got '%s'", tostring(out.activation)), 0)
  end
  return out
end

local MLP = nn.Module:extend('MLP')
M.MLP = MLP

function MLP:init(cfg)
  cfg = M.config(cfg)
  self.config = cfg
  local where = { dtype = cfg.dtype, device = cfg.device }
  local layers, width = {}, cfg.input_size
  for _, h in ipairs(cfg.hidden) do
    layers[#layers + 1] = nn.Linear(width, h, where)
    layers[#layers + 1] = ACTIVATIONS[cfg.activation]()
    if cfg.dropout > 0 then layers[#layers + 1] = nn.Dropout(cfg.dropout) end
    width = h
  end
  layers[#layers + 1] = nn.Linear(width, cfg.num_classes, where)
  self.net = nn.Sequential(layers)
end

-- forward(batch) with batch = {x = inputs, y = labels} or forward(x [, y]):
-- the mean cross-entropy and the logits with labels, else the logits [B, classes].
function MLP:forward(x, y)
  if type(x) == 'table' then x, y = x.x, x.y end
  if not ds.is_tensor(x) or x:dim() < 1 or x:numel() ~= x:size(1) * self.config.input_size then
    error(string.format('MLP: expected inputs [B, ...] of %d features each, got %s', self.config.input_size,
                        ds.is_tensor(x) and ('[' .. table.concat(x:size(), 'x') .. ']') or type(x)), 2)
  end
  local logits = self.net(x:reshape({ x:size(1), self.config.input_size }))
  if y == nil then return logits end
  return ds.cross_entropy(logits, y), logits
end

-- The same network as pipeline layers (ds.pipe.LayerSpec): Flatten, then
-- each Linear and activation a layer of its own, for a PipelineModule with
-- loss_fn = ds.cross_entropy.
function M.pipe_layers(cfg)
  cfg = M.config(cfg)
  local pipe = ds.pipe
  local where = { dtype = cfg.dtype, device = cfg.device }
  local layers, width = { pipe.LayerSpec(nn.Flatten) }, cfg.input_size
  for _, h in ipairs(cfg.hidden) do
    layers[#layers + 1] = pipe.LayerSpec(nn.Linear, width, h, where)
    layers[#layers + 1] = pipe.LayerSpec(ACTIVATIONS[cfg.activation])
    if cfg.dropout > 0 then layers[#layers + 1] = pipe.LayerSpec(nn.Dropout, cfg.dropout) end
    width = h
  end
  layers[#layers + 1] = pipe.LayerSpec(nn.Linear, width, cfg.num_classes, where)
  return layers
end

return setmetatable(M, { __call = function(_, cfg) return MLP(cfg) end })
