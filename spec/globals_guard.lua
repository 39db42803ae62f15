-- The spec run fails on a global variable the library creates. .busted
-- loads this as its helper, before any spec file: _G gets a __newindex
-- that notes who sets each new global, and each spec file ends in an
-- error naming every global the library set during it and where (before
-- busted's insulation wipes them with the rest of the file's _G). Specs
-- may create globals on purpose; library code (the embedded modules, whose
-- chunks cmake/embed_lua.cmake names @lua/..., @models/..., @samplers/...)
-- may not, bar M.allowed. A global set around __newindex (rawset, C's
-- lua_rawset) is caught too, by comparing _G with the file's start, with
-- no place to name.
local busted = require 'busted'

local M = {}

M.library = { '@lua/', '@models/', '@samplers/' }

-- Globals the library sets on purpose: name -> the chunk that may.
M.allowed = { ds = '@lua/dslua/live/repl.lua', help = '@lua/dslua/live/repl.lua' }     -- the REPL's `ds` and `help`

local before, seen, leaks

local function keys(t)
  local out = {}
  for k in pairs(t) do out[k] = true end
  return out
end

local function restart()
  before, seen, leaks = keys(_G), {}, {}
end

local function is_library(source)
  for _, prefix in ipairs(M.library) do
    if source:sub(1, #prefix) == prefix then return true end
  end
  return false
end

-- The Lua function that made the assignment: the first one above
-- __newindex, past C functions (lua_setglobal from a binding).
local function setter()
  for level = 3, math.huge do
    local info = debug.getinfo(level, 'Sl')
    if not info or info.what ~= 'C' then return info end
  end
end

assert(getmetatable(_G) == nil, 'globals_guard: _G already has a metatable')
setmetatable(_G, { __newindex = function(g, name, value)
  local info = setter()
  if not info or (is_library(info.source) and M.allowed[name] ~= info.source) then
    leaks[#leaks + 1] = { name = tostring(name),
                          where = info and info.short_src .. ':' .. info.currentline or 'from C, no Lua caller' }
  end
  seen[name] = true
  rawset(g, name, value)
end })

-- take() -> the globals the library set since the file started (or the
-- last take), { name =, where = } each, and forgets them.
function M.take()
  local found = leaks
  for name in pairs(_G) do
    if not before[name] and not seen[name] then
      found[#found + 1] = { name = tostring(name), where = 'set around __newindex, place unknown' }
    end
  end
  restart()
  return found
end

restart()
busted.subscribe({ 'file', 'start' }, function()
  restart()
  return nil, true
end)
busted.subscribe({ 'file', 'end' }, function()
  local found = M.take()
  if #found == 0 then return nil, true end
  local lines = {}
  for i, leak in ipairs(found) do lines[i] = '  ' .. leak.name .. ' (' .. leak.where .. ')' end
  error('globals created by the library (make them local):\n' .. table.concat(lines, '\n'), 0)
end)

return M
