-- The task run.lua trains and reference.lua recomputes: 2048 samples of 32
-- features, their labels from a noisy linear map, and the MLP, all drawn
-- from seed 7 in this order.
local ds = require 'dslua'
return function()
  ds.manual_seed(7)
  local n, d = 2048, 32
  local x = ds.randn(n, d)
  local w_true = ds.randn(d, 4)
  local y = (x:matmul(w_true) + ds.randn(n, 4) * 0.1):argmax(2)
  local model = ds.nn.Sequential(ds.nn.Linear(d, 64), ds.nn.GELU(), ds.nn.Linear(64, 64), ds.nn.GELU(),
                                 ds.nn.Linear(64, 4))
  return x, y, model
end
