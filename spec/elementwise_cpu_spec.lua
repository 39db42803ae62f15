-- The CPU elementwise kernels on tensors large enough to be cut into tiles
-- and shared among threads, and the f32 GELU fast paths against f64.
local H = require 'helpers'
local ds = H.ds

-- Largest |a - b| over all elements, both read as f64.
local function max_diff(a, b) return (a:double() - b:double()):abs():amax():item() end

describe('cpu elementwise tiles', function()
  it('a contiguous add (one long row of many tiles) is exact in f32', function()
    local a, b = ds.randn(3, 70001), ds.randn(3, 70001)
    assert.are.equal(0, max_diff(a + b, (a:double() + b:double()):float()))
  end)

  it('a broadcast row, a scalar and a transposed view give the f64 result', function()
    local a, row = ds.randn(40, 9000), ds.randn(9000)
    assert.are.equal(0, max_diff(a + row, (a:double() + row:double()):float()))
    assert.are.equal(0, max_diff(a * 3, (a:double() * 3):float()))
    local t = ds.randn(9000, 40):t()
    assert.are.equal(0, max_diff(t - a, (t:double() - a:double()):float()))
  end)

  -- + - * / over mixes of f32, bf16 and f16 run widened to f32 (bit for bit
  -- the f64 route); the values span many binades, and 0 is a divisor too
  it('+ - * / over mixed float dtypes equal the f64 route rounded once', function()
    local function values(dt, ...)
      return (ds.randn({ ... }) * ds.exp(ds.randn({ ... }) * 6)):to(dt)
    end
    local ops = { function(x, y) return x + y end, function(x, y) return x - y end,
                  function(x, y) return x * y end, function(x, y) return x / y end }
    for _, dts in ipairs { { 'bf16', 'bf16' }, { 'f16', 'f16' }, { 'bf16', 'f32' }, { 'f32', 'f16' },
                           { 'f16', 'bf16' } } do
      local a = values(dts[1], 3, 9001)
      for _, b in ipairs { values(dts[2], 3, 9001), values(dts[2], 9001), values(dts[2], 1), ds.zeros(1):to(dts[2]) } do
        for k, op in ipairs(ops) do
          local got = op(a, b)
          local want = op(a:to('f64'), b:to('f64')):to(got:dtype())
          H.assert_same(got, want, string.format('%s op %d %s [%s]', dts[1], k, dts[2], table.concat(b:size(), 'x')))
        end
      end
    end
    local m, g = ds.randn(5, 20000), ds.randn(5, 20000):to('bf16')
    local want = (m:to('f64') + g:to('f64')):to('f32')
    m:add_(g)
    H.assert_same(m, want, 'f32 += bf16 in place')
  end)

  it('in-place add, unary, where and unary backward cover every element', function()
    local a, b = ds.randn(5, 20000), ds.randn(5, 20000)
    local want = (a:double() + b:double()):float()
    local c = a:clone()
    c:add_(b)
    assert.are.equal(0, max_diff(c, want))
    assert.are.equal(0, max_diff(ds.relu(a), ds.where(a:gt(0), a, ds.zeros(1))))
    assert.are.equal(0, max_diff(ds.where(a:gt(b), a, b), ds.maximum(a, b)))
    local x = ds.randn(5, 20000):requires_grad_()
    ds.tanh(x):sum():backward()
    local y = ds.tanh(x:detach())
    assert.is_true(max_diff(x.grad, 1 - y * y) < 1e-6)
  end)
end)

describe('cpu gelu tanh, f32 fast path', function()
  it('is within 1e-6 of f64 over [-20, 20]', function()
    local x = (ds.arange(-400000, 400000):to('f64') / 20000):float()
    local got, want = x:gelu('tanh'), x:double():gelu('tanh')
    assert.is_true(max_diff(got, want) < 1e-6)
  end)

  it('keeps inf, nan and signed zeros, and sends -inf to 0', function()
    local y = ds.tensor({ 1 / 0, -1 / 0, 0 / 0, 0, -30, 3e38 }):gelu('tanh'):totable()
    assert.are.equal(1 / 0, y[1])
    assert.are.equal(0, y[2])
    assert.is_true(y[3] ~= y[3])
    assert.are.equal(0, y[4])
    assert.are.equal(0, y[5])
    assert.are.equal(ds.tensor({ 3e38 }):item(), y[6])
  end)
end)

-- GELU's gradient at x, through autograd, in dtype dt
local function gelu_grad(x, dt)
  local xg = x:to(dt):detach():requires_grad_()
  xg:gelu('tanh'):sum():backward()
  return xg.grad
end

describe('cpu gelu tanh backward, f32 fast path', function()
  it('is within 2e-6 of f64 over [-20, 20]', function()
    local x = (ds.arange(-400000, 400000):to('f64') / 20000):float()
    assert.is_true(max_diff(gelu_grad(x, 'f32'), gelu_grad(x, 'f64')) < 2e-6)
  end)

  it('is 1 and 0 far out and at the infinities, and NaN stays NaN', function()
    local g = gelu_grad(ds.tensor({ 1e20, -1e20, 1 / 0, -1 / 0, 0 / 0, 11, -11 }), 'f32'):totable()
    assert.are.same({ 1, 0, 1, 0 }, { g[1], g[2], g[3], g[4] })
    assert.is_true(g[5] ~= g[5])
    assert.are.same({ 1, 0 }, { g[6], g[7] })
  end)
end)

-- bf16 and f16 widen to f32 exactly, so these paths are the f32 kernels'
-- results rounded once
describe('cpu unary ops on bf16 and f16', function()
  local x = ds.randn(4, 9001) * 3

  it('compute in f32 and round once, forward and GELU backward', function()
    for _, dt in ipairs { 'bf16', 'f16' } do
      local xd = x:to(dt)
      for _, op in ipairs { 'tanh', 'exp', 'sigmoid', 'silu', 'relu', 'neg' } do
        H.assert_same(ds[op](xd), ds[op](xd:float()):to(dt), dt .. ' ' .. op)
      end
      H.assert_same(xd:gelu('tanh'), xd:float():gelu('tanh'):to(dt), dt .. ' gelu')
      H.assert_same(gelu_grad(xd, dt), gelu_grad(xd:float(), 'f32'):to(dt), dt .. ' gelu backward')
    end
  end)

  it('take other gradients through f64, as before', function()
    for _, dt in ipairs { 'bf16', 'f16' } do
      local xd = x:to(dt):requires_grad_()
      local y = ds.tanh(xd)
      y:sum():backward()
      local yd = y:detach():to('f64')
      H.assert_same(xd.grad, (1 - yd * yd):to(dt), dt .. ' tanh backward')
    end
  end)
end)
