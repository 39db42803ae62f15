-- A rank whose config or lr differs from rank 0's: run.lua MODE DIR trains
-- a small model for 5 steps and prints "[rank r] refused: <error>" or
-- "[rank r] trained". MODE: same, lr (the optimizer's lr per rank), clip
-- (gradient_clipping per rank), schedule (a Lua schedule reading the
-- rank), late (the same, from step 3 on), reload (the schedule rewritten
-- after step 2 to read the rank). DIR holds the schedule files.
local ds = require 'dslua'
local mode, dir = arg[1], arg[2]
local rank = ds.comm.rank()
local cfg = { train_batch_size = 2 * ds.comm.world_size(), steps_per_print = 1e9,
              optimizer = { type = 'SGD', params = { lr = 0.01 } } }
if mode == 'lr' then cfg.optimizer.params.lr = 0.01 * (rank + 1) end
if mode == 'clip' then cfg.gradient_clipping = rank end
local BY_RANK = 'return function(step) return 0.01 * (require("dslua").comm.rank() + 1) end'
local SCHEDULES = {
  schedule = BY_RANK,
  late = 'return function(step) return step < 3 and 0.01 or 0.01 * (require("dslua").comm.rank() + 1) end',
  reload = 'return function(step) return 0.01 end',
}
local path = dir .. '/' .. mode .. '.lua'
local function write(text)
  if rank == 0 then
    local f = assert(io.open(path, 'w'))
    f:write(text)
    f:close()
  end
  ds.comm.barrier()
end
if SCHEDULES[mode] then
  write(SCHEDULES[mode])
  cfg.scheduler = { type = 'lua', params = { path = path } }
end
ds.manual_seed(1)
local ok, err = pcall(function()
  local e = ds.initialize { model = ds.nn.Linear(3, 2), config = cfg }
  local x = ds.randn(2, 3)
  for step = 1, 5 do
    e:backward(e(x):sum())
    e:step()
    if step == 2 and mode == 'reload' then write(BY_RANK .. '\n') end
  end
end)
print(string.format('[rank %d] %s', rank, ok and 'trained' or 'refused: ' .. tostring(err)))
