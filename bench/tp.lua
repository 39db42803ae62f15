-- Run by bench/tp.sh under mpirun on 2 ranks: trains GPT-2 (gpt-mini's
-- shape, or a tiny one with quick) through ds.initialize on the same
-- global batch per step, tensor degree 2 (one data rank: every rank the
-- whole batch, half of every layer) or data parallel (each rank half the
-- batch, the whole model); AdamW, fp32. Prints
--   result tp <mode> <tokens per step> <seconds per step> <loss>
-- for mode tensor2 or data2: the median of the timed steps after warm-up.
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local args = ds.args.rest
local mode, quick = args[1], args[2] == 'quick'
assert(mode == 'tensor2' or mode == 'data2', 'usage: tp.lua tensor2|data2 [quick]')
local cfg = quick and { n_layer = 2, n_head = 4, n_embd = 64, vocab_size = 512, block_size = 64 }
            or { name = 'gpt-mini', vocab_size = 8192, block_size = 256 }
local GLOBAL, WARM, STEPS = 8, quick and 1 or 2, quick and 2 or 6
local tp = mode == 'tensor2' and 2 or 1
cfg.tp = tp
ds.manual_seed(1)
local model = GPT(cfg)
local micro = GLOBAL / (ds.comm.world_size() / tp)
local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = micro, steps_per_print = 10 ^ 9,
  optimizer = { type = 'AdamW', params = { lr = 1e-4 } } } }
local T, V = model.config.block_size, model.config.vocab_size
local ids = (ds.rand(GLOBAL, T + 1) * (V - 0.01)):to('i64')
local rows = (model.dp_rank or ds.comm.rank()) * micro + 1
local x = ids:narrow(1, rows, micro):narrow(2, 1, T):contiguous()
local y = ids:narrow(1, rows, micro):narrow(2, 2, T):contiguous()
local times, loss = {}, 0
for s = 1, WARM + STEPS do
  ds.comm.barrier()
  local t0 = ds.wall_time()
  local l = engine:forward { x = x, y = y }
  engine:backward(l)
  engine:step()
  loss = l:item()
  ds.comm.barrier()
  if s > WARM then times[#times + 1] = ds.wall_time() - t0 end
end
table.sort(times)
if ds.comm.rank() == 0 then
  print(string.format('result tp %s %d %.4f %.4f', mode, GLOBAL * T, times[math.floor((#times + 1) / 2)], loss))
end
