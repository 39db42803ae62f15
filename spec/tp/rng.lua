-- Run by spec/tp_spec.lua under mpirun with tensor degree arg[2]: a tiny
-- GPT-2 with dropout on, trained two steps; rank 0 writes as JSON to
-- arg[1] the largest difference between the tensor ranks' losses (the
-- replicated activations, with their dropout masks, must agree), whether
-- a mask drawn forked (the model-parallel state) differs between tensor
-- ranks and whether one drawn from the default generator agrees; and
-- whether the engine's own loader, and the sampler block's, give the
-- tensor ranks the same batches.
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local out_path, tp = assert(arg[1]), tonumber(arg[2])
ds.checkpointing.model_parallel_manual_seed(5, ds.comm.rank() % tp)
local m = GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 4, n_embd = 16, dropout = 0.2, tp = tp,
                checkpoint = true }
local g = m.tensor_group
local engine = ds.initialize { model = m, config = { train_batch_size = 4, optimizer = { type = 'SGD',
                                                                                         params = { lr = 0.1 } } } }
-- the largest difference of x between the ranks of g
local function spread(x)
  local hi, lo = x:clone(), x:clone()
  ds.comm.all_reduce(hi, 'max', g)
  ds.comm.all_reduce(lo, 'min', g)
  return (hi - lo):abs():amax():item()
end

local tokens = (ds.rand(4, 9) * 32):to('i64')
local loss_spread = 0
for _ = 1, 2 do
  local loss = engine { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
  engine:backward(loss)
  engine:step()
  loss_spread = math.max(loss_spread, spread(loss:detach():reshape({ 1 })))
end
local ones = ds.ones(64)
local tracker = ds.checkpointing.get_rng_tracker()
local forked = tracker:fork(ds.checkpointing.MODEL_PARALLEL_RNG, function() return ds.dropout(ones, 0.5) end)
local plain = ds.dropout(ones, 0.5)
-- the engine's own loader: the same batches on the tensor ranks, whatever
-- their generators' states
if g:rank() == 1 then ds.rand(3) end
local data = ds.data.tensors { x = ds.arange(24, 'f32'):reshape({ 24, 1 }) }
local _, _, loader = ds.initialize {
  model = GPT { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8, tp = tp },
  config = { train_batch_size = 4, optimizer = { type = 'SGD', params = { lr = 0.1 } } }, training_data = data }
local batch_spread, first = 0, nil
for _, b in loader:epoch(1) do
  batch_spread = math.max(batch_spread, spread(b.x))
  first = first or b.x:reshape(-1):totable()
end
-- and the sampler block's policy: one micro batch a data-parallel rank
local _, _, policy_loader = ds.initialize {
  model = GPT { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8, tp = tp },
  config = { sampler = { policy = 'uneven', micro_batch_per_rank = { 4 } }, steps_per_print = 1e9,
             optimizer = { type = 'SGD', params = { lr = 0.1 } } }, training_data = data }
local sampler_spread, sampler_batches = 0, 0
for _, b in policy_loader:epoch(1) do
  sampler_spread, sampler_batches = math.max(sampler_spread, spread(b.x)), sampler_batches + 1
end
local result = { loss_spread = loss_spread, forked_spread = spread(forked), default_spread = spread(plain),
                 loss = engine.last_loss, batch_spread = batch_spread, first_batch = first,
                 sampler_spread = sampler_spread, sampler_batches = sampler_batches }
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode(result))
  f:close()
end
