-- Run by spec/sp_spec.lua on 1 rank and under mpirun: trains a tiny
-- GPT-2 or Llama (grouped-query heads) through ds.initialize with
-- sequence_parallel P (world / P data indices) on the same global batch
-- of 4 sequences of 8 tokens per step, some targets ignored, unevenly
-- over the sequence chunks; SGD with momentum (blind to no factor on the
-- gradient), ZeRO stage `zero`. Rank 0 writes every step's loss, the
-- final weights and the largest difference of any rank's weights from
-- rank 0's as JSON to the output path. With `save:<dir>` it saves a
-- checkpoint in dir after the first step; with `load:<dir>` it loads one
-- and runs the steps after it (losses: those steps').
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local rank_weights = require 'ranks.weights'

local out_path, kind, P, zero = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4] or 0)
local ckpt, ckpt_dir = (arg[5] or ''):match('^(%a+):(.+)$')
assert(out_path and (kind == 'gpt2' or kind == 'llama') and P,
       'usage: equiv.lua out.json gpt2|llama P [zero [save:dir|load:dir]]')
local GLOBAL, T, STEPS = 4, 8, 3
local dp = ds.comm.world_size() / P
local micro = GLOBAL / dp

ds.manual_seed(100 + ds.comm.rank())  -- each rank its own init: rank 0's is broadcast
local model, ignore
if kind == 'gpt2' then
  model = require('models.gpt2') { vocab_size = 32, block_size = T, n_layer = 2, n_head = 4, n_embd = 16,
                                   sequence_parallel = P }
  ignore = -1
else
  model = require('models.llama') { vocab_size = 32, block_size = T, n_layer = 2, n_head = 8, n_kv_head = 4,
                                    n_embd = 32, intermediate_size = 24, sequence_parallel = P }
  ignore = -100
end

local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = micro, gradient_accumulation_steps = 1, steps_per_print = 1000,
  optimizer = { type = 'SGD', params = { lr = 0.2, momentum = 0.9 } }, zero_optimization = { stage = zero },
  sequence_parallel_size = P,
} }

-- the steps' global batches; in each half (a data index's rows on 2 of
-- them) the targets of one row's last 3 tokens and of the other's second
-- ignored: the chunks of a sequence count unequally, the halves equally
ds.manual_seed(11)
local batches = {}
for s = 1, STEPS do
  local ids = (ds.rand(GLOBAL, T + 1) * 31.99):to('i64')
  local y = ids:narrow(2, 2, T):contiguous()
  ds.no_grad(function()
    for r = 1, GLOBAL, 2 do
      y:narrow(1, r, 1):narrow(2, T - 2, 3):fill_(ignore)
      y:narrow(1, r + 1, 1):narrow(2, 2, 1):fill_(ignore)
    end
  end)
  batches[s] = { x = ids:narrow(2, 1, T):contiguous(), y = y }
end

local losses, first = {}, 1
if ckpt == 'load' then
  engine:load_checkpoint(ckpt_dir)
  first = engine.global_steps + 1
end
for s = first, STEPS do
  local b = batches[s]
  local mine = { x = b.x:narrow(1, (model.dp_rank or 0) * micro + 1, micro):contiguous(),
                 y = b.y:narrow(1, (model.dp_rank or 0) * micro + 1, micro):contiguous() }
  local loss = engine:forward(mine)
  engine:backward(loss)
  engine:step()
  -- the mean over the data indices (each loss already covers its whole sequences)
  local l = ds.tensor({ loss:item() / dp }, 'f64')
  ds.comm.all_reduce(l, 'sum')
  losses[#losses + 1] = l:item() / P
  if ckpt == 'save' and s == 1 then engine:save_checkpoint(ckpt_dir) end
end

local weights, spread = rank_weights(model)
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses, weights = weights, spread = spread })
  f:close()
end
