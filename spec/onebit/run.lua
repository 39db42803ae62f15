-- Trains a small MLP data parallel with one optimizer block and writes each
-- step's loss (the mean over ranks), whether its communication was
-- compressed and the bytes this rank handed to collectives, with the final
-- weights, as JSON: run.lua OUT.json TYPE STEPS [key=value ...] (the
-- optimizer's params: numbers, true or false; precision=bf16 or fp16 turns
-- that block on; groups=2: the biases in a second param group, without
-- weight decay). Every rank trains on its own samples. Each step also
-- notes how far the ranks' weights are apart: the largest difference from
-- rank 0's, over rank 0's largest weight.
local ds = require 'dslua'
local out, kind, steps = arg[1], arg[2], tonumber(arg[3])
local params, precision, groups = { lr = 2e-3, weight_decay = 0.01 }, nil, 1
for i = 4, #arg do
  local k, v = arg[i]:match('^(%w[%w_]*)=(.*)$')
  if k == 'precision' then precision = v elseif k == 'groups' then groups = tonumber(v)
  elseif k then params[k] = tonumber(v) or v == 'true' end
end
local x, y, model = require('spec.onebit.task')()
local model_parameters
if groups == 2 then
  local weights, biases = {}, {}
  for _, e in ipairs(model:named_parameters()) do
    local list = e[1]:match('bias$') and biases or weights
    list[#list + 1] = e[2]
  end
  model_parameters = { { params = weights }, { params = biases, weight_decay = 0 } }
end
local engine, _, loader = ds.initialize {
  model = model, training_data = ds.data.tensors { x = x, y = y }, model_parameters = model_parameters,
  config = { train_micro_batch_size_per_gpu = 16, steps_per_print = 100000,
             optimizer = { type = kind, params = params },
             bf16 = { enabled = precision == 'bf16' }, fp16 = { enabled = precision == 'fp16' } },
}
-- max |p - p on rank 0| / max |p on rank 0| over every weight and rank
local function spread()
  local apart, largest = 0, 0
  for _, e in ipairs(model:named_parameters()) do
    local p = e[2]:to('f32')
    local zero = p:clone()
    ds.comm.broadcast(zero, 0)
    apart = math.max(apart, (p - zero):abs():amax():item())
    largest = math.max(largest, zero:abs():amax():item())
  end
  local t = ds.tensor({ apart / largest }, 'f64')
  ds.comm.all_reduce(t, 'max')
  return t:item()
end
local rows, done = {}, false
while not done do
  for _, b in loader:epoch() do
    local loss = ds.cross_entropy(engine(b.x):to('f32'), b.y)
    engine:backward(loss)
    engine:step()
    local mean = ds.tensor({ loss:item() }, 'f64')
    ds.comm.all_reduce(mean, 'avg')
    local ob = engine.onebit_stats
    local compressed = ob ~= nil and ob.compressed
    rows[#rows + 1] = { loss = mean:item(), compressed = compressed, skipped = engine.overflow or false, spread = spread(),
                        bytes = compressed and ob.bytes or (engine.comm_stats and engine.comm_stats.bytes or 0) }
    if #rows == steps then done = true break end
  end
end
local weights = {}
for _, e in ipairs(model:named_parameters()) do weights[e[1]] = e[2]:to('f32'):view(-1):totable() end
if engine.rank == 0 then
  local f = assert(io.open(out, 'w'))
  f:write(ds.json.encode({ steps = rows, weights = weights, world_size = engine.world_size }))
  f:close()
end
engine:finish()
