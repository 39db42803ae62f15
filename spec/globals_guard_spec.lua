-- The guard against globals the library creates (spec/globals_guard.lua,
-- the helper .busted loads), and the library's own code checked for any.
local H = require 'helpers'
local guard = require 'globals_guard'

-- A library module as the embedded loader loads it (chunk @lua/...): one
-- global at load time (the kind engine.lua had), one when called.
local LEAKY = [[
function leaky_setup() end
local M = {}
function M.run() leaky_count = 1 end
return M
]]

local function names(leaks)
  local out = {}
  for i, leak in ipairs(leaks) do out[i] = leak.name .. ' ' .. leak.where end
  return out
end

describe('the globals guard', function()
  after_each(function()
    package.preload['dslua.leaky'] = nil
    for _, name in ipairs { 'leaky_setup', 'leaky_count', 'spec_made_this', 'loaded_by_a_spec', 'ds' } do
      rawset(_G, name, nil)
    end
    guard.take()
  end)

  it('notes each global a library module sets, and where', function()
    package.preload['dslua.leaky'] = assert(loadstring(LEAKY, '@lua/dslua/leaky.lua'))
    require('dslua.leaky').run()
    assert.are.same({ 'leaky_setup lua/dslua/leaky.lua:1', 'leaky_count lua/dslua/leaky.lua:3' },
                    names(guard.take()))
    assert.are.same({}, guard.take())
  end)

  it('lets specs, code they load, and the REPL set globals', function()
    _G.spec_made_this = 1
    assert(loadstring('loaded_by_a_spec = 1', '@spec/fixture.lua'))()
    assert(loadstring('ds = 1', '@lua/dslua/live/repl.lua'))()
    assert.are.same({}, guard.take())
  end)

  it('notes a global set around __newindex, without a place', function()
    rawset(_G, 'leaky_count', 1)
    assert.are.same({ 'leaky_count set around __newindex, place unknown' }, names(guard.take()))
  end)

  it('fails the spec file, naming the global and where it was set', function()
    local d = H.tmpdir()
    H.write(d .. '/leak_spec.lua', string.format([[
it('uses a leaky module', function()
  package.preload['dslua.leaky'] = assert(loadstring(%q, '@lua/dslua/leaky.lua'))
  require('dslua.leaky').run()
end)
]], LEAKY))
    local p = io.popen(H.bin() .. ' /usr/bin/busted ' .. d .. ' 2>&1; echo "exit:$?"')
    local out = p:read('*a')
    p:close()
    H.has(out, 'globals created by the library (make them local):\n'
          .. '  leaky_setup (lua/dslua/leaky.lua:1)\n  leaky_count (lua/dslua/leaky.lua:3)')
    H.has(out, 'specs: 1 passed, 1 failed, 0 skipped')
    assert.is_nil(out:match('exit:0%s*$'))
  end)
end)

-- Static, so code no spec runs counts too (the CUDA paths, the ranks'
-- children): no library chunk assigns a global (LuaJIT's GSET; `_G.x =`
-- is a table store, as deliberate as it looks).
describe('the library', function()
  local ju, vmdef = require 'jit.util', require 'jit.vmdef'
  local at = vmdef.bcnames:find('GSET  ', 1, true)
  local GSET = (at - 1) / 6

  local function global_sets(fn, path, out)
    for pc = 1, math.huge do
      local ins = ju.funcbc(fn, pc)
      if not ins then break end
      if bit.band(ins, 0xff) == GSET then
        out[#out + 1] = string.format('%s:%d: %s', path, ju.funcinfo(fn, pc).currentline,
                                      ju.funck(fn, -bit.rshift(ins, 16) - 1))
      end
    end
    for i = 1, ju.funcinfo(fn).gcconsts do
      local k = ju.funck(fn, -i)
      if type(k) == 'proto' then global_sets(k, path, out) end
    end
    return out
  end

  it('finds a global assignment in a chunk', function()
    assert.are.same({ 'x.lua:1: leaky_setup', 'x.lua:3: leaky_count' },
                    global_sets(assert(loadstring(LEAKY)), 'x.lua', {}))
  end)

  it('assigns no global in any of its modules', function()
    local found, files = {}, 0
    for path in io.popen('find lua models samplers -name "*.lua" | sort'):lines() do
      global_sets(assert(loadfile(path)), path, found)
      files = files + 1
    end
    assert.is_true(files >= 20, 'found only ' .. files .. ' library files')
    assert.are.same({}, found)
  end)
end)
