local H = require 'helpers'
local ds = H.ds

local errmsg = H.errmsg

local function param(values, dt)
  return ds.tensor(values, dt or 'f64'):requires_grad_()
end

describe('autograd', function()
  it('accumulates gradients over two backward calls until they are cleared', function()
    local x = param { 1, 2, 3 }
    ;(x * x):sum():backward()
    assert.are.same({ 2, 4, 6 }, x.grad:totable())
    ;(x * 3):sum():backward()
    assert.are.same({ 5, 7, 9 }, x.grad:totable())
    x:zero_grad()
    assert.is_nil(x.grad)
    ;(x * 3):sum():backward()
    assert.are.same({ 3, 3, 3 }, x.grad:totable())
  end)

  it('gives the right gradient for a tensor used twice', function()
    local x = param { 1, -2 }
    ;(x * x + x):sum():backward()
    assert.are.same({ 3, -3 }, x.grad:totable())
    local y = param { 5 }
    local z = y + y
    ;(z * y):sum():backward()          -- 2y * y: d/dy = 4y
    assert.are.same({ 20 }, y.grad:totable())
  end)

  it('no_grad runs fn without recording, returns its results, restores the mode', function()
    local x = param { 1, 2 }
    local a, b = ds.no_grad(function(k) return x * k, 'extra' end, 2)
    assert.is_nil(a.grad_fn)
    assert.is_false(a.requires_grad)
    assert.are.equal('extra', b)
    assert.is_true(ds.is_grad_enabled())
    assert.is_not_nil((x * 2).grad_fn)
    -- an error inside: the mode comes back, the error goes on
    local ok, err = pcall(ds.no_grad, function() error('inside no_grad') end)
    assert.is_false(ok)
    assert.matches('inside no_grad', err)
    assert.is_true(ds.is_grad_enabled())
    -- nested, and enable_grad inside no_grad
    ds.no_grad(function()
      assert.is_false(ds.is_grad_enabled())
      ds.no_grad(function() end)
      assert.is_false(ds.is_grad_enabled())
      local r = ds.enable_grad(function() return x * 2 end)
      assert.are.equal('mul', r.grad_fn)
      assert.is_false(ds.is_grad_enabled())
    end)
    assert.is_true(ds.is_grad_enabled())
  end)

  it('detach gives a leaf without history that shares the data', function()
    local x = param { 1, 2 }
    local y = x * 2
    local d = y:detach()
    assert.is_nil(d.grad_fn)
    assert.is_false(d.requires_grad)
    assert.is_true(d.is_leaf)
    assert.is_false(y.is_leaf)
    d:fill_(7)
    assert.are.same({ 7, 7 }, y:totable())
    -- gradient stops at the detach
    local z = (y:detach() * x):sum()
    z:backward()
    assert.are.same({ 7, 7 }, x.grad:totable())
  end)

  it('applies the requires_grad rules', function()
    for _, dt in ipairs { 'i32', 'i64', 'u8', 'bool' } do
      local t = ds.zeros(2, dt)
      assert.matches('only floating point tensors can require grad, got ' .. dt, errmsg(t.requires_grad_, t))
      assert.matches('only floating point', errmsg(function() t.requires_grad = true end))
      t.requires_grad = false    -- turning it off is always fine on a leaf
    end
    for _, dt in ipairs { 'f32', 'f64', 'bf16', 'f16' } do
      assert.is_true(ds.zeros(2, dt):requires_grad_().requires_grad)
    end
    local x = ds.ones(2)
    assert.is_false(x.requires_grad)
    x.requires_grad = true
    assert.is_true(x.requires_grad)
    local y = x + 1
    assert.is_true(y.requires_grad)
    assert.are.equal('add', y.grad_fn)
    assert.matches('cannot turn off on a non%-leaf', errmsg(function() y.requires_grad = false end))
    assert.is_false((ds.ones(2) + 1).requires_grad)
    -- comparisons and argmax carry no gradient
    assert.is_false(ds.gt(x, 0).requires_grad)
    assert.is_false(x:argmax().requires_grad)
    -- in-place ops on a tensor that requires grad need no_grad
    assert.matches('wrap it in ds%.no_grad', errmsg(x.add_, x, 1))
    ds.no_grad(function() x:add_(1) end)
    assert.are.same({ 2, 2 }, x:totable())
  end)

  it('refuses every in-place op on a tensor that requires grad, leaf or not', function()
    local x = ds.tensor({ 0, 0 }):requires_grad_()
    local y = x:sigmoid()
    for _, case in ipairs {
      { 'fill_', function(t) return t:fill_(0) end }, { 'copy_', function(t) return t:copy_(ds.ones(2)) end },
      { 'zero_', function(t) return t:zero_() end }, { 'add_', function(t) return t:add_(1) end },
      { 'sub_', function(t) return t:sub_(1) end }, { 'mul_', function(t) return t:mul_(2) end },
      { 'div_', function(t) return t:div_(2) end },
    } do
      local name = case[1] == 'zero_' and 'fill_' or case[1]
      assert.matches(name .. ': in%-place op on a f32 %[2%] tensor that requires grad %(a leaf%)', errmsg(case[2], x))
      assert.matches(name .. ': in%-place op on a f32 %[2%] tensor that requires grad %(made by sigmoid%)',
                     errmsg(case[2], y))
    end
    assert.are.same({ 0, 0 }, x:totable())
    assert.are.same({ 0.5, 0.5 }, y:totable())
  end)

  it('fails backward through a saved tensor modified in place, naming the op and the tensor', function()
    -- sigmoid saves its output: y:fill_(0) behind autograd's back would give 0 instead of 0.25
    local x = ds.tensor({ 0, 0 }):requires_grad_()
    local y = x:sigmoid()
    ds.no_grad(function() y:fill_(0) end)
    assert.matches('backward of sigmoid: the f32 %[2%] tensor it saved %(saved tensor %d%) was modified in place ' ..
                   'by fill_ after it was saved %(version 1, saved at 0%)', errmsg(function() y:sum():backward() end))
    assert.is_nil(x.grad)
    -- through a view sharing the storage (detach), and by each in-place op
    for _, op in ipairs { 'copy_', 'add_', 'mul_', 'div_', 'sub_' } do
      local a = ds.tensor({ 1, 2 }):requires_grad_()
      local b = a:exp()
      local alias = b:detach():narrow(1, 2, 1)
      ds.no_grad(function() alias[op](alias, op == 'copy_' and ds.ones(1) or 2) end)
      assert.matches('backward of exp: .* modified in place by ' .. op:gsub('_', '%%_'),
                     errmsg(function() b:sum():backward() end))
    end
    -- a saved input, written in place: mul saves both of its inputs
    local w = ds.tensor({ 3, 4 }):requires_grad_()
    local c = ds.tensor { 1, 1 }
    local d = w * c
    c:add_(1)
    assert.matches('backward of mul: the f32 %[2%] tensor it saved .* by add_',
                   errmsg(function() d:sum():backward() end))
    -- untouched, or written before it was saved: backward runs
    local e = ds.tensor { 1, 1 }
    e:mul_(3)
    local f = w * e
    f:sum():backward()
    assert.are.same({ 3, 3 }, w.grad:totable())
  end)

  it('frees the graph after backward unless retain_graph, and says so', function()
    local x = param { 1, 2 }
    local loss = (x * x):sum()
    loss:backward(nil, true)
    loss:backward()
    assert.are.same({ 4, 8 }, x.grad:totable())
    assert.matches('backward of mul: its saved tensors were freed by an earlier backward; pass retain_graph=true',
                   errmsg(loss.backward, loss))
    -- nodes that saved nothing can run again, as in PyTorch
    local y = param { 1 }
    local s = (y + 1):sum()
    s:backward()
    s:backward()
    assert.are.same({ 2 }, y.grad:totable())
  end)

  it('needs a grad argument for a non-scalar backward', function()
    local x = param { 1, 2, 3 }
    local y = x * 2
    assert.matches('grad can be omitted only for one%-element tensors, got shape %[3%]', errmsg(y.backward, y))
    assert.matches('grad shape %[2%] does not match', errmsg(y.backward, y, ds.ones(2, 'f64')))
    y:backward(ds.tensor({ 1, 10, 100 }, 'f64'), true)
    assert.are.same({ 2, 20, 200 }, x.grad:totable())
    -- a grad of another dtype is cast, as in PyTorch
    x:zero_grad()
    y:backward(ds.tensor({ 1, 2, 3 }, 'i64'))
    assert.are.same({ 2, 4, 6 }, x.grad:totable())
    assert.are.equal('f64', x.grad:dtype())
    assert.matches('does not require grad', errmsg(ds.ones(1).backward, ds.ones(1)))
  end)

  it('gives each leaf its own grad buffer', function()
    local a, b = param { 1, 2 }, param { 3, 4 }
    ;(a + b):sum():backward()        -- both receive the same incoming gradient
    a.grad:add_(10)
    assert.are.same({ 11, 11 }, a.grad:totable())
    assert.are.same({ 1, 1 }, b.grad:totable())
    -- a leaf used as the root gets a copy of grad, not grad itself
    local c = param { 1, 2 }
    local g = ds.tensor({ 5, 6 }, 'f64')
    c:backward(g)
    c.grad:mul_(2)
    assert.are.same({ 5, 6 }, g:totable())
    assert.are.equal('gradients', (function()
      local before = ds.memory_stats().current.gradients
      local d = param { 1, 2, 3, 4 }
      d:sum():backward()
      return ds.memory_stats().current.gradients - before == 32 and 'gradients' or 'elsewhere'
    end)())
  end)

  it('walks and frees a graph 100,000 ops deep', function()
    collectgarbage()
    local before = ds.memory_stats().current.total
    local x = param { 1, 2 }
    local y = x
    for i = 1, 100000 do y = (i % 2 == 0) and y + 1 or y * 1 end
    y:sum():backward()
    assert.are.same({ 1, 1 }, x.grad:totable())
    y, x = nil, nil
    collectgarbage()
    collectgarbage()
    assert.are.equal(before, ds.memory_stats().current.total)
  end)

  it('casts gradients back to the dtype of each leaf', function()
    local x = param({ 1, 2 }, 'f32')
    local w = param({ 3, 4 }, 'f64')
    ;(x * w):sum():backward()        -- computed in f64
    assert.are.equal('f32', x.grad:dtype())
    assert.are.same({ 3, 4 }, x.grad:totable())
    assert.are.same({ 1, 2 }, w.grad:totable())
  end)
end)

describe('autograd memory', function()
  local function mem() collectgarbage(); collectgarbage(); return ds.memory_stats().current end

  it('shows every category in memory_stats, current and peak', function()
    local s = ds.memory_stats()
    for _, part in ipairs { 'current', 'peak' } do
      for _, k in ipairs { 'parameters', 'gradients', 'master_weights', 'optimizer_state', 'activations', 'other', 'total' } do
        assert.is_number(s[part][k], part .. '.' .. k)
      end
      local sum = 0
      for _, k in ipairs { 'parameters', 'gradients', 'master_weights', 'optimizer_state', 'activations', 'other' } do sum = sum + s[part][k] end
      if part == 'current' then assert.are.equal(s.current.total, sum) end
    end
    local cur = mem()
    ds.reset_peak_memory()
    assert.are.equal(cur.total, ds.memory_stats().peak.total)
    local t = ds.zeros(1000)
    t = nil
    local after = mem()
    assert.are.equal(cur.total, after.total)
    assert.are.equal(cur.total + 4000, ds.memory_stats().peak.total)
  end)

  it('set_category moves a tensor\'s bytes between categories', function()
    local base = mem()
    local t = ds.zeros(1000, 'f64')
    assert.are.equal(base.other + 8000, mem().other)
    assert.are.equal(t, t:set_category('optimizer_state'))
    local now = mem()
    assert.are.equal(base.other, now.other)
    assert.are.equal(base.optimizer_state + 8000, now.optimizer_state)
    assert.are.equal(base.total + 8000, now.total)
    -- a view shares the storage, so it moves the same bytes
    t:narrow(1, 1, 10):set_category('parameters')
    now = mem()
    assert.are.equal(base.optimizer_state, now.optimizer_state)
    assert.are.equal(base.parameters + 8000, now.parameters)
    assert.matches("unknown memory category 'weights'", errmsg(t.set_category, t, 'weights'))
    t = nil
    assert.are.equal(base.total, mem().total)
  end)

  it('counts op outputs as activations, but not views of a leaf', function()
    local base = mem()
    local x = ds.zeros(1000):requires_grad_()
    local v = x:view(10, 100):transpose(1, 2)
    local now = mem()
    assert.are.equal(base.other + 4000, now.other)
    assert.are.equal(base.activations, now.activations)
    local y = x * 2
    assert.are.equal(base.activations + 4000, mem().activations)
    assert.are.equal('permute', v.grad_fn)
    assert.are.equal('mul', y.grad_fn)
  end)

  -- GELU's derivative reads its input alone: its node keeps x, and its
  -- output goes with its last user; exp's reads the output, which stays.
  it('keeps a unary op\'s output for backward only where its derivative reads it', function()
    local x = ds.randn(256, 1024):requires_grad_()
    local out = 256 * 1024 * 4
    for _, c in ipairs({ { 'gelu', false }, { 'silu', false }, { 'exp', true }, { 'tanh', true } }) do
      local base = mem()
      local loss = ds[c[1]](x):sum()                      -- sum's backward keeps nothing of its input
      local held = mem().total - base.total
      if c[2] then
        assert.is_true(held >= out, c[1] .. ' keeps its output: ' .. held)
      else
        assert.is_true(held < out, c[1] .. ' holds ' .. held .. ' bytes, its output among them')
      end
      loss:backward()
      x.grad = nil
    end
  end)

  it('frees activations during backward while parameters stay', function()
    local base = mem()
    local w1 = ds.randn(64, 256, 'f32'):set_category('parameters'):requires_grad_()
    local w2 = ds.randn(256, 1, 'f32'):set_category('parameters'):requires_grad_()
    local x = ds.randn(128, 64, 1, 'f32')
    -- a little MLP out of elementwise ops and sums, keeping no intermediates
    local function forward()
      local h = (x * w1):sum(2):tanh()                  -- [128, 256]
      local y = (h:unsqueeze(3) * w2):sum(2)             -- [128, 1]
      return (y * y):mean()
    end
    local loss = forward()
    local during = mem()
    assert.is_true(during.activations - base.activations >= 2 * 128 * 256 * 4,
                   'the graph holds activations: ' .. (during.activations - base.activations))
    assert.are.equal(base.parameters + (64 * 256 + 256) * 4, during.parameters)
    loss:backward()
    local after = mem()
    assert.is_true(after.activations - base.activations <= 64,
                   'activations left after backward: ' .. (after.activations - base.activations))
    assert.are.equal(during.parameters, after.parameters)
    assert.are.equal(base.gradients + (64 * 256 + 256) * 4, after.gradients)
    loss, w1, w2, x = nil, nil, nil, nil
    assert.are.equal(base.total, mem().total)
  end)
end)
