-- Run by spec/comm_spec.lua under mpirun: one way for a job to go wrong
-- per mode (arg[1]), provoked by the last rank after a first collective
-- that every rank completes. The spec checks how fast and how loudly the
-- whole job ends.
local ffi = require 'ffi'
local ds = require 'dslua'
local c = ds.comm

ffi.cdef 'int usleep(unsigned int usec);'
local function sleep(s) for _ = 1, s * 10 do ffi.C.usleep(100000) end end

local mode = arg[1]
local r, n = c.rank(), c.world_size()
local last = r == n - 1
local t = ds.ones(10)
c.all_reduce(t)
c.print('first collective done')

if mode == 'error' and last then
  error('boom in rank ' .. r)
elseif mode == 'exit' and last then
  os.exit(3)
elseif mode == 'exit0' and last then
  os.exit(0)
elseif mode == 'kill' and last then
  os.execute('kill -9 $PPID')
elseif mode == 'timeout' and last then
  sleep(30)                                   -- never joins; the others time out
elseif mode == 'mismatch' and last then
  c.broadcast(t, 0)
elseif mode == 'count' then
  -- the same call with another count on the last rank: refused on every
  -- rank before a byte moves (without the agreement, a heap overrun)
  local ok, err = pcall(c.all_reduce, last and ds.ones(10000) or t)
  c.print(ok and 'count accepted' or 'refused: ' .. err)
  c.print(c.flight_record()[2].what .. ' ' .. c.flight_record()[2].state)
  ok, err = pcall(c.all_to_all, last and ds.ones(4) or ds.ones(2))
  c.print(ok and 'all_to_all count accepted' or 'refused: ' .. err)
elseif mode == 'stop' and last then
  os.execute('kill -STOP $PPID')              -- stopped: never answers
elseif mode == 'stuck' then
  -- the last rank keeps busy after its last collective; the others exit
  if last then sleep(30) end
  c.print('END')
  os.exit(0)
elseif mode == 'recv' then
  if r == 0 then c.recv(t, n - 1) elseif last then os.exit(0) end
elseif mode == 'recv_size' then
  -- a recv into a larger tensor than the send's: refused, not filled in part
  if r == 0 then
    local into = ds.zeros(10)
    local ok, err = pcall(c.recv, into, 1)
    c.print(ok and 'recv accepted' or 'refused: ' .. err)
  elseif r == 1 then
    c.send(ds.ones(4), 0)
  end
  c.print('END')
  os.exit(0)
elseif mode == 'stagger' then
  sleep(r * 0.3)                              -- ranks end at different times, all fine
  c.print('END')
  os.exit(0)
end
if mode ~= 'recv' then c.all_reduce(t) end
c.print('second collective done')
