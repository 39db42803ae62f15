-- The cost of carrying a collective through host memory
-- (core/comm/ds_comm_staged.c), run on 2 ranks by bench/staged.sh:
--
--   mpirun -np 2 dslua bench/staged.lua LABEL DEVICE [quick]
--
-- all_reduce (f32 sum, in place) of 256 KB to 64 MB on DEVICE's tensors
-- through ds.comm, as bytes per second: the tensor's bytes over the
-- slowest rank's time, best of 5 (2 when quick). Beside it the host copy
-- rate of the same bytes on this rank: a CPU tensor's copy_ (the memcpy
-- the CPU stand-in stages with), and on a GPU the copy to the host and
-- back (t:cpu(), then :to(device)), the copies every staged call makes.
-- Rank 0 prints `result` lines: label, size, GB/s of the all_reduce, GB/s
-- of the copy.
local ds = require 'dslua'

local args = ds.args.rest or {}
local label, dev, quick = args[1], args[2], args[3] == 'quick'
if not label or not dev then
  io.stderr:write('usage: mpirun -np 2 dslua bench/staged.lua LABEL DEVICE [quick]\n')
  os.exit(2)
end
local comm, now = ds.comm, ds.wall_time
local reps = quick and 2 or 5

local function sync()
  if dev ~= 'cpu' then ds.cuda.synchronize() end
end

-- the best time of reps runs of fn, the slowest rank's
local function best(fn)
  local t = math.huge
  for _ = 1, reps do
    sync()
    comm.barrier()
    local t0 = now()
    fn()
    sync()
    t = math.min(t, now() - t0)
  end
  local m = ds.tensor({ t }, 'f64')
  comm.all_reduce(m, 'max')
  return m:item()
end

for _, kb in ipairs({ 256, 1024, 4096, 16384, 65536 }) do
  local n = kb * 256
  local x = ds.ones(n):to(dev)
  local bytes = n * 4
  local t = best(function() comm.all_reduce(x) end)
  local host = ds.zeros(n)
  local c = best(function()
    if dev == 'cpu' then host:copy_(x) else x:cpu():to(dev) end
  end)
  if comm.rank() == 0 then
    io.stdout:write(string.format('result\t%s\t%d KB\t%.3f\t%.3f\n', label, kb, bytes / t / 1e9,
                                  bytes * (dev == 'cpu' and 1 or 2) / c / 1e9))
    io.stdout:flush()
  end
end
