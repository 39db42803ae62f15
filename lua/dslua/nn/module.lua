-- nn.Module, the base every module extends (registration of parameters,
-- buffers and children by assignment, state dicts, devices, printing),
-- nn.init and the argument checks the layers share. The nn table is made
-- here; layers.lua and init.lua add to it.
local ds = require 'dslua'

local M = {}
local nn = {}

local fmt = string.format

-- ---- helpers ----

local function shape_str(t)
  return '[' .. table.concat(t:size(), 'x') .. ']'
end

local function check_int(v, who, what, min)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < (min or 1) then
    error(fmt('%s: %s must be an integer >= %d, got %s', who, what, min or 1, tostring(v)), 4)
  end
  return v
end

-- An options table from nil, a table, or a bare value standing for the
-- first option (nn.Linear(4, 2, false) means bias = false). Unknown keys
-- are errors naming the module and the known keys.
local function options(opts, who, defaults, bare_key)
  if opts == nil then opts = {} end
  if type(opts) ~= 'table' then
    if not bare_key then error(fmt('%s: expected an options table, got %s', who, type(opts)), 4) end
    opts = { [bare_key] = opts }
  end
  local out = {}
  for k, v in pairs(opts) do
    if defaults[k] == nil then
      local known = {}
      for name in pairs(defaults) do known[#known + 1] = name end
      table.sort(known)
      error(fmt("%s: unknown option '%s' (expected %s)", who, tostring(k), table.concat(known, ', ')), 4)
    end
    out[k] = v
  end
  for k, v in pairs(defaults) do
    if out[k] == nil then out[k] = v end
  end
  for k, v in pairs(out) do
    if v == nn.NONE then out[k] = nil end
  end
  return out
end

-- Marks an option whose default is "absent" (a nil would not list it).
nn.NONE = setmetatable({}, { __tostring = function() return 'none' end })

local function shape_of(s, who)
  if type(s) == 'number' then s = { s } end
  if type(s) ~= 'table' or #s == 0 then
    error(fmt('%s: normalized_shape must be an integer or a list of integers, got %s', who, tostring(s)), 4)
  end
  local out = {}
  for i, d in ipairs(s) do out[i] = check_int(d, who, 'normalized_shape', 1) end
  return out
end

-- ---- initialisation (torch.nn.init's in-place fillers) ----

nn.init = {}

-- Random fills are drawn then scaled in place; inside nn.skip_init they
-- are left out (the tensor keeps its zeros) for a caller that
-- initialises everything itself.
local skipping = false

-- The partitioned-construction scope open now (ds.zero.Init,
-- dslua/engine/zinit.lua), or nil: it makes parameters' tensors and fills
-- its shards.
local partition = nil
function M.set_partition(p) partition = p end

local function refill(t, draw, scale, shift)
  if skipping then return t end
  if partition and partition:owns(t) then
    partition:fill(t, draw == ds.randn, scale, shift)
    return t
  end
  ds.no_grad(function()
    local r = draw(t:size(), t:dtype(), t:device())
    if scale ~= 1 then r:mul_(scale) end
    if shift ~= 0 then r:add_(shift) end
    t:copy_(r)
  end)
  return t
end

function nn.init.uniform_(t, a, b)
  return refill(t, ds.rand, b - a, a)
end

function nn.init.normal_(t, mean, std)
  return refill(t, ds.randn, std or 1, mean or 0)
end

-- Runs fn(...) with the modules' random initialisation off (deterministic
-- fills such as LayerNorm's ones stay), as torch.nn.utils.skip_init: for
-- models that draw all their weights afterwards.
function nn.skip_init(fn, ...)
  local prev = skipping
  skipping = true
  local res = { pcall(fn, ...) }
  skipping = prev
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

function nn.init.constant_(t, v)
  if partition and partition:owns(t) then
    partition:constant(t, v)
    return t
  end
  ds.no_grad(function() t:fill_(v) end)
  return t
end

function nn.init.zeros_(t) return nn.init.constant_(t, 0) end
function nn.init.ones_(t) return nn.init.constant_(t, 1) end

-- fan_in as torch computes it: dim 2 times the receptive field.
function nn.init.fan_in(t)
  local s = t:size()
  local n = s[2] or 1
  for i = 3, #s do n = n * s[i] end
  return n
end

-- kaiming_uniform_(a): bound = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)).
function nn.init.kaiming_uniform_(t, a)
  local gain = math.sqrt(2 / (1 + (a or 0) ^ 2))
  local bound = gain * math.sqrt(3 / nn.init.fan_in(t))
  return nn.init.uniform_(t, -bound, bound)
end

-- A tensor made a parameter: a leaf that requires grad, counted as
-- parameter memory.
function nn.parameter(t)
  if not t.is_leaf then t = t:detach() end
  t:requires_grad_(true)
  t:set_category('parameters')
  return t
end

local function empty(shape, opts)
  if partition then return partition:empty(shape, opts) end
  return ds.zeros(shape, opts.dtype or 'f32', opts.device)
end

-- ---- Module ----

-- Metamethods are not inherited through __index: each class copies them.
local META = { '__call', '__tostring', '__newindex' }

local function is_module(v)
  return type(v) == 'table' and getmetatable(v) ~= nil and rawget(v, '_kind') ~= nil
end
nn.is_module = is_module

-- A key's name in parameter paths: list entries count from 0, as torch's
-- ModuleList and Sequential name them.
local function key_name(k)
  return type(k) == 'number' and tostring(k - 1) or k
end

-- The method names a class answers to, its parents' included.
local function method_names(cls)
  local names = {}
  while cls do
    for k, v in pairs(cls) do
      if type(k) == 'string' and type(v) == 'function' and not k:match('^__') then names[#names + 1] = k end
    end
    cls = getmetatable(cls).__index
  end
  return names
end

-- hints[cls][key]: the method a missing key was likely meant as, or false;
-- kept, since a module may look up a field it has not set on every call.
local hints = setmetatable({}, { __mode = 'k' })

-- An instance's lookups: its class's fields, and an error for a key that
-- is no registered name but one slip from a method (m:forwrd(x)); other
-- keys a module never set stay nil, the Lua way.
local function class_index(cls)
  return function(self, key)
    local v = cls[key]
    if v ~= nil or type(key) ~= 'string' then return v end
    local kinds = rawget(self, '_kind')
    if kinds and kinds[key] then return nil end
    hints[cls] = hints[cls] or {}
    local hint = hints[cls][key]
    if hint == nil then
      hint = require('dslua.base.suggest').typo(key, method_names(cls)) or false
      hints[cls][key] = hint
    end
    if hint then error(fmt("%s has no method '%s' (did you mean '%s'?)", cls.__name, key, hint), 2) end
    return nil
  end
end

local function new_class(name, parent)
  local cls = { __name = name }
  cls.__index = class_index(cls)
  cls.methods = cls      -- what the REPL completes and help lists, __index being a function
  if parent then
    for _, m in ipairs(META) do cls[m] = parent[m] end
  end
  return setmetatable(cls, {
    __index = parent,
    __call = function(c, ...)
      local self = setmetatable({
        _kind = {},          -- key -> 'param' | 'buffer' | 'module'
        _params = {}, _buffers = {}, _modules = {},   -- keys in registration order
        _transient = {},     -- buffers left out of state_dict
        training = true,
      }, c)
      c.init(self, ...)
      return self
    end,
  })
end

local Module = new_class('Module')
nn.Module = Module

-- A subclass: `local Net = nn.Module:extend('Net')`; its init(self, ...)
-- builds the module, forward(self, ...) runs it.
function Module:extend(name)
  return new_class(name or 'Module', self)
end

function Module:init() end

function Module:forward()
  error(fmt('%s: forward is not implemented (a container; call its children)', self.__name), 2)
end

function Module:__call(...) return self:forward(...) end

local function register(self, kind, key, value)
  local kinds = rawget(self, '_kind')
  local prev = kinds[key]
  if prev and prev ~= kind then
    error(fmt("%s: '%s' is already registered as a %s", self.__name, tostring(key), prev), 3)
  end
  if partition and kind == 'param' and value ~= nil then partition:named(value, self.__name, key) end
  if not prev then
    kinds[key] = kind
    local list = rawget(self, kind == 'param' and '_params' or kind == 'buffer' and '_buffers' or '_modules')
    list[#list + 1] = key
  end
  rawset(self, key, value)
end

-- Assigning a new field registers it: a module as a child, a leaf tensor
-- that requires grad as a parameter, in the order of assignment (other
-- values, computed tensors among them, stay plain fields). Reassigning a
-- registered field keeps its place (so `lm_head.weight = wte.weight` ties).
function Module:__newindex(key, value)
  if is_module(value) then register(self, 'module', key, value)
  elseif ds.is_tensor(value) and value.requires_grad and value.is_leaf then register(self, 'param', key, value)
  else rawset(self, key, value) end
end

function Module:register_parameter(name, t)
  if t ~= nil and not ds.is_tensor(t) then
    error(fmt("%s: register_parameter '%s' expects a tensor or nil, got %s", self.__name, tostring(name), type(t)), 2)
  end
  local p = t and nn.parameter(t)
  register(self, 'param', name, p)
  return p
end

-- A tensor that moves with the module and, unless persistent is false,
-- travels in state_dict, but is not trained.
function Module:register_buffer(name, t, persistent)
  if t ~= nil and not ds.is_tensor(t) then
    error(fmt("%s: register_buffer '%s' expects a tensor or nil, got %s", self.__name, tostring(name), type(t)), 2)
  end
  register(self, 'buffer', name, t)
  rawget(self, '_transient')[name] = persistent == false or nil
  return t
end

function Module:add_module(name, m)
  if not is_module(m) then
    error(fmt("%s: add_module '%s' expects a module, got %s", self.__name, tostring(name), type(m)), 2)
  end
  register(self, 'module', name, m)
  return m
end

-- Children in registration order: list of {name, module}.
function Module:named_children()
  local out = {}
  for _, k in ipairs(rawget(self, '_modules')) do
    local m = rawget(self, k)
    if m ~= nil then out[#out + 1] = { key_name(k), m } end
  end
  return out
end

function Module:children()
  local out = {}
  for i, c in ipairs(self:named_children()) do out[i] = c[2] end
  return out
end

-- This module and every descendant, as torch lists them: self first
-- (named ''), then depth first in registration order.
function Module:named_modules(prefix, out)
  out = out or {}
  prefix = prefix or ''
  out[#out + 1] = { prefix, self }
  for _, c in ipairs(self:named_children()) do
    c[2]:named_modules(prefix == '' and c[1] or (prefix .. '.' .. c[1]), out)
  end
  return out
end

function Module:modules()
  local out = {}
  for i, c in ipairs(self:named_modules()) do out[i] = c[2] end
  return out
end

-- Tensors of one kind under this module as {name, tensor} pairs (also
-- readable as .name/.tensor): each module's own tensors in registration
-- order, then its children's; a tensor seen before under another name (a
-- tied weight) is left out, as torch's named_parameters does.
local function collect(self, list_key)
  local out, seen = {}, {}
  for _, nm in ipairs(self:named_modules()) do
    local prefix, m = nm[1], nm[2]
    for _, k in ipairs(rawget(m, list_key)) do
      local t = rawget(m, k)
      if t ~= nil and not seen[t] then
        seen[t] = true
        local name = prefix == '' and key_name(k) or (prefix .. '.' .. key_name(k))
        out[#out + 1] = { name, t, name = name, tensor = t }
      end
    end
  end
  return out
end

function Module:named_parameters() return collect(self, '_params') end
function Module:named_buffers() return collect(self, '_buffers') end

function Module:parameters()
  local out = {}
  for i, p in ipairs(self:named_parameters()) do out[i] = p[2] end
  return out
end

function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- The names state_dict holds, in torch's order: per module its parameters,
-- then its persistent buffers, children after; tied tensors appear under
-- every name, as in torch. module:state_entries() -> {{name, tensor}...},
-- the module's own tensors (not detached copies).
local function state_entries(self)
  local out = {}
  for _, nm in ipairs(self:named_modules()) do
    local prefix, m = nm[1], nm[2]
    local transient = rawget(m, '_transient')
    for _, list in ipairs({ '_params', '_buffers' }) do
      for _, k in ipairs(rawget(m, list)) do
        local t = rawget(m, k)
        if t ~= nil and not (list == '_buffers' and transient[k]) then
          out[#out + 1] = { prefix == '' and key_name(k) or (prefix .. '.' .. key_name(k)), t }
        end
      end
    end
  end
  return out
end
Module.state_entries = state_entries

-- name -> tensor (detached, sharing memory with the module): one value,
-- as torch's, so save_file(path, m:state_dict()) takes no stray argument.
-- module:state_keys() gives the names in torch's order.
function Module:state_dict()
  local sd = {}
  for _, e in ipairs(state_entries(self)) do sd[e[1]] = e[2]:detach() end
  return sd
end

function Module:state_keys()
  local keys = {}
  for i, e in ipairs(state_entries(self)) do keys[i] = e[1] end
  return keys
end

-- Copies a state_dict in. Every problem (missing or unexpected keys,
-- non-tensors, shape mismatches) is checked before anything is copied and
-- reported together in one error, as torch does. A name may be missing
-- when its tensor is tied to one that is present. strict = false accepts
-- missing and unexpected keys and returns them as two lists.
function Module:load_state_dict(sd, strict)
  if type(sd) ~= 'table' then
    error(fmt('%s: load_state_dict expects a table of name -> tensor, got %s', self.__name, type(sd)), 2)
  end
  strict = strict ~= false
  local entries = state_entries(self)
  local expected, provided = {}, {}
  local missing, unexpected, problems = {}, {}, {}
  for _, e in ipairs(entries) do
    expected[e[1]] = true
    local v = sd[e[1]]
    if v ~= nil then provided[e[2]] = true end
  end
  local copies = {}
  for _, e in ipairs(entries) do
    local name, t = e[1], e[2]
    local v = sd[name]
    if v == nil then
      if not provided[t] then missing[#missing + 1] = name end
    elseif not ds.is_tensor(v) then
      problems[#problems + 1] = fmt('%s: expected a tensor, got %s', name, type(v))
    elseif table.concat(v:size(), 'x') ~= table.concat(t:size(), 'x') then
      problems[#problems + 1] = fmt('size mismatch for %s: copying a param with shape %s from checkpoint, '
                                    .. 'the shape in current model is %s', name, shape_str(v), shape_str(t))
    else
      copies[#copies + 1] = { t, v }
    end
  end
  for k in pairs(sd) do
    if not expected[k] then unexpected[#unexpected + 1] = tostring(k) end
  end
  table.sort(unexpected)
  local lines = {}
  if strict and #missing > 0 then lines[#lines + 1] = 'Missing key(s) in state_dict: ' .. table.concat(missing, ', ') end
  if strict and #unexpected > 0 then
    lines[#lines + 1] = 'Unexpected key(s) in state_dict: ' .. table.concat(unexpected, ', ')
  end
  for _, p in ipairs(problems) do lines[#lines + 1] = p end
  if #lines > 0 then
    error(fmt('Error(s) in loading state_dict for %s:\n\t%s', self.__name, table.concat(lines, '\n\t')), 2)
  end
  ds.no_grad(function()
    for _, c in ipairs(copies) do c[1]:copy_(c[2]) end
  end)
  return missing, unexpected
end

function Module:train(mode)
  if mode == nil then mode = true end
  for _, m in ipairs(self:modules()) do rawset(m, 'training', mode and true or false) end
  return self
end

function Module:eval() return self:train(false) end

-- Zeroes every parameter's gradient in place, so the flat gradient
-- buffers a ds.optim optimizer attaches stay attached; set_to_none drops
-- them instead (torch's default, safe only without such an optimizer).
function Module:zero_grad(set_to_none)
  ds.no_grad(function()
    for _, p in ipairs(self:parameters()) do
      if set_to_none then p.grad = nil
      else
        local g = p.grad
        if g then g:fill_(0) end
      end
    end
  end)
end

-- fn(module) on every descendant, children before parents, as torch.
function Module:apply(fn)
  for _, c in ipairs(self:children()) do c:apply(fn) end
  fn(self)
  return self
end

-- Moves or converts every parameter and buffer (t:to(what): a dtype or a
-- device). Converted tensors are new (gradients dropped); tensors already
-- there are kept as they are; tied tensors stay tied. Returns the module
-- and a table from each old tensor to its replacement, for lists of
-- parameters made before the move.
function Module:to(what)
  if what == 'cuda' then what = 'cuda:0' end    -- the name t:device() gives, so tensors already there stay
  local done = {}
  local function convert(t, as_param)
    if done[t] == nil then
      if t:dtype() == what or t:device() == what then done[t] = t
      else
        local c = ds.no_grad(function() return t:to(what) end):detach()
        done[t] = as_param and nn.parameter(c) or c
      end
    end
    return done[t]
  end
  for _, m in ipairs(self:modules()) do
    for _, k in ipairs(rawget(m, '_params')) do
      local t = rawget(m, k)
      if t ~= nil then rawset(m, k, convert(t, true)) end
    end
    for _, k in ipairs(rawget(m, '_buffers')) do
      local t = rawget(m, k)
      if t ~= nil then rawset(m, k, convert(t, false)) end
    end
  end
  return self, done
end

-- The device of the first parameter (or buffer), where the module runs;
-- 'cpu' for a module with neither.
function Module:device()
  local first = self:parameters()[1]
  if not first then
    local b = self:named_buffers()[1]
    first = b and b[2]
  end
  return first and first:device() or 'cpu'
end

-- Two groups as nanoGPT's configure_optimizers makes them: tensors of two
-- or more dims (weights, embeddings) decay, the rest (biases, norms) not.
function Module:weight_decay_groups(weight_decay)
  local decay, no_decay = {}, {}
  for _, p in ipairs(self:parameters()) do
    if p:dim() >= 2 then decay[#decay + 1] = p else no_decay[#no_decay + 1] = p end
  end
  return { { params = decay, weight_decay = weight_decay }, { params = no_decay, weight_decay = 0 } }
end

function Module:extra_repr() return '' end

-- torch's module printout: one line per leaf module, children indented.
function Module:__tostring()
  local extra = self:extra_repr()
  local lines = {}
  -- children as they are indexed: m[1] prints as (1), m.fc as (fc)
  for _, k in ipairs(rawget(self, '_modules')) do
    local m = rawget(self, k)
    if m ~= nil then lines[#lines + 1] = '  (' .. tostring(k) .. '): ' .. tostring(m):gsub('\n', '\n  ') end
  end
  if #lines == 0 then return self.__name .. '(' .. extra .. ')' end
  if extra ~= '' then table.insert(lines, 1, '  ' .. extra) end
  return self.__name .. '(\n' .. table.concat(lines, '\n') .. '\n)'
end

M.Module = Module
M.check_int = check_int
M.empty = empty
M.fmt = fmt
M.is_module = is_module
M.nn = nn
M.options = options
M.shape_of = shape_of
M.shape_str = shape_str

return M
