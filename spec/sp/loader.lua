-- Run by spec/sp_spec.lua on 1 rank and under mpirun on 2 and 4: a tiny
-- GPT-2 with sequence_parallel 2 where the world holds it (1 on one rank)
-- trains one epoch of 32 sequences from the engine's own loader, 8 a step;
-- rank 0 writes every step's loss (the mean over the data indices) as JSON
-- to arg[1].
local ds = require 'dslua'

local out_path = assert(arg[1], 'usage: loader.lua out.json')
local world = ds.comm.world_size()
local P = math.min(2, world)
ds.manual_seed(3)
local tokens = (ds.rand(32, 9) * 31.99):to('i64')
local data = ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
ds.manual_seed(100)
local model = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8,
                                       sequence_parallel = P }
local engine, _, loader = ds.initialize { model = model, training_data = data, config = {
  train_batch_size = 8, steps_per_print = 1000, sequence_parallel_size = P,
  optimizer = { type = 'SGD', params = { lr = 0.1, momentum = 0.9 } } } }
local losses = {}
for _, batch in loader:epoch() do
  local loss = engine(batch)
  engine:backward(loss)
  engine:step()
  local l = ds.tensor({ loss:item() / world }, 'f64')
  ds.comm.all_reduce(l, 'sum')
  losses[#losses + 1] = l:item()
end
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses })
  f:close()
end
