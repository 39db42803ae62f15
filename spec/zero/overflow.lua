-- Run by spec/zero_spec.lua (1 rank, and 2 ranks under mpirun): fp16 with
-- dynamic loss scaling; the loss is multiplied by 1e30 on the steps listed
-- in arg[2] (on the last rank only), which overflows the fp16 gradients.
-- Rank 0 writes per step: the loss scale before and after, skipped_steps,
-- the learning rate after the step and the scheduler's step count.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local write_json = require 'ranks.write_json'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: overflow.lua out.json steps stage [hysteresis consecutive min_scale]')
local bad = {}
for s in (arg[2] or ''):gmatch('%d+') do bad[tonumber(s)] = true end
local stage = tonumber(arg[3] or 0)
local hysteresis = tonumber(arg[4] or 2)
local consecutive = arg[5] == 'true'
local min_scale = tonumber(arg[6] or 1)
local N = ds.comm.world_size()

ds.manual_seed(11)
local tokens = (ds.rand(8 * 16, 9) * 32):to('i64')
local data = ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
ds.manual_seed(100)
local m = GPT { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16, bias = false }
local cfg = {
  train_batch_size = 8, steps_per_print = 1000,
  optimizer = { type = 'AdamW', params = { lr = 1e-3 } },
  scheduler = { type = 'WarmupLR', params = { warmup_min_lr = 0, warmup_max_lr = 1e-3, warmup_num_steps = 100,
                                               warmup_type = 'linear' } },
  fp16 = { enabled = true, initial_scale_power = 8, loss_scale_window = 3, hysteresis = hysteresis,
           consecutive_hysteresis = consecutive, min_loss_scale = min_scale },
  zero_optimization = { stage = stage },
}
local engine, _, loader, sched = ds.initialize { model = m, config = cfg, training_data = data }
local steps = {}
for _, batch in loader:epoch(1) do
  local step = engine.global_steps + 1
  local loss = engine(batch)
  if bad[step] and ds.comm.rank() == N - 1 then loss = loss * 1e30 end
  local before = engine.scaler.cur_scale
  engine:backward(loss)
  engine:step()
  steps[#steps + 1] = { scale_before = before, scale_after = engine.scaler.cur_scale, skipped = engine.skipped_steps,
                        lr = engine:get_lr()[1], overflow = engine.overflow and true or false }
end
if ds.comm.rank() == 0 then write_json(out_path, { steps = steps }) end
