-- Child dslua processes for specs that must survive a crash or set the
-- environment: the binary's absolute path, however the specs were started.
local P = {}

-- $DSLUA_BIN, else this very process when it is a dslua binary, else
-- arg[-1] (under busted, the interpreter busted runs in; maybe relative,
-- maybe a bare name found on PATH).
function P.bin()
  local env = os.getenv('DSLUA_BIN')
  if env and env ~= '' then return env end
  local stat = io.open('/proc/self/stat')
  if stat then
    local pid = stat:read('*l'):match('^(%d+)')
    stat:close()
    local p = io.popen('readlink /proc/' .. pid .. '/exe')
    local exe = p:read('*l')
    p:close()
    if exe and exe:match('dslua[^/]*$') then return exe end
  end
  local b = assert(arg and arg[-1], 'cannot tell the dslua binary: set DSLUA_BIN')
  if not b:find('/') then
    local p = io.popen('command -v ' .. b)
    b = p:read('*l') or b
    p:close()
  end
  if b:sub(1, 1) ~= '/' then b = os.getenv('PWD') .. '/' .. b end
  return b
end

-- A fresh empty directory.
function P.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute('mkdir -p ' .. d) == 0)
  return d
end

function P.write(path, text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
end

return P
