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

-- ---- help ----

-- The comment lines of an embedded chunk ("@lua/dslua/nn/init.lua") that end at
-- line `last` (a function's doc) or, with no last, start it (a module's
-- first paragraph), without their dashes; nil where there are none.
local function comment(chunk, last)
  local text = chunk and require('dslua.core').embedded_source(chunk)
  if not text then return nil end
  local lines = {}
  for l in (text .. '\n'):gmatch('([^\n]*)\n') do lines[#lines + 1] = l:match('^%s*%-%-+ ?(.*)$') or false end
  local out = {}
  if last then
    for i = last, 1, -1 do
      if not lines[i] then break end
      table.insert(out, 1, lines[i])
    end
  else
    for i = 1, #lines do
      if not lines[i] or lines[i] == '' then break end
      out[#out + 1] = lines[i]
    end
  end
  return #out > 0 and table.concat(out, ' ') or nil
end

-- The first sentence of a comment, at most a line long.
local function summary(text)
  if not text then return nil end
  local s = (text:match('^(.-%.)%s') or text):gsub('^ds[%w_.]*: ', '')
  return #s > 100 and s:sub(1, 97) .. '...' or s
end

-- The module name a table was loaded as (dslua.nn), and its chunk's text.
local function module_of(v)
  for name, m in pairs(package.loaded) do
    if rawequal(m, v) and (name == 'dslua' or name:match('^dslua%.')) then
      local path = name:gsub('%.', '/')
      local doc = comment('@lua/' .. path .. '.lua') or comment('@lua/' .. path .. '/init.lua')
      return name, doc
    end
  end
end

-- The sorted names of the functions v answers to, through its metatables.
local function methods_of(v)
  local found, out = {}, {}
  keys_of(v, found)
  for k in pairs(found) do
    if type(k) == 'string' and not k:match('^_') then
      local ok, f = pcall(function() return v[k] end)
      if ok and type(f) == 'function' then out[#out + 1] = k end
    end
  end
  table.sort(out)
  return out
end

-- Words wrapped into lines of about 78 columns, each starting with indent.
local function wrap(words, indent)
  local lines, line = {}, indent
  for _, w in ipairs(words) do
    if #line + #w > 78 and line ~= indent then lines[#lines + 1] = line; line = indent end
    line = line .. (line == indent and '' or ' ') .. w
  end
  if line ~= indent then lines[#lines + 1] = line end
  return table.concat(lines, '\n')
end

-- A function's call line and its doc comment: `name(a, b)` and what the
-- comment above its definition says, or that it is built in.
local function describe_function(f, name)
  local info = debug.getinfo(f, 'S')
  if info.what == 'C' then return name .. ': a built-in function (C); see docs/tensors.md for its arguments' end
  local params = {}
  for i = 1, math.huge do
    local p = debug.getlocal(f, i)
    if not p then break end
    params[i] = p
  end
  if debug.getinfo(f, 'u').isvararg then params[#params + 1] = '...' end
  local doc = comment(info.source, info.linedefined - 1)
  return name .. '(' .. table.concat(params, ', ') .. ')' .. (doc and ': ' .. doc or '')
    .. '\n  defined at ' .. info.short_src .. ':' .. info.linedefined
end

-- The names of t's fields, split into functions, modules and the rest.
local function members(t, prefix)
  local fns, mods, other = {}, {}, {}
  for k, v in pairs(t) do
    if type(k) == 'string' and not k:match('^_') then
      local list = type(v) == 'function' and fns or (type(v) == 'table' and module_of(v)) and mods or other
      list[#list + 1] = prefix .. k
    end
  end
  table.sort(fns)
  table.sort(mods)
  table.sort(other)
  return fns, mods, other
end

-- help(): the entry points of ds; help(x): what x is and its methods.
function M.help(...)
  local ds = require 'dslua'
  local out = {}
  local function add(s) out[#out + 1] = s end
  if select('#', ...) == 0 then
    add('ds: ' .. summary(select(2, module_of(ds))))
    local fns, mods = members(ds, 'ds.')
    add('modules:')
    for _, name in ipairs(mods) do
      local m = ds[name:sub(4)]
      add(string.format('  %-16s %s', name, summary(select(2, module_of(m))) or ''))
    end
    add('functions (tensors, ops, autograd, the engine):')
    add(wrap(fns, '  '))
    add('help(x) says what x is (a ds function or module, a tensor, an nn module) and its methods;')
    add('t:<Tab> completes a tensor\'s methods.')
  else
    local v = ...
    if ds.is_tensor(v) then
      add(tostring(v):match('^[^\n]*') .. ': a tensor')
      add('fields: grad requires_grad is_leaf grad_fn; t[i] is the view at position i of dim 1')
      add('methods:')
      add(wrap(methods_of(v), '  '))
    elseif type(v) == 'function' then
      local name = '?'
      for k, f in pairs(ds) do if rawequal(f, v) then name = 'ds.' .. k end end
      for mk, m in pairs(ds) do
        if type(m) == 'table' and module_of(m) then
          for k, f in pairs(m) do if rawequal(f, v) then name = 'ds.' .. mk .. '.' .. k end end
        end
      end
      add(describe_function(v, name))
    elseif type(v) == 'table' and module_of(v) then
      local name, doc = module_of(v)
      add(name:gsub('^dslua', 'ds') .. ': ' .. (doc and doc:gsub('^ds[%w_.]*: ', '') or 'a module of dslua'))
      local fns, mods, other = members(v, '')
      if #fns > 0 then add('functions:'); add(wrap(fns, '  ')) end
      if #mods + #other > 0 then add('classes, tables and values:'); add(wrap(mods, '  ')); add(wrap(other, '  ')) end
    elseif ds.nn.is_module(v) or (type(v) == 'table' and rawget(v, 'methods') == v and rawget(v, '__name')) then
      local init = debug.getinfo(v.init, 'S')
      local doc = init.what == 'Lua' and comment(init.source, init.linedefined - 1)
      local head = ds.nn.is_module(v) and tostring(v):match('^[^\n]*') .. ': an nn module'
        or v.__name .. ': an nn module class'
      add(head .. (doc and ' -- ' .. doc or ''))
      add('methods:')
      add(wrap(methods_of(v), '  '))
    else
      add(show(v) .. ': a ' .. type(v))
      local names = methods_of(v)
      if #names > 0 then add('methods:'); add(wrap(names, '  ')) end
    end
  end
  for _, line in ipairs(out) do if line ~= '' then M.print(line) end end
end

-- The globals the REPL and `dslua -e` code have.
function M.init()
  _G.ds = require 'dslua'
  _G.help = M.help
end

return M
