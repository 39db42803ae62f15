-- The Lua library keeps the layering docs/ARCHITECTURE.md draws: a module
-- requires only modules of its own layer or of the layers drawn below it.
local H = require 'helpers'

-- bottom to top, as the picture in docs/ARCHITECTURE.md ("Layers")
local ORDER = { 'base', 'samplers', 'optim', 'nn', 'parallel', 'io', 'live', 'engine', 'config', 'ds', 'models' }
local RANK = {}
for i, name in ipairs(ORDER) do RANK[name] = i end

local function layer_of_file(path)
  if path:match('^models/') then return 'models' end
  if path:match('^samplers/') then return 'samplers' end
  if path == 'lua/dslua/init.lua' then return 'ds' end
  return path:match('^lua/dslua/([%w_]+)/')
end

local function layer_of_module(name)
  if name:match('^models%.') then return 'models' end
  if name:match('^samplers%.') then return 'samplers' end
  if name == 'dslua' or name == 'dslua.core' then return nil end   -- the C functions: any layer
  return name:match('^dslua%.([%w_]+)')
end

local function lua_files()
  local list = {}
  local p = io.popen('find lua models samplers -name "*.lua" | sort')
  for path in p:lines() do list[#list + 1] = path end
  p:close()
  return list
end

describe('the Lua library by layer', function()
  it('has every file in a layer of the picture', function()
    local files = lua_files()
    assert.is_true(#files > 40, 'found ' .. #files .. ' Lua files')
    for _, path in ipairs(files) do
      local layer = layer_of_file(path)
      assert.is_truthy(layer and RANK[layer], path .. ' is in no layer of docs/ARCHITECTURE.md')
    end
  end)

  it('requires only its own layer and the layers below it', function()
    local upward = {}
    for _, path in ipairs(lua_files()) do
      local mine = RANK[layer_of_file(path)]
      for name in H.read(path):gmatch("require%s*%(?%s*['\"]([%w_%.]+)['\"]") do
        local theirs = layer_of_module(name)
        if theirs and RANK[theirs] and RANK[theirs] > mine then
          upward[#upward + 1] = path .. ' requires ' .. name
        end
      end
    end
    assert.are.same({}, upward)
  end)
end)
