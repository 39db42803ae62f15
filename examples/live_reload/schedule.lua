-- The learning rate of examples/live_reload: edit this file while train.lua
-- runs and the new version takes over at the next step, on every rank.
-- step counts the optimizer steps taken; return the lr of the next one.
local peak, floor = 3e-3, 3e-4
local warmup, total = 30, 400

return function(step)
  if step < warmup then return peak * (step + 1) / warmup end
  local t = math.min(1, (step - warmup) / (total - warmup))
  return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
end
