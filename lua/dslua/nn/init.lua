-- ds.nn: modules over the core ops, shaped like torch.nn so that weights
-- move between the two: the same parameter names (state_dict keys such as
-- "transformer.h.0.attn.c_attn.weight"), the same layouts and the same
-- initial distributions (drawn from dslua's generator, so the values
-- themselves differ from torch's).
--
--   local Net = nn.Module:extend('Net')
--   function Net:init(n) self.fc = nn.Linear(n, 2) end   -- assigning registers
--   function Net:forward(x) return self.fc(x):relu() end
--   local net = Net(4); net(x); net:named_parameters(); net:state_dict()
local ds = require 'dslua'

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

local function refill(t, draw, scale, shift)
  if skipping then return t end
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

-- ---- layers ----

local Linear = Module:extend('Linear')
nn.Linear = Linear

-- Linear(in_features, out_features [, {bias = true, dtype, device}] or bias):
-- weight [out, in] and bias uniform in +-1/sqrt(in), which is torch's
-- kaiming_uniform(a = sqrt(5)) and its bias rule.
function Linear:init(in_features, out_features, opts)
  opts = options(opts, 'Linear', { bias = true, dtype = 'f32', device = 'cpu' }, 'bias')
  self.in_features = check_int(in_features, 'Linear', 'in_features')
  self.out_features = check_int(out_features, 'Linear', 'out_features')
  local bound = 1 / math.sqrt(in_features)
  self:register_parameter('weight', nn.init.uniform_(empty({ out_features, in_features }, opts), -bound, bound))
  self:register_parameter('bias', opts.bias and nn.init.uniform_(empty({ out_features }, opts), -bound, bound) or nil)
end

function Linear:forward(x) return ds.linear(x, self.weight, self.bias) end

function Linear:extra_repr()
  return fmt('in_features=%d, out_features=%d, bias=%s', self.in_features, self.out_features, tostring(self.bias ~= nil))
end

local function pair(v, who, what, min)
  if type(v) == 'table' then
    if #v ~= 2 then error(fmt('%s: %s must be an integer or {h, w}', who, what), 4) end
    return { check_int(v[1], who, what, min), check_int(v[2], who, what, min) }
  end
  check_int(v, who, what, min)
  return { v, v }
end

local Conv2d = Module:extend('Conv2d')
nn.Conv2d = Conv2d

-- Conv2d(in_channels, out_channels, kernel_size [, {stride = 1, padding = 0,
-- dilation = 1, groups = 1, bias = true, dtype, device}]): weight
-- [out, in/groups, kh, kw], initialised as torch (bound 1/sqrt(fan_in)).
function Conv2d:init(in_channels, out_channels, kernel_size, opts)
  opts = options(opts, 'Conv2d', { stride = 1, padding = 0, dilation = 1, groups = 1, bias = true,
                                   dtype = 'f32', device = 'cpu' })
  self.in_channels = check_int(in_channels, 'Conv2d', 'in_channels')
  self.out_channels = check_int(out_channels, 'Conv2d', 'out_channels')
  self.kernel_size = pair(kernel_size, 'Conv2d', 'kernel_size')
  self.stride = pair(opts.stride, 'Conv2d', 'stride')
  self.padding = pair(opts.padding, 'Conv2d', 'padding', 0)
  self.dilation = pair(opts.dilation, 'Conv2d', 'dilation')
  self.groups = check_int(opts.groups, 'Conv2d', 'groups')
  if in_channels % self.groups ~= 0 or out_channels % self.groups ~= 0 then
    error(fmt('Conv2d: in_channels %d and out_channels %d must both be divisible by groups %d',
              in_channels, out_channels, self.groups), 3)
  end
  local w = empty({ out_channels, in_channels / self.groups, self.kernel_size[1], self.kernel_size[2] }, opts)
  local bound = 1 / math.sqrt(nn.init.fan_in(w))
  self:register_parameter('weight', nn.init.uniform_(w, -bound, bound))
  self:register_parameter('bias', opts.bias and nn.init.uniform_(empty({ out_channels }, opts), -bound, bound) or nil)
  self.conv_opts = { stride = self.stride, padding = self.padding, dilation = self.dilation, groups = self.groups }
end

function Conv2d:forward(x) return ds.conv2d(x, self.weight, self.bias, self.conv_opts) end

function Conv2d:extra_repr()
  local k, s, p = self.kernel_size, self.stride, self.padding
  return fmt('%d, %d, kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d)%s', self.in_channels,
             self.out_channels, k[1], k[2], s[1], s[2], p[1], p[2], self.bias and '' or ', bias=false')
end

local MaxPool2d = Module:extend('MaxPool2d')
nn.MaxPool2d = MaxPool2d

-- MaxPool2d(kernel_size [, {stride = kernel_size, padding = 0}])
function MaxPool2d:init(kernel_size, opts)
  opts = options(opts, 'MaxPool2d', { stride = nn.NONE, padding = 0 })
  self.kernel_size = pair(kernel_size, 'MaxPool2d', 'kernel_size')
  self.pool_opts = { stride = opts.stride and pair(opts.stride, 'MaxPool2d', 'stride') or self.kernel_size,
                     padding = pair(opts.padding, 'MaxPool2d', 'padding', 0) }
end

function MaxPool2d:forward(x) return ds.max_pool2d(x, self.kernel_size, self.pool_opts) end

function MaxPool2d:extra_repr()
  return fmt('kernel_size=%d, stride=%d', self.kernel_size[1], self.pool_opts.stride[1])
end

local AvgPool2d = Module:extend('AvgPool2d')
nn.AvgPool2d = AvgPool2d

-- AvgPool2d(kernel_size [, {stride = kernel_size, padding = 0, count_include_pad = true}])
function AvgPool2d:init(kernel_size, opts)
  opts = options(opts, 'AvgPool2d', { stride = nn.NONE, padding = 0, count_include_pad = true })
  self.kernel_size = pair(kernel_size, 'AvgPool2d', 'kernel_size')
  self.pool_opts = { stride = opts.stride and pair(opts.stride, 'AvgPool2d', 'stride') or self.kernel_size,
                     padding = pair(opts.padding, 'AvgPool2d', 'padding', 0),
                     count_include_pad = opts.count_include_pad }
end

function AvgPool2d:forward(x) return ds.avg_pool2d(x, self.kernel_size, self.pool_opts) end

AvgPool2d.extra_repr = MaxPool2d.extra_repr

local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding

-- Embedding(num_embeddings, embedding_dim [, {dtype, device}]): weight
-- [num, dim] drawn from N(0, 1) as torch; ids are 0-based (i64 or i32).
function Embedding:init(num_embeddings, embedding_dim, opts)
  opts = options(opts, 'Embedding', { dtype = 'f32', device = 'cpu' })
  self.num_embeddings = check_int(num_embeddings, 'Embedding', 'num_embeddings')
  self.embedding_dim = check_int(embedding_dim, 'Embedding', 'embedding_dim')
  self:register_parameter('weight', nn.init.normal_(empty({ num_embeddings, embedding_dim }, opts), 0, 1))
end

function Embedding:forward(ids) return ds.embedding(self.weight, ids) end

function Embedding:extra_repr() return fmt('%d, %d', self.num_embeddings, self.embedding_dim) end

local LayerNorm = Module:extend('LayerNorm')
nn.LayerNorm = LayerNorm

-- LayerNorm(normalized_shape [, {eps = 1e-5, elementwise_affine = true,
-- bias = true, dtype, device}]): weight ones, bias zeros.
function LayerNorm:init(normalized_shape, opts)
  opts = options(opts, 'LayerNorm', { eps = 1e-5, elementwise_affine = true, bias = true, dtype = 'f32', device = 'cpu' })
  self.normalized_shape = shape_of(normalized_shape, 'LayerNorm')
  self.eps = opts.eps
  if opts.elementwise_affine then
    self:register_parameter('weight', nn.init.ones_(empty(self.normalized_shape, opts)))
    self:register_parameter('bias', opts.bias and empty(self.normalized_shape, opts) or nil)
  end
end

function LayerNorm:forward(x)
  return ds.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
end

function LayerNorm:extra_repr()
  return fmt('{%s}, eps=%g', table.concat(self.normalized_shape, ', '), self.eps)
end

local RMSNorm = Module:extend('RMSNorm')
nn.RMSNorm = RMSNorm

-- RMSNorm(normalized_shape [, {eps, elementwise_affine = true, dtype, device}]):
-- x / sqrt(mean(x^2) + eps) * weight; eps defaults to the dtype's machine
-- epsilon, as torch.nn.RMSNorm.
function RMSNorm:init(normalized_shape, opts)
  opts = options(opts, 'RMSNorm', { eps = nn.NONE, elementwise_affine = true, dtype = 'f32', device = 'cpu' })
  self.normalized_shape = shape_of(normalized_shape, 'RMSNorm')
  self.eps = opts.eps
  if opts.elementwise_affine then
    self:register_parameter('weight', nn.init.ones_(empty(self.normalized_shape, opts)))
  end
end

function RMSNorm:forward(x) return ds.rms_norm(x, self.normalized_shape, self.weight, self.eps) end

function RMSNorm:extra_repr()
  return fmt('{%s}, eps=%s', table.concat(self.normalized_shape, ', '), tostring(self.eps))
end

local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout

-- Dropout(p = 0.5): zeroes with probability p and scales by 1/(1-p) while
-- training; the identity in eval mode.
function Dropout:init(p)
  p = p == nil and 0.5 or p
  if type(p) ~= 'number' or p < 0 or p > 1 then
    error(fmt('Dropout: p must be a number in [0, 1], got %s', tostring(p)), 3)
  end
  self.p = p
end

function Dropout:forward(x)
  if not self.training or self.p == 0 then return x end
  return ds.dropout(x, self.p, true)
end

function Dropout:extra_repr() return fmt('p=%g', self.p) end

-- Stateless activations.
local function activation(name, fn)
  local cls = Module:extend(name)
  cls.forward = function(_, x) return fn(x) end
  nn[name] = cls
  return cls
end

activation('ReLU', ds.relu)
activation('SiLU', ds.silu)
activation('Tanh', ds.tanh)
activation('Sigmoid', ds.sigmoid)
activation('Identity', function(x) return x end)

local GELU = Module:extend('GELU')
nn.GELU = GELU

-- GELU([approximate = 'none']) or GELU{approximate = 'tanh'}: erf form or
-- the tanh approximation GPT-2 uses.
function GELU:init(opts)
  opts = options(opts, 'GELU', { approximate = 'none' }, 'approximate')
  if opts.approximate ~= 'none' and opts.approximate ~= 'tanh' then
    error(fmt("GELU: approximate must be 'none' or 'tanh', got %s", tostring(opts.approximate)), 3)
  end
  self.approximate = opts.approximate
end

function GELU:forward(x) return ds.gelu(x, self.approximate) end

function GELU:extra_repr() return self.approximate == 'tanh' and "approximate='tanh'" or '' end

local Flatten = Module:extend('Flatten')
nn.Flatten = Flatten

-- Flatten([start_dim = 2 [, end_dim = -1]]): dims 1-based, so the default
-- keeps the batch dim as torch's Flatten(1, -1) does.
function Flatten:init(start_dim, end_dim)
  self.start_dim, self.end_dim = start_dim or 2, end_dim or -1
end

function Flatten:forward(x)
  local s, n = x:size(), x:dim()
  local a = self.start_dim < 0 and n + 1 + self.start_dim or self.start_dim
  local b = self.end_dim < 0 and n + 1 + self.end_dim or self.end_dim
  if a < 1 or b > n or a > b then
    error(fmt('Flatten: dims %d..%d out of range for input %s', self.start_dim, self.end_dim, shape_str(x)), 2)
  end
  local shape = {}
  for i = 1, a - 1 do shape[#shape + 1] = s[i] end
  local m = 1
  for i = a, b do m = m * s[i] end
  shape[#shape + 1] = m
  for i = b + 1, n do shape[#shape + 1] = s[i] end
  return x:reshape(shape)
end

-- ---- containers ----

local function add_list(self, who, mods)
  for i, m in ipairs(mods) do
    if not is_module(m) then error(fmt('%s: element %d is a %s, expected a module', who, i, type(m)), 4) end
    self[#self + 1] = m
  end
end

local ModuleList = Module:extend('ModuleList')
nn.ModuleList = ModuleList

-- ModuleList({m1, m2, ...}): self[1], self[2] ... named "0", "1" ...;
-- iterate with ipairs, grow with append.
function ModuleList:init(mods) add_list(self, 'ModuleList', mods or {}) end

function ModuleList:append(m)
  add_list(self, 'ModuleList', { m })
  return self
end

local Sequential = Module:extend('Sequential')
nn.Sequential = Sequential

-- Sequential(m1, m2, ...) or Sequential({m1, m2, ...}): runs them in turn.
function Sequential:init(...)
  local first = ...
  local mods = (select('#', ...) == 1 and type(first) == 'table' and not is_module(first)) and first or { ... }
  add_list(self, 'Sequential', mods)
end

Sequential.append = ModuleList.append

function Sequential:forward(x)
  for _, m in ipairs(self) do x = m(x) end
  return x
end

-- ---- attention ----

local CausalSelfAttention = Module:extend('CausalSelfAttention')
nn.CausalSelfAttention = CausalSelfAttention

-- CausalSelfAttention{n_embd, n_head, bias = true, dropout = 0, dtype, device,
-- attention_backend = 'auto'}: nanoGPT's block: c_attn (the fused q,k,v
-- projection), the causal attention op (ds.qkv_attention with that backend),
-- c_proj, residual dropout. With attention dropout on in training the
-- scores are formed explicitly, since the attention op has no dropout.
function CausalSelfAttention:init(cfg)
  cfg = options(cfg, 'CausalSelfAttention', { n_embd = nn.NONE, n_head = nn.NONE, bias = true, dropout = 0,
                                              dtype = 'f32', device = 'cpu', attention_backend = 'auto' })
  local backend = cfg.attention_backend
  if backend ~= 'auto' and backend ~= 'fused' and backend ~= 'math' then
    error(fmt("CausalSelfAttention: attention_backend must be 'auto', 'fused' or 'math', got %s", tostring(backend)), 3)
  end
  self.attention = { backend = backend }
  local C = check_int(cfg.n_embd, 'CausalSelfAttention', 'n_embd')
  self.n_head = check_int(cfg.n_head, 'CausalSelfAttention', 'n_head')
  if C % self.n_head ~= 0 then
    error(fmt('CausalSelfAttention: n_embd %d is not divisible by n_head %d', C, self.n_head), 3)
  end
  self.n_embd = C
  local lin = { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device }
  self.c_attn = Linear(C, 3 * C, lin)
  self.c_proj = Linear(C, C, lin)
  self.attn_dropout = Dropout(cfg.dropout)
  self.resid_dropout = Dropout(cfg.dropout)
end

-- softmax(q k^T / sqrt(D) + causal mask) with dropout on the weights, times v.
local function attention_with_dropout(q, k, v, p)
  local T, D = q:size(3), q:size(4)
  local pos = ds.arange(T, 'i64', q:device())
  local visible = pos:view({ T, 1 }):ge(pos:view({ 1, T }))
  local att = ds.matmul(q, k:transpose(3, 4)) * (1 / math.sqrt(D))
  att = ds.where(visible, att, -math.huge):softmax(-1)
  return ds.matmul(ds.dropout(att, p, true), v)
end

function CausalSelfAttention:forward(x)
  if not ds.is_tensor(x) or x:dim() ~= 3 or x:size(3) ~= self.n_embd then
    error(fmt('CausalSelfAttention: expected x [B, T, %d], got %s', self.n_embd,
              ds.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local nh = self.n_head
  local y
  if self.attn_dropout.training and self.attn_dropout.p > 0 then
    local qkv = self.c_attn(x):split(C, 3)
    local q = qkv[1]:view({ B, T, nh, C / nh }):transpose(2, 3)
    local k = qkv[2]:view({ B, T, nh, C / nh }):transpose(2, 3)
    local v = qkv[3]:view({ B, T, nh, C / nh }):transpose(2, 3)
    y = attention_with_dropout(q, k, v, self.attn_dropout.p):transpose(2, 3):reshape({ B, T, C })
  else
    y = ds.qkv_attention(self.c_attn(x), nh, self.attention)    -- no split, transposes or concatenation in backward
  end
  return self.resid_dropout(self.c_proj(y))
end

function CausalSelfAttention:extra_repr() return fmt('n_embd=%d, n_head=%d', self.n_embd, self.n_head) end

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
