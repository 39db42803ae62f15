-- Communication benchmark, run on 2 ranks by bench/comm.sh:
--
--   mpirun -np 2 dslua bench/comm.lua REF_LIBRARY [bandwidth|overlap|all] [quick]
--
-- bandwidth: all-reduce bus bandwidth (f32 sum, in place) over 4 KB ..
--   256 MB through ds.comm.all_reduce (as configured, and with the agreement
--   before each collective turned off), next to MPI_Allreduce called from C
--   in this same process (bench/allreduce_ref.c, loaded through the FFI),
--   alternating, best of 3 rounds each; busbw = bytes / time * 2(n-1)/n
--   (nccl-tests' convention), the slowest rank's time. A third column
--   times MPI_Iallreduce + MPI_Wait from C, the calls ds.comm makes.
-- overlap: GPT-2 124M training steps (B=1, T=128, SGD) through the engine,
--   for three reduce_bucket_size values: backward alone, the engine's
--   backward that launches buckets as they fill, what step() still waits,
--   the same buckets all-reduced back to back after backward (serial, no
--   overlap), and from the engine's comm_stats the buckets' time in flight
--   and the part of it before backward returned.
-- Rank 0 prints the tables.
local ds = require 'dslua'
local util = require 'bench.util'
local ffi = require 'ffi'

local args = ds.args.rest or {}
local lib, which, quick = args[1], 'all', false
for i = 2, #args do
  if args[i] == 'quick' then quick = true else which = args[i] end
end
if not lib or (which ~= 'all' and which ~= 'bandwidth' and which ~= 'overlap') then
  io.stderr:write('usage: mpirun -np 2 dslua bench/comm.lua REF_LIBRARY [bandwidth|overlap|all] [quick]\n')
  os.exit(2)
end

local comm = ds.comm
local N, rank = comm.world_size(), comm.rank()
local now = ds.wall_time

local out = util.say

-- the largest of every rank's x
local function slowest(x)
  local t = ds.tensor({ x }, 'f64')
  comm.all_reduce(t, 'max')
  return t:item()
end

local median = util.median

local function size_text(bytes)
  if bytes >= 2 ^ 20 then return string.format('%d MB', bytes / 2 ^ 20) end
  return string.format('%d KB', bytes / 2 ^ 10)
end

---------------------------------------------------------------- bandwidth

local function bandwidth()
  ffi.cdef 'double ref_allreduce_seconds(long n, int iters, int nonblocking);'
  local ref = ffi.load(lib)
  local sample = quick and 0.02 or 0.2
  local rounds = quick and 1 or 3
  local checked = comm.check_enabled()
  out('all-reduce bus bandwidth, f32 sum in place, %d ranks, best of %d round(s)', N, rounds)
  out('%-8s %6s %12s %12s %14s %15s %8s %8s', 'size', 'calls', 'ds.comm', 'unchecked', 'MPI_Allreduce',
      'MPI_Iallreduce', 'ratio', 'checked')
  out('%-8s %6s %12s %12s %14s %15s %8s %8s', '', '', 'GB/s', 'GB/s', 'GB/s', '+Wait GB/s', '', '/unchk')
  for e = 12, 28, 2 do
    local bytes = 2 ^ e
    local n = bytes / 4
    local t = ds.zeros(n)
    comm.all_reduce(t)
    local t0 = now()
    comm.all_reduce(t)
    local iters = math.max(2, math.min(5000, math.ceil(sample / math.max(slowest(now() - t0), 1e-7))))
    local best_ds, best_un, best_ref, best_nb = math.huge, math.huge, math.huge, math.huge
    for _ = 1, rounds do
      comm.barrier()
      t0 = now()
      for _ = 1, iters do comm.all_reduce(t) end
      best_ds = math.min(best_ds, slowest((now() - t0) / iters))
      -- the same calls without the agreement that precedes each one
      comm.set_check(false)
      comm.barrier()
      t0 = now()
      for _ = 1, iters do comm.all_reduce(t) end
      comm.set_check(checked)
      best_un = math.min(best_un, slowest((now() - t0) / iters))
      best_ref = math.min(best_ref, ref.ref_allreduce_seconds(n, iters, 0))
      best_nb = math.min(best_nb, ref.ref_allreduce_seconds(n, iters, 1))
    end
    local factor = 2 * (N - 1) / N / 1e9
    out('%-8s %6d %12.2f %12.2f %14.2f %15.2f %8.2f %8.2f', size_text(bytes), iters, bytes / best_ds * factor,
        bytes / best_un * factor, bytes / best_ref * factor, bytes / best_nb * factor, best_ref / best_ds,
        best_un / best_ds)
  end
  out('ratio = ds.comm bus bandwidth / MPI_Allreduce bus bandwidth (> 1: ds.comm faster); MPI_Iallreduce + Wait')
  out('is what ds.comm calls underneath (OpenMPI: libnbc schedules, not coll/tuned\'s algorithms);')
  out('ds.comm agrees on each call first (%s); unchecked: the same calls with the agreement off',
      checked and 'on' or 'off: DSLUA_COMM_CHECK=0')
  out('(DSLUA_COMM_CHECK=0); checked/unchk = ds.comm bandwidth / unchecked bandwidth (< 1: what the check costs)')
end

---------------------------------------------------------------- overlap

local function overlap()
  local GPT = require 'models.gpt2'
  local B, T = 1, 128
  local steps = quick and 1 or 5
  ds.manual_seed(1)
  local x = (ds.rand(B, T + 1) * 50257):to('i64')
  local batch = { x = x:narrow(2, 1, T):contiguous(), y = x:narrow(2, 2, T):contiguous() }
  out('')
  out('GPT-2 124M on %d ranks, micro batch %dx%d per rank, SGD; median over %d step(s) after a warm-up step', N, B,
      T, steps)
  local head = '%-12s %7s %9s %9s %9s %9s %9s %9s %9s %9s'
  out(head, 'bucket size', 'buckets', 'bwd', 'bwd+ddp', 'exposed', 'serial', 'flight', 'hidden', 'hidden', 'hidden')
  out(head, '(elements)', '', 'ms', 'ms', 'ms', 'ms', 'ms', 'ms', '/flight', 'net')
  for _, bucket in ipairs({ 5e8, 2.5e7, 6.25e6 }) do
    ds.manual_seed(0)
    local engine = ds.initialize {
      model = GPT 'gpt2',
      config = {
        train_batch_size = B * N, train_micro_batch_size_per_gpu = B, steps_per_print = 1e9,
        optimizer = { type = 'SGD', params = { lr = 1e-4 } },
        zero_optimization = { reduce_bucket_size = bucket },
      },
    }
    local runs = {}
    local function timed(fn)
      comm.barrier()
      local t0 = now()
      fn()
      return 1000 * slowest(now() - t0)
    end
    -- tensors of the engine's bucket sizes, for the back-to-back reference
    local buckets = {}
    for b = 1, engine.steps.engine:buckets() do
      local _, _, numel = engine.steps.engine:bucket(b)
      buckets[b] = ds.zeros(numel)
    end
    for s = 0, steps do
      -- backward alone: loss:backward() directly, which the engine's buckets do not see
      local loss = engine(batch)
      local plain = timed(function() loss:backward() end)
      engine.optimizer:zero_grad()
      -- the engine's boundary backward, launching buckets as they fill
      loss = engine(batch)
      local ddp = timed(function() engine:backward(loss) end)
      engine:step()
      local st = engine.comm_stats
      -- the same buckets all-reduced back to back after backward, nothing to hide behind
      local serial = timed(function()
        for _, t in ipairs(buckets) do comm.all_reduce(t) end
      end)
      local wait, flight, hidden = slowest(st.wait_ms), slowest(st.comm_ms), slowest(st.hidden_ms)
      if s > 0 then
        for k, v in pairs({ plain = plain, ddp = ddp, wait = wait, serial = serial, comm = flight, hidden = hidden,
                            share = hidden / flight, net = 1 - (ddp + wait - plain) / serial }) do
          runs[k] = runs[k] or {}
          table.insert(runs[k], v)
        end
      end
    end
    local m = {}
    for k, v in pairs(runs) do m[k] = median(v) end
    out('%-12s %7d %9.0f %9.0f %9.0f %9.0f %9.0f %9.0f %8.0f%% %8.0f%%', string.format('%.4g', bucket),
        #buckets, m.plain, m.ddp, m.wait, m.serial, m.comm, m.hidden, 100 * m.share, 100 * m.net)
    engine:destroy()
    engine = nil
    collectgarbage()
    collectgarbage()
  end
  out('bwd: backward without reduction; bwd+ddp: the engine\'s backward launching buckets as they fill;')
  out('exposed: what step() then waited; serial: the same buckets all-reduced back to back after backward;')
  out('flight: sum over buckets of launch to completion; hidden: the part of it before backward returned;')
  out('hidden/flight: the all-reduce time that was over before backward returned, over all of it;')
  out('hidden net: 1 - (bwd+ddp + exposed - bwd) / serial, the step time the overlap saved, over serial')
end

if which ~= 'overlap' then bandwidth() end
if which ~= 'bandwidth' then overlap() end
