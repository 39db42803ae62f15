-- ZeRO-Offload's two costs (run by bench/offload.sh).
--   dslua bench/offload.lua adam [elements] [quick]
-- The CPU AdamW step over flat f32 buffers in GB/s (bytes read and
-- written per step: p, g, m, v in, p, m, v out, 28 per element, over its
-- median time), under each instruction set this CPU runs and on 1 thread
-- and all, against a large memcpy's rate measured beside it (2 x its
-- bytes; ds copy_ of contiguous f32 is memcpy in threads' pieces).
--   mpirun ... dslua bench/offload.lua zero [steps] [quick]
-- A GPT-2 trained with AdamW at stages 2 and 3, with and without
-- offload_optimizer device cpu: the median step time of each (the faster
-- of two runs) and their ratio. Under DSLUA_TEST_OFFLOAD_CPU (as
-- offload.sh runs it) offload takes its pipeline as from a GPU, its
-- copies made on the host; the runs say whether it did.
local ds = require 'dslua'

local MODE = arg[1]
local quick = arg[3] == 'quick'

-- Calls of fn that last 0.1 s, after as many warm-up calls.
local function calls_for(fn)
  fn()
  local t0 = ds.wall_time()
  fn()
  local k = math.max(1, math.ceil(0.1 / math.max(ds.wall_time() - t0, 1e-6)))
  for _ = 1, math.max(2, k) do fn() end
  return k
end

local function seconds(fn, k)
  local t0 = ds.wall_time()
  for _ = 1, k do fn() end
  return (ds.wall_time() - t0) / k
end

local function median(xs)
  table.sort(xs)
  return xs[math.floor((#xs + 1) / 2)]
end

-- GB/s of a and of b (bytes per call ba, bb) and their ratio: 7 samples of
-- each, a's and b's taken back to back so that both see the same load
-- (bench/README.md's method, in pairs); the medians.
local function paired(a, ba, b, bb)
  local ka, kb = calls_for(a), calls_for(b)
  local ra, rb, ratio = {}, {}, {}
  for s = 1, 7 do
    ra[s] = ba / seconds(a, ka) / 1e9
    rb[s] = bb / seconds(b, kb) / 1e9
    ratio[s] = ra[s] / rb[s]
  end
  return median(ra), median(rb), median(ratio)
end

local function adam()
  local n = math.floor(tonumber(arg[2]) or (quick and 2^18 or 2^24))
  ds.manual_seed(1)
  local w = ds.randn(n):requires_grad_()
  local opt = ds.optim.AdamW({ w }, { lr = 1e-3, weight_decay = 0.01 })
  w.grad:copy_(ds.randn(n))
  local src, dst = ds.randn(n), ds.zeros(n)
  local threads, best = ds.num_threads(), ds.cpu_optim_isa()
  print(string.format('AdamW over %s f32 elements (%.0f MiB of p, g, m, v); %s',
                      require('dslua.engine.zero').commas(n), 16 * n / 2^20, best))
  print(string.format('%-8s %8s %12s %12s %8s', 'isa', 'threads', 'AdamW GB/s', 'copy GB/s', 'ratio'))
  local counts = threads > 1 and { 1, threads } or { 1 }
  for _, isa in ipairs({ 'avx512', 'avx2', 'sse2' }) do
    if pcall(ds.cpu_optim_isa, isa) then
      for _, t in ipairs(counts) do
        ds.num_threads(t)
        local step, copy, ratio = paired(function() opt:step() end, 28 * n, function() dst:copy_(src) end, 8 * n)
        print(string.format('%-8s %8d %12.2f %12.2f %8.2f', isa, t, step, copy, ratio))
        print(string.format('result dslua adamw %s %d %.3f %.3f', isa, t, step, copy))
      end
    end
  end
  ds.num_threads(threads)
  ds.cpu_optim_isa(best)
  print('ratio: AdamW GB/s / copy GB/s, the median of 7 back-to-back pairs (1: the step runs at the copy rate);')
  print('a copy\'s stores read their lines first (write-allocate), a third more traffic than it counts;')
  print('AdamW stores into lines it has read')
end

local function zero()
  local GPT = require 'models.gpt2'
  local steps, warmup = math.floor(tonumber(arg[2]) or 6), quick and 1 or 2
  local N, rank = ds.comm.world_size(), ds.comm.rank()
  local size = quick and { n_layer = 2, n_embd = 64, vocab = 256, T = 32, B = 2 }
                      or { n_layer = 6, n_embd = 512, vocab = 8192, T = 128, B = 2 }
  ds.manual_seed(7)
  local tokens = (ds.rand(size.B * N * (steps + warmup), size.T + 1) * size.vocab):to('i64')
  local data = ds.data.tensors { x = tokens:narrow(2, 1, size.T):contiguous(),
                                 y = tokens:narrow(2, 2, size.T):contiguous() }
  local function run(stage, offload)
    jit.flush()
    require('dslua.engine').settle_garbage()
    ds.manual_seed(1)
    local model = GPT { vocab_size = size.vocab, block_size = size.T, n_layer = size.n_layer, n_head = 8,
                        n_embd = size.n_embd, bias = false }
    local cfg = {
      train_batch_size = size.B * N, steps_per_print = 1e9,
      optimizer = { type = 'AdamW', params = { lr = 3e-4, weight_decay = 0.1 } },
      zero_optimization = { stage = stage, offload_optimizer = { device = offload } },
    }
    local engine, _, loader = ds.initialize { model = model, config = cfg, training_data = data }
    local times, step, pipelined = {}, 0, engine.zero.engine:offload_counts() ~= nil
    for _, batch in loader:epoch(1) do
      step = step + 1
      ds.comm.barrier()
      local t0 = ds.wall_time()
      engine:backward(engine(batch))
      engine:step()
      local dt = ds.comm.all_reduce(ds.tensor({ ds.wall_time() - t0 }, 'f64'), 'max'):item()
      if step > warmup then times[#times + 1] = dt end
    end
    table.sort(times)
    local n = model:num_parameters()
    engine:finish()
    engine:destroy()
    return 1000 * times[math.floor((#times + 1) / 2)], n, pipelined
  end
  -- each twice, in the order none, cpu, cpu, none, the faster run kept:
  -- a run's place in the sequence (the heap and caches the ones before
  -- leave) weighs on both alike
  local rows = {}
  for _, stage in ipairs({ 2, 3 }) do
    local none, n = run(stage, 'none')
    local cpu, _, pipelined = run(stage, 'cpu')
    cpu = math.min(cpu, (run(stage, 'cpu')))
    none = math.min(none, (run(stage, 'none')))
    rows[#rows + 1] = { stage = stage, none = none, cpu = cpu, n = n, pipelined = pipelined }
  end
  if rank ~= 0 then return end
  print(string.format('GPT-2 %d layers, %d wide, vocab %d (%s parameters), T=%d, micro batch %d per rank, fp32, '
                      .. 'AdamW; %d CPU ranks; median of %d steps', size.n_layer, size.n_embd, size.vocab,
                      require('dslua.engine.zero').commas(rows[1].n), size.T, size.B, N, steps))
  print(string.format('%-6s %14s %14s %8s', 'stage', 'no offload ms', 'offload ms', 'ratio'))
  for _, r in ipairs(rows) do
    print(string.format('%-6d %14.1f %14.1f %7.2fx', r.stage, r.none, r.cpu, r.cpu / r.none))
    print(string.format('result dslua offload stage%d %.3f %.3f', r.stage, r.none, r.cpu))
  end
  print('ratio: offload step time / no offload (on CPU ranks the masters are in host memory either way); '
        .. (rows[1].pipelined and 'offload through its pipeline, the host\'s copies standing in for a GPU\'s'
            or 'offload the plain step (no DSLUA_TEST_OFFLOAD_CPU)'))
end

if MODE == 'adam' then adam()
elseif MODE == 'zero' then zero()
else error('usage: dslua bench/offload.lua adam [elements] [quick] | zero [steps] [quick]') end
