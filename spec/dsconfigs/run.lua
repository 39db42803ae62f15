-- Initializes a tiny model from the config named by --config and takes two
-- steps: prints what initialize prints, then "ran 2 steps". With --pass-
-- optimizer an AdamW (lr 0.005, weight_decay 0.02) is passed to initialize
-- (fp32 stage 0 configs only: ZeRO takes a function); with --pass-scheduler
-- also a WarmupDecayLR over it (3 warm-up steps of 40); with --pass-batch
-- batch_size 4.
local ds = require 'dslua'
ds.manual_seed(3)
local model = ds.nn.Sequential(ds.nn.Linear(6, 8), ds.nn.ReLU(), ds.nn.Linear(8, 2))
local n = 64
local data = ds.data.tensors { x = ds.randn(n, 6), y = ds.randn(n, 2) }
local opts = { model = model, training_data = data }
for _, a in ipairs(arg) do
  if a == '--pass-optimizer' or a == '--pass-scheduler' then
    opts.optimizer = ds.optim.AdamW(model:parameters(), { lr = 0.005, weight_decay = 0.02 })
  end
  if a == '--pass-batch' then opts.batch_size = 4 end
  if a == '--pass-scheduler' then
    opts.lr_scheduler = ds.lr.WarmupDecayLR(opts.optimizer, { warmup_num_steps = 3, total_num_steps = 40 })
  end
end
local engine, _, loader = ds.initialize(opts)
for _, b in loader:epoch() do
  local out = engine(b.x)
  engine:backward(((out:to('f32') - b.y) ^ 2):mean())
  engine:step()
  if engine.global_steps == 2 then break end
end
engine:finish()
if engine.rank == 0 then print('ran ' .. engine.global_steps .. ' steps') end
