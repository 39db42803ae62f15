-- help() and help(x) in the REPL and `dslua -e`, read off the live tables
-- and the embedded sources' comments; misspelt methods named with the
-- config checker's suggestion; `ds` in `dslua -e` code.
local H = require 'helpers'
local ds = H.ds
local repl = require 'dslua.live.repl'

local function help_text(...)
  local old, lines = repl.print, {}
  repl.print = function(s) lines[#lines + 1] = s end
  local ok, err = pcall(repl.help, ...)
  repl.print = old
  assert(ok, err)
  return table.concat(lines, '\n')
end

local function err_of(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok)
  return tostring(err)
end

describe('help()', function()
  after_each(function() ds.zz_help_spec = nil end)

  it('lists every module of ds with its first sentence, and every function, as the tables hold them', function()
    ds.zz_help_spec = function() end            -- a function added now shows: the list is the table's
    local out = help_text()
    assert.truthy(out:find('\n  ds.nn            modules over the core ops', 1, true), out)
    assert.truthy(out:find('\n  ds.comm          collectives between ranks', 1, true), out)
    for k, v in pairs(ds) do
      local listed = out:find('ds.' .. k .. '[ \n]') or out:find('ds.' .. k .. '$')
      if type(v) == 'function' then assert.truthy(listed, 'ds.' .. k .. ' missing from\n' .. out) end
    end
    assert.truthy(out:find('ds.zz_help_spec', 1, true))
  end)

  it('describes a tensor: its fields and every method its metatable holds', function()
    local t = ds.zeros(2, 3)
    local out = help_text(t)
    assert.truthy(out:find('^tensor 2x3 f32 cpu: a tensor\n'), out)
    for name in pairs(getmetatable(t).methods) do
      assert.truthy(out:find('[ \n]' .. name .. '[ \n]') or out:find(' ' .. name .. '$'), name .. ' missing from\n' .. out)
    end
  end)

  it("gives a Lua function's call line and the comment above its definition", function()
    local out = help_text(ds.no_grad)
    assert.truthy(out:find('^ds%.no_grad%(fn, %.%.%.%): Runs fn%(%.%.%.%) with autograd off'), out)
    assert.truthy(out:find('defined at lua/dslua/init.lua:', 1, true), out)
    assert.truthy(help_text(ds.zeros):find('^ds%.zeros: a built%-in function'))
  end)

  it("lists a module's functions and classes, and an nn module's methods", function()
    local out = help_text(ds.nn)
    assert.truthy(out:find('^ds%.nn: modules over the core ops'), out)
    assert.truthy(out:find(' Linear ', 1, true), out)
    out = help_text(ds.nn.Linear(2, 3))
    assert.truthy(out:find('^Linear%(in_features=2, out_features=3, bias=true%): an nn module %-%- Linear%(in_features'), out)
    for _, name in ipairs { 'forward', 'parameters', 'state_dict', 'zero_grad' } do
      assert.truthy(out:find(' ' .. name .. '[ \n]') or out:find(' ' .. name .. '$'), name)
    end
    assert.truthy(help_text(ds.nn.Sequential):find('^Sequential: an nn module class'))
  end)
end)

describe('a misspelt method', function()
  it('on a tensor names the tensor and the method meant', function()
    local x = ds.zeros(2, 2)
    assert.matches("help_spec%.lua:%d+: tensor has no method 'matmull' %(did you mean 'matmul'%?%)",
                   err_of(function() return x:matmull(x) end))
    assert.matches("tensor has no method 'requires_gard' %(did you mean 'requires_grad'%?%)",
                   err_of(function() return x.requires_gard end))
    assert.matches("tensor has no method 'zzzzzzzzzzzz'$", err_of(function() return x.zzzzzzzzzzzz end))
  end)

  it('on an nn module names its class and the method meant; fields stay nil, registered or not', function()
    local m = ds.nn.Linear(2, 3, false)
    assert.matches("help_spec%.lua:%d+: Linear has no method 'forwrd' %(did you mean 'forward'%?%)",
                   err_of(function() return m:forwrd(ds.zeros(1, 2)) end))
    assert.matches("Sequential has no method 'paramters' %(did you mean 'parameters'%?%)",
                   err_of(function() return ds.nn.Sequential(m):paramters() end))
    assert.is_nil(m.bias)                       -- registered as nil
    assert.is_nil(m.some_cache_of_mine)         -- never set, near no method
    assert.is_nil(m.name)                       -- a part of named_buffers, not a slip from it
    assert.is_nil(m.zero)
  end)
end)

describe('dslua -e', function()
  it('has ds and help as the REPL has them', function()
    local out, status = H.run(H.bin() .. [[ -e 'print(ds.zeros(2, 3):numel(), type(help)); help(ds.zeros(1))']])
    assert.are.equal(0, status, out)
    assert.truthy(out:find('^6\tfunction\ntensor 1 f32 cpu: a tensor\n'), out)
  end)
end)
