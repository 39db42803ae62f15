-- Run on 2 ranks by spec/launcher_spec.lua through the launcher: writes to
-- <out>/rank.<RANK> where Open MPI keeps this job's files (its scratch
-- folder, the session directory, the shared-memory segments in it) and
-- the addresses mpirun (this rank's parent) listens on, then, with
-- --hold, waits to be killed.
local ds = require 'dslua'
local out, hold
for _, a in ipairs(arg) do
  out = a:match('^%-%-out=(.*)$') or out
  hold = hold or a == '--hold'
end
ds.comm.barrier()                      -- the shared-memory segments exist from here

local function lines_of(cmd)
  local p = io.popen(cmd)
  local s = p:read('*a')
  p:close()
  return s
end

-- mpirun's listening TCP sockets, as addresses: its socket inodes, looked up in /proc/net/tcp{,6}
local ppid = assert(io.open('/proc/self/stat')):read('*l'):match('^%d+ %b() %S+ (%d+)')
local inodes = {}
for inode in lines_of('ls -l /proc/' .. ppid .. '/fd 2>/dev/null'):gmatch('socket:%[(%d+)%]') do inodes[inode] = true end
local listening = {}
for _, file in ipairs({ '/proc/net/tcp', '/proc/net/tcp6' }) do
  for line in io.lines(file) do
    local f = {}
    for w in line:gmatch('%S+') do f[#f + 1] = w end
    if f[4] == '0A' and inodes[f[10]] then listening[#listening + 1] = f[2]:match('^(%x+):') end
  end
end
table.sort(listening)

local scratch = os.getenv('OMPI_MCA_orte_tmpdir_base') or '(unset)'
local segments = select(2, lines_of('ls ' .. scratch .. ' 2>/dev/null'):gsub('vader_segment', ''))
local f = assert(io.open(out .. '/rank.' .. ds.comm.rank(), 'w'))
f:write('scratch=', scratch, '\n', 'session=', os.getenv('OMPI_MCA_orte_top_session_dir') or '(unset)', '\n',
        'segments=', segments, '\n', 'listening=', table.concat(listening, ','), '\n')
f:close()
if hold then
  while true do os.execute('sleep 1') end
end
