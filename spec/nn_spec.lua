local H = require 'helpers'
local ds = H.ds

local F = H.fixture('nn')

-- Runs fixture case `name` through fn(xs, case): the output, then the
-- input gradients of the output projected on the fixture's weights.
local function against_torch(name, n_inputs, fn, tol)
  H.against_torch(F[name], name, function(xs) return fn(xs, F[name]) end, tol, n_inputs)
end

local function f64(...)
  return ds.randn({ ... }, 'f64'):requires_grad_()
end

local fails = H.fails

local function max_diff(a, b)
  return (a:to('f64') - b:to('f64')):abs():amax():item()
end

describe('softmax', function()
  it('over the last dim matches PyTorch', function()
    against_torch('softmax_last', 1, function(x) return x[1]:softmax(-1) end)
  end)
  it('over a middle dim matches PyTorch', function()
    against_torch('softmax_mid', 1, function(x) return x[1]:softmax(2) end)
  end)
  it('over the first dim matches PyTorch', function()
    against_torch('softmax_first', 1, function(x) return ds.softmax(x[1], 1) end)
  end)
  it('stays finite for large logits', function()
    against_torch('softmax_large', 1, function(x) return ds.softmax(x[1], 2) end)
  end)
  it('log_softmax over the last dim matches PyTorch', function()
    against_torch('log_softmax_last', 1, function(x) return x[1]:log_softmax(-1) end)
  end)
  it('log_softmax over the first dim matches PyTorch', function()
    against_torch('log_softmax_first', 1, function(x) return ds.log_softmax(x[1], 1) end)
  end)
  it('log_softmax stays finite for large logits', function()
    against_torch('log_softmax_large', 1, function(x) return x[1]:log_softmax(2) end)
  end)
  it('takes bf16 and returns bf16', function()
    against_torch('softmax_bf16', 1, function(x)
      local y = x[1]:softmax(-1)
      assert.are.equal('bf16', y:dtype())
      return y
    end)
  end)

  it('defaults to the last dim', function()
    local x = ds.randn(3, 4)
    assert.are.equal(0, max_diff(ds.softmax(x), x:softmax(2)))
    assert.are.equal(0, max_diff(ds.log_softmax(x), x:log_softmax(-1)))
  end)

  it('gives masked (-inf) entries exactly 0', function()
    local y = ds.tensor({ { 0, -math.huge, 1 }, { -math.huge, 2, -math.huge } }):softmax(-1)
    local t = y:totable()
    assert.are.equal(0, t[1][2])
    assert.are.same({ 0, 1, 0 }, t[2])
    assert.are.equal(-math.huge, ds.tensor({ 0, -math.huge }):log_softmax(1):totable()[2])
  end)

  it('f32 rows of every length agree with f64 on many threads', function()
    for _, n in ipairs { 1, 3, 17, 64, 1000, 3001 } do
      local x = ds.randn(70, n) * 4
      local ref = x:to('f64'):softmax(-1)
      H.assert_close(x:softmax(-1), ref:to('f32'), { rtol = 2e-5, atol = 1e-7 }, 'softmax n=' .. n)
      H.assert_close(x:log_softmax(-1), x:to('f64'):log_softmax(-1):to('f32'), { rtol = 2e-5, atol = 2e-5 },
                     'log_softmax n=' .. n)
    end
  end)

  it('f16 computes like f32 and returns f16', function()
    local x = ds.randn(5, 33)
    local y = x:to('f16'):softmax(-1)
    assert.are.equal('f16', y:dtype())
    H.assert_close(y, x:to('f16'):to('f32'):softmax(-1), H.tol.f16)
  end)

  it('gradients match finite differences', function()
    H.gradcheck(function(x) return x:softmax(-1) end, { f64(3, 5) })
    H.gradcheck(function(x) return x:softmax(2) end, { f64(2, 3, 4) })
    H.gradcheck(function(x) return x:log_softmax(-1) end, { f64(3, 5) })
    H.gradcheck(function(x) return x:log_softmax(1) end, { f64(3, 2, 2) })
  end)

  it('takes a broadcast incoming gradient: rows of softmax sum to 1, so d sum = 0', function()
    local x = ds.randn(3, 4):requires_grad_()
    x:softmax(-1):sum():backward()
    assert.is_true(x.grad:abs():amax():item() < 1e-6)
  end)

  it('takes a non-contiguous input', function()
    local x = ds.randn(4, 6)
    local t = x:t()
    H.assert_close(t:softmax(2), t:contiguous():softmax(2))
  end)

  it('rejects integer tensors and bad dims', function()
    fails('softmax: input must be a floating point tensor, got i64', ds.softmax, ds.arange(4, 'i64'), 1)
    fails('dim 3 out of range for a 2%-dim tensor', ds.softmax, ds.zeros(2, 3), 3)
  end)
end)

describe('cross_entropy', function()
  local function ce(name, opts)
    against_torch(name, 1, function(x, c) return ds.cross_entropy(x[1], H.tensor(c.target), opts) end)
  end
  for _, red in ipairs { 'mean', 'sum', 'none' } do
    it('reduction ' .. red .. ' with ignored rows matches PyTorch', function()
      ce('ce_' .. red, { reduction = red })
    end)
    it('label smoothing with reduction ' .. red .. ' matches PyTorch', function()
      ce('ce_smooth_' .. red, { reduction = red, label_smoothing = 0.2 })
    end)
  end
  it('a custom ignore_index and i32 targets match PyTorch', function()
    assert.are.equal('i32', H.tensor(F.ce_ignore2.target):dtype())
    ce('ce_ignore2', { ignore_index = 2, label_smoothing = 0.1 })
  end)
  it('takes [B, T, C] logits with [B, T] targets (class dim last)', function()
    ce('ce_btc')
    against_torch('ce_btc_none', 1, function(x, c)
      local l = ds.cross_entropy(x[1], H.tensor(c.target), { reduction = 'none' })
      assert.are.same({ 2, 3 }, l:size())
      return l
    end)
  end)
  it('takes bf16 logits: the loss in f32, as PyTorch\'s autocast gives it, the gradient in bf16', function()
    against_torch('ce_bf16', 1, function(x, c)
      local l = ds.cross_entropy(x[1], H.tensor(c.target))
      assert.are.equal('f32', l:dtype())
      return l
    end, H.tol.bf16)
  end)

  it('a reduced loss over bf16 or f16 keeps f32\'s digits; per row it stays in the input dtype', function()
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      local x = ds.randn(64, 40):to(dt):requires_grad_()
      local y = (ds.rand(64) * 40):to('i64')
      for _, red in ipairs({ 'mean', 'sum' }) do
        local l = ds.cross_entropy(x, y, { reduction = red })
        local want = ds.cross_entropy(x:detach():to('f64'), y, { reduction = red }):item()
        assert.are.equal('f32', l:dtype())
        -- f32 rounding of a sum of 64 terms, far inside one bf16/f16 step of the value
        assert.is_true(math.abs(l:item() - want) <= 1e-5 * math.abs(want), dt .. ' ' .. red)
        x.grad = nil
        l:backward()
        assert.are.equal(dt, x.grad:dtype())
      end
      assert.are.equal(dt, ds.cross_entropy(x, y, { reduction = 'none' }):dtype())
    end
  end)

  it('takes [C] logits with a 0-dim target', function()
    local x = ds.randn(5)
    local l = ds.cross_entropy(x, ds.tensor(3, 'i64'):reshape({}))
    assert.are.equal(0, l:dim())
    H.assert_close(l, -x:log_softmax(1):narrow(1, 4, 1):reshape({}))
  end)

  it('defaults to the mean over all rows', function()
    local x, t = ds.randn(4, 3), ds.tensor({ 0, 2, 1, 1 }, 'i64')
    local none = ds.cross_entropy(x, t, { reduction = 'none' })
    H.assert_close(ds.cross_entropy(x, t), none:mean())
    -- the loss of a row is -log_softmax at its target
    H.assert_close(none:narrow(1, 2, 1):reshape({}), -x:log_softmax(-1):narrow(1, 2, 1):narrow(2, 3, 1):reshape({}))
  end)

  it('gradients match finite differences', function()
    local t = ds.tensor({ 2, -100, 0, 3, 1 }, 'i64')
    for _, opts in ipairs {
      {}, { reduction = 'sum' }, { reduction = 'none' }, { label_smoothing = 0.3 },
    } do
      H.gradcheck(function(x) return ds.cross_entropy(x, t, opts) end, { f64(5, 4) })
    end
    local t3 = ds.tensor({ 2, 3, 0, 3, 1 }, 'i32')
    H.gradcheck(function(x) return ds.cross_entropy(x, t3, { reduction = 'none', label_smoothing = 0.1, ignore_index = 3 }) end,
                { f64(5, 4) })
    local t2 = ds.tensor({ { 1, 0 }, { 2, 2 } }, 'i64')
    H.gradcheck(function(x) return ds.cross_entropy(x, t2, { label_smoothing = 0.2 }) end, { f64(2, 2, 3) })
  end)

  it('a mean over only ignored rows is NaN, as in PyTorch', function()
    local x = ds.randn(2, 3):requires_grad_()
    local l = ds.cross_entropy(x, ds.tensor({ -100, -100 }, 'i64'))
    assert.is_true(l:item() ~= l:item())
    assert.are.equal(0, ds.cross_entropy(x, ds.tensor({ -100, -100 }, 'i64'), { reduction = 'sum' }):item())
  end)

  it('f32 rows agree with f64 for many classes and rows', function()
    local x, t = ds.randn(300, 1000) * 3, (ds.rand(300) * 1000):to('i64')
    local got = ds.cross_entropy(x, t, { reduction = 'none', label_smoothing = 0.1 })
    local ref = ds.cross_entropy(x:to('f64'), t, { reduction = 'none', label_smoothing = 0.1 })
    H.assert_close(got, ref:to('f32'), { rtol = 1e-5, atol = 1e-5 })
    local xg, xd = x:clone():requires_grad_(), x:to('f64'):requires_grad_()
    ds.cross_entropy(xg, t):backward()
    ds.cross_entropy(xd, t):backward()
    H.assert_close(xg.grad, xd.grad:to('f32'), { rtol = 1e-4, atol = 1e-9 })
  end)

  it('counts only the first `classes` columns (a padded vocab): the narrowed logits\' loss, zero gradient past them', function()
    for _, dt in ipairs({ 'f32', 'f64', 'bf16' }) do
      local x, t = (ds.randn(6, 13) * 3):to(dt), ds.tensor({ 0, 9, -100, 4, 8, 1 }, 'i64')
      for _, opts in ipairs({ {}, { label_smoothing = 0.1 }, { reduction = 'none' } }) do
        local xp, xn = x:clone():requires_grad_(), x:narrow(2, 1, 10):contiguous():requires_grad_()
        local o = { classes = 10 }
        for k, v in pairs(opts) do o[k] = v end
        local lp, ln = ds.cross_entropy(xp, t, o), ds.cross_entropy(xn, t, opts)
        assert.are.equal(0, (lp - ln):to('f64'):abs():amax():item(), dt)
        lp:sum():backward()
        ln:sum():backward()
        assert.are.equal(0, (xp.grad:narrow(2, 1, 10) - xn.grad):to('f64'):abs():amax():item(), dt)
        assert.are.equal(0, xp.grad:narrow(2, 11, 3):to('f64'):abs():amax():item(), dt)
      end
    end
    fails('target value 10 at position %(1%) of target %[2%] is out of range %[0, 10%)', ds.cross_entropy, ds.randn(2, 13), ds.tensor({ 10, 0 }, 'i64'), { classes = 10 })
    fails('cross_entropy: classes must be in %[1, 13%]', ds.cross_entropy, ds.randn(2, 13), ds.zeros(2, 'i64'), { classes = 14 })
    fails('cross_entropy: classes must be a positive integer', ds.cross_entropy, ds.randn(2, 13), ds.zeros(2, 'i64'), { classes = 0 })
  end)

  it('names an out-of-range target and its position', function()
    local x = ds.randn(3, 5)
    fails('cross_entropy: target value 7 at position %(2%) of target %[3%] is out of range %[0, 5%) for logits of shape %[3,5%]',
          ds.cross_entropy, x, ds.tensor({ 1, 7, 4 }, 'i64'))
    fails('target value %-1 at position %(3%)', ds.cross_entropy, x, ds.tensor({ 1, 0, -1 }, 'i32'))
    fails('target value 5 at position %(1%)', ds.cross_entropy, x, ds.tensor({ 5, 0, 0 }, 'i64'))
    fails('target value 3 at position %(2,1%) of target %[2,2%] is out of range %[0, 3%) for logits of shape %[2,2,5%]',
          ds.cross_entropy, ds.randn(2, 2, 5), ds.tensor({ { 0, 1 }, { 3, 2 } }, 'i64'), { classes = 3 })
    -- ignore_index is let through wherever it lies, and a bad value is still found after it
    assert.is_true(ds.is_tensor(ds.cross_entropy(x, ds.tensor({ -100, 0, 4 }, 'i64'))))
    fails('target value 9 at position %(3%)', ds.cross_entropy, x, ds.tensor({ 2, -100, 9 }, 'i64'))
    fails('target value %-100 at position %(1%)', ds.cross_entropy, x, ds.tensor({ -100, 1, 2 }, 'i64'),
          { ignore_index = 1 })
    -- an ignore_index past i32's range ignores no i32 target (not one wrapped onto it)
    local t32 = ds.tensor({ 0, 1, 2 }, 'i32')
    H.assert_close(ds.cross_entropy(x, t32, { ignore_index = 2 ^ 32 + 1 }), ds.cross_entropy(x, t32, { ignore_index = -100 }))
  end)

  it('rejects bad shapes, dtypes and options', function()
    local x = ds.randn(3, 5)
    fails('cross_entropy: logits %[3,5%] and target %[4%] do not match', ds.cross_entropy, x, ds.zeros(4, 'i64'))
    fails('cross_entropy: logits %[3,5%] and target %[3,5%] do not match', ds.cross_entropy, x, ds.zeros(3, 5, 'i64'))
    fails('target must hold i64 or i32 class ids, got f32', ds.cross_entropy, x, ds.zeros(3))
    fails('logits must be a floating point tensor, got i64', ds.cross_entropy, ds.zeros(3, 5, 'i64'), ds.zeros(3, 'i64'))
    fails('label_smoothing must be in %[0, 1%], got 1.5', ds.cross_entropy, x, ds.zeros(3, 'i64'), { label_smoothing = 1.5 })
    fails("reduction must be 'mean', 'sum' or 'none', got 'avg'", ds.cross_entropy, x, ds.zeros(3, 'i64'), { reduction = 'avg' })
    fails("unknown option 'smoothing'", ds.cross_entropy, x, ds.zeros(3, 'i64'), { smoothing = 0.1 })
    fails('ignore_index must be an integer', ds.cross_entropy, x, ds.zeros(3, 'i64'), { ignore_index = 0.5 })
    fails('cross_entropy: logits need a class dim', ds.cross_entropy, ds.zeros({}), ds.zeros({}, 'i64'))
    fails('expected', ds.cross_entropy, x)
  end)
end)

describe('mse_loss', function()
  for _, red in ipairs { 'mean', 'sum', 'none' } do
    it('reduction ' .. red .. ' matches PyTorch', function()
      against_torch('mse_' .. red, 2, function(x) return ds.mse_loss(x[1], x[2], red) end)
    end)
  end
  it('a reduced loss over bf16 or f16 is computed and returned in f32, the gradients in the input dtype', function()
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      local a, b = ds.randn(50, 30):to(dt):requires_grad_(), ds.randn(50, 30):to(dt)
      for _, red in ipairs({ 'mean', 'sum' }) do
        local l = ds.mse_loss(a, b, red)
        local want = ds.mse_loss(a:detach():to('f64'), b:to('f64'), red):item()
        assert.are.equal('f32', l:dtype())
        assert.is_true(math.abs(l:item() - want) <= 1e-5 * math.abs(want), dt .. ' ' .. red)
        a.grad = nil
        l:backward()
        assert.are.equal(dt, a.grad:dtype())
      end
      assert.are.equal(dt, ds.mse_loss(a, b, 'none'):dtype())
    end
  end)
  it('gradients match finite differences, broadcast included', function()
    H.gradcheck(function(a, b) return ds.mse_loss(a, b) end, { f64(3, 4), f64(3, 4) })
    H.gradcheck(function(a, b) return ds.mse_loss(a, b, 'none') end, { f64(3, 4), f64(4) })
  end)
  it('rejects bad reductions and shapes, naming mse_loss', function()
    fails("mse_loss: reduction must be 'mean', 'sum' or 'none', got 'max'", ds.mse_loss, ds.zeros(2), ds.zeros(2), 'max')
    fails('mse_loss: shapes %[2,3%] and %[4%] do not broadcast', ds.mse_loss, ds.zeros(2, 3), ds.zeros(4))
    fails('mse_loss: target must be a floating point tensor', ds.mse_loss, ds.zeros(2), ds.zeros(2, 'i64'))
  end)
end)

describe('layer_norm', function()
  it('with weight and bias matches PyTorch', function()
    against_torch('ln_wb', 3, function(x) return ds.layer_norm(x[1], x[2], x[3]) end)
  end)
  it('over the last dim of a 3-d input matches PyTorch', function()
    against_torch('ln_3d', 3, function(x) return ds.layer_norm(x[1], x[2], x[3]) end)
  end)
  it('without weight and bias matches PyTorch', function()
    against_torch('ln_plain', 1, function(x) return ds.layer_norm(x[1], nil, nil) end)
  end)
  it('with weight only and another eps matches PyTorch', function()
    against_torch('ln_weight_only', 2, function(x) return ds.layer_norm(x[1], x[2], nil, 1e-3) end)
  end)
  it('over the dims of a 2-d weight matches PyTorch', function()
    against_torch('ln_2dims', 3, function(x) return ds.layer_norm(x[1], x[2], x[3]) end)
  end)
  it('takes the torch.nn.functional form with normalized_shape', function()
    against_torch('ln_2dims', 3, function(x) return ds.layer_norm(x[1], { 3, 4 }, x[2], x[3], 1e-5) end)
    against_torch('ln_wb', 3, function(x) return ds.layer_norm(x[1], 6, x[2], x[3]) end)
    local x = ds.randn(2, 3, 4)
    H.assert_close(ds.layer_norm(x, { 3, 4 }), ds.layer_norm(x, ds.ones(3, 4), nil))
    fails('layer_norm: normalized_shape %[4,3%] does not match the last dims of input %[2,3,4%]',
          ds.layer_norm, x, { 4, 3 })
  end)
  it('takes bf16 and returns bf16', function()
    against_torch('ln_bf16', 3, function(x)
      local y = ds.layer_norm(x[1], x[2], x[3])
      assert.are.equal('bf16', y:dtype())
      return y
    end, { rtol = 1.6e-2, atol = 3e-2 })
  end)

  it('gradients match finite differences', function()
    H.gradcheck(function(x, w, b) return ds.layer_norm(x, w, b) end, { f64(3, 5), f64(5), f64(5) })
    H.gradcheck(function(x) return ds.layer_norm(x, nil, nil, 1e-3) end, { f64(2, 4) })
    H.gradcheck(function(x, w, b) return ds.layer_norm(x, w, b) end, { f64(2, 2, 3), f64(2, 3), f64(2, 3) })
    H.gradcheck(function(x, b) return ds.layer_norm(x, nil, b) end, { f64(3, 4), f64(4) })
  end)

  it('only computes the gradients asked for', function()
    local x, w = ds.randn(3, 4):requires_grad_(), ds.randn(4)
    ds.layer_norm(x, w, ds.zeros(4)):sum():backward()
    assert.is_nil(w.grad)
    assert.are.same({ 3, 4 }, x.grad:size())
  end)

  it('f32 rows agree with f64 at transformer sizes', function()
    local x, w, b = ds.randn(130, 768) * 2 + 1, ds.randn(768), ds.randn(768)
    local xs, ws, bs = x:clone():requires_grad_(), w:clone():requires_grad_(), b:clone():requires_grad_()
    local xd, wd, bd = x:to('f64'):requires_grad_(), w:to('f64'):requires_grad_(), b:to('f64'):requires_grad_()
    local g = ds.randn(130, 768)
    local y, yd = ds.layer_norm(xs, ws, bs), ds.layer_norm(xd, wd, bd)
    H.assert_close(y, yd:to('f32'), { rtol = 1e-4, atol = 1e-4 })
    ;(y * g):sum():backward()
    ;(yd * g:to('f64')):sum():backward()
    H.assert_close(xs.grad, xd.grad:to('f32'), { rtol = 1e-3, atol = 1e-3 })
    H.assert_close(ws.grad, wd.grad:to('f32'), { rtol = 1e-3, atol = 1e-3 })
    H.assert_close(bs.grad, bd.grad:to('f32'), { rtol = 1e-4, atol = 1e-4 })
  end)

  it('rejects parameters that do not match the input', function()
    fails('layer_norm: weight of shape %[5%] does not match the last dims of input %[3,4%]',
          ds.layer_norm, ds.zeros(3, 4), ds.ones(5), nil)
    fails('layer_norm: bias of shape %[3%] does not match the last dims of input %[3,4%]',
          ds.layer_norm, ds.zeros(3, 4), ds.ones(4), ds.zeros(3))
    fails('layer_norm: cannot normalise the last 3 dims of an input of shape %[3,4%]',
          ds.layer_norm, ds.zeros(3, 4), ds.ones(2, 3, 4), nil)
    fails('layer_norm: input must be a floating point tensor, got i32', ds.layer_norm, ds.zeros(3, 4, 'i32'))
    fails('layer_norm: weight must be a floating point tensor', ds.layer_norm, ds.zeros(3, 4), ds.zeros(4, 'i64'))
    fails('layer_norm: eps must be >= 0', ds.layer_norm, ds.zeros(3, 4), nil, nil, -1)
  end)
end)

-- The residual norms, each with the unfused pair it replaces: y = norm(x
-- + res), and x + res. call(fused, x, r, shape, p, eps): shape nil or the
-- torch form's normalized_shape, p the norm's parameters (w, b or w).
local function residual_norm(name, module, fused_norm, norm, n_params)
  local function unfused(a, b, ...)
    local s = a + b
    return norm(s, ...), s
  end
  local function call(fused, x, r, shape, p, eps)
    local args, n = { x, r }, 2
    if shape then n = n + 1; args[n] = shape end
    for i = 1, n_params do args[n + i] = p[i] end
    n = n + n_params + 1
    args[n] = eps
    return (fused and fused_norm or unfused)(unpack(args, 1, n))
  end
  return { name = name, module = module, n_params = n_params, call = call }
end

local RESIDUAL_NORMS = {
  residual_norm('add_layer_norm', ds.nn.LayerNorm, ds.add_layer_norm, ds.layer_norm, 2),
  residual_norm('add_rms_norm', ds.nn.RMSNorm, ds.add_rms_norm, ds.rms_norm, 1),
}

for _, case in ipairs(RESIDUAL_NORMS) do
  describe(case.name, function()
    local function fused(x, r, shape, p, eps) return case.call(true, x, r, shape, p, eps) end

    it('gradients match finite differences, the sum used after the norm or not at all', function()
      local function params(...)
        local p = {}
        for i = 1, case.n_params do p[i] = f64(...) end
        return p
      end
      local p5, p23 = params(5), params(2, 3)
      H.gradcheck(function(x, r, ...)
        local y, s = fused(x, r, nil, { ... })
        return s + y:tanh()          -- the sum's gradient is there before the norm's backward runs
      end, { f64(3, 5), f64(3, 5), unpack(p5) })
      H.gradcheck(function(x, r) return (fused(x, r, nil, {}, 1e-3)) end, { f64(2, 4), f64(2, 4) })
      H.gradcheck(function(x, r, ...)
        local y, s = fused(x, r, { 2, 3 }, { ... })
        return y * s
      end, { f64(2, 2, 3), f64(2, 2, 3), unpack(p23) })
    end)

    it('gives the unfused add and norm exactly, forward and backward, in f32 and bf16', function()
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        local function leaf(...) return ds.randn({ ... }):to(dt):requires_grad_() end
        local x, r, p = leaf(6, 7, 40), leaf(6, 7, 40), { leaf(40), leaf(40) }
        p[case.n_params + 1] = nil
        local g1, g2 = ds.randn(6, 7, 40):to(dt), ds.randn(6, 7, 40):to(dt)
        local function run(is_fused)
          local all = { x, r, unpack(p) }
          for _, t in ipairs(all) do t.grad = nil end
          local y, s = case.call(is_fused, x, r, nil, p, 1e-5)
          ;(y * g1 + (s * g2):tanh()):sum():backward()
          local out = { y, s }
          for _, t in ipairs(all) do out[#out + 1] = t.grad end
          return out
        end
        local got, want = run(true), run(false)
        assert.are.equal(#want, #got)
        for i = 1, #want do
          assert.are.equal(dt, got[i]:dtype())
          assert.are.same(want[i]:to('f64'):totable(), got[i]:to('f64'):totable(), dt .. ' result ' .. i)
        end
      end
    end)

    it('is the norm module given the residual, and the pair (norm, x) given false', function()
      local norm = case.module(8)
      local x, r = ds.randn(3, 8), ds.randn(3, 8)
      local y, s = norm(x, r)
      assert.are.same((x + r):totable(), s:totable())
      assert.are.same(norm(x + r):totable(), y:totable())
      local y2, same = norm(x, false)
      assert.are.same(norm(x):totable(), y2:totable())
      assert.are.equal(x, same)
      assert.are.equal(1, select('#', norm(x)))
    end)

    it('refuses a residual of another shape or dtype, and parameters that do not match', function()
      local n = case.name
      local function call(...) return fused(...) end
      fails(n .. ': residual f32 %[3,5%] does not match input f32 %[3,4%] %(same shape and dtype%)',
            call, ds.zeros(3, 4), ds.zeros(3, 5), nil, {})
      fails(n .. ': residual f64 %[3,4%] does not match input f32 %[3,4%]',
            call, ds.zeros(3, 4), ds.zeros(3, 4, 'f64'), nil, {})
      fails(n .. ': weight of shape %[5%] does not match the last dims of input %[3,4%]',
            call, ds.zeros(3, 4), ds.zeros(3, 4), nil, { ds.ones(5) })
      fails(n .. ': normalized_shape %[3%] does not match the last dims of input %[3,4%]',
            call, ds.zeros(3, 4), ds.zeros(3, 4), 3, {})
    end)
  end)
end

describe('rope', function()
  -- Hugging Face's rotate_half form, composed of the ops ds.rope replaces
  local function composed(x, cos, sin)
    local h = x:split(x:size(x:dim()) / 2, x:dim())
    return x * cos + ds.cat({ -h[2], h[1] }, x:dim()) * sin
  end

  it('gradients match finite differences', function()
    local cos, sin = ds.randn({ 3, 6 }, 'f64'), ds.randn({ 3, 6 }, 'f64')
    H.gradcheck(function(x) return ds.rope(x, cos, sin) end, { f64(2, 3, 6) })
    H.gradcheck(function(x) return ds.rope(x:transpose(1, 2), cos, sin) end, { f64(3, 3, 6) })
  end)

  it('gives the composed ops exactly, forward and backward, of a transposed input, in f32, bf16 and f16', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
      local base = ds.randn(2, 5, 3, 8):to(dt)
      local cos, sin, g = ds.randn(5, 8):to(dt), ds.randn(5, 8):to(dt), ds.randn(2, 3, 5, 8):to(dt)
      local function run(fn)
        local x = base:detach():requires_grad_()
        local y = fn(x:transpose(2, 3), cos, sin)
        y:backward(g)
        return y, x.grad
      end
      local y1, g1 = run(composed)
      local y2, g2 = run(ds.rope)
      assert.are.equal(dt, y2:dtype())
      -- the bits, a zero's sign included
      assert.are.same(y1:to('f64'):totable(), y2:to('f64'):totable(), dt)
      assert.are.same((1 / g1:to('f64')):totable(), (1 / g2:to('f64')):totable(), dt .. ' gradient')
    end
  end)

  it('refuses an odd last dim, tables of another dtype or shape, and tables that need a gradient', function()
    local x, t = ds.zeros(2, 4), ds.zeros(2, 4)
    fails('rope: the last dim of input %[2,3%] must be even', ds.rope, ds.zeros(2, 3), ds.zeros(2, 3), ds.zeros(2, 3))
    fails('rope: cos f64 and sin f32 must be the input\'s dtype f32', ds.rope, x, ds.zeros(2, 4, 'f64'), t)
    fails('rope: cos %[2,4%] and sin %[4%] differ in shape', ds.rope, x, t, ds.zeros(4))
    fails('rope: cos and sin %[3,4%] do not broadcast to the input %[2,4%]', ds.rope, x, ds.zeros(3, 4), ds.zeros(3, 4))
    fails('rope: cos and sin are tables and take no gradient', ds.rope, x, ds.zeros(2, 4):requires_grad_(), t)
    fails('rope: input must be a floating point tensor', ds.rope, ds.zeros(2, 4, 'i64'), t, t)
  end)
end)

describe('swiglu', function()
  -- Unit roundoff of each dtype (u), of the type the forward computes in
  -- (c: f32 for f32/bf16/f16, f64 for f64), and half the spacing of the
  -- dtype's subnormals (eta: the most a result rounded into that range loses).
  local U = { f32 = 2 ^ -24, bf16 = 2 ^ -8, f16 = 2 ^ -11, f64 = 2 ^ -53 }
  local C = { f32 = 2 ^ -24, bf16 = 2 ^ -24, f16 = 2 ^ -24, f64 = 2 ^ -53 }
  local ETA = { f32 = 2 ^ -150, bf16 = 2 ^ -134, f16 = 2 ^ -25, f64 = 2 ^ -1075 }

  -- Every element of got within bound of ref (f64 tensors of one shape).
  local function within(got, ref, bound, what)
    local over = (got:to('f64') - ref):abs() - bound
    local worst = over:amax():item()
    assert(worst <= 0, string.format('%s: exceeds its bound by %.3g', what, worst))
  end

  -- silu(g) u and its gradients from d in f64, from the inputs as stored (bf16 and f16 widen exactly)
  local function reference(g, u, d)
    g, u, d = g:to('f64'), u:to('f64'), d and d:to('f64')
    local s = ds.sigmoid(g)
    local y = g * s * u
    if not d then return y end
    return y, d * u * s * (1 + g * (1 - s)), d * g * s
  end

  it('gradients match finite differences, both inputs, transposed and contiguous', function()
    H.gradcheck(ds.swiglu, { f64(3, 5), f64(3, 5) })
    H.gradcheck(function(g, u) return ds.swiglu(g:t(), u) end, { f64(4, 3), f64(3, 4) })
  end)

  -- Forward: SiLU as x / (1 + e^-x) in the compute type c, exp within 2 ulp
  -- (4c relative; CUDA's expf documents 2 ulp, glibc's under 1), the sum
  -- with 1 adding c (5c), the division c (6c), the product with up c
  -- (7c), then one rounding to the dtype (u; for f32 it is the product's
  -- own): |y - ref| <= (u + 8c) |ref| + eta, 8c covering the second-order
  -- terms. Backward in f64, rounded to the dtype (bf16 and f16 through
  -- f32, as ds_store rounds: u + 2^-24 of |ref|, where f32's is u): the
  -- f64 sums err by a few units of 2^-53 of |d u| (1 + |g|) and |d g|
  -- (1 - s has an absolute error, not a relative one), so 2^-48 of those
  -- bounds both them and the reference's own; plus eta. Inputs of
  -- moderate size: no intermediate leaves the normal range.
  for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
    it(dt .. ': values and gradients against f64 within the rounding bound, strided and contiguous', function()
      ds.manual_seed(3)
      for _, strided in ipairs({ true, false }) do
        local g = strided and (ds.randn(6, 40, 'f64') * 3):to(dt):t():requires_grad_()   -- [40, 6], strided
                  or (ds.randn(40, 6, 'f64') * 3):to(dt):requires_grad_()
        local u = (ds.randn(40, 6, 'f64') * 3):to(dt):requires_grad_()
        local d = ds.randn(40, 6, 'f64'):to(dt)
        local y = ds.swiglu(g, u)
        assert.are.equal(dt, y:dtype())
        y:backward(d)
        local ry, rdg, rdu = reference(g:detach(), u:detach(), d)
        local what = dt .. (strided and ' strided' or ' contiguous')
        within(y, ry, ry:abs() * (U[dt] + 8 * C[dt]) + ETA[dt], what .. ' value')
        local g64, u64, d64 = g:detach():to('f64'), u:detach():to('f64'), d:to('f64')
        local r = U[dt] + (U[dt] > 2 ^ -24 and 2 ^ -24 or 0)
        within(g.grad, rdg, rdg:abs() * r + (d64 * u64):abs() * (1 + g64:abs()) * 2 ^ -48 + ETA[dt],
               what .. ' gate gradient')
        within(u.grad, rdu, rdu:abs() * r + (d64 * g64):abs() * 2 ^ -48 + ETA[dt], what .. ' up gradient')
        assert.are.equal(dt, g.grad:dtype())
      end
    end)
  end

  it('f32 forward gives silu then mul to the bit (the same f32 SiLU, one product)', function()
    local g, u = ds.randn(7, 33) * 4, ds.randn(7, 33)
    assert.are.same((ds.silu(g) * u):totable(), ds.swiglu(g, u):totable())
  end)

  it('gives only the gradient asked for: none for a constant up', function()
    local g, u = ds.randn(4, 6):requires_grad_(), ds.randn(4, 6)
    local y = ds.swiglu(g, u)
    y:backward(ds.ones(4, 6))
    assert.is_nil(u.grad)
    local _, want = reference(g:detach(), u, ds.ones(4, 6))
    within(g.grad, want, want:abs() * U.f32 + (u:to('f64')):abs() * (1 + g:detach():to('f64'):abs()) * 2 ^ -48,
           'gate gradient')
  end)

  it('refuses another shape (no broadcast), another dtype and integer inputs, naming them', function()
    fails('swiglu: gate f32 %[2,3%] and up f32 %[3%] must share shape and dtype %(no broadcast%)', ds.swiglu,
          ds.zeros(2, 3), ds.zeros(3))
    fails('swiglu: gate f32 %[2,3%] and up bf16 %[2,3%] must share shape and dtype', ds.swiglu, ds.zeros(2, 3),
          ds.zeros(2, 3, 'bf16'))
    fails('swiglu: gate must be a floating point tensor, got i64', ds.swiglu, ds.zeros(2, 3, 'i64'), ds.zeros(2, 3))
    fails('swiglu: up must be a floating point tensor, got i64', ds.swiglu, ds.zeros(2, 3), ds.zeros(2, 3, 'i64'))
  end)
end)

describe('rms_norm', function()
  it('with a weight matches the float64 reference', function()
    against_torch('rms_w', 2, function(x) return ds.rms_norm(x[1], x[2], 1e-6) end)
  end)
  it('default eps is the f32 machine epsilon', function()
    against_torch('rms_default_eps', 2, function(x) return ds.rms_norm(x[1], x[2]) end)
    against_torch('rms_tiny', 2, function(x) return ds.rms_norm(x[1], x[2]) end)
  end)
  it('without a weight matches the float64 reference', function()
    against_torch('rms_plain', 1, function(x) return ds.rms_norm(x[1], nil) end)
  end)
  it('over the dims of a 2-d weight matches the float64 reference', function()
    against_torch('rms_2dims', 2, function(x) return ds.rms_norm(x[1], x[2], 1e-5) end)
  end)

  it('takes the torch.nn.functional form with normalized_shape', function()
    against_torch('rms_2dims', 2, function(x) return ds.rms_norm(x[1], { 3, 4 }, x[2], 1e-5) end)
    against_torch('rms_plain', 1, function(x) return ds.rms_norm(x[1], { 5 }) end)
    fails('rms_norm: normalized_shape %[6%] does not match the last dims of input %[2,4%]',
          ds.rms_norm, ds.zeros(2, 4), 6)
  end)

  it('gradients match finite differences', function()
    H.gradcheck(function(x, w) return ds.rms_norm(x, w, 1e-6) end, { f64(3, 5), f64(5) })
    H.gradcheck(function(x) return ds.rms_norm(x) end, { f64(2, 4) })
    H.gradcheck(function(x, w) return ds.rms_norm(x, w) end, { f64(2, 2, 3), f64(2, 3) })
  end)

  it('f32 and bf16 agree with f64', function()
    local x, w = ds.randn(100, 512), ds.randn(512)
    local ref = ds.rms_norm(x:to('f64'), w:to('f64'), 1e-6)
    H.assert_close(ds.rms_norm(x, w, 1e-6), ref:to('f32'), { rtol = 1e-4, atol = 1e-5 })
    local yb = ds.rms_norm(x:to('bf16'), w:to('bf16'), 1e-6)
    assert.are.equal('bf16', yb:dtype())
    H.assert_close(yb, ds.rms_norm(x:to('bf16'):to('f64'), w:to('bf16'):to('f64'), 1e-6), { rtol = 1e-2, atol = 1e-2 })
    local xs, xd = x:clone():requires_grad_(), x:to('f64'):requires_grad_()
    local ws, wd = w:clone():requires_grad_(), w:to('f64'):requires_grad_()
    local g = ds.randn(100, 512)
    ;(ds.rms_norm(xs, ws) * g):sum():backward()
    ;(ds.rms_norm(xd, wd, 1.1920928955078125e-07) * g:to('f64')):sum():backward()
    H.assert_close(xs.grad, xd.grad:to('f32'), { rtol = 1e-3, atol = 1e-3 })
    H.assert_close(ws.grad, wd.grad:to('f32'), { rtol = 1e-3, atol = 1e-3 })
  end)

  it('rejects a weight that does not match', function()
    fails('rms_norm: weight of shape %[3%] does not match the last dims of input %[2,4%]',
          ds.rms_norm, ds.zeros(2, 4), ds.ones(3))
    fails('rms_norm: input must be a floating point tensor', ds.rms_norm, ds.zeros(2, 4, 'i64'))
  end)
end)

describe('dropout', function()
  it('the same seed gives the same mask', function()
    local x = ds.randn(1000)
    ds.manual_seed(7)
    local a = ds.dropout(x, 0.3)
    ds.manual_seed(7)
    local b = ds.dropout(x, 0.3)
    local c = ds.dropout(x, 0.3)
    assert.are.equal(0, max_diff(a, b))
    assert.is_true(max_diff(b, c) > 0, 'a second draw gives another mask')
  end)

  it('keeps 1-p of the elements, scaled by 1/(1-p), and preserves the mean', function()
    local p, n = 0.25, 200000
    ds.manual_seed(3)
    local y = ds.dropout(ds.ones(n), p)
    local kept = y:gt(0):to('f64'):sum():item()
    assert.is_true(math.abs(kept / n - (1 - p)) < 0.005, 'kept fraction ' .. kept / n)
    H.assert_close(y:amax(), ds.tensor(1 / (1 - p)))
    assert.are.equal(0, y:amin():item())
    assert.is_true(math.abs(y:to('f64'):mean():item() - 1) < 0.01)
    H.assert_close(y:gt(0):to('f32'):sum(), ds.tensor(kept))
  end)

  it('the mask does not depend on the thread count', function()
    local threads = ds.num_threads()
    local x = ds.randn(300, 1001)
    ds.num_threads(1)
    ds.manual_seed(11)
    local a = ds.dropout(x, 0.5)
    ds.num_threads(2)
    ds.manual_seed(11)
    local b = ds.dropout(x, 0.5)
    ds.num_threads(threads)
    assert.are.equal(0, max_diff(a, b))
  end)

  it('backward multiplies by the same mask', function()
    local x = ds.randn(50, 40):requires_grad_()
    local g = ds.randn(50, 40)
    local y = ds.dropout(x, 0.4)
    ;(y * g):sum():backward()
    local mask = y:detach():ne(0):to('f32') / 0.6
    H.assert_close(x.grad, g * mask)
    H.assert_close(y, x:detach() * mask)
  end)

  it('is the identity for p = 0 or when not training; p = 1 gives zeros', function()
    local x = ds.randn(4, 5):requires_grad_()
    assert.are.equal(0, max_diff(ds.dropout(x, 0), x))
    assert.are.equal(0, max_diff(ds.dropout(x, 0.9, false), x))
    local z = ds.dropout(x, 1)
    assert.are.equal(0, z:abs():amax():item())
    z:sum():backward()
    assert.are.equal(0, x.grad:abs():amax():item())
  end)

  it('bf16 and f64 draw the same mask as f32', function()
    local x = ds.ones(999)
    ds.manual_seed(5)
    local a = ds.dropout(x, 0.5)
    ds.manual_seed(5)
    local b = ds.dropout(x:to('bf16'), 0.5)
    ds.manual_seed(5)
    local c = ds.dropout(x:to('f64'), 0.5)
    assert.are.equal('bf16', b:dtype())
    assert.are.equal(0, max_diff(a, b))
    assert.are.equal(0, max_diff(a, c))
  end)

  it('rejects p outside [0, 1] and integer inputs', function()
    fails('dropout: probability must be in %[0, 1%], got 1.5', ds.dropout, ds.ones(3), 1.5)
    fails('dropout: probability must be in %[0, 1%], got %-0.1', ds.dropout, ds.ones(3), -0.1)
    fails('dropout: probability must be in %[0, 1%], got %-?nan', ds.dropout, ds.ones(3), 0 / 0)
    fails('dropout: input must be a floating point tensor', ds.dropout, ds.ones(3, 'i64'), 0.5)
  end)
end)

describe('nn ops on empty tensors', function()
  it('return empty results without touching memory', function()
    assert.are.same({ 0, 5 }, ds.zeros(0, 5):softmax(-1):size())
    assert.are.same({ 3, 0 }, ds.zeros(3, 0):log_softmax(2):size())
    assert.are.same({ 0, 4 }, ds.layer_norm(ds.zeros(0, 4), ds.ones(4), ds.zeros(4)):size())
    assert.are.same({ 0, 4 }, ds.rms_norm(ds.zeros(0, 4), ds.ones(4)):size())
    assert.are.same({ 0 }, ds.dropout(ds.zeros(0), 0.5):size())
    assert.are.same({ 0 }, ds.cross_entropy(ds.zeros(0, 4), ds.zeros(0, 'i64'), { reduction = 'none' }):size())
    fails('target value 0 at position %(1%) of target %[2%] is out of range %[0, 0%)', ds.cross_entropy, ds.zeros(2, 0), ds.zeros(2, 'i64'))
  end)
end)
