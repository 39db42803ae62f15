-- What the REPL does with a line: compile (as an expression first, so
-- results print), run with a traceback, print results, complete names.
local M = {}

M.print = print   -- where results go; specs replace it to capture them

local function pack(...) return { n = select('#', ...), ... } end

local function show(v)
  local ds = package.loaded.dslua
  if type(v) == 'string' then return string.format('%q', v) end
  if ds and ds.is_tensor(v) then return tostring(v) end
  if type(v) ~= 'table' or getmetatable(v) then return tostring(v) end
  local parts, n = {}, 0
  local function item(x) return type(x) == 'string' and string.format('%q', x) or tostring(x) end
  if #v > 0 and next(v, #v) == nil then          -- a plain list
    for i = 1, math.min(#v, 20) do parts[i] = item(v[i]) end
    if #v > 20 then parts[#parts + 1] = '... (' .. #v .. ' items)' end
    return '{' .. table.concat(parts, ', ') .. '}'
  end
  for k, x in pairs(v) do
    n = n + 1
    if n > 12 then parts[#parts + 1] = '...'; break end
    local key = type(k) == 'string' and k or ('[' .. tostring(k) .. ']')
    parts[#parts + 1] = key .. ' = ' .. item(x)
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end

M.show = show      -- `dslua attach` shows a job's values the same way

-- The traceback of an error in user code, without the REPL's own frames.
local function traceback(e)
  local tb = debug.traceback(tostring(e), 2)
  return (tb:gsub("\n%s*%[C%]: in function 'xpcall'.*$", ''))
end

function M.init()
  _G.ds = require 'dslua'
end

-- Runs one (possibly multi-line) input. Returns true when the input is
-- incomplete and the REPL should read another line.
function M.step(src)
  local quiet = src:match(';%s*$') ~= nil
  local fn, err
  if not quiet then fn = loadstring('return ' .. src, '=stdin') end
  if not fn then fn, err = loadstring(src, '=stdin') end
  if not fn then
    if err:match("<eof>'?$") then return true end
    io.stderr:write(err, '\n')
    return false
  end
  local res = pack(xpcall(fn, traceback))
  if not res[1] then
    io.stderr:write(tostring(res[2]), '\n')
  elseif not quiet then
    for i = 2, res.n do M.print(show(res[i])) end
  end
  return false
end

-- Keys reachable from v: its own (tables) and its metatable's methods.
local function keys_of(v, out)
  if type(v) == 'table' then for k in pairs(v) do out[k] = true end end
  local mt = getmetatable(v)
  if type(mt) == 'table' then
    local idx = rawget(mt, 'methods') or rawget(mt, '__index')
    if type(idx) == 'table' then keys_of(idx, out) end
  end
end

-- Completions of `text` such as "ds.ze", "t:si", "pri".
function M.complete(text)
  local head, sep, partial = text:match('^(.-)([%.:])([%w_]*)$')
  local scope = _G
  if head then
    for name in head:gmatch('[^%.:]+') do
      if type(scope) ~= 'table' and type(scope) ~= 'userdata' then return {} end
      local ok, nxt = pcall(function() return scope[name] end)
      if not ok or nxt == nil then return {} end
      scope = nxt
    end
  else
    head, sep, partial = '', '', text
  end
  local found, out = {}, {}
  keys_of(scope, found)
  for k in pairs(found) do
    if type(k) == 'string' and k:sub(1, #partial) == partial and k:match('^[%a_][%w_]*$') then
      out[#out + 1] = head .. sep .. k
    end
  end
  table.sort(out)
  return out
end

return M
