-- Run by spec/api_spec.lua in a temporary folder (calls that take a path
-- make files there): every C function of ds.core and every method of its
-- object types called through pcall with arguments of the wrong kinds.
-- Prints one line per error that does not name its function, then a
-- count line.
local ds = require 'dslua'
local core = require 'dslua.core'

local SKIP = { kill_self = true, abort = true }     -- their point is to end the process
local t = ds.zeros(2)
local ARGS = { {}, { 'x' }, { {} }, { 1e300 }, { -1 }, { 'x', 'x' }, { 1, 'x' }, { t, 'x' }, { t, {} }, { {}, t } }

local seen, functions, errors = {}, 0, 0
local function sweep(prefix, tbl)
  if seen[tbl] then return end
  seen[tbl] = true
  local keys = {}
  for k in pairs(tbl) do
    if type(k) == 'string' and not k:match('^__') then keys[#keys + 1] = k end
  end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = tbl[k]
    if type(v) == 'table' then
      sweep(prefix .. k .. '.', v)
    elseif type(v) == 'function' and debug.getinfo(v, 'S').what == 'C' and not SKIP[k] then
      functions = functions + 1
      for _, args in ipairs(ARGS) do
        local ok, err = pcall(v, unpack(args))
        if not ok then
          errors = errors + 1
          if type(err) == 'string' and err:find("'?'", 1, true) then print('unnamed: ' .. prefix .. k .. ': ' .. err) end
        end
      end
    end
  end
end

sweep('ds.core.', core)
for name, mt in pairs(debug.getregistry()) do
  if type(name) == 'string' and name:match('^dslua%.') and type(mt) == 'table' and type(mt.__index) == 'table' then
    sweep(name .. ':', mt.__index)
  end
end
print(string.format('swept %d functions, %d errors', functions, errors))
