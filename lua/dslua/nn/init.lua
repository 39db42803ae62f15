-- ds.nn: modules over the core ops, shaped like torch.nn so that weights
-- move between the two: the same parameter names (state_dict keys such as
-- "transformer.h.0.attn.c_attn.weight"), the same layouts and the same
-- initial distributions (drawn from dslua's generator, so the values
-- themselves differ from torch's). module.lua holds nn.Module and nn.init,
-- layers.lua the layers; this file sampling and the model config checks.
--
--   local Net = nn.Module:extend('Net')
--   function Net:init(n) self.fc = nn.Linear(n, 2) end   -- assigning registers
--   function Net:forward(x) return self.fc(x):relu() end
--   local net = Net(4); net(x); net:named_parameters(); net:state_dict()
local ds = require 'dslua'
local base = require 'dslua.nn.module'
local nn, shape_str, check_int, options = base.nn, base.shape_str, base.check_int, base.options
require 'dslua.nn.layers'     -- adds the layers to nn

-- ---- sampling ----

-- Token ids drawn from a row of logits (a Lua list): greedy at temperature
-- 0, else softmax(logits / temperature) restricted to the top_k largest.
local function draw(row, temperature, top_k, u)
  local V = #row
  if temperature == 0 then
    local best = 1
    for j = 2, V do if row[j] > row[best] then best = j end end
    return best - 1
  end
  local cut = -math.huge
  if top_k and top_k < V then
    local sorted = {}
    for j = 1, V do sorted[j] = row[j] end
    table.sort(sorted, function(a, b) return a > b end)
    cut = sorted[top_k]
  end
  local mx = -math.huge
  for j = 1, V do if row[j] > mx then mx = row[j] end end
  local w, total = {}, 0
  for j = 1, V do
    local e = row[j] >= cut and math.exp((row[j] - mx) / temperature) or 0
    w[j] = e
    total = total + e
  end
  local target, acc = u * total, 0
  for j = 1, V do
    acc = acc + w[j]
    if w[j] > 0 and acc >= target then return j - 1 end
  end
  for j = V, 1, -1 do if w[j] > 0 then return j - 1 end end
end

-- Appends max_new_tokens sampled tokens to idx [B, T] (i64), feeding at
-- most model.config.block_size of context; model:last_logits(idx) gives
-- the logits [B, vocab] of the last position. Runs without autograd and
-- with dropout off; uniforms come from dslua's generator (ds.manual_seed
-- makes it repeatable). opts: temperature (1.0; 0 is greedy), top_k.
-- idx may be on any device: the tokens go to the model's, and the result
-- comes back on idx's.
function nn.generate(model, idx, max_new_tokens, opts)
  opts = options(opts, 'generate', { temperature = 1.0, top_k = nn.NONE })
  if not ds.is_tensor(idx) or idx:dim() ~= 2 then
    error('generate: expected idx [B, T] of token ids, got ' .. (ds.is_tensor(idx) and shape_str(idx) or type(idx)), 3)
  end
  check_int(max_new_tokens, 'generate', 'max_new_tokens', 0)
  if type(opts.temperature) ~= 'number' or opts.temperature < 0 then
    error('generate: temperature must be a number >= 0, got ' .. tostring(opts.temperature), 3)
  end
  if opts.top_k ~= nil then check_int(opts.top_k, 'generate', 'top_k') end
  local block = model.config.block_size
  local was_training = model.training
  model:eval()
  local home = idx:device()
  local ok, res = pcall(ds.no_grad, function()
    local device = model:device()
    if home ~= device then idx = idx:to(device) end
    for _ = 1, max_new_tokens do
      local T = idx:size(2)
      local cond = T > block and idx:narrow(2, T - block + 1, block) or idx
      local logits = model:last_logits(cond):to('f64'):totable()
      local u = ds.rand({ #logits }, 'f64'):totable()
      local next_ids = {}
      for b, row in ipairs(logits) do next_ids[b] = { draw(row, opts.temperature, opts.top_k, u[b]) } end
      local nxt = ds.tensor(next_ids, 'i64')
      if device ~= 'cpu' then nxt = nxt:to(device) end
      idx = ds.cat({ idx, nxt:to(idx:dtype()) }, 2)
    end
    return idx:device() == home and idx or idx:to(home)
  end)
  model:train(was_training)
  if not ok then error(res, 0) end
  return res
end

-- Model configs ----------------------------------------------------------

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return table.concat(out, ', ')
end

-- A model's full config: its defaults, then the named size cfg.name (or cfg
-- given as a name) from `named`, then cfg's own keys. Unknown names and
-- keys are errors that name the model and list what it knows.
function nn.model_config(model, defaults, named, cfg)
  if type(cfg) == 'string' then cfg = { name = cfg } end
  if cfg ~= nil and type(cfg) ~= 'table' then
    error(string.format('%s: config must be a table or a name, got %s', model, type(cfg)), 0)
  end
  cfg = cfg or {}
  local out = {}
  for k, v in pairs(defaults) do out[k] = v end
  if cfg.name ~= nil then
    local base = named[cfg.name]
    if not base then
      error(string.format("%s: unknown config '%s' (known: %s)", model, tostring(cfg.name), sorted_keys(named)), 0)
    end
    for k, v in pairs(base) do out[k] = v end
  end
  for k, v in pairs(cfg) do
    if k ~= 'name' then
      if defaults[k] == nil then
        error(string.format("%s: unknown config key '%s' (expected name, %s)", model, tostring(k),
                            sorted_keys(defaults)), 0)
      end
      out[k] = v
    end
  end
  out.name = cfg.name
  return out
end

-- Errors unless every cfg[k] for k in keys is a positive integer.
function nn.check_positive(model, cfg, keys)
  for _, k in ipairs(keys) do
    local v = cfg[k]
    if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
      error(string.format('%s: %s must be a positive integer, got %s', model, k, tostring(v)), 0)
    end
  end
end

return nn
