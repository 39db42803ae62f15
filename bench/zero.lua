-- ZeRO stages on N ranks (run by bench/zero.sh under mpirun): a GPT-2 of
-- a few million parameters trained with AdamW at stages 0-3 (fp32, and
-- bf16 with -d bf16); per stage the median step time over the timed steps,
-- its ratio to stage 0's measured in the same run, and each rank's peak
-- bytes by category from the allocator's counters (peaks reset after the
-- warm-up steps, so they are the steady state of a step).
--   dslua bench/zero.lua [steps] [dtype] [quick]
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local STEPS = tonumber(arg[1] or 12)
local DTYPE = arg[2] or 'fp32'
local quick = arg[3] == 'quick'
local WARMUP = quick and 1 or 3
local N = ds.comm.world_size()
local rank = ds.comm.rank()
local size = quick and { n_layer = 2, n_embd = 64, vocab = 256, T = 32, B = 2 }
                    or { n_layer = 6, n_embd = 256, vocab = 4096, T = 128, B = 4 }

ds.manual_seed(7)
local tokens = (ds.rand(size.B * N * (STEPS + WARMUP), size.T + 1) * size.vocab):to('i64')
local data = ds.data.tensors { x = tokens:narrow(2, 1, size.T):contiguous(),
                               y = tokens:narrow(2, 2, size.T):contiguous() }

local KEYS = { 'parameters', 'gradients', 'master_weights', 'optimizer_state', 'activations', 'total' }
local BUCKET = 5e5        -- reduce_bucket_size, elements

-- Step ms of the Lua-driven ZeRO that came before the C step engine, on
-- this 2-core machine with 2 ranks of 1 thread (bench/README.md, commit
-- 8c2470b): what "vs landed" divides by.
local LANDED = { fp32 = { 293.8, 300.4, 300.7, 311.7 }, bf16 = { 426.9 } }

local function run(stage)
  jit.flush()      -- compiled traces keep the objects they specialised on (the last engine) alive
  require('dslua.engine').settle_garbage()
  ds.manual_seed(1)
  local model = GPT { vocab_size = size.vocab, block_size = size.T, n_layer = size.n_layer, n_head = 4,
                      n_embd = size.n_embd, bias = false }
  local cfg = {
    train_batch_size = size.B * N, steps_per_print = 1e9,
    optimizer = { type = 'AdamW', params = { lr = 3e-4, weight_decay = 0.1 } },
    zero_optimization = { stage = stage, reduce_bucket_size = BUCKET, stage3_prefetch_bucket_size = 5e5,
                          stage3_param_persistence_threshold = 1e4 },
    bf16 = { enabled = DTYPE == 'bf16' },
  }
  local engine, _, loader = ds.initialize { model = model, config = cfg, training_data = data }
  local times, step, crossings = {}, 0, nil
  for _, batch in loader:epoch(1) do
    step = step + 1
    if step == WARMUP + 1 then ds.reset_peak_memory() end
    ds.comm.barrier()
    local t0 = ds.wall_time()
    local loss = engine(batch)
    if step == WARMUP then
      -- untimed (the JIT is off while counting): Lua-C crossings of backward and step
      crossings = ds.crossings(function() engine:backward(loss); engine:step() end)
    else
      engine:backward(loss)
      engine:step()
    end

    local dt = ds.comm.all_reduce(ds.tensor({ ds.wall_time() - t0 }, 'f64'), 'max'):item()
    if step > WARMUP then times[#times + 1] = dt end

    collectgarbage()       -- untimed: every stage's peaks start from live tensors only
  end
  table.sort(times)
  local steps = engine.steps.engine
  local largest = 0
  for b = 1, steps:buckets() do largest = math.max(largest, select(3, steps:bucket(b))) end
  local report = engine:memory_report()
  engine:finish()
  engine:destroy()
  local out = { ms = 1000 * times[math.floor((#times + 1) / 2)], report = report, params = model:num_parameters(),
                crossings = crossings, largest_bucket = largest }
  return out
end

local results = {}
for stage = 0, 3 do results[stage] = run(stage) end

if rank == 0 then
  local function mb(b) return string.format('%.1f', b / 2^20) end
  print(string.format('GPT-2 %d layers, %d wide, vocab %d, T=%d, micro batch %d per rank, %s, AdamW; %d ranks; '
                      .. 'median of %d steps', size.n_layer, size.n_embd, size.vocab, size.T, size.B, DTYPE, N,
                      #results[0].report > 0 and STEPS or 0))
  print(string.format('%s parameters; peak MiB per rank (the largest over ranks) during the timed steps',
                      require('dslua.engine.zero').commas(results[0].params)))
  print()
  print(string.format('%-6s %10s %9s %10s %10s %11s %10s %8s %10s %12s %9s', 'stage', 'step ms', 'vs 0', 'vs landed',
                      'crossings', 'parameters', 'gradients', 'master', 'optimizer', 'activations', 'total'))
  local peaks = {}
  for stage = 0, 3 do
    local r = results[stage]
    local peak = {}
    for _, k in ipairs(KEYS) do
      peak[k] = 0
      for _, e in ipairs(r.report) do peak[k] = math.max(peak[k], e.peak[k]) end
    end
    peaks[stage] = peak
    local landed = not quick and (LANDED[DTYPE] or {})[stage + 1] or nil
    print(string.format('%-6d %10.1f %8.2fx %10s %10d %11s %10s %8s %10s %12s %9s', stage, r.ms, r.ms / results[0].ms,
                        landed and string.format('%.2fx', r.ms / landed) or '-', r.crossings,
                        mb(peak.parameters), mb(peak.gradients), mb(peak.master_weights), mb(peak.optimizer_state),
                        mb(peak.activations), mb(peak.total)))
  end
  print()
  print('vs 0: step time / stage 0 step time in this run (> 1: slower than stage 0)')
  print('vs landed: step time / the Lua-driven ZeRO\'s on this machine, 2 ranks of 1 thread (bench/README.md)')
  print('crossings: Lua-C calls of one backward + step (ds.crossings), independent of the parameter count')
  -- stage 2 keeps its shard of fp32 gradients, and of the model's
  -- gradients only those whose bucket has not gone: the one filling and
  -- one held back (the tied embedding's completes last); a parameter
  -- above reduce_bucket_size is a bucket of its own
  local bytes = DTYPE == 'bf16' and 2 or 4
  local limit = peaks[0].gradients / N + (BUCKET + results[2].largest_bucket) * bytes
  print(string.format('stage 2 peak gradients %s MiB <= stage 0 / %d + one bucket + the largest (%s elements) = %s MiB: %s',
                      mb(peaks[2].gradients), N, require('dslua.engine.zero').commas(results[2].largest_bucket), mb(limit),
                      peaks[2].gradients <= limit and 'yes' or 'NO'))
end
