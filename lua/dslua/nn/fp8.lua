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
-- unless given), a wrong key or value an error naming it. weight_casts
-- counts the casts of weights it made.
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
  r.layers, r.by_module, r.weight_casts = {}, setmetatable({}, { __mode = 'k' }), 0
  r.grad_format = r.format == 'hybrid' and 'e5m2' or 'e4m3'
  return setmetatable(r, Recipe)
end

-- The state of a layer's three casts: meta [3, 3] on the weight's device,
-- a row (scale, scale_inv, amax) per cast, each cast's amax history, and
-- (weight) the step's codes of the weight.
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

-- The name the comms logger gives the amaxes agreed within a step.
M.LOG = 'fp8_amax_all_reduce'

-- The codes of t in format f under row (a cast's meta) and r's scaling.
-- group: where t is one tensor split over a tensor group, each rank a
-- piece; under current scaling the pieces then share one scale, from the
-- max of their amaxes, so the codes are those of the whole tensor.
-- Delayed scaling casts with the row's scale, which the step's update
-- agrees over the group. transpose (t 2-D): the codes transposed too, from
-- the same pass: the layout the backward's GEMMs read (TN only on the GPU).
local function cast(r, t, row, f, group, transpose)
  local cur = r.recipe == 'current'
  local op = transpose and C.fp8_cast_transpose or C.fp8_cast
  if not (cur and group) then return op(t, row, f, cur, r.margin) end
  local amax = C.fp8_amax(t)
  ds.comm.all_reduce(amax, 'max', { group = group, log_name = M.LOG })
  return op(t, row, f, true, r.margin, amax)
end

-- The weight's codes and the scales they were cast with, cast once while
-- its bytes stay as they are (their version: no in-place write since), so
-- the micro batches of a step share them, as Transformer Engine's
-- is_first_microbatch does; with transpose (a backward to come) the
-- transposed codes too, from the same cast. update() drops them.
local function weight_codes(r, st, w, group, transpose)
  local id, version = w:version()
  local c = st.weight
  if c and c.w == w and c.id == id and c.version == version and (c.qt or not transpose) then return c end
  local q, qt = cast(r, w:detach(), st.rows[2], 'e4m3', group, transpose)
  -- current scales as this cast set them: a later cast sets the row anew
  c = { w = w, id = id, version = version, q = q, qt = qt,
        meta = r.recipe == 'current' and st.rows[2]:clone() or st.rows[2] }
  st.weight = c
  r.weight_casts = r.weight_casts + 1
  return c
end

-- y = x w^T + b with x, w and the output gradient in fp8 (st: the layer's
-- state): one autograd node whose backward reads the forward's codes and
-- nothing else, so x itself goes once the forward is done. For a
-- tensor-parallel layer: its group and split, which of input, weight and
-- grad_output are split over the group.
function M.linear(r, st, x, w, b, group, split)
  local N, K = w:size(1), w:size(2)
  local shape = x:size()
  if shape[#shape] ~= K then
    error(string.format('fp8 linear %s: x %s does not end in the weight\'s in_features %d', st.name,
                        '[' .. table.concat(shape, ',') .. ']', K), 0)
  end
  split = group and split or {}
  local gx, gw, gg = split.input and group, split.weight and group, split.grad_output and group
  local gf = r.grad_format
  local mx, mg = st.rows[1], st.rows[3]
  local needs = C.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b and b.requires_grad))
  -- a backward reads x's and w's codes transposed, cast with them
  local qx, qxt = cast(r, x:detach():reshape({ -1, K }), mx, 'e4m3', gx, needs)
  local wc = weight_codes(r, st, w, gw, needs)
  local qw, mw = wc.q, wc.meta
  -- current scales as this cast set them: the layer's next forward (a
  -- second use, a pipeline's next micro batch) sets its own before this
  -- backward reads them (delayed scales hold until the step's update)
  if r.recipe == 'current' then mx = mx:clone() end
  local xdt, wdt, bdt = x:dtype(), w:dtype(), b and b:dtype()
  local y = C.fp8_gemm(qx, mx, 'e4m3', qw, mw, 'e4m3', b and b:detach(), xdt)
  local out_shape = { unpack(shape) }
  out_shape[#out_shape] = N
  y = y:view(out_shape)
  if not needs then return y end
  local function backward(grad)
    local g2 = grad:reshape({ -1, N })
    local qg, qgt = cast(r, g2, mg, gf, gg, true)
    local dx = C.fp8_gemm(qg, mg, gf, wc.qt, mw, 'e4m3', nil, xdt):view(shape)
    local dw = C.fp8_gemm(qgt, mg, gf, qxt, mx, 'e4m3', nil, wdt)
    if b then return dx, dw, g2:sum(1):to(bdt) end    -- summed wider than its dtype, as every sum
    return dx, dw
  end
  if b then return C.function_node_bare(y, backward, x, w, b) end
  return C.function_node_bare(y, backward, x, w)
end

-- ---- delayed scaling ----

-- After a step: each cast's amax since the last update (the max over the
-- ranks of group where there are several, and over the layers' tensor
-- group: Transformer Engine's amax reduction group, data x tensor, so every
-- rank keeps the same scales and a split tensor's pieces one scale) onto
-- its history, its scale from the history, amax back to 0. Current scaling
-- keeps no history and casts with each tensor's own amax: its amaxes are
-- cleared where they are, with no collective and no read to the host. The
-- weights' codes go: the optimizer is about to change them.
function Recipe:update(group)
  local n = #self.layers
  if n == 0 then return end
  for _, st in ipairs(self.layers) do st.weight = nil end
  if self.recipe ~= 'delayed' then
    for _, st in ipairs(self.layers) do st.meta:narrow(2, 3, 1):zero_() end
    return
  end
  local metas = {}
  for i, st in ipairs(self.layers) do metas[i] = st.meta:view({ 1, 3, 3 }) end
  local all = n > 1 and ds.cat(metas, 1) or metas[1]:clone()
  if ds.comm and ds.comm.world_size() > 1 then
    ds.comm.all_reduce(all, 'max', { group = group })
    local tg = self.tensor_group
    if tg and tg:size() > 1 then ds.comm.all_reduce(all, 'max', { group = tg, log_name = M.LOG }) end
  end
  local host = all:to('cpu'):totable()
  for i, st in ipairs(self.layers) do
    local rows = host[i]
    for k = 1, 3 do
      local row = rows[k]
      local h = st.history[k]
      h[#h + 1] = row[3]
      if #h > self.amax_history_len then table.remove(h, 1) end
      row[1], row[2] = C.fp8_scale(self:amax(h), k == 3 and self.grad_format or 'e4m3', self.margin, row[1])
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
    st.weight = nil         -- cast with the scale before
  end
  for name in pairs(s.layers) do
    if not seen[name] then error('fp8: the checkpoint has an amax history for layer ' .. name
                                 .. ', which this model does not have in fp8', 0) end
  end
end

-- Whether module m runs in fp8 in the scope: an nn.Linear or a tensor-
-- parallel linear not marked fp8 = false.
function M.runs(m)
  local cls, nn = getmetatable(m), ds.nn
  return (cls == nn.Linear or cls == nn.ColumnParallelLinear or cls == nn.RowParallelLinear)
         and rawget(m, 'fp8') ~= false
end

-- The layer state of m, a tensor-parallel linear over group g: its amaxes
-- agree over g at each update too.
function Recipe:parallel_layer(m, g, name)
  if g and g:size() > 1 then self.tensor_group = g end
  return self:layer(m, name)
end

-- What of a Linear's casts hold this rank's tokens under sequence
-- parallelism (ds.sequence): its input and output gradient. Each agrees
-- its amax over the sequence group under current scaling, so the codes are
-- those of the whole sequences (a replicated tensor's max is its own).
M.TOKENS = { input = true, grad_output = true }

-- Registers every linear of model in fp8 (M.runs) under its name, in
-- module order: the engine's layers, ready for checkpoints before the
-- first forward; a model's sequence group (sequence_parallel) noted.
function Recipe:register(model)
  local seq = rawget(model, 'seq')
  if seq and seq.size > 1 then self.sequence_group = seq.group end
  for _, e in ipairs(model:named_modules()) do
    local m = e[2]
    if M.runs(m) then self:parallel_layer(m, rawget(m, 'group'), e[1]) end
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
