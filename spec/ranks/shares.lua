-- For pipeline spec children: an iterator over this data-parallel rank's
-- share of each step's `micro` micro batches of list, gas of them a step
-- (rank d takes micro batches d * gas + 1 .. (d + 1) * gas of each step).
return function(list, micro, gas, dp_rank)
  local step, k = 0, gas
  return function()
    if k == gas then step, k = step + 1, 0 end
    k = k + 1
    return list[(step - 1) * micro + dp_rank * gas + k]
  end
end
