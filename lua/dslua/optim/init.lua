-- Optimizers with PyTorch's interface over fused C kernels on flat fp32
-- buffers (core/train/ds_optim.h). Building one gathers each param group's
-- parameters into one buffer (the tensors become views into it) and attaches
-- a flat gradient buffer as their .grad, so backward accumulates into it and
-- zero_grad() fills it with zeros. A lone parameter that is the whole of its
-- storage is its own buffer, and its .grad too if the whole of its own (the
-- step engine's masters are adopted, not copied). param_groups hold the
-- hyperparameters and are read at every step, so a scheduler changes them
-- by assignment.
local C = require 'dslua.core'

local M = {}

local Optimizer = {}
Optimizer.__index = Optimizer

-- Defaults: PyTorch's (SGD, Adam, AdamW, Adagrad), DeepSpeed FusedLamb's,
-- lion-pytorch's (Lion).
local DEFAULTS = {
  SGD = { lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false },
  Adam = { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0, bias_correction = true },
  AdamW = { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 1e-2, bias_correction = true },
  Adagrad = { lr = 1e-2, lr_decay = 0, weight_decay = 0, initial_accumulator_value = 0, eps = 1e-10 },
  Lamb = { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0, bias_correction = true,
           eps_inside_sqrt = false, max_coeff = 10, min_coeff = 0.01 },
  Lion = { lr = 1e-4, betas = { 0.9, 0.99 }, weight_decay = 0 },
}

-- Options for variants not implemented: accepted only at these values.
local FIXED = {
  SGD = { maximize = false }, Adam = { amsgrad = false, maximize = false },
  AdamW = { amsgrad = false, maximize = false }, Adagrad = { maximize = false },
  Lamb = { amsgrad = false }, Lion = {},
}

-- PyTorch's implementation switches: no effect on the result, so ignored.
local IGNORED = { foreach = true, fused = true, capturable = true, differentiable = true, set_grad_none = true }

local function sorted_keys(...)
  local keys, seen = {}, {}
  for _, t in ipairs({ ... }) do
    for k in pairs(t) do
      if not seen[k] then seen[k] = true; keys[#keys + 1] = k end
    end
  end
  table.sort(keys)
  return keys
end

local function copy_value(v)
  if type(v) ~= 'table' or C.is_tensor(v) then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = copy_value(x) end
  return c
end

-- A list of tensors from a list, a single tensor or a module.
local function tensor_list(name, x, where)
  if C.is_tensor(x) then return { x } end
  if type(x) == 'table' and type(x.parameters) == 'function' then return x:parameters() end
  if type(x) ~= 'table' then
    error(string.format('optim.%s: %s must be a list of tensors, got %s', name, where, type(x)), 3)
  end
  local list = {}
  for i = 1, #x do
    if not C.is_tensor(x[i]) then
      error(string.format('optim.%s: %s[%d] is a %s, not a tensor', name, where, i, type(x[i])), 3)
    end
    list[i] = x[i]
  end
  return list
end

-- Copies opts into group over its defaults, refusing unknown keys.
local function apply_options(name, group, opts, where)
  for k, v in pairs(opts) do
    if k ~= 'params' then
      if FIXED[name][k] ~= nil then
        if v ~= FIXED[name][k] then
          error(string.format('optim.%s: %s%s = %s is not supported', name, where, k, tostring(v)), 3)
        end
      elseif not IGNORED[k] then
        if DEFAULTS[name][k] == nil then
          error(string.format("optim.%s: %sunknown option '%s' (options: %s)", name, where, tostring(k),
                              table.concat(sorted_keys(DEFAULTS[name], FIXED[name]), ', ')), 3)
        end
        group[k] = copy_value(v)
      end
    end
  end
end

local function new(name, params, opts)
  if opts ~= nil and type(opts) ~= 'table' then
    error(string.format('optim.%s: options must be a table, got %s', name, type(opts)), 2)
  end
  local defaults = copy_value(DEFAULTS[name])
  apply_options(name, defaults, opts or {}, '')
  local self = setmetatable({ name = name, defaults = defaults, param_groups = {}, _h = C.optim_new(name) },
                            Optimizer)
  local groups
  if type(params) == 'table' and type(params.parameters) ~= 'function' and type(params[1]) == 'table' then
    groups = params
  else
    groups = { { params = tensor_list(name, params, 'params') } }
  end
  local count = 0
  for _, g in ipairs(groups) do
    if type(g) ~= 'table' or g.params == nil then
      error(string.format('optim.%s: a param group must be a table with a params list', name), 2)
    end
    count = count + #tensor_list(name, g.params, 'params')
  end
  if count == 0 then error(string.format('optim.%s: empty parameter list', name), 2) end
  for _, g in ipairs(groups) do self:add_param_group(g) end
  return self
end

for name in pairs(DEFAULTS) do
  M[name] = function(params, opts) return new(name, params, opts) end
end

-- ds.optim.apply(name, group, t, p, g, {state...} [, first [, grad_scale]]):
-- one stateless step of the kind's kernel on contiguous 1-D f32 views (p
-- and the state updated in place), for optimizers that hold their buffers
-- elsewhere (dslua.engine.nvme streams them from files). group: hyperparameters as
-- in param_groups; t: the 1-based step; state in state_names(name) order;
-- first: SGD's momentum starts here (default t == 1); grad_scale: the step
-- takes g times it, as g * grad_scale would give it (default 1; g is left
-- as it is). Lamb is refused.
M.apply = C.optim_apply
-- Raises what apply would about group's hyperparameters.
M.check_group = C.optim_check_group
-- The kind's state slots in order, e.g. {'exp_avg', 'exp_avg_sq'}.
M.state_names = C.optim_state_names

-- A copy of the kind's default hyperparameters.
function M.defaults(name)
  if not DEFAULTS[name] then
    error(string.format("optim: unknown optimizer '%s' (SGD, Adam, AdamW, Adagrad, Lamb, Lion)", tostring(name)), 2)
  end
  return copy_value(DEFAULTS[name])
end

-- Adds a group {params = ..., <options>}; missing options take the
-- optimizer's defaults.
function Optimizer:add_param_group(group)
  local n = #self.param_groups + 1
  local g = copy_value(self.defaults)
  apply_options(self.name, g, group, string.format('group %d: ', n))
  g.params = tensor_list(self.name, group.params, string.format('group %d params', n))
  self._h:add_group(g)
  self.param_groups[n] = g
end

-- One update of every group. A closure, if given, is called first (with
-- grad enabled) and its result returned, as in PyTorch.
function Optimizer:step(closure)
  local loss
  if closure then
    local prev = C.set_grad_enabled(true)
    local ok, res = pcall(closure)
    C.set_grad_enabled(prev)
    if not ok then error(res, 0) end
    loss = res
  end
  self._h:step(self.param_groups)
  return loss
end

-- Fills the flat gradient buffers with zeros; grads are never dropped, the
-- parameters keep their .grad views (set_to_none is ignored).
function Optimizer:zero_grad()
  self._h:zero_grad()
end

-- The flat buffers of group g (default 1): 1-D f32 tensors sharing storage
-- with the parameters / grads / state.
function Optimizer:flat_params(g) return self._h:flat(g or 1, 'params') end
function Optimizer:flat_grads(g) return self._h:flat(g or 1, 'grads') end
function Optimizer:flat_state(g, name) return self._h:flat(g or 1, name) end
function Optimizer:state_names() return self._h:state_names() end

-- Lamb's trust ratio of each parameter at the last step (DeepSpeed's
-- get_lamb_coeffs), all groups in order.
function Optimizer:get_lamb_coeffs()
  if self.name ~= 'Lamb' then error('optim.' .. self.name .. ': get_lamb_coeffs is for Lamb', 2) end
  local out = {}
  for g = 1, #self.param_groups do
    for _, c in ipairs(self._h:lamb_coeffs(g)) do out[#out + 1] = c end
  end
  return out
end

-- PyTorch's layout: state[k] = {step = n, <buffer> = tensor} for the k-th
-- parameter counted over all groups (1-based); param_groups hold the
-- hyperparameters and params = {k...}. Tensors are copies.
function Optimizer:state_dict()
  local state, groups, k = {}, {}, 0
  for gi, g in ipairs(self.param_groups) do
    local sg = {}
    for key, v in pairs(g) do
      if key ~= 'params' then sg[key] = copy_value(v) end
    end
    sg.params = {}
    local step = self._h:steps(gi)
    for pi = 1, #g.params do
      k = k + 1
      sg.params[pi] = k
      if step > 0 or self.name == 'Adagrad' then
        local st = self._h:param_state(gi, pi)
        st.step = step
        state[k] = st
      end
    end
    groups[gi] = sg
  end
  return { state = state, param_groups = groups }
end

-- Restores a state_dict of an optimizer of the same kind over parameters
-- of the same shapes, group by group; stepping then continues exactly.
function Optimizer:load_state_dict(sd)
  local name = 'optim.' .. self.name .. ': load_state_dict: '
  if type(sd) ~= 'table' or type(sd.param_groups) ~= 'table' then
    error(name .. 'expected a table with param_groups and state', 2)
  end
  if #sd.param_groups ~= #self.param_groups then
    error(string.format('%sthe state has %d param groups, the optimizer %d', name, #sd.param_groups,
                        #self.param_groups), 2)
  end
  local state = sd.state or {}
  for gi, sg in ipairs(sd.param_groups) do
    local g = self.param_groups[gi]
    if type(sg.params) ~= 'table' or #sg.params ~= #g.params then
      error(string.format('%sgroup %d has %s parameters, the optimizer\'s has %d', name, gi,
                          type(sg.params) == 'table' and tostring(#sg.params) or 'no', #g.params), 2)
    end
  end
  for gi, sg in ipairs(sd.param_groups) do
    local g = self.param_groups[gi]
    local values = copy_value(g)
    for key, v in pairs(sg) do
      if key ~= 'params' then values[key] = copy_value(v) end
    end
    self._h:reset_state(gi, values)
    local step
    for pi, k in ipairs(sg.params) do
      local st = state[k] or state[tostring(k)]
      if st ~= nil then
        if type(st) ~= 'table' then error(string.format('%sstate[%s] is not a table', name, tostring(k)), 2) end
        for key, t in pairs(st) do
          if key == 'step' then
            local n = tonumber(C.is_tensor(t) and t:item() or t)
            if step and n ~= step then
              error(string.format('%sparameters of group %d have different steps (%s and %s); a flat group '
                                  .. 'steps together', name, gi, tostring(step), tostring(n)), 2)
            end
            step = n
          else
            if not C.is_tensor(t) then
              error(string.format('%sstate[%s].%s is not a tensor', name, tostring(k), tostring(key)), 2)
            end
            self._h:load_state(gi, pi, key, t)
          end
        end
      end
    end
    self._h:steps(gi, step or 0)
    for key, v in pairs(values) do
      if key ~= 'params' then g[key] = v end
    end
  end
end

function Optimizer:__tostring()
  local n = 0
  for _, g in ipairs(self.param_groups) do n = n + #g.params end
  return string.format('optim.%s (%d groups, %d parameters)', self.name, #self.param_groups, n)
end

-- ---- DeepSpeed's optimizer block ----

-- What DeepSpeed builds for each type and the params it takes.
local CONFIG_KEYS = {
  adam = { 'lr', 'betas', 'eps', 'weight_decay', 'bias_correction', 'amsgrad', 'torch_adam', 'adam_w_mode',
           'set_grad_none', 'foreach', 'fused', 'maximize', 'capturable', 'differentiable' },
  sgd = { 'lr', 'momentum', 'dampening', 'weight_decay', 'nesterov', 'maximize', 'foreach', 'differentiable' },
  adagrad = { 'lr', 'lr_decay', 'weight_decay', 'initial_accumulator_value', 'eps', 'foreach', 'maximize',
              'differentiable' },
  lamb = { 'lr', 'bias_correction', 'betas', 'eps', 'eps_inside_sqrt', 'weight_decay', 'max_coeff', 'min_coeff',
           'amsgrad' },
  lion = { 'lr', 'betas', 'weight_decay', 'set_grad_none' },
}
CONFIG_KEYS.adamw = CONFIG_KEYS.adam
-- DeepSpeed's 1-bit optimizers (deepspeed/runtime/fp16/onebit): an AdamW
-- (OneBitLamb: a Lamb) without bias correction that the step engine drives
-- (dslua/engine/init.lua, core/train/ds_onebit.h); their own keys go to
-- optimizer.onebit.
local ONEBIT_COMMON = { 'lr', 'bias_correction', 'betas', 'eps', 'eps_inside_sqrt', 'weight_decay', 'amsgrad',
                        'cuda_aware', 'comm_backend_name' }
local ONEBIT = {
  onebitadam = { name = 'OneBitAdam', keys = { 'freeze_step' } },
  zerooneadam = { name = 'ZeroOneAdam',
                  keys = { 'var_freeze_step', 'var_update_scaler', 'local_step_scaler', 'local_step_clipper' } },
  onebitlamb = { name = 'OneBitLamb', lamb = true,
                 keys = { 'freeze_step', 'coeff_beta', 'factor_max', 'factor_min', 'factor_threshold', 'max_coeff',
                          'min_coeff' } },
}
for kind, o in pairs(ONEBIT) do
  CONFIG_KEYS[kind] = { unpack(ONEBIT_COMMON) }
  for _, k in ipairs(o.keys) do table.insert(CONFIG_KEYS[kind], k) end
end

-- What from_config gives a type's params its block leaves out, where it
-- differs from the kind's own default (FusedAdam's weight decay, FusedLion's).
local CONFIG_DEFAULTS = { adam = { weight_decay = 0 }, adamw = { weight_decay = 0 },
                          onebitadam = { weight_decay = 0 }, zerooneadam = { weight_decay = 0 },
                          onebitlamb = { weight_decay = 0 },
                          lion = { lr = 1e-3, betas = { 0.9, 0.999 } } }
local CONFIG_KINDS = { adam = 'AdamW', adamw = 'AdamW', sgd = 'SGD', adagrad = 'Adagrad', lamb = 'Lamb', lion = 'Lion',
                       onebitadam = 'AdamW', zerooneadam = 'AdamW', onebitlamb = 'Lamb' }

-- The value param k of a block of type kind (lower case) takes when the
-- block leaves it out (nil: none, or no such param).
function M.config_default(kind, k)
  local own = CONFIG_DEFAULTS[kind]
  if own and own[k] ~= nil then return copy_value(own[k]) end
  return CONFIG_KINDS[kind] and copy_value(DEFAULTS[CONFIG_KINDS[kind]][k])
end

-- ds.optim.from_config(params, {type = ..., params = {...}}): the optimizer
-- DeepSpeed's engine builds from its config block (_configure_basic_optimizer):
-- type names case-insensitive; Adam and AdamW are FusedAdam with adam_w_mode
-- defaulting to true (so "Adam" means AdamW unless adam_w_mode is false, and
-- "AdamW" is always decoupled) and weight_decay defaulting to 0 unless
-- torch_adam picks torch.optim's own defaults; Lion is FusedLion (lr 1e-3,
-- betas 0.9/0.999 by default); max_grad_norm is refused as DeepSpeed does.
function M.from_config(params, block)
  if type(block) ~= 'table' or type(block.type) ~= 'string' then
    error('optim.from_config: expected an optimizer block {type = ..., params = {...}}', 2)
  end
  local kind = block.type:lower()
  local keys = CONFIG_KEYS[kind]
  if not keys then
    error(string.format("optimizer.type: '%s' is not supported (Adam, AdamW, SGD, Adagrad, Lamb, Lion)", block.type), 2)
  end
  local p = {}
  for k, v in pairs(block.params or {}) do p[k] = copy_value(v) end
  if p.max_grad_norm ~= nil then
    error("optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer parameter, please "
          .. "switch to using the deepspeed parameter 'gradient_clipping'", 2)
  end
  local valid = {}
  for _, k in ipairs(keys) do valid[k] = true end
  for k in pairs(p) do
    if not valid[k] then
      local names = copy_value(keys)
      table.sort(names)
      error(string.format("optimizer.params.%s: unknown parameter for %s (valid: %s)", tostring(k), block.type,
                          table.concat(names, ', ')), 2)
    end
  end
  if ONEBIT[kind] then
    -- DeepSpeed's update m / (sqrt v + eps) + wd p (times the trust ratio
    -- for Lamb): AdamW or Lamb, no bias correction
    local o = ONEBIT[kind].lamb
      and M.Lamb(params, { lr = p.lr, betas = p.betas, eps = p.eps, weight_decay = p.weight_decay or 0,
                           max_coeff = p.max_coeff, min_coeff = p.min_coeff, bias_correction = false })
      or M.AdamW(params, { lr = p.lr, betas = p.betas, eps = p.eps, weight_decay = p.weight_decay or 0,
                           bias_correction = false })
    o.onebit = { kind = ONEBIT[kind].name }
    for _, k in ipairs(ONEBIT[kind].keys) do o.onebit[k] = p[k] end
    return o
  elseif kind == 'adam' or kind == 'adamw' then
    local torch_adam = p.torch_adam
    local w_mode = p.adam_w_mode
    if w_mode == nil then w_mode = true end
    p.torch_adam, p.adam_w_mode = nil, nil
    local decoupled = kind == 'adamw' or w_mode
    if not torch_adam and p.weight_decay == nil then p.weight_decay = 0 end
    return (decoupled and M.AdamW or M.Adam)(params, p)
  elseif kind == 'lion' then
    for k, v in pairs(CONFIG_DEFAULTS.lion) do
      if p[k] == nil then p[k] = copy_value(v) end
    end
    return M.Lion(params, p)
  end
  local ctor = ({ sgd = M.SGD, adagrad = M.Adagrad, lamb = M.Lamb })[kind]
  return ctor(params, p)
end

return M
