-- The 1-bit optimizers against their uncompressed counterpart on N ranks
-- (run by bench/onebit.sh under mpirun): an MLP classifier trained data
-- parallel with an AdamW without bias correction (what OneBitAdam and
-- ZeroOneAdam are during warm-up), OneBitAdam and ZeroOneAdam, from the same
-- start on the same batches. Per window of steps: each one's mean loss
-- (over the window and the ranks) and the bytes a rank handed to
-- collectives per step; then the totals and their ratios.
--   dslua bench/onebit.lua [steps] [freeze] [quick]
local ds = require 'dslua'

local STEPS = tonumber(arg[1] or 600)
local FREEZE = tonumber(arg[2] or 150)
local quick = arg[3] == 'quick'
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
}

local function train(run)
  ds.manual_seed(11)
  local model = ds.nn.Sequential(ds.nn.Linear(d, hidden), ds.nn.GELU(), ds.nn.Linear(hidden, hidden), ds.nn.GELU(),
                                 ds.nn.Linear(hidden, classes))
  run.params.lr, run.params.weight_decay = 1e-3, 0.01
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

print(string.format('%d ranks, %d steps, freeze at %d (OneBitAdam freeze_step, ZeroOneAdam var_freeze_step)', N,
                    STEPS, FREEZE))
print(string.format('%-11s | %-29s | %s', 'steps', 'mean loss', 'bytes sent per step per rank'))
print(string.format('%-11s | %9s %9s %9s | %9s %9s %9s', '', 'AdamW', '1-bit', '0/1', 'AdamW', '1-bit', '0/1'))
for lo = 1, STEPS, WINDOW do
  local hi = math.min(STEPS, lo + WINDOW - 1)
  local row = { string.format('%4d-%-6d |', lo, hi) }
  for _, r in ipairs(results) do row[#row + 1] = string.format('%9.4f', mean(r.losses, lo, hi)) end
  row[#row + 1] = '|'
  for _, r in ipairs(results) do row[#row + 1] = string.format('%9.0f', mean(r.bytes, lo, hi)) end
  print(table.concat(row, ' '))
end
local total = {}
for i, r in ipairs(results) do total[i] = mean(r.bytes, 1, STEPS) * STEPS end
local after = {}
for i, r in ipairs(results) do after[i] = mean(r.bytes, FREEZE + 1, STEPS) end
print(string.format('bytes, all steps: AdamW %.0f, OneBitAdam %.0f (x%.1f less), ZeroOneAdam %.0f (x%.1f less)',
                    total[1], total[2], total[1] / total[2], total[3], total[1] / total[3]))
print(string.format('bytes per step after the freeze: AdamW %.0f, OneBitAdam %.0f (x%.1f less), ZeroOneAdam %.0f '
                    .. '(x%.1f less)', after[1], after[2], after[1] / after[2], after[3],
                    after[1] / math.max(after[3], 1)))
local last = math.max(1, STEPS - WINDOW + 1)
print(string.format('mean loss of the last %d steps: AdamW %.4f, OneBitAdam %.4f (%+.1f%%), ZeroOneAdam %.4f (%+.1f%%)',
                    STEPS - last + 1, mean(results[1].losses, last, STEPS), mean(results[2].losses, last, STEPS),
                    100 * (mean(results[2].losses, last, STEPS) / mean(results[1].losses, last, STEPS) - 1),
                    mean(results[3].losses, last, STEPS),
                    100 * (mean(results[3].losses, last, STEPS) / mean(results[1].losses, last, STEPS) - 1)))
