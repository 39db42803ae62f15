local H = require 'helpers'
local ds = H.ds

local F = H.fixture('linalg')

-- Runs fixture case `name` through fn(c, inputs...): the output, then the
-- input gradients of the output projected on the fixture's weights.
local function against_torch(name, fn, tol)
  H.against_torch(F[name], name, function(xs) return fn(F[name], unpack(xs)) end, tol)
end

local function f64(...) return ds.randn({ ... }, 'f64'):requires_grad_() end

local fails = H.fails

-- larger bf16 tolerance for sums of 16 products rounded once more
local bf16 = { rtol = 2e-2, atol = 3e-2 }

describe('matmul', function()
  local matmul = function(_, a, b) return ds.matmul(a, b) end
  for _, name in ipairs { 'mm_dot', 'mm_2d', 'mm_vec_mat', 'mm_mat_vec', 'mm_batched', 'mm_broadcast',
                          'mm_3d_2d', 'mm_2d_3d', 'mm_vec_3d', 'mm_3d_vec' } do
    it(name .. ' matches PyTorch', function() against_torch(name, matmul) end)
  end

  it('takes transposed operands as they are', function()
    against_torch('mm_transposed', function(_, a, b) return a:t():matmul(b:t()) end)
    against_torch('mm_batched_transposed', function(_, a, b) return a:transpose(2, 3):matmul(b:transpose(2, 3)) end)
  end)

  it('takes narrowed and permuted (copied) operands', function()
    against_torch('mm_narrow', function(_, a, b) return a:narrow(2, 2, 4):matmul(b) end)
    against_torch('mm_permuted', function(_, a, b) return a:permute(3, 1, 2):matmul(b) end)
  end)

  it('bmm matches PyTorch', function() against_torch('bmm', function(_, a, b) return ds.bmm(a, b) end) end)

  it('bf16 matches PyTorch within bf16 rounding', function()
    against_torch('mm_bf16', matmul, bf16)
    against_torch('mm_bf16_batched', matmul, bf16)
  end)

  it('f16 agrees with f32', function()
    local a, b = ds.randn({ 2, 5, 12 }), ds.randn({ 12, 7 })
    local want = ds.matmul(a, b)
    H.assert_close(ds.matmul(a:to('f16'), b:to('f16')):to('f32'), want, { rtol = 1e-2, atol = 2e-2 })
  end)

  it('f16 and bf16 take transposed and big operands as f32 does', function()
    -- the f32 product of the same half values, rounded once to the dtype
    -- (300 x 200 x 150 spreads the widening over threads)
    for _, dt in ipairs({ 'f16', 'bf16' }) do
      local a, b = ds.randn({ 150, 300 }):to(dt), ds.randn({ 200, 150 }):to(dt)
      local got = a:t():matmul(b:t())
      local want = a:to('f32'):t():matmul(b:to('f32'):t()):to(dt)
      H.assert_close(got:to('f32'), want:to('f32'), { rtol = dt == 'f16' and 2e-3 or 1.6e-2, atol = 1e-3 })
    end
  end)

  it('bf16 and f16 gradients summed over broadcast batches agree with f32', function()
    local a, b = ds.randn({ 3, 4 }), ds.randn({ 3, 4, 5 })
    for _, dt in ipairs { 'bf16', 'f16' } do
      local ah, bh = a:to(dt):requires_grad_(), b:to(dt):requires_grad_()
      local af, bf = a:to(dt):float():requires_grad_(), b:to(dt):float():requires_grad_()
      ds.matmul(ah, bh):sum():backward()
      ds.matmul(af, bf):sum():backward()
      H.assert_close(ah.grad:float(), af.grad, bf16, dt .. ' grad a')
      H.assert_close(bh.grad:float(), bf.grad, bf16, dt .. ' grad b')
    end
  end)

  it('many small GEMMs spread over threads agree with f64', function()
    local a, b = ds.randn({ 64, 6, 7 }, 'f64'), ds.randn({ 64, 7, 5 }, 'f64')
    H.assert_close(ds.bmm(a:float(), b:float()), ds.bmm(a, b):float())
    H.assert_close(ds.bmm(a:float():transpose(2, 3):contiguous():transpose(2, 3), b:float()), ds.bmm(a, b):float())
  end)

  it('gradients match finite differences in every shape case', function()
    local shapes = {
      { { 4 }, { 4 } }, { { 3, 4 }, { 4, 2 } }, { { 4 }, { 4, 3 } }, { { 3, 4 }, { 4 } },
      { { 2, 3, 2 }, { 2, 2, 3 } }, { { 2, 1, 2, 3 }, { 3, 3, 2 } }, { { 2, 3, 2 }, { 2, 3 } },
      { { 3, 2 }, { 2, 2, 3 } }, { { 3 }, { 2, 3, 2 } }, { { 2, 2, 3 }, { 3 } },
    }
    for _, s in ipairs(shapes) do
      H.gradcheck(ds.matmul, { f64(unpack(s[1])), f64(unpack(s[2])) })
    end
  end)

  it('gradients through transposed and copied views match finite differences', function()
    H.gradcheck(function(a, b) return a:transpose(2, 3):matmul(b:t()) end, { f64(2, 3, 2), f64(2, 3) })
    H.gradcheck(function(a, b) return a:permute(3, 1, 2):matmul(b) end, { f64(3, 2, 2), f64(2, 3) })
  end)

  it('handles empty dims', function()
    assert.are.same({ 0, 5 }, ds.matmul(ds.zeros(0, 4), ds.zeros(4, 5)):size())
    assert.are.same({ { 0, 0 }, { 0, 0 } }, ds.matmul(ds.ones(2, 0), ds.ones(0, 2)):totable())
    local a = ds.randn({ 3, 4 }):requires_grad_()
    local b = ds.randn({ 0, 4, 2 }):requires_grad_()
    ds.matmul(a, b):sum():backward()
    assert.are.same(ds.zeros(3, 4):totable(), a.grad:totable())
  end)

  it('is fast on contiguous and transposed f32 (no copies)', function()
    local a, b = ds.randn({ 64, 64 }), ds.randn({ 64, 64 })
    H.assert_close(ds.matmul(a:t(), b:t()), ds.matmul(a:t():contiguous(), b:t():contiguous()))
  end)

  it('names the op and the shapes when they do not fit', function()
    fails('matmul: shapes %[3,4%] and %[5,6%] do not match', ds.matmul, ds.zeros(3, 4), ds.zeros(5, 6))
    fails('matmul: shapes %[3%] and %[4%] do not match', ds.matmul, ds.zeros(3), ds.zeros(4))
    fails('matmul: batch dims of %[2,3,4%] and %[3,4,5%] do not broadcast', ds.matmul, ds.zeros(2, 3, 4),
          ds.zeros(3, 4, 5))
    fails('matmul: both arguments need at least 1 dim, got %[%] and %[3%]', ds.matmul, ds.tensor(1), ds.zeros(3))
    fails('matmul: dtypes f32 and f64 differ', ds.matmul, ds.zeros(2, 2), ds.zeros({ 2, 2 }, 'f64'))
    fails('matmul: needs floating point tensors, got i64', ds.matmul, ds.zeros({ 2, 2 }, 'i64'),
          ds.zeros({ 2, 2 }, 'i64'))
    fails('bmm: expected 3%-D tensors, got %[2,3%] and %[2,3,4%]', ds.bmm, ds.zeros(2, 3), ds.zeros(2, 3, 4))
    fails('bmm: shapes %[2,3,4%] and %[3,4,5%] do not match', ds.bmm, ds.zeros(2, 3, 4), ds.zeros(3, 4, 5))
    fails('mm: expected 2%-D tensors', ds.mm, ds.zeros(2, 3, 4), ds.zeros(4, 5))
    fails('bad argument', ds.matmul, ds.zeros(2, 2), 3)
  end)
end)

describe('linear', function()
  local linear = function(_, x, w, b) return ds.linear(x, w, b) end
  for _, name in ipairs { 'linear_bias', 'linear_nobias', 'linear_vec' } do
    it(name .. ' matches PyTorch', function() against_torch(name, linear) end)
  end

  it('takes a transposed input', function()
    against_torch('linear_transposed', function(_, x, w, b) return ds.linear(x:t(), w, b) end)
  end)

  it('bf16 matches PyTorch within bf16 rounding', function() against_torch('linear_bf16', linear, bf16) end)

  it('equals x @ w^T + b', function()
    local x, w, b = ds.randn({ 2, 3, 4 }), ds.randn({ 5, 4 }), ds.randn({ 5 })
    H.assert_close(x:linear(w, b), ds.matmul(x, w:t()) + b)
  end)

  it('gradients match finite differences', function()
    H.gradcheck(ds.linear, { f64(2, 3, 4), f64(2, 4), f64(2) })
    H.gradcheck(ds.linear, { f64(3), f64(2, 3) })
    H.gradcheck(function(x, w) return ds.linear(x:transpose(1, 2), w) end, { f64(3, 2, 4), f64(2, 4) })
  end)

  it('names the op and the shapes when they do not fit', function()
    fails('linear: input %[2,3%] and weight %[4,5%] do not match', ds.linear, ds.zeros(2, 3), ds.zeros(4, 5))
    fails('linear: weight must be 2%-D %[out,in%], got %[4%]', ds.linear, ds.zeros(2, 4), ds.zeros(4))
    fails('linear: bias %[3%] does not match weight %[4,5%]', ds.linear, ds.zeros(2, 5), ds.zeros(4, 5), ds.zeros(3))
    fails('linear: dtypes f32 and bf16 differ', ds.linear, ds.zeros(2, 5), ds.zeros({ 4, 5 }, 'bf16'))
  end)
end)

describe('conv2d', function()
  local conv = function(c, x, w, b) return ds.conv2d(x, w, b, c.opts) end
  for _, name in ipairs { 'conv_basic', 'conv_stride_pad', 'conv_stride_floor', 'conv_dilation', 'conv_groups',
                          'conv_depthwise', 'conv_rect' } do
    it(name .. ' matches PyTorch', function() against_torch(name, conv) end)
  end

  it('bf16 matches PyTorch within bf16 rounding', function() against_torch('conv_bf16', conv, bf16) end)

  it('f16 agrees with f32', function()
    local x, w, b = ds.randn({ 1, 2, 5, 5 }), ds.randn({ 3, 2, 3, 3 }), ds.randn({ 3 })
    local want = ds.conv2d(x, w, b, { padding = 1 })
    local got = ds.conv2d(x:to('f16'), w:to('f16'), b:to('f16'), { padding = 1 })
    H.assert_close(got:to('f32'), want, { rtol = 1e-2, atol = 2e-2 })
  end)

  it('f64 (im2col) agrees with f32 (oneDNN)', function()
    local x, w, b = ds.randn({ 2, 4, 6, 5 }), ds.randn({ 6, 2, 3, 2 }), ds.randn({ 6 })
    local opts = { stride = { 2, 1 }, padding = { 1, 0 }, dilation = { 1, 2 }, groups = 2 }
    H.assert_close(ds.conv2d(x:double(), w:double(), b:double(), opts):float(), ds.conv2d(x, w, b, opts))
  end)

  it('gradients match finite differences', function()
    H.gradcheck(function(x, w, b) return ds.conv2d(x, w, b, { stride = 2, padding = 1 }) end,
                { f64(2, 2, 5, 5), f64(3, 2, 3, 3), f64(3) })
    H.gradcheck(function(x, w) return ds.conv2d(x, w, { dilation = 2, groups = 2, padding = { 1, 2 } }) end,
                { f64(1, 4, 5, 6), f64(2, 2, 2, 3) })
  end)

  it('an empty batch gives an empty output and zero weight gradients', function()
    local x, w, b = ds.zeros(0, 2, 5, 5):requires_grad_(), ds.randn({ 3, 2, 3, 3 }):requires_grad_(),
                    ds.randn({ 3 }):requires_grad_()
    local y = ds.conv2d(x, w, b, { padding = 1 })
    assert.are.same({ 0, 3, 5, 5 }, y:size())
    y:sum():backward()
    assert.are.same({ 0, 2, 5, 5 }, x.grad:size())
    assert.are.same(0, w.grad:abs():sum():item())
    assert.are.same({ 0, 0, 0 }, b.grad:totable())
  end)

  it('bias only needs its gradient', function()
    local x, w, b = ds.randn({ 2, 2, 4, 4 }), ds.randn({ 3, 2, 3, 3 }), ds.randn({ 3 }):requires_grad_()
    ds.conv2d(x, w, b):sum():backward()
    assert.are.same({ 8, 8, 8 }, b.grad:totable())
  end)

  it('names the op and the shapes when they do not fit', function()
    fails('conv2d: input %[1,3,5,5%] has 3 channels, weight %[4,2,3,3%] with groups=1 takes 2', ds.conv2d,
          ds.zeros(1, 3, 5, 5), ds.zeros(4, 2, 3, 3))
    fails('conv2d: weight %[3,2,3,3%] has 3 output channels, not a multiple of groups=2', ds.conv2d,
          ds.zeros(1, 4, 5, 5), ds.zeros(3, 2, 3, 3), { groups = 2 })
    fails('conv2d: expected an input %[N,C,H,W%], got %[3,5,5%]', ds.conv2d, ds.zeros(3, 5, 5), ds.zeros(4, 3, 3, 3))
    fails('conv2d: input %[1,1,2,2%] with padding 0x0 is smaller than the kernel %[1,1,3,3%]', ds.conv2d,
          ds.zeros(1, 1, 2, 2), ds.zeros(1, 1, 3, 3))
    fails('conv2d: bias %[2%] does not match weight %[4,3,3,3%]', ds.conv2d, ds.zeros(1, 3, 5, 5),
          ds.zeros(4, 3, 3, 3), ds.zeros(2))
    fails('conv2d: stride 0x0', ds.conv2d, ds.zeros(1, 1, 5, 5), ds.zeros(1, 1, 3, 3), { stride = 0 })
    fails("conv2d: unknown option 'strides'", ds.conv2d, ds.zeros(1, 1, 5, 5), ds.zeros(1, 1, 3, 3), { strides = 2 })
    fails('conv2d: padding must be an integer, got 1.5', ds.conv2d, ds.zeros(1, 1, 5, 5), ds.zeros(1, 1, 3, 3),
          { padding = 1.5 })
    fails('conv2d: dtypes f32 and f64 differ', ds.conv2d, ds.zeros(1, 1, 5, 5), ds.zeros({ 1, 1, 3, 3 }, 'f64'))
  end)
end)

describe('pooling', function()
  local function pool(fn) return function(c, x) return fn(x, c.kernel, c.opts) end end
  for _, name in ipairs { 'maxpool_2', 'maxpool_3s2p1', 'maxpool_rect' } do
    it(name .. ' matches PyTorch', function() against_torch(name, pool(ds.max_pool2d)) end)
  end
  for _, name in ipairs { 'avgpool_2', 'avgpool_3s2p1', 'avgpool_exclude_pad', 'avgpool_rect' } do
    it(name .. ' matches PyTorch', function() against_torch(name, pool(ds.avg_pool2d)) end)
  end

  it('gradients match finite differences', function()
    H.gradcheck(function(x) return x:max_pool2d(3, { stride = 2, padding = 1 }) end, { f64(1, 2, 5, 5) })
    H.gradcheck(function(x) return x:avg_pool2d({ 2, 3 }, { stride = 1, padding = { 1, 1 } }) end, { f64(1, 2, 4, 5) })
    H.gradcheck(function(x) return x:avg_pool2d(3, { stride = 2, padding = 1, count_include_pad = false }) end,
                { f64(1, 1, 5, 5) })
  end)

  it('works in bf16', function()
    local x = ds.randn({ 1, 2, 4, 4 })
    H.assert_close(ds.max_pool2d(x:bf16(), 2):float(), ds.max_pool2d(x:bf16():float(), 2))
    H.assert_close(ds.avg_pool2d(x:bf16(), 2):float(), ds.avg_pool2d(x:bf16():float(), 2), H.tol.bf16)
  end)

  it('names the op and the shapes when they do not fit', function()
    fails('max_pool2d: padding 2 is more than half the kernel 3', ds.max_pool2d, ds.zeros(1, 1, 5, 5), 3,
          { padding = 2 })
    fails('avg_pool2d: input %[1,1,2,2%] with padding 0x0 is smaller than the kernel 3x3', ds.avg_pool2d,
          ds.zeros(1, 1, 2, 2), 3)
    fails('max_pool2d: expected an input %[N,C,H,W%], got %[4,4%]', ds.max_pool2d, ds.zeros(4, 4), 2)
    fails('max_pool2d: input %[1,1,0,3%] has an empty spatial dim', ds.max_pool2d, ds.zeros(1, 1, 0, 3), 2,
          { padding = 1 })
    fails('max_pool2d: expected a kernel size', ds.max_pool2d, ds.zeros(1, 1, 4, 4))
    fails("max_pool2d: unknown option 'count_include_pad'", ds.max_pool2d, ds.zeros(1, 1, 4, 4), 2,
          { count_include_pad = false })
    fails('avg_pool2d: kernel must be an integer', ds.avg_pool2d, ds.zeros(1, 1, 4, 4), 'x')
    fails('max_pool2d: needs a floating point input, got i64', ds.max_pool2d, ds.zeros({ 1, 1, 4, 4 }, 'i64'), 2)
  end)
end)
