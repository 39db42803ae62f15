-- Run on every rank by spec/launcher_spec.lua: writes this rank's launch
-- environment and arguments to <out>/rank.<RANK>, one `name=value` line
-- each (arg0, arg1, ... for the arguments). With --fail=R, rank R raises an
-- error and the others wait long enough that only a prompt end of the job
-- passes the spec; with --kill=R, rank R is killed by SIGKILL instead.
local NAMES = { 'RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_SIZE', 'CROSS_RANK', 'CROSS_SIZE',
                'MASTER_ADDR', 'MASTER_PORT', 'DSLUA_NUM_THREADS', 'CUDA_VISIBLE_DEVICES', 'DSLUA_SPEC_FORWARD' }

local out, fail, kill
for _, a in ipairs(arg) do
  out = a:match('^%-%-out=(.*)$') or out
  fail = a:match('^%-%-fail=(%d+)$') or fail
  kill = a:match('^%-%-kill=(%d+)$') or kill
end
local rank = os.getenv('RANK') or '?'
if rank == kill then os.execute('kill -KILL $PPID') end      -- the shell's parent: this rank
if fail or kill then
  if rank == fail then error('rank ' .. rank .. ' fails on purpose') end
  local t0 = os.time()
  while os.time() - t0 < 30 do end
end
local lines = {}
for _, n in ipairs(NAMES) do lines[#lines + 1] = n .. '=' .. (os.getenv(n) or '(unset)') end
for i = 0, #arg do lines[#lines + 1] = 'arg' .. i .. '=' .. arg[i] end
local f = assert(io.open(out .. '/rank.' .. rank, 'w'))
f:write(table.concat(lines, '\n'), '\n')
f:close()
