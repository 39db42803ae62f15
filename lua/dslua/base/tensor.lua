-- Tensor operators, conveniences and printing, added to the C tensor type.
local M = {}

local fmt = string.format

-- Numbers shown with one format per tensor, chosen from its largest value.
local function number_format(t)
  if t:dtype() == 'bool' then return function(v) return v and 'true' or 'false' end end
  local integral = not t:dtype():match('^[fb]')
  if integral then return function(v) return fmt('%d', v) end end
  return function(v)
    if v ~= v then return 'nan' end
    if v == math.huge then return 'inf' elseif v == -math.huge then return '-inf' end
    local a = math.abs(v)
    if a ~= 0 and (a >= 1e5 or a < 1e-4) then return fmt('%.4e', v) end
    return fmt('%.4f', v)
  end
end

local function render(values, ndim, show, indent)
  if ndim == 0 then return show(values) end
  if ndim == 1 then
    local parts = {}
    for i = 1, #values do parts[i] = show(values[i]) end
    return '[' .. table.concat(parts, ', ') .. ']'
  end
  local rows = {}
  for i = 1, #values do rows[i] = render(values[i], ndim - 1, show, indent .. ' ') end
  return '[' .. table.concat(rows, ',\n' .. indent .. ' ') .. ']'
end

local MAX_SHOWN = 100   -- elements printed in full; larger tensors get a summary

function M.tostring(t)
  local shape = table.concat(t:size(), 'x')
  local head = fmt('tensor %s %s %s', shape == '' and 'scalar' or shape, t:dtype(), t:device())
  if t.requires_grad then
    head = head .. (t.grad_fn and (' grad_fn=' .. t.grad_fn) or ' requires_grad')
  end
  if t:numel() == 0 then return head .. ' []' end
  if t:numel() <= MAX_SHOWN then
    return head .. '\n' .. render(t:totable(), t:dim(), number_format(t), '')
  end
  if t:dtype() == 'bool' then return head end
  local f = t:detach():to('f64')
  return fmt('%s  min %.4g  max %.4g  mean %.4g  std %.4g', head,
             f:amin():item(), f:amax():item(), f:mean():item(), f:numel() > 1 and math.sqrt(f:var():item()) or 0)
end

function M.install(C)
  local mt = C.Tensor
  local methods = mt.methods
  mt.__add, mt.__sub, mt.__mul, mt.__div = C.add, C.sub, C.mul, C.div
  mt.__unm = function(a) return C.neg(a) end
  mt.__pow = C.pow
  mt.__tostring = M.tostring

  function methods.float(t) return t:to('f32') end
  function methods.double(t) return t:to('f64') end
  function methods.bf16(t) return t:to('bf16') end
  function methods.half(t) return t:to('f16') end
  function methods.long(t) return t:to('i64') end
  function methods.int(t) return t:to('i32') end
  function methods.flatten(t) return t:reshape(-1) end
  function methods.zero_(t) return t:fill_(0) end
  function methods.zero_grad(t) t.grad = nil end
  function methods.shape(t) return t:size() end
  function methods.t(t) return t:transpose(1, 2) end

  -- The message for a key that names no method or field (the C __index
  -- raises it), with the nearest name.
  local fields = { 'grad', 'requires_grad', 'is_leaf', 'grad_fn' }
  function mt.no_method(name)
    local names = {}
    for k in pairs(methods) do names[#names + 1] = k end
    for _, k in ipairs(fields) do names[#names + 1] = k end
    local hint = require('dslua.base.suggest').did_you_mean(name, names)
    return fmt("tensor has no method '%s'", name) .. (hint and ' (' .. hint .. ')' or '')
  end
end

return M
