-- OneBitAdam under fp16 on N ranks (mpirun), compressing from step 3: on
-- step 6 the last rank's loss is multiplied by 1e30, which overflows its
-- fp16 gradients alone. Rank 0 writes, per step and rank, whether the
-- step was skipped, gathered from every rank. overflow.lua OUT.json
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local write_json = require 'ranks.write_json'
local out = arg[1]
ds.manual_seed(7)
local x, y = ds.randn(256, 8), (ds.rand(256) * 3):to('i64')
ds.manual_seed(3)
local model = ds.nn.Sequential(ds.nn.Linear(8, 16), ds.nn.GELU(), ds.nn.Linear(16, 3))
local engine, _, loader = ds.initialize {
  model = model, training_data = ds.data.tensors { x = x, y = y },
  config = { train_micro_batch_size_per_gpu = 8, steps_per_print = 1e9, fp16 = { enabled = true },
             optimizer = { type = 'OneBitAdam', params = { lr = 1e-3, freeze_step = 2 } } },
}
local N, rows = ds.comm.world_size(), {}
for step, b in loader:epoch() do
  local loss = ds.cross_entropy(engine(b.x):to('f32'), b.y)
  if step == 6 and ds.comm.rank() == N - 1 then loss = loss * 1e30 end
  engine:backward(loss)
  engine:step()
  local flags = {}
  for r, t in ipairs(ds.comm.all_gather(ds.tensor({ engine.overflow and 1 or 0 }, 'f64'))) do flags[r] = t:item() == 1 end
  rows[step] = { skipped = flags, compressed = engine.onebit_stats.compressed }
  if step == 8 then break end
end
if ds.comm.rank() == 0 then write_json(out, { steps = rows }) end
