-- ds.json: decode (C, over cJSON: comments and trailing commas allowed as
-- DeepSpeed's hjson loader allows them, duplicate keys are errors) and
-- encode (here: sorted keys, so the output is stable and diffable).
local C = require('dslua.core').json

local M = {
  decode = C.decode,      -- decode(text [, source [, keep_duplicates]]) -> value [, duplicates]
  null = C.null,          -- JSON null (a NULL light userdata)
  array = C.array,        -- array(t) -> t, marked to encode as an array even when empty
  is_array = C.is_array,
}

local escapes = {
  ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f',
  ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
}

local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or string.format('\\u%04x', c:byte())
  end) .. '"'
end

-- The shortest %g text (15 to 17 digits) that reads back as the finite
-- double x.
function M.shortest_g(x)
  for digits = 15, 16 do
    local s = string.format('%.' .. digits .. 'g', x)
    if tonumber(s) == x then return s end
  end
  return string.format('%.17g', x)
end

-- The shortest form that reads back as the same double.
function M.number(x)
  if x ~= x or x == math.huge or x == -math.huge then return nil end
  if x == math.floor(x) and math.abs(x) < 2 ^ 53 then return string.format('%d', x) end
  return M.shortest_g(x)
end

-- 'list' for arrays (marked, or keys exactly 1..n with n > 0), 'object'
-- for the rest; nil and a reason for tables that are neither.
local function table_kind(t)
  if M.is_array(t) then return 'list' end
  local n, count = #t, 0
  for k in pairs(t) do
    count = count + 1
    if type(k) ~= 'string' and not (type(k) == 'number' and k >= 1 and k <= n and k == math.floor(k)) then
      return nil, 'a table key of type ' .. type(k)
    end
  end
  if n > 0 and count == n then return 'list' end
  if n > 0 then return nil, 'a table that is neither a list (keys 1..n) nor an object (string keys)' end
  return 'object'
end

local function at(path) return path == '' and 'value' or path end

local function encode_value(v, indent, depth, path, seen, out)
  local tv = type(v)
  if v == nil or v == M.null then
    out[#out + 1] = 'null'
  elseif tv == 'boolean' then
    out[#out + 1] = tostring(v)
  elseif tv == 'number' then
    local s = M.number(v)
    if not s then error(string.format('json.encode: %s: cannot encode %s', at(path), tostring(v)), 0) end
    out[#out + 1] = s
  elseif tv == 'string' then
    out[#out + 1] = quote(v)
  elseif tv == 'table' then
    if seen[v] then error(string.format('json.encode: %s: the table contains itself', at(path)), 0) end
    local kind, why = table_kind(v)
    if not kind then error(string.format('json.encode: %s: cannot encode %s', at(path), why), 0) end
    seen[v] = true
    local pad = indent and '\n' .. string.rep(' ', indent * (depth + 1)) or ''
    local close = indent and '\n' .. string.rep(' ', indent * depth) or ''
    if kind == 'list' then
      local flat = true             -- lists of scalars stay on one line
      for _, x in ipairs(v) do flat = flat and type(x) ~= 'table' end
      out[#out + 1] = '['
      for i, x in ipairs(v) do
        if i > 1 then out[#out + 1] = (indent and flat) and ', ' or ',' end
        if not flat then out[#out + 1] = pad end
        encode_value(x, indent, depth + 1, path .. '[' .. (i - 1) .. ']', seen, out)
      end
      if not flat and #v > 0 then out[#out + 1] = close end
      out[#out + 1] = ']'
    else
      local keys = {}
      for k in pairs(v) do keys[#keys + 1] = k end
      table.sort(keys)
      out[#out + 1] = '{'
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = ',' end
        out[#out + 1] = pad .. quote(k) .. (indent and ': ' or ':')
        encode_value(v[k], indent, depth + 1, path == '' and k or path .. '.' .. k, seen, out)
      end
      if #keys > 0 then out[#out + 1] = close end
      out[#out + 1] = '}'
    end
    seen[v] = nil
  else
    error(string.format('json.encode: %s: cannot encode a %s', at(path), tv), 0)
  end
end

-- encode(value [, indent]) -> JSON text; with indent (spaces per level)
-- one key per line, keys sorted.
function M.encode(value, indent)
  if indent ~= nil and (type(indent) ~= 'number' or indent < 0 or indent ~= math.floor(indent)) then
    error('json.encode: indent must be a non-negative integer, got ' .. tostring(indent), 2)
  end
  local out = {}
  encode_value(value, indent, 0, '', {}, out)
  return table.concat(out)
end

return M
