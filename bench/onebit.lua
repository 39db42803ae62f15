-- The 1-bit optimizers against their uncompressed counterparts on N ranks
-- (run by bench/onebit.sh under mpirun): an MLP classifier trained data
-- parallel with an AdamW without bias correction (what OneBitAdam and
-- ZeroOneAdam are during warm-up), OneBitAdam, ZeroOneAdam, a Lamb without
-- bias correction and OneBitLamb, from the same start on the same batches.
-- Per window of steps: each one's mean loss (over the window and the
-- ranks) and the bytes a rank handed to collectives per step; then the
-- totals and their ratios against the counterpart.
--   dslua bench/onebit.lua [steps] [freeze] [adam_lr] [quick]
local ds = require 'dslua'

local STEPS = tonumber(arg[1] or 600)
local FREEZE = tonumber(arg[2] or 150)
local ADAM_LR = tonumber(arg[3] or 1e-3)
local quick = arg[4] == 'quick'
local WINDOW = math.max(1, math.floor(STEPS / 12))
local rank, N = ds.comm.rank(), ds.comm.world_size()
local d, hidden, classes, n = 64, quick and 64 or 512, 10, 8192

ds.manual_seed(7)
local x = ds.randn(n, d)
local y = (x:matmul(ds.randn(d, classes)) + ds.randn(n, classes) * 0.3):argmax(2)
local data = ds.data.tensors { x = x, y = y }

local RUNS = {
  { name = 'AdamW', type = 'AdamW', params = { bias_correction = false } },
  { name = 'OneBitAdam', type = 'OneBitAdam', params = { freeze_step = FREEZE } },
  { name = 'ZeroOneAdam', type = 'ZeroOneAdam', params = { var_freeze_step = FREEZE, var_update_scaler = 16,
                                                           local_step_scaler = 64, local_step_clipper = 8 } },
  { name = 'Lamb', type = 'Lamb', lr = 1e-2, params = { bias_correction = false } },
  { name = 'OneBitLamb', type = 'OneBitLamb', lr = 1e-2, params = { freeze_step = FREEZE } },
}
local BASE = { 1, 1, 1, 4, 4 }     -- each run's uncompressed counterpart

local function train(run)
  ds.manual_seed(11)
  local model = ds.nn.Sequential(ds.nn.Linear(d, hidden), ds.nn.GELU(), ds.nn.Linear(hidden, hidden), ds.nn.GELU(),
                                 ds.nn.Linear(hidden, classes))
  run.params.lr, run.params.weight_decay = run.lr or ADAM_LR, 0.01
  local engine, _, loader = ds.initialize {
    model = model, training_data = data,
    config = { train_micro_batch_size_per_gpu = 32, steps_per_print = 1e9,
               optimizer = { type = run.type, params = run.params } },
  }
  local losses, bytes = {}, {}
  while #losses < STEPS do
    for _, b in loader:epoch() do
      local loss = ds.cross_entropy(engine(b.x), b.y)
      engine:backward(loss)
      engine:step()
      local mean = ds.tensor({ loss:item() }, 'f64')
      ds.comm.all_reduce(mean, 'avg')
      local ob = engine.onebit_stats
      losses[#losses + 1] = mean:item()
      bytes[#bytes + 1] = ob and ob.compressed and ob.bytes or engine.comm_stats.bytes
      if #losses == STEPS then break end
    end
  end
  engine:destroy()
  return { losses = losses, bytes = bytes }
end

local results = {}
for i, run in ipairs(RUNS) do results[i] = train(run) end
if rank ~= 0 then return end

local function mean(t, lo, hi)
  local s = 0
  for k = lo, hi do s = s + t[k] end
  return s / (hi - lo + 1)
end

print(string.format('%d ranks, %d steps, freeze at %d (freeze_step, ZeroOneAdam var_freeze_step), Adam lr %g', N, STEPS,
                    FREEZE, ADAM_LR))
local heads = { 'AdamW', '1bitAdam', '0/1Adam', 'Lamb', '1bitLamb' }
local head = {}
for i, h in ipairs(heads) do head[i] = string.format('%9s', h) end
print(string.format('%-11s | %-49s | %s', 'steps', 'mean loss', 'bytes sent per step per rank'))
print(string.format('%-11s | %s | %s', '', table.concat(head, ' '), table.concat(head, ' ')))
for lo = 1, STEPS, WINDOW do
  local hi = math.min(STEPS, lo + WINDOW - 1)
  local row = { string.format('%4d-%-6d |', lo, hi) }
  for _, r in ipairs(results) do row[#row + 1] = string.format('%9.4f', mean(r.losses, lo, hi)) end
  row[#row + 1] = '|'
  for _, r in ipairs(results) do row[#row + 1] = string.format('%9.0f', mean(r.bytes, lo, hi)) end
  print(table.concat(row, ' '))
end
local last = math.max(1, STEPS - WINDOW + 1)
print(string.format('%-11s | %14s %14s %14s | %s', '', 'bytes, all', 'per step after', 'vs', 'mean loss, last '
                    .. (STEPS - last + 1) .. ' steps'))
for i, run in ipairs(RUNS) do
  local r, base = results[i], results[BASE[i]]
  local total, after = mean(r.bytes, 1, STEPS) * STEPS, mean(r.bytes, FREEZE + 1, STEPS)
  local loss, ref = mean(r.losses, last, STEPS), mean(base.losses, last, STEPS)
  print(string.format('%-11s | %14.0f %14.0f %13.1fx | %.4f (%+.1f%% vs %s)', run.name, total, after,
                      mean(base.bytes, FREEZE + 1, STEPS) / math.max(after, 1), loss, 100 * (loss / ref - 1),
                      RUNS[BASE[i]].name))
end
