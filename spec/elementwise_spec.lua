local H = require 'helpers'
local ds = H.ds

local F = H.fixture('elementwise')

-- Runs a fixture case through fn: output, then input gradients of the
-- output projected on the fixture's weights, against PyTorch.
local function against_torch(name, fn, n_inputs)
  H.against_torch(F[name], name, function(xs) return fn(unpack(xs)) end, nil, n_inputs)
end

-- f64 inputs for finite differences; positive ones where the op needs it.
local function f64(positive, ...)
  local t = ds.randn({ ... }, 'f64')
  if positive then t = t:abs() + 0.5 end
  return t:detach():requires_grad_()
end

describe('binary ops', function()
  local ops = {
    add_broadcast = function(a, b) return a + b end,
    sub_broadcast = function(a, b) return a - b end,
    mul = function(a, b) return a * b end,
    div = function(a, b) return a / b end,
    pow = function(a, b) return a ^ b end,
    maximum = function(a, b) return ds.maximum(a, b) end,
  }
  for name, fn in pairs(ops) do
    it(name .. ' matches PyTorch', function() against_torch(name, fn, 2) end)
  end

  it('broadcast gradients match finite differences', function()
    H.gradcheck(function(a, b) return a * b + a / b - b end, { f64(false, 3, 1, 4), f64(true, 2, 1) })
  end)

  it('pow gradients match finite differences', function()
    H.gradcheck(function(a, b) return a ^ b end, { f64(true, 3, 2), f64(false, 2) })
  end)

  it('numbers on either side take the tensor dtype', function()
    local t = ds.tensor({ 1, 2 }, 'f64')
    assert.are.equal('f64', (2 * t):dtype())
    assert.are.same({ 1, 0 }, (2 - t):totable())
    assert.are.same({ 0.5, 1 }, (t / 2):totable())
    assert.are.same({ -1, -2 }, (-t):totable())
  end)

  it('promotes dtypes like PyTorch', function()
    local i = ds.tensor({ 1, 2 }, 'i64')
    assert.are.equal('f32', (i + ds.tensor { 1, 1 }):dtype())
    assert.are.equal('f32', (ds.ones(2, 'bf16') + ds.ones(2, 'f16')):dtype())
    assert.are.equal('i64', (i + i):dtype())
  end)

  it('comparisons give bool tensors and no gradient', function()
    local a = ds.tensor({ 1, 2, 3 }):requires_grad_()
    local m = a:gt(1.5)
    assert.are.equal('bool', m:dtype())
    assert.are.same({ false, true, true }, m:totable())
    assert.is_false(m.requires_grad)
    assert.are.same({ true, false, false }, a:le(1):totable())
    assert.are.same({ false, true, false }, a:eq(2):totable())
  end)

  it('rejects shapes that do not broadcast, naming both', function()
    H.fails('add: shapes %[2,3%] and %[4%] do not broadcast', function() return ds.zeros(2, 3) + ds.zeros(4) end)
  end)
end)

describe('unary ops', function()
  local ops = {
    exp = 'exp', tanh = 'tanh', sigmoid = 'sigmoid', abs = 'abs', relu = 'relu',
    log = 'log', sqrt = 'sqrt', rsqrt = 'rsqrt', silu = 'silu',
  }
  for name, method in pairs(ops) do
    it(name .. ' matches PyTorch', function() against_torch(name, function(x) return x[method](x) end, 1) end)
  end
  it('gelu (tanh form) matches PyTorch', function()
    against_torch('gelu_tanh', function(x) return x:gelu('tanh') end, 1)
  end)
  it('gelu (erf form) matches PyTorch', function()
    against_torch('gelu_erf', function(x) return x:gelu() end, 1)
  end)
  it('pow by a number matches PyTorch', function() against_torch('pow_scalar', function(x) return x ^ 3 end, 1) end)

  for _, m in ipairs { 'exp', 'tanh', 'sigmoid', 'silu', 'gelu', 'relu', 'abs', 'neg' } do
    it(m .. ' gradient matches finite differences', function()
      H.gradcheck(function(x) return x[m](x) end, { f64(false, 3, 4) })
    end)
  end
  for _, m in ipairs { 'log', 'sqrt', 'rsqrt' } do
    it(m .. ' gradient matches finite differences', function()
      H.gradcheck(function(x) return x[m](x) end, { f64(true, 3, 4) })
    end)
  end
  it('gelu tanh gradient matches finite differences', function()
    H.gradcheck(function(x) return x:gelu('tanh') end, { f64(false, 10) })
  end)

  it('where picks elementwise and routes gradients', function()
    local a, b = f64(false, 2, 3), f64(false, 3)
    local c = ds.tensor({ { 1, 0, 1 }, { 0, 0, 1 } }):to('bool')
    H.gradcheck(function(x, y) return ds.where(c, x, y) end, { a, b })
    local r = ds.where(c, 1, ds.zeros(2, 3))
    assert.are.same({ { 1, 0, 1 }, { 0, 0, 1 } }, r:totable())
  end)
end)

describe('reductions', function()
  it('sum over dims matches PyTorch', function() against_torch('sum_dims', function(x) return x:sum { 1, 3 } end, 1) end)
  it('mean keepdim matches PyTorch', function() against_torch('mean_keepdim', function(x) return x:mean(2, true) end, 1) end)
  it('amax matches PyTorch', function() against_torch('amax', function(x) return x:amax(-1) end, 1) end)
  it('var matches PyTorch', function() against_torch('var', function(x) return x:var(2) end, 1) end)
  it('2-norm matches PyTorch', function() against_torch('norm', function(x) return x:norm(2, 2) end, 1) end)
  it('3-norm of everything matches PyTorch', function() against_torch('norm3', function(x) return x:norm(3) end, 1) end)
  it('argmax gives 0-based indices like PyTorch', function()
    local c = F.argmax
    H.assert_close(H.tensor(c.x1):argmax(2), H.tensor(c.out))
    assert.are.equal('i64', H.tensor(c.x1):argmax(2):dtype())
  end)

  for _, case in ipairs {
    { 'sum', function(x) return x:sum { 1, 3 } end },
    { 'mean', function(x) return x:mean(2, true) end },
    { 'amax', function(x) return x:amax { 2, 3 } end },
    { 'var', function(x) return x:var({ 1, 3 }, 1) end },
    { 'norm1', function(x) return x:norm(1, 2) end },
    { 'norm2', function(x) return x:norm(2, { 1, 2 }) end },
    { 'norm3', function(x) return x:norm(3) end },
  } do
    it(case[1] .. ' gradient matches finite differences', function()
      H.gradcheck(case[2], { f64(false, 2, 3, 4) })
    end)
  end

  it('sums integers into i64 and everything when no dim is given', function()
    local t = ds.arange(1, 7, 1, 'i32'):view(2, 3)
    assert.are.equal('i64', t:sum():dtype())
    assert.are.equal(21, t:sum():item())
    assert.are.same({ 6, 15 }, t:sum(2):totable())
    assert.are.same({ { 5, 7, 9 } }, t:sum(1, true):totable())
  end)

  it('sums and means of bf16 and f16 over any dim are the exact sum rounded once', function()
    -- randn's half values span far fewer than 53 bits: their double sum is
    -- exact in any order, so the result is the f64 one rounded to the dtype
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      local x = ds.randn(3, 70, 300):to(dt)
      for _, dim in ipairs({ 1, 2, 3 }) do
        assert.are.same(x:to('f64'):sum(dim):to(dt):totable(), x:sum(dim):totable(), dt .. ' sum ' .. dim)
        assert.are.same(x:to('f64'):mean(dim):to(dt):totable(), x:mean(dim):totable(), dt .. ' mean ' .. dim)
      end
    end
  end)

  it('rejects dims out of range with the shape', function()
    H.fails('dim 3 out of range for a 2%-dim tensor', function() return ds.zeros(2, 3):sum(3) end)
  end)
end)

describe('shapes and views', function()
  it('transpose, contiguous and view match PyTorch', function()
    against_torch('transpose_view', function(x) return x:transpose(1, 2):contiguous():view(12) * 2 end, 1)
  end)
  it('narrow matches PyTorch', function() against_torch('narrow', function(x) return x:narrow(2, 2, 2) end, 1) end)

  it('views share storage and strides', function()
    local t = ds.arange(12, 'f32'):view(3, 4)
    local tt = t:transpose(1, 2)
    assert.are.same({ 4, 3 }, tt:size())
    assert.are.same({ 1, 4 }, tt:stride())
    assert.is_false(tt:is_contiguous())
    t:narrow(1, 1, 1):fill_(7)
    assert.are.same({ 7, 7, 7 }, tt:narrow(1, 1, 3):narrow(2, 1, 1):reshape(-1):totable())
  end)

  it('view refuses a non-contiguous layout and reshape copies', function()
    local t = ds.arange(6, 'f32'):view(2, 3):transpose(1, 2)
    H.fails('not contiguous enough to view; use reshape', function() return t:view(6) end)
    assert.are.same({ 0, 3, 1, 4, 2, 5 }, t:reshape(6):totable())
  end)

  it('infers one -1 and reports bad shapes', function()
    assert.are.same({ 2, 6 }, ds.zeros(3, 4):view(2, -1):size())
    H.fails('shape %[5,%-1%] is invalid for a tensor of shape %[3,4%]',
            function() return ds.zeros(3, 4):view(5, -1) end)
  end)

  it('permute, squeeze and unsqueeze', function()
    local t = ds.zeros(2, 1, 3)
    assert.are.same({ 3, 2, 1 }, t:permute(3, 1, 2):size())
    assert.are.same({ 2, 3 }, t:squeeze():size())
    assert.are.same({ 2, 3 }, t:squeeze(2):size())
    assert.are.same({ 2, 1, 3, 1 }, t:unsqueeze(-1):size())
    H.gradcheck(function(x) return x:permute(3, 1, 2):reshape(-1) end, { f64(false, 2, 3, 4) })
  end)
end)

describe('dtypes', function()
  it('rounds f32 to bf16 to nearest even, bit-exact with PyTorch', function()
    local c = F.bf16_round
    local got = H.tensor(c.x1):to('bf16')
    assert.are.same(H.tensor(c.out):to('f64'):totable(), got:to('f64'):totable())
  end)

  it('rounds f32 to f16 to nearest even, overflow and subnormals included', function()
    local c = F.f16_round
    local got = H.tensor(c.x1):to('f16')
    assert.are.same(H.tensor(c.out):to('f64'):totable(), got:to('f64'):totable())
  end)

  it('round-trips every bf16 and f16 value through f32', function()
    -- all 65536 bit patterns as u16 pairs would need bit casts; values
    -- spread over the exponent range stand in for them
    for _, dt in ipairs { 'bf16', 'f16' } do
      local x = ds.randn(4096):to(dt)
      assert.are.same(x:to('f64'):totable(), x:to('f32'):to(dt):to('f64'):totable())
    end
  end)

  it('casts between all dtypes, with gradients through float casts', function()
    local x = ds.tensor({ 1.5, -2.25, 3 }):requires_grad_()
    local y = x:to('f64'):to('bf16'):to('f16'):to('f32')
    y:sum():backward()
    assert.are.same({ 1, 1, 1 }, x.grad:totable())
    assert.are.same({ 1, -2, 3 }, x:to('i32'):totable())
    assert.are.same({ true, true, true }, x:to('bool'):totable())
  end)
end)
