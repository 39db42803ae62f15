-- ds.fp8: linear layers in FP8, as Transformer Engine runs them. Inside
-- ds.fp8.autocast(recipe, fn) every nn.Linear (but those with `fp8 = false`,
-- the models' lm_head among them) casts its input and weight to e4m3 and
-- multiplies them in an fp8 GEMM accumulating in f32; its backward casts
-- the output gradient to e5m2 ('hybrid') or e4m3 and makes the input and
-- weight gradients of the same codes. Parameters, gradients and the
-- optimizer keep their dtypes: fp8 lives only inside the layer.
--
--   local r = ds.fp8.recipe { recipe = 'delayed', amax_history_len = 16 }
--   local loss = ds.fp8.autocast(r, function() return model(x):loss(y) end)
--   loss:backward(); opt:step(); r:update()
--
-- Each tensor cast (input, weight, output gradient of each layer) has its
-- own scale: 'current' scaling takes it from the tensor's own amax at each
-- cast; 'delayed' scaling (TE's DelayedScaling) casts with the scale of
-- the history of amaxes before, and r:update() after each step pushes the
-- step's amax onto the history (amax_history_len long) and sets the scale
-- from its max ('max') or its newest ('most_recent'):
-- fp8_max / amax / 2^margin. The engine's "fp8" block does all this itself.
local ds = require 'dslua'
local C = require 'dslua.core'
local S = require 'dslua.base.schema'
local fp8_config = require 'dslua.nn.fp8_config'

local M = {}

local ROWS = { 'input', 'weight', 'grad_output' }

local Recipe = {}
Recipe.__index = Recipe

-- ds.fp8.recipe(opts) -> a recipe: the "fp8" block's keys (enabled true
-- unless given), a wrong key or value an error naming it.
function M.recipe(opts)
  if opts ~= nil and type(opts) ~= 'table' then error('ds.fp8.recipe: expected a table, got ' .. type(opts), 2) end
  local given = {}
  for k, v in pairs(opts or {}) do given[k] = v end
  if given.enabled == nil then given.enabled = true end
  local ctx = { problems = {}, notes = {}, bad = {}, autos = {} }
  local r = S.check_block(ctx, '', given, fp8_config.SCHEMA)
  if #ctx.problems > 0 then
    local lines = {}
    for i, p in ipairs(ctx.problems) do lines[i] = p.path .. ': ' .. p.msg end
    error('ds.fp8.recipe: ' .. table.concat(lines, '; '), 2)
  end
  r.layers, r.by_module = {}, setmetatable({}, { __mode = 'k' })
  r.grad_format = r.format == 'hybrid' and 'e5m2' or 'e4m3'
  return setmetatable(r, Recipe)
end

-- The state of a layer's three casts: meta [3, 3] on the weight's device,
-- a row (scale, scale_inv, amax) per cast, and each cast's amax history.
local function new_layer(name, w)
  local meta = ds.tensor({ { 1, 1, 0 }, { 1, 1, 0 }, { 1, 1, 0 } }, 'f32')
  if w:device() ~= 'cpu' then meta = meta:to(w:device()) end
  local rows = {}
  for k = 1, 3 do rows[k] = meta:narrow(1, k, 1):view({ 3 }) end
  return { name = name, meta = meta, rows = rows, history = { {}, {}, {} } }
end

-- The layer state of module m (a Linear), made on first use; name keys it
-- in checkpoints (the engine registers every layer by its name up front,
-- ds.fp8.autocast alone names them by their order of first use).
function Recipe:layer(m, name)
  local st = self.by_module[m]
  if st then return st end
  st = new_layer(name or ('linear.' .. (#self.layers + 1)), m.weight)
  self.layers[#self.layers + 1] = st
  self.by_module[m] = st
  return st
end

local active

-- The recipe of the innermost ds.fp8.autocast running, or nil.
function M.active() return active end

-- ds.fp8.autocast(recipe, fn, ...) -> fn(...)'s results, with the
-- Linears inside in fp8 under recipe (its state, the amax histories, lives
-- from step to step: made once); the scope before comes back even when fn
-- raises.
function M.autocast(recipe, fn, ...)
  if getmetatable(recipe) ~= Recipe then
    error('ds.fp8.autocast: expected a recipe (ds.fp8.recipe{...}), got ' .. type(recipe), 2)
  end
  if type(fn) ~= 'function' then error('ds.fp8.autocast: expected a function, got ' .. type(fn), 2) end
  local prev = active
  active = recipe.enabled ~= false and recipe or nil
  local res = { pcall(fn, ...) }
  active = prev
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- y = x w^T + b with x, w and the output gradient in fp8 (st: the layer's
-- state): one autograd node whose backward reads the forward's codes.
function M.linear(r, st, x, w, b)
  local N, K = w:size(1), w:size(2)
  local shape = x:size()
  if shape[#shape] ~= K then
    error(string.format('fp8 linear %s: x %s does not end in the weight\'s in_features %d', st.name,
                        '[' .. table.concat(shape, ',') .. ']', K), 0)
  end
  local cur, margin, gf = r.recipe == 'current', r.margin, r.grad_format
  local mx, mw, mg = st.rows[1], st.rows[2], st.rows[3]
  local x2 = x:detach():reshape({ -1, K })
  local qx = C.fp8_cast(x2, mx, 'e4m3', cur, margin)
  local qw = C.fp8_cast(w:detach(), mw, 'e4m3', cur, margin)
  -- current scales as these casts set them: the layer's next forward (a
  -- second use, a pipeline's next micro batch) sets its own before this
  -- backward reads them (delayed scales hold until the step's update)
  if cur then mx, mw = mx:clone(), mw:clone() end
  local y = C.fp8_gemm(qx, mx, 'e4m3', qw, mw, 'e4m3', b and b:detach(), x:dtype())
  local out_shape = { unpack(shape) }
  out_shape[#out_shape] = N
  y = y:view(out_shape)
  local needs = x.requires_grad or w.requires_grad or (b and b.requires_grad)
  if not (C.is_grad_enabled() and needs) then return y end
  local function backward(g)
    local g2 = g:reshape({ -1, N })
    local qg = C.fp8_cast(g2, mg, gf, cur, margin)
    local dx = C.fp8_gemm(qg, mg, gf, qw:transpose(1, 2):contiguous(), mw, 'e4m3', nil, x:dtype()):view(shape)
    local dw = C.fp8_gemm(qg:transpose(1, 2):contiguous(), mg, gf, qx:transpose(1, 2):contiguous(), mx, 'e4m3',
                          nil, w:dtype())
    if b then return dx, dw, g2:sum(1):to(b:dtype()) end    -- summed wider than its dtype, as every sum
    return dx, dw
  end
  if b then return C.function_node(y, backward, x, w, b) end
  return C.function_node(y, backward, x, w)
end

-- ---- delayed scaling ----

-- After a step: each cast's amax since the last update (the max over the
-- ranks of group where there are several, so every rank keeps the same
-- scales) onto its history, its scale from the history, amax back to 0.
-- Current scaling keeps no history: only the amaxes are cleared.
function Recipe:update(group)
  local n = #self.layers
  if n == 0 then return end
  local metas = {}
  for i, st in ipairs(self.layers) do metas[i] = st.meta:view({ 1, 3, 3 }) end
  local all = n > 1 and ds.cat(metas, 1) or metas[1]:clone()
  if ds.comm and ds.comm.world_size() > 1 then ds.comm.all_reduce(all, 'max', { group = group }) end
  local host = all:to('cpu'):totable()
  for i, st in ipairs(self.layers) do
    local rows = host[i]
    for k = 1, 3 do
      local row = rows[k]
      if self.recipe == 'delayed' then
        local h = st.history[k]
        h[#h + 1] = row[3]
        if #h > self.amax_history_len then table.remove(h, 1) end
        row[1], row[2] = C.fp8_scale(self:amax(h), k == 3 and self.grad_format or 'e4m3', self.margin, row[1])
      end
      row[3] = 0
    end
  end
  local fresh = ds.tensor(host, 'f32')
  if all:device() ~= 'cpu' then fresh = fresh:to(all:device()) end
  for i, st in ipairs(self.layers) do st.meta:copy_(fresh:narrow(1, i, 1):view({ 3, 3 })) end
end

-- The amax a history gives the scale: its max, or its newest entry.
function Recipe:amax(h)
  if self.amax_compute_algo == 'most_recent' then return h[#h] or 0 end
  local m = 0
  for _, v in ipairs(h) do if v > m then m = v end end
  return m
end

-- ---- checkpoints ----

-- The recipe's state, JSON-able: per layer name, each cast's history,
-- scale and its inverse (amaxes are 0 at a step boundary, where
-- checkpoints are taken).
function Recipe:state_dict()
  local layers = {}
  for _, st in ipairs(self.layers) do
    local rows = st.meta:to('cpu'):totable()
    local one = {}
    for k = 1, 3 do
      one[ROWS[k]] = { scale = rows[k][1], scale_inv = rows[k][2], amax_history = { unpack(st.history[k]) } }
    end
    layers[st.name] = one
  end
  return { recipe = self.recipe, format = self.format, layers = layers }
end

-- A history entry as a checkpoint's JSON holds it: a number, or an
-- infinity or NaN (an overflowing step's amax) as the string it became.
local NONFINITE = { inf = math.huge, ['-inf'] = -math.huge }
local function entry(v)
  if type(v) == 'number' then return v end
  return NONFINITE[v] or 0 / 0
end

-- Restores state_dict()'s output onto the layers registered under the same
-- names; a layer missing from either side is an error naming it.
function Recipe:load_state_dict(s)
  local seen = {}
  for _, st in ipairs(self.layers) do
    local saved = s.layers[st.name]
    if not saved then error('fp8: the checkpoint has no amax history for layer ' .. st.name, 0) end
    seen[st.name] = true
    local rows = {}
    for k = 1, 3 do
      local one = saved[ROWS[k]]
      local h = {}
      for i, v in ipairs(one.amax_history) do h[i] = entry(v) end
      st.history[k] = h
      rows[k] = { one.scale, one.scale_inv, 0 }
    end
    local t = ds.tensor(rows, 'f32')
    st.meta:copy_(st.meta:device() ~= 'cpu' and t:to(st.meta:device()) or t)
  end
  for name in pairs(s.layers) do
    if not seen[name] then error('fp8: the checkpoint has an amax history for layer ' .. name
                                 .. ', which this model does not have in fp8', 0) end
  end
end

-- Registers every Linear of model in fp8 (those without `fp8 = false`)
-- under its name, in module order: the engine's layers, ready for
-- checkpoints before the first forward.
function Recipe:register(model)
  local Linear = ds.nn.Linear
  for _, e in ipairs(model:named_modules()) do
    local m = e[2]
    if getmetatable(m) == Linear and m.fp8 ~= false then self:layer(m, e[1]) end
  end
  return self
end

-- One line for the engine's start-up log: what runs in fp8 and how.
function Recipe:describe()
  local how = self.recipe == 'delayed'
    and string.format('delayed scaling (amax history %d, %s, margin %d)', self.amax_history_len,
                      self.amax_compute_algo, self.margin)
    or string.format('current scaling (margin %d)', self.margin)
  return string.format('fp8 | %d Linear layers: e4m3 forward, %s gradients; %s', #self.layers, self.grad_format, how)
end

return M
