-- The binding's errors name their function however it is called: Lua
-- names a C function from the bytecode that called it, so through pcall,
-- a tail call or a local it would say '?' (core/binding/lua_module.c).
local H = require 'helpers'
local ds = H.ds
local core = require 'dslua.core'

describe('binding errors', function()
  it('name the function when it is called through pcall, as a method or from a local', function()
    local ok, err = pcall(core.ckpt.open, {})
    assert.is_false(ok)
    assert.are.equal("bad argument #1 to 'open' (string expected, got table)", err)
    local t = ds.zeros(2)
    ok, err = pcall(t.narrow, t, 'a')
    assert.are.equal("bad argument #2 to 'narrow' (number expected, got string)", err)
    local narrow = t.narrow
    ok, err = pcall(function() local u = narrow(t, 'a'); return u end)
    assert.matches("api_spec%.lua:%d+: bad argument #2 to 'narrow' %(number expected, got string%)", err)
    ok, err = pcall(function() local u = t:narrow('a'); return u end)
    assert.matches("api_spec%.lua:%d+: bad argument #1 to 'narrow' %(number expected, got string%)", err)
    ok, err = pcall(function() local u = t.narrow(5); return u end)
    assert.matches("api_spec%.lua:%d+: bad argument #1 to 'narrow' %(tensor expected, got number%)", err)
  end)

  it('name it for every function of ds.core and every method of its objects (a sweep of bad arguments)', function()
    local dir, here = H.tmpdir(), H.run('pwd'):match('^(.-)%s*$')
    local out, status = H.run('cd ' .. dir .. ' && timeout 300 ' .. H.bin() .. ' ' .. here .. '/spec/api/sweep.lua')
    assert.are.equal(0, status, out)
    local functions, errors = out:match('swept (%d+) functions, (%d+) errors')
    assert(functions, out)
    assert.is_true(tonumber(functions) > 300 and tonumber(errors) > 1000, out)
    assert.is_nil(out:find('unnamed: ', 1, true), out)
  end)
end)
