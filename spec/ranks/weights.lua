-- For multi-rank spec children: every parameter of a model as a flat f64
-- list by name, and the largest difference of any rank's weights from rank
-- 0's (all-reduced, so every rank returns the same number).
local ds = require 'dslua'

return function(model)
  local weights, diff = {}, 0
  for _, entry in ipairs(model:named_parameters()) do
    local p = entry[2]
    local r0 = ds.comm.broadcast(p:clone(), 0)
    diff = math.max(diff, (r0 - p):abs():amax():item())
    weights[entry[1]] = p:reshape(-1):to('f64'):totable()
  end
  local d = ds.tensor({ diff }, 'f64')
  ds.comm.all_reduce(d, 'max')
  return weights, d:item()
end
