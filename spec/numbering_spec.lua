-- The Lua API counts from 1, and so do its messages: a dim, start or
-- position in an error is the number the caller wrote (the C core, 0-based
-- inside, words its messages the API's way); t[i] is torch's t[i]; a
-- module prints its children as they are indexed.
local H = require 'helpers'
local ds = H.ds

local function err_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  return tostring(err)
end

describe('error messages', function()
  local x = ds.zeros(2, 3)
  -- each case: the call, then the numbers its message must give as written
  local cases = {
    { 'narrow start and dim', function() return ds.arange(10):narrow(1, 5, 100) end,
      'narrow: start 5 length 100 out of range for dim 1 of shape %[10%]' },
    { 'narrow on dim 2', function() return x:narrow(2, 3, 5) end, 'start 3 length 5 out of range for dim 2 ' },
    { 'narrow from the end', function() return x:narrow(2, -2, 5) end, 'start %-2 length 5 out of range for dim 2 ' },
    { 'broadcast', function() return x + ds.zeros(2, 4) end, 'do not broadcast %(dim 2: 3 vs 4%)' },
    { 'permute', function() return x:permute(2, 2) end, 'permute: dim 2 repeated' },
    { 'reduction dims', function() return x:sum({ 2, 2 }) end, 'sum: dim 2 listed twice' },
    { 'view size', function() return x:view(2, -3) end, 'view: invalid size %-3 in dim 2' },
    { 'new shape', function() return ds.zeros(2, -1) end, 'negative size %-1 in dim 2' },
    { 'split piece', function() return x:split({ 1, -1 }, 2) end, 'size %-1 of piece 2 is negative' },
    { 'unsqueeze', function() return x:unsqueeze(5) end, 'dim 5 out of range for unsqueezing a 2%-dim tensor' },
    { 'embedding position', function() return ds.embedding(ds.zeros(4, 2), ds.tensor({ { 0, 1, 2 }, { 3, 4, 0 } }, 'i64')) end,
      'ids value 4 at position %(2,2%) of ids %[2,3%]' },
    { 'gather position', function() return ds.gather(x, 2, ds.tensor({ { 0, 5 }, { 0, 0 } }, 'i64')) end,
      'index value 5 at position %(1,2%) of index %[2,2%]' },
  }
  for _, c in ipairs(cases) do
    it('give 1-based numbers: ' .. c[1], function()
      assert.matches(c[3], err_of(c[2]))
    end)
  end
end)

describe('t[i]', function()
  it('is the view at 1-based position i of dim 1, as torch indexes', function()
    local t = ds.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    assert.are.same({ 1, 2, 3 }, t[1]:totable())
    assert.are.same({ 4, 5, 6 }, t[-1]:totable())
    assert.are.equal(5, t[2][2]:item())
    assert.are.equal(0, t[2][3]:dim())
    t[2]:fill_(7)                                  -- a view: writes reach t
    assert.are.same({ { 1, 2, 3 }, { 7, 7, 7 } }, t:totable())
  end)

  it('carries gradients back to the positions it took', function()
    local t = ds.zeros(3, 2):requires_grad_()
    t[2]:sum():backward()
    assert.are.same({ { 0, 0 }, { 1, 1 }, { 0, 0 } }, t.grad:totable())
  end)

  it('refuses positions out of range, 0, fractions and 0-dim tensors by name', function()
    local t = ds.zeros(3, 2)
    assert.matches('t%[4%]: index out of range for dim 1 of size 3 %(indices are 1%-based', err_of(function() return t[4] end))
    assert.matches('t%[0%]: index out of range', err_of(function() return t[0] end))
    assert.matches('t%[%-4%]: index out of range', err_of(function() return t[-4] end))
    assert.matches('t%[1.5%]: index out of range', err_of(function() return t[1.5] end))
    assert.matches('a 0%-dim tensor has no dim to index; use t:item%(%)', err_of(function() return ds.tensor(1)[1] end))
  end)

  it('leaves method lookup and fields as they were', function()
    local t = ds.ones(2, 2):requires_grad_()
    assert.are.equal(4, t:sum():item())
    assert.is_nil(t.grad)
    assert.is_true(t.is_leaf)
  end)
end)

describe('module printouts', function()
  it('name children as they are indexed: (1) for the first of a Sequential, (fc) for a field', function()
    local m = ds.nn.Sequential(ds.nn.Linear(2, 3), ds.nn.ReLU())
    local s = tostring(m)
    assert.truthy(s:find('\n  (1): Linear(', 1, true), s)
    assert.truthy(s:find('\n  (2): ReLU()', 1, true), s)
    assert.are.equal(m[1], m:children()[1])
    local Net = ds.nn.Module:extend('Net')
    function Net:init() self.fc = ds.nn.Linear(2, 2) end
    assert.truthy(tostring(Net()):find('\n  (fc): Linear(', 1, true))
  end)
end)
