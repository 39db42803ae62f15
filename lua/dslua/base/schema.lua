-- The machinery of ds.config's checkers: the messages (each naming the
-- file and the key path), the fields (a kind, a default and the checks
-- DeepSpeed's types imply) and check_block, which checks an object against
-- its fields and weighs unknown keys against them. Each block's checker
-- lives beside the code it guards and builds on these; config/init.lua
-- reads the file and calls them.
local json = require 'dslua.base.json'
local suggest = require 'dslua.base.suggest'
local file = require 'dslua.base.file'

------------------------------------------------------------------------
-- Messages

local function describe(v)
  local t = type(v)
  if v == json.null then return 'null' end
  if t == 'string' then return json.encode(v) end
  if t == 'number' then return json.number(v) or tostring(v) end
  if t == 'boolean' then return tostring(v) end
  if t == 'table' then
    return (json.is_array(v) or (#v > 0 and next(v, #v) == nil)) and 'a list' or 'an object'
  end
  return 'a ' .. t
end

-- A resolved value as JSON writes it.
local function describe_value(v)
  if type(v) == 'table' then return json.encode(json.array({ unpack(v) })) end
  return json.encode(v)
end

-- A key in a path: as it is, or quoted when it would not show (empty, or
-- with control bytes), or cut with its length when long.
local function join(path, key)
  if type(key) == 'number' then return path .. '[' .. key .. ']' end
  if #key > 64 then
    return string.format('%s[%s... (%d bytes)]', path, json.encode(key:sub(1, 40)):sub(1, -2), #key)
  end
  if key == '' or key:find('[%z\1-\31\127]') then return path .. '[' .. json.encode(key) .. ']' end
  return path == '' and key or path .. '.' .. key
end

local function unknown(word, candidates, what)
  local s = suggest.did_you_mean(word, candidates)
  local msg = 'unknown ' .. (what and what .. ' ' .. describe(word) or 'key')
  if s then return msg .. ', ' .. s end
  if #candidates <= 12 then
    local sorted = { unpack(candidates) }
    table.sort(sorted)
    return msg .. ' (expected one of: ' .. table.concat(sorted, ', ') .. ')'
  end
  return msg
end

local function problem(ctx, path, msg)
  ctx.problems[#ctx.problems + 1] = { path = path, msg = msg }
  ctx.bad[path] = true
end

local function note(ctx, path, msg, kind)
  ctx.notes[#ctx.notes + 1] = { path = path, msg = msg, kind = kind }
end

------------------------------------------------------------------------
-- Fields: a kind, a default, and the checks DeepSpeed's types imply

local function field(kind, default, opts)
  local f = opts or {}
  f.kind, f.default = kind, default
  return f
end
local function bool(default, opts) return field('bool', default, opts) end
local function int(default, min, opts)
  local f = field('int', default, opts)
  f.min = min
  return f
end
local function num(default, min, opts)
  local f = field('num', default, opts)
  f.min = f.min or min
  return f
end
local function enum(default, values, opts)
  local f = field('enum', default, opts)
  f.values = values
  return f
end
local function str(opts) return field('str', nil, opts) end
local function strlist() return field('strlist', function() return json.array({}) end) end
local function any(opts) return field('any', nil, opts) end
local function block(schema, opts)
  local f = field('block', nil, opts)
  f.schema = schema
  return f
end

local function is_list(v)
  if type(v) ~= 'table' then return false end
  if json.is_array(v) then return true end
  return next(v) == nil or (#v > 0 and next(v, #v) == nil)
end

local function is_object(v)
  return type(v) == 'table' and not json.is_array(v) and (next(v) == nil or #v == 0)
end

local function copy(v)
  if type(v) ~= 'table' then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = copy(x) end
  return setmetatable(c, getmetatable(v))
end

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

local function in_range(ctx, path, v, f)
  local lo, hi, above = f.min, f.max, f.above
  local bad = (lo and v < lo) or (hi and v > hi) or (above and v <= above)
  if not bad then return v end
  local want
  if f.range_msg then want = f.range_msg
  elseif lo and hi then want = string.format('must be between %s and %s', json.number(lo), json.number(hi))
  elseif above then want = 'must be > ' .. json.number(above)
  elseif lo == 1 and f.kind == 'int' then want = 'must be a positive integer'
  elseif lo then want = 'must be >= ' .. json.number(lo)
  else want = 'must be <= ' .. json.number(hi) end
  problem(ctx, path, want .. ', got ' .. describe(v))
end

local check_block

-- The checked value, or nil after recording a problem.
local function check_value(ctx, path, v, f)
  local k = f.kind
  if k == 'bool' then
    if type(v) == 'boolean' then return v end
    problem(ctx, path, 'must be true or false, got ' .. describe(v))
  elseif k == 'int' then
    -- past 2^63 a whole double is no integer C can hold (1e308); 2^63 itself
    -- is how JSON's 9223372036854775807 (Python's sys.maxsize) reads
    if finite(v) and v == math.floor(v) and v >= -2 ^ 63 and v <= 2 ^ 63 then return in_range(ctx, path, v, f) end
    problem(ctx, path, 'must be an integer' .. (finite(v) and v == math.floor(v)
            and ' between -2^63 and 2^63 - 1' or '') .. ', got ' .. describe(v))
  elseif k == 'num' then
    if finite(v) then return in_range(ctx, path, v, f) end
    problem(ctx, path, 'must be a number, got ' .. describe(v))
  elseif k == 'numlist' then    -- a number, or one per parameter group
    if finite(v) then return in_range(ctx, path, v, f) end
    if is_list(v) and #v > 0 then
      local out = json.array({})
      for i, x in ipairs(v) do
        if not finite(x) then
          return problem(ctx, join(path, i - 1), 'must be a number, got ' .. describe(x))
        end
        out[i] = in_range(ctx, join(path, i - 1), x, f)
      end
      return out
    end
    problem(ctx, path, 'must be a number or a list of numbers (one per parameter group), got ' .. describe(v))
  elseif k == 'betas' then
    if is_list(v) and #v == 2 and finite(v[1]) and finite(v[2]) then
      for i = 1, 2 do
        if v[i] < 0 or v[i] >= 1 then
          return problem(ctx, path, string.format('Invalid beta parameter at index %d: %s (must be in [0, 1))',
                                                  i - 1, json.number(v[i])))
        end
      end
      return json.array({ v[1], v[2] })
    end
    problem(ctx, path, 'must be a list of two numbers [beta1, beta2], got ' .. describe(v))
  elseif k == 'enum' then
    for _, x in ipairs(f.values) do
      if v == x then return v end
    end
    local shown = {}
    for i, x in ipairs(f.values) do shown[i] = describe(x) end
    local msg = 'must be ' .. table.concat(shown, ', ', 1, #shown - 1) .. ' or ' .. shown[#shown]
                .. ', got ' .. describe(v)
    if type(v) == 'string' then
      local s = suggest.did_you_mean(v, f.values)
      if s then msg = msg .. ', ' .. s end
    end
    problem(ctx, path, msg)
  elseif k == 'str' then
    if type(v) == 'string' then return v end
    problem(ctx, path, 'must be a string, got ' .. describe(v))
  elseif k == 'strlist' then
    if is_list(v) then
      local out = json.array({})
      for i, x in ipairs(v) do
        if type(x) ~= 'string' then
          return problem(ctx, join(path, i - 1), 'must be a string, got ' .. describe(x))
        end
        out[i] = x
      end
      return out
    end
    problem(ctx, path, 'must be a list of strings, got ' .. describe(v))
  elseif k == 'object' then
    if is_object(v) then return copy(v) end
    problem(ctx, path, 'must be an object, got ' .. describe(v))
  elseif k == 'any' then
    return copy(v)
  elseif k == 'block' then
    if v == json.null or is_object(v) then return (check_block(ctx, path, v ~= json.null and v or nil, f.schema)) end
    problem(ctx, path, 'must be an object, got ' .. describe(v))
  elseif k == 'custom' then
    return f.check(ctx, path, v)
  end
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

-- Checks the object v (nil: absent) against schema = {fields = {name =
-- field}, aliases = {other_name = name}, auto = true for DeepSpeed's
-- pydantic models (they drop "auto" values, left for Hugging Face to fill;
-- a field's own auto = true does the same for it; resolve_autos fills them),
-- Unknown keys of a block weighed against its names (edit distances) one
-- by one; past them a runaway config (200,000 keys) costs no more, and one
-- line counts the rest.
local UNKNOWN_MAX = 100

-- The names of a block's fields and their aliases.
local function block_names(schema)
  local names = {}
  for n in pairs(schema.fields) do names[#names + 1] = n end
  for a in pairs(schema.aliases or {}) do names[#names + 1] = a end
  return names
end

-- The line for a block's unknown keys past UNKNOWN_MAX: a warning where
-- DeepSpeed ignores them, else a problem.
local function unknown_rest(ctx, path, schema, n)
  if n <= 0 then return end
  local what = string.format('%d more unknown keys', n)
  if schema.lenient then
    note(ctx, path, what .. ', ignored (as DeepSpeed ignores them) and not weighed as near misses of known keys',
         'warning')
  else
    problem(ctx, path, what)
  end
end

-- nofill = true to keep only the given keys, open = true to pass unknown keys
-- through, lenient = true to warn of unknown keys that are no near miss
-- of a known one}. Returns the resolved table and {name = the key given}.
check_block = function(ctx, path, v, schema)
  local out, given = {}, {}
  local fields, aliases = schema.fields, schema.aliases or {}
  local names, unknowns = nil, 0
  v = v or {}
  for _, key in ipairs(sorted_keys(v)) do
    local x, kp = v[key], join(path, tostring(key))
    local name = aliases[key] or key
    local f = type(key) == 'string' and fields[name]
    if type(key) ~= 'string' then
      problem(ctx, kp, 'keys must be strings, got ' .. describe(key))
    elseif not f and schema.open then
      out[key] = copy(x)
    elseif not f and unknowns >= UNKNOWN_MAX then
      unknowns = unknowns + 1           -- counted, not weighed: unknown_rest
    elseif not f then
      unknowns = unknowns + 1
      names = names or block_names(schema)
      if schema.lenient and not suggest.nearest(key, names) then
        -- DeepSpeed reads such a block key by key and never sees the rest
        note(ctx, kp, string.format("unknown key, ignored (as DeepSpeed ignores it); the nearest known key is '%s'",
                                    suggest.closest(key, names)), 'warning')
      else
        problem(ctx, kp, unknown(key, names))
      end
    elseif given[name] then
      problem(ctx, kp, string.format("give only one of '%s' and '%s'", given[name], key))
    else
      given[name] = key
      if (schema.auto or f.auto) and x == 'auto' then
        ctx.autos[#ctx.autos + 1] = { path = kp, key = join(path, name), block = out, name = name }
      elseif not (x == json.null and f.nullable) then
        out[name] = check_value(ctx, kp, x, f)
      end
    end
  end
  unknown_rest(ctx, path, schema, unknowns - UNKNOWN_MAX)
  for _, name in ipairs(sorted_keys(fields)) do
    local f = fields[name]
    if f.required and given[name] == nil and not ctx.bad[join(path, name)] then
      problem(ctx, join(path, name), 'missing: required' .. (schema.what and ' by ' .. schema.what or ''))
    end
    if out[name] == nil and not schema.nofill then
      if f.kind == 'block' and not f.nullable then out[name] = check_block(ctx, join(path, name), nil, f.schema)
      elseif f.kind == 'custom' and f.fill then out[name] = f.check(ctx, join(path, name), nil)
      elseif type(f.default) == 'function' then out[name] = f.default()   -- a fresh table
      else out[name] = f.default end
    end
  end
  return out, given
end

-- A Lua file the config names (a sampler policy, the hooks file): as
-- given, then next to the config file. -> path or nil, the paths tried.
local function policy_file(name, source)
  local exists = require('dslua.core').ckpt.exists
  local tried = { name }
  if exists(name) then return name, tried end
  local dir = type(source) == 'string' and source:match('^(.*)/[^/]*$')
  if dir and name:sub(1, 1) ~= '/' then
    local other = dir .. '/' .. name
    tried[2] = other
    if exists(other) then return other, tried end
  end
  return nil, tried
end

-- Why the Lua file at path (what: 'policy', 'hooks') cannot be used: it
-- cannot be read through the guarded open (a FIFO, a device, a planted
-- link) or does not compile. nil when it can.
local function lua_file_problem(path, what)
  local text, why = file.text(path)
  if not text then return string.format('cannot read the %s file %s: %s', what, describe(path), why) end
  local _, cerr = loadstring(text, '@' .. path)
  return cerr and string.format('the %s file does not compile: %s', what, cerr)
end

-- The Lua file v (what: 'policy', 'hooks') names, as found, or nil after
-- recording why it cannot be used.
local function lua_file(ctx, path, v, what)
  local found, tried = policy_file(v, ctx.source)
  if not found then
    return problem(ctx, path, 'cannot read the ' .. what .. ' file ' .. describe(v) .. ' (tried ' .. table.concat(tried, ', ') .. ')')
  end
  local why = lua_file_problem(found, what)
  if why then return problem(ctx, path, why) end
  return found
end

return {
  describe = describe,
  describe_value = describe_value,
  join = join,
  unknown = unknown,
  problem = problem,
  note = note,
  field = field,
  bool = bool,
  int = int,
  num = num,
  enum = enum,
  str = str,
  strlist = strlist,
  any = any,
  block = block,
  is_list = is_list,
  is_object = is_object,
  copy = copy,
  finite = finite,
  check_value = check_value,
  sorted_keys = sorted_keys,
  check_block = check_block,
  lua_file = lua_file,
}
