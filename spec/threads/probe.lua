-- Run by spec/threads_spec.lua, alone or on ranks: prints one line
--   probe rank=R threads=N wait_env=V wait_now=V blas_env=V blas_now=V added_now=V sleeps=K
-- *_env: OMP_WAIT_POLICY / OPENBLAS_NUM_THREADS as this process started
-- (what libgomp and OpenBLAS read when they loaded), *_now: as scripts see
-- them. With --sleeps, K is how often the busiest OpenMP worker went to
-- sleep (voluntary context switches) over 50 parallel ops with a pause
-- after each: each op ends in one with a passive wait, none when it spins.
local ffi = require 'ffi'
ffi.cdef 'int usleep(unsigned int usec);'

local read = require('dslua.base.file').read

local pid = read('/proc/self/stat'):match('^(%d+)')

-- thread id -> voluntary context switches, for every thread of this process
local function switches()
  local out, p = {}, io.popen('ls /proc/' .. pid .. '/task')
  for tid in p:lines() do
    local status = read('/proc/' .. pid .. '/task/' .. tid .. '/status')
    if status then out[tid] = tonumber(status:match('\nvoluntary_ctxt_switches:%s*(%d+)')) end
  end
  p:close()
  return out
end

local sleeps = '-'
local before = arg[1] == '--sleeps' and switches()     -- before any parallel region: no workers yet
local ds = require 'dslua'
if before then
  local x = ds.ones{1024, 1024}
  local _ = x + x
  local start = switches()
  for _ = 1, 50 do
    _ = x + x
    ffi.C.usleep(1000)
  end
  local now, most = switches(), nil
  for tid, n in pairs(start) do
    if not before[tid] and now[tid] then most = math.max(most or 0, now[tid] - n) end
  end
  sleeps = most or 'no-workers'
end

local started = {}
for entry in (read('/proc/self/environ') or ''):gmatch('[^%z]+') do
  local k, v = entry:match('^([^=]+)=(.*)$')
  if k then started[k] = v end
end
print(string.format('probe rank=%s threads=%d wait_env=%s wait_now=%s blas_env=%s blas_now=%s added_now=%s sleeps=%s',
                    os.getenv('RANK') or '-', ds.num_threads(), started.OMP_WAIT_POLICY or '(unset)',
                    os.getenv('OMP_WAIT_POLICY') or '(unset)', started.OPENBLAS_NUM_THREADS or '(unset)',
                    os.getenv('OPENBLAS_NUM_THREADS') or '(unset)', os.getenv('DSLUA_THREADS_ADDED') or '(unset)',
                    tostring(sleeps)))
