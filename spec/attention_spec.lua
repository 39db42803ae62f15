local H = require 'helpers'
local ds = H.ds

local F = H.fixture('attention')
local sdpa = ds.scaled_dot_product_attention

-- Runs a fixture case: q, k, v as stored, view maps them to [B,H,T,D];
-- the output and the gradients of the output projected on w, vs PyTorch.
local function against_torch(name, opts, view)
  local c = F[name]
  view = view or function(x) return x end
  local q, k, v = H.tensor(c.q):requires_grad_(), H.tensor(c.k):requires_grad_(), H.tensor(c.v):requires_grad_()
  local out = sdpa(view(q), view(k), view(v), opts)
  H.assert_close(out, H.tensor(c.out), H.tol.f32, name .. ' forward')
  ;(out * H.tensor(c.w)):sum():backward()
  H.assert_close(q.grad, H.tensor(c.gq), H.tol.f32, name .. ' dq')
  H.assert_close(k.grad, H.tensor(c.gk), H.tol.f32, name .. ' dk')
  H.assert_close(v.grad, H.tensor(c.gv), H.tol.f32, name .. ' dv')
end

local function leaf(shape, dtype) return ds.randn(shape, dtype or 'f32'):requires_grad_() end

-- Output and input gradients for a fixed projection of the output.
local function run(q, k, v, opts, w)
  for _, x in ipairs { q, k, v } do x.grad = nil end
  local out = sdpa(q, k, v, opts)
  ;(out * w):sum():backward()
  return out, q.grad, k.grad, v.grad
end

describe('scaled_dot_product_attention', function()
  it('matches PyTorch, causal, T not a multiple of the block', function()
    against_torch('causal')
  end)

  it('matches PyTorch without the mask, Tq ~= Tk and Dv ~= D', function()
    against_torch('cross', { causal = false })
  end)

  it('matches PyTorch with an explicit scale', function()
    against_torch('full_scaled', { causal = false, scale = 0.3 })
  end)

  it('reads non-contiguous inputs: [B,T,H,D] transposed to [B,H,T,D]', function()
    local q = H.tensor(F.transposed.q):transpose(2, 3)
    assert.is_false(q:is_contiguous())
    against_torch('transposed', nil, function(x) return x:transpose(2, 3) end)
  end)

  it('gradients match finite differences in f64', function()
    H.gradcheck(function(q, k, v) return sdpa(q, k, v) end,
                { leaf({ 1, 2, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64') })
    H.gradcheck(function(q, k, v) return sdpa(q, k, v, { causal = false, scale = 0.7 }) end,
                { leaf({ 2, 1, 3, 3 }, 'f64'), leaf({ 2, 1, 4, 3 }, 'f64'), leaf({ 2, 1, 4, 2 }, 'f64') })
  end)

  it('f32 tiles over several blocks agree with the f64 path', function()
    for _, case in ipairs {
      { q = { 1, 2, 150, 8 }, k = { 1, 2, 150, 8 }, v = { 1, 2, 150, 8 } },
      { q = { 2, 1, 130, 8 }, k = { 2, 1, 200, 8 }, v = { 2, 1, 200, 5 }, opts = { causal = false } },
    } do
      local q, k, v = leaf(case.q), leaf(case.k), leaf(case.v)
      local q64, k64, v64 = q:double():detach():requires_grad_(), k:double():detach():requires_grad_(),
                            v:double():detach():requires_grad_()
      local w = ds.randn(case.q[1], case.q[2], case.q[3], case.v[4])
      local o, dq, dk, dv = run(q, k, v, case.opts, w)
      local o64, dq64, dk64, dv64 = run(q64, k64, v64, case.opts, w:double())
      H.assert_close(o, o64, H.tol.f32, 'out')
      H.assert_close(dq, dq64, H.tol.f32, 'dq')
      H.assert_close(dk, dk64, H.tol.f32, 'dk')
      H.assert_close(dv, dv64, H.tol.f32, 'dv')
    end
  end)

  it('is causal: future keys and values do not change earlier outputs', function()
    local T, t = 70, 40
    local q, k, v = ds.randn(2, 2, T, 4), ds.randn(2, 2, T, 4), ds.randn(2, 2, T, 4)
    local k2, v2 = k:clone(), v:clone()
    k2:narrow(3, t + 1, T - t):copy_(ds.randn(2, 2, T - t, 4))
    v2:narrow(3, t + 1, T - t):fill_(100)
    local a, b = sdpa(q, k, v), sdpa(q, k2, v2)
    assert.are.same(a:narrow(3, 1, t):totable(), b:narrow(3, 1, t):totable())
    assert.is_true((a:narrow(3, t + 1, 1) - b:narrow(3, t + 1, 1)):abs():amax():item() > 1)
    -- without the mask they do
    local c = sdpa(q, k, v2, { causal = false })
    assert.is_true((c:narrow(3, 1, 1) - sdpa(q, k, v, { causal = false }):narrow(3, 1, 1)):abs():amax():item() > 1)
  end)

  it('bf16 and f16 compute in f32 and keep their dtype, gradients too', function()
    for _, dt in ipairs { 'bf16', 'f16' } do
      local q, k, v = leaf({ 1, 2, 20, 8 }, dt), leaf({ 1, 2, 20, 8 }, dt), leaf({ 1, 2, 20, 8 }, dt)
      local qf, kf, vf = q:float():detach():requires_grad_(), k:float():detach():requires_grad_(),
                         v:float():detach():requires_grad_()
      local w = ds.randn(1, 2, 20, 8)
      local o, dq, dk, dv = run(q, k, v, nil, w:to(dt))
      local of, dqf, dkf, dvf = run(qf, kf, vf, nil, w:to(dt):float())
      assert.are.equal(dt, o:dtype())
      assert.are.equal(dt, dq:dtype())
      local tol = { rtol = 2e-2, atol = 2e-2 }
      H.assert_close(o:float(), of, tol, dt .. ' out')
      H.assert_close(dq:float(), dqf, tol, dt .. ' dq')
      H.assert_close(dk:float(), dkf, tol, dt .. ' dk')
      H.assert_close(dv:float(), dvf, tol, dt .. ' dv')
    end
  end)

  it('keeps peak memory for T = 1024 far below one T x T matrix (auto is fused on the CPU)', function()
    local T = 1024
    local q, k, v = leaf({ 1, 1, T, 16 }), leaf({ 1, 1, T, 16 }), leaf({ 1, 1, T, 16 })
    collectgarbage()
    collectgarbage()
    local before = ds.memory_stats().current.total
    ds.reset_peak_memory()
    sdpa(q, k, v):sum():backward()
    local used = ds.memory_stats().peak.total - before
    local scores = T * T * 4
    assert(used < scores / 4, string.format('peak %d bytes over the inputs, a T x T f32 matrix is %d', used, scores))
    assert.are.same({ 1, 1, T, 16 }, q.grad:size())
  end)

  it('handles empty batches and query-free cross attention', function()
    assert.are.same({ 0, 2, 4, 3 }, sdpa(ds.zeros(0, 2, 4, 3), ds.zeros(0, 2, 4, 3), ds.zeros(0, 2, 4, 3)):size())
    assert.are.same({ 1, 1, 0, 5 }, sdpa(ds.zeros(1, 1, 0, 3), ds.zeros(1, 1, 2, 3), ds.zeros(1, 1, 2, 5),
                                         { causal = false }):size())
  end)

  it('rejects bad inputs, naming the op, shapes and dtypes', function()
    local function fails(pattern, ...)
      local args = { ... }
      H.fails(pattern, function() return sdpa(unpack(args, 1, 4)) end)
    end
    local a = ds.zeros(2, 3, 5, 4)
    fails('scaled_dot_product_attention: shapes q %[2,3,5,4%], k %[2,3,5,6%], v %[2,3,5,4%] do not fit',
          a, ds.zeros(2, 3, 5, 6), a)
    fails('shapes q %[2,3,5,4%], k %[2,3,5,4%], v %[2,2,5,4%]', a, a, ds.zeros(2, 2, 5, 4))
    fails('shapes q %[2,3,5,4%], k %[2,3,5,4%], v %[2,3,6,4%]', a, a, ds.zeros(2, 3, 6, 4), { causal = false })
    fails('scaled_dot_product_attention: causal attention needs as many queries as keys, got q %[2,3,5,4%] and k %[2,3,7,4%]',
          a, ds.zeros(2, 3, 7, 4), ds.zeros(2, 3, 7, 4))
    fails('scaled_dot_product_attention: q, k, v must share one floating point dtype, got f32, f64, f32',
          a, a:double(), a)
    fails('got i64, i64, i64', a:long(), a:long(), a:long())
    fails('scaled_dot_product_attention: q, k, v must be %[B,H,T,D%], got q %[3,5,4%]',
          ds.zeros(3, 5, 4), ds.zeros(3, 5, 4), ds.zeros(3, 5, 4))
    fails('at least one key, got q %[1,1,2,3%] and k %[1,1,0,3%]', ds.zeros(1, 1, 2, 3), ds.zeros(1, 1, 0, 3),
          ds.zeros(1, 1, 0, 3), { causal = false })
    fails('head dim', ds.zeros(1, 1, 2, 0), ds.zeros(1, 1, 2, 0), ds.zeros(1, 1, 2, 3))
    fails("unknown option 'casual'", a, a, a, { casual = false })
    fails('causal must be a boolean, got number', a, a, a, { causal = 0 })
    fails('scale must be a finite number', a, a, a, { scale = 'big' })
    fails('tensor expected', a, a, nil)
  end)
end)

describe('scaled_dot_product_attention with fewer key/value heads (grouped-query)', function()
  -- k and v [B,KV,T,D] with strides of a projection's heads ([B,T,KV,D] transposed)
  local function heads(B, KV, T, D, dt)
    return ds.randn({ B, T, KV, D }, dt):transpose(2, 3)
  end

  local function leaves(...)
    local r = {}
    for i, x in ipairs { ... } do r[i] = x:detach():clone():requires_grad_() end
    return unpack(r)
  end

  for _, dt in ipairs { 'f32', 'bf16' } do
    for _, causal in ipairs { true, false } do
      for _, G in ipairs { 1, 2, 4, 8 } do
        local name = string.format('%s, %s, %d query heads per kv head', dt, causal and 'causal' or 'not causal', G)
        it('equals repeating k and v then attending, bit for bit: ' .. name, function()
          local B, Hq, T, D = 2, 8, 70, 8    -- T past one 64-row tile
          local KV = Hq / G
          local q, k, v = ds.randn({ B, Hq, T, D }, dt), heads(B, KV, T, D, dt), heads(B, KV, T, D, dt)
          local w = ds.randn({ B, Hq, T, D }, dt)
          local opts = { causal = causal, backend = 'fused' }
          local qa, ka, va = leaves(q, k, v)
          local qb, kb, vb = leaves(q, k, v)
          local oa, dqa, dka, dva = run(qa, ka, va, opts, w)
          local ob = sdpa(qb, kb:repeat_interleave(G, 2), vb:repeat_interleave(G, 2), opts)
          ;(ob * w):sum():backward()
          assert.are.same({ B, KV, T, D }, dka:size())
          H.assert_same(oa, ob, 'out')
          H.assert_same(dqa, qb.grad, 'dq')
          H.assert_same(dka, kb.grad, 'dk')
          H.assert_same(dva, vb.grad, 'dv')
        end)
      end
    end
  end

  it('keeps no repeated copy of k and v: the saved activations shrink by it', function()
    local B, Hq, KV, T, D = 1, 8, 2, 64, 16
    local q, k, v = leaf({ B, Hq, T, D }), leaf({ B, KV, T, D }), leaf({ B, KV, T, D })
    local function held(f)
      collectgarbage()
      collectgarbage()
      local before = ds.memory_stats().current.total
      local out = f()
      local used = ds.memory_stats().current.total - before
      out = nil    -- luacheck: ignore
      collectgarbage()
      collectgarbage()
      return used
    end
    local native = held(function() return sdpa(q, k, v) end)
    local repeated = held(function() return sdpa(q, k:repeat_interleave(4, 2), v:repeat_interleave(4, 2)) end)
    local copies = 2 * B * Hq * T * D * 4
    assert(repeated - native >= copies, string.format('native %d bytes, repeated %d: expected %d fewer', native,
                                                      repeated, copies))
  end)

  it('gradients match finite differences in f64, fused and math', function()
    for _, backend in ipairs { 'fused', 'math' } do
      H.gradcheck(function(q, k, v) return sdpa(q, k, v, { backend = backend }) end,
                  { leaf({ 1, 4, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64') })
      H.gradcheck(function(q, k, v) return sdpa(q, k, v, { causal = false, scale = 0.7, backend = backend }) end,
                  { leaf({ 2, 3, 3, 3 }, 'f64'), leaf({ 2, 1, 4, 3 }, 'f64'), leaf({ 2, 1, 4, 2 }, 'f64') })
    end
  end)

  for _, dt in ipairs { 'f32', 'f64' } do
    it('math equals fused, ' .. dt, function()
      local q, k, v = ds.randn({ 2, 6, 37, 8 }, dt), ds.randn({ 2, 2, 37, 8 }, dt), ds.randn({ 2, 2, 37, 8 }, dt)
      local w = ds.randn({ 2, 6, 37, 8 }, dt)
      local qa, ka, va = leaves(q, k, v)
      local qb, kb, vb = leaves(q, k, v)
      local oa, dqa, dka, dva = run(qa, ka, va, { backend = 'fused' }, w)
      local ob, dqb, dkb, dvb = run(qb, kb, vb, { backend = 'math' }, w)
      H.assert_close(ob, oa, H.tol[dt], 'out')
      H.assert_close(dqb, dqa, H.tol[dt], 'dq')
      H.assert_close(dkb, dka, H.tol[dt], 'dk')
      H.assert_close(dvb, dva, H.tol[dt], 'dv')
    end)
  end

  it('rejects head counts that do not group, naming the shapes', function()
    local q = ds.zeros(2, 6, 5, 4)
    H.fails("scaled_dot_product_attention: q's heads must be a multiple of k and v's %(grouped%-query attention%), "
            .. 'got q %[2,6,5,4%], k %[2,4,5,4%], v %[2,4,5,4%]', sdpa, q, ds.zeros(2, 4, 5, 4), ds.zeros(2, 4, 5, 4))
    H.fails("q's heads must be a multiple of k and v's", sdpa, q, ds.zeros(2, 0, 5, 4), ds.zeros(2, 0, 5, 4))
    H.fails("q's heads must be a multiple of k and v's", sdpa, ds.zeros(2, 2, 5, 4), ds.zeros(2, 4, 5, 4),
            ds.zeros(2, 4, 5, 4))
    H.fails('shapes q %[2,6,5,4%], k %[2,3,5,4%], v %[2,2,5,4%] do not fit q %[B,H,Tq,D%], k %[B,KV,Tk,D%]',
            sdpa, q, ds.zeros(2, 3, 5, 4), ds.zeros(2, 2, 5, 4))
  end)
end)

describe('qkv_attention', function()
  -- The unfused path it replaces: split, heads as [B,H,T,D], attention,
  -- heads merged back into [B,T,C].
  local function unfused(qkv, nh, opts)
    local B, T, C = qkv:size(1), qkv:size(2), qkv:size(3) / 3
    local parts = qkv:split(C, 3)
    local function heads(x) return x:view({ B, T, nh, C / nh }):transpose(2, 3) end
    return sdpa(heads(parts[1]), heads(parts[2]), heads(parts[3]), opts):transpose(2, 3):reshape({ B, T, C })
  end

  it('equals split, attention and merge, output and qkv gradient', function()
    for _, case in ipairs {
      { 2, 37, 3, 4, nil }, { 1, 70, 2, 8, { causal = false, scale = 0.3 } }, { 1, 1, 1, 2, nil },
    } do
      local B, T, nh, D, opts = unpack(case)
      local x = ds.randn({ B, T, 3 * nh * D })
      local w = ds.randn({ B, T, nh * D })
      local a, b = x:clone():requires_grad_(), x:clone():requires_grad_()
      local ya, yb = ds.qkv_attention(a, nh, opts), unfused(b, nh, opts)
      assert.are.same({ B, T, nh * D }, ya:size())
      H.assert_close(ya, yb, H.tol.f32, 'output')
      ;(ya * w):sum():backward()
      ;(yb * w):sum():backward()
      H.assert_close(a.grad, b.grad, H.tol.f32, 'qkv gradient')
    end
  end)

  it('gradients match finite differences in f64', function()
    H.gradcheck(function(qkv) return ds.qkv_attention(qkv, 2) end, { leaf({ 2, 5, 12 }, 'f64') })
    H.gradcheck(function(qkv) return ds.qkv_attention(qkv, 1, { causal = false }) end, { leaf({ 1, 4, 6 }, 'f64') })
  end)

  it('rejects bad inputs, naming the op and the shape', function()
    local function fails(pattern, ...)
      local args = { ... }
      H.fails(pattern, function() return ds.qkv_attention(unpack(args, 1, 3)) end)
    end
    fails('qkv_attention: qkv must be %[B,T,3%*C%] with C divisible by n_head 2, got %[2,5,9%]', ds.zeros(2, 5, 9), 2)
    fails('n_head 0', ds.zeros(2, 5, 12), 0)
    fails('n_head 4611686018427387904', ds.zeros(2, 5, 12), 2 ^ 62)
    fails('got %[5,12%]', ds.zeros(5, 12), 2)
    fails('qkv_attention: qkv must be a floating point tensor, got i64', ds.zeros(2, 5, 12):long(), 2)
    fails("qkv_attention: unknown option 'casual'", ds.zeros(2, 5, 12), 2, { casual = true })
  end)
end)

describe('attention backends', function()
  -- opts with the backend set, the caller's table left alone
  local function with(opts, backend)
    local o = { backend = backend }
    for key, val in pairs(opts or {}) do o[key] = val end
    return o
  end

  local function copies(xs)
    local r = {}
    for i, x in ipairs(xs) do r[i] = x:detach():clone():requires_grad_() end
    return r
  end

  local cases = {
    { 'causal', { 2, 3, 37, 8 }, { 2, 3, 37, 8 }, { 2, 3, 37, 8 }, nil },
    { 'not causal', { 1, 2, 20, 6 }, { 1, 2, 20, 6 }, { 1, 2, 20, 6 }, { causal = false } },
    { 'cross attention, Tq ~= Tk, Dv ~= D', { 2, 1, 5, 4 }, { 2, 1, 70, 4 }, { 2, 1, 70, 3 }, { causal = false } },
    { 'an explicit scale', { 1, 2, 9, 5 }, { 1, 2, 9, 5 }, { 1, 2, 9, 5 }, { scale = 0.3 } },
  }

  for _, dt in ipairs { 'f32', 'f64' } do
    for _, c in ipairs(cases) do
      local name, qs, ks, vs, opts = unpack(c)
      it('scaled_dot_product_attention: math equals fused, ' .. name .. ', ' .. dt, function()
        local q, k, v = ds.randn(qs, dt), ds.randn(ks, dt), ds.randn(vs, dt)
        local w = ds.randn({ qs[1], qs[2], qs[3], vs[4] }, dt)
        local a, b = copies { q, k, v }, copies { q, k, v }
        local oa, dqa, dka, dva = run(a[1], a[2], a[3], with(opts, 'fused'), w)
        local ob, dqb, dkb, dvb = run(b[1], b[2], b[3], with(opts, 'math'), w)
        H.assert_close(ob, oa, H.tol[dt], 'out')
        -- the heads-inner layout: the heads merge with a view, without a copy
        assert.are.same({ qs[1], qs[3], qs[2] * vs[4] }, ob:transpose(2, 3):view({ qs[1], qs[3], -1 }):size())
        H.assert_close(dqb, dqa, H.tol[dt], 'dq')
        H.assert_close(dkb, dka, H.tol[dt], 'dk')
        H.assert_close(dvb, dva, H.tol[dt], 'dv')
      end)
    end

    it('qkv_attention: math equals fused, output and qkv gradient, ' .. dt, function()
      for _, case in ipairs { { 2, 37, 3, 4, nil }, { 1, 20, 2, 8, { causal = false, scale = 0.3 } } } do
        local B, T, nh, D, opts = unpack(case)
        local x = ds.randn({ B, T, 3 * nh * D }, dt)
        local w = ds.randn({ B, T, nh * D }, dt)
        local a, b = x:clone():requires_grad_(), x:clone():requires_grad_()
        local ya, yb = ds.qkv_attention(a, nh, with(opts, 'fused')), ds.qkv_attention(b, nh, with(opts, 'math'))
        assert.are.same(ya:size(), yb:size())
        assert.is_true(yb:is_contiguous())
        H.assert_close(yb, ya, H.tol[dt], 'output')
        ;(ya * w):sum():backward()
        ;(yb * w):sum():backward()
        H.assert_close(b.grad, a.grad, H.tol[dt], 'qkv gradient')
      end
    end)
  end

  it('math gradients match finite differences in f64', function()
    local math_ = { backend = 'math' }
    H.gradcheck(function(q, k, v) return sdpa(q, k, v, math_) end,
                { leaf({ 1, 2, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64'), leaf({ 1, 2, 5, 3 }, 'f64') })
    H.gradcheck(function(q, k, v) return sdpa(q, k, v, { causal = false, scale = 0.7, backend = 'math' }) end,
                { leaf({ 2, 1, 3, 3 }, 'f64'), leaf({ 2, 1, 4, 3 }, 'f64'), leaf({ 2, 1, 4, 2 }, 'f64') })
    H.gradcheck(function(qkv) return ds.qkv_attention(qkv, 2, math_) end, { leaf({ 2, 5, 12 }, 'f64') })
  end)

  it('math runs bf16 and keeps its dtype', function()
    local q, k, v = ds.randn(1, 2, 12, 4, 'bf16'), ds.randn(1, 2, 12, 4, 'bf16'), ds.randn(1, 2, 12, 4, 'bf16')
    local o = sdpa(q, k, v, { backend = 'math' })
    assert.are.equal('bf16', o:dtype())
    H.assert_close(o:float(), sdpa(q:float(), k:float(), v:float()), { rtol = 3e-2, atol = 3e-2 }, 'bf16 math')
  end)

  it('auto is fused on the CPU in every dtype', function()
    for _, dt in ipairs { 'f32', 'f64', 'bf16' } do
      local x = ds.randn({ 1, 2, 4, 8 }, dt):requires_grad_()
      assert.are.equal('scaled_dot_product_attention', sdpa(x, x, x).grad_fn, dt)
      assert.are.equal('permute', sdpa(x, x, x, { backend = 'math' }).grad_fn, dt)
      local qkv = ds.randn({ 1, 4, 24 }, dt):requires_grad_()
      assert.are.equal('qkv_attention', ds.qkv_attention(qkv, 2, { backend = 'auto' }).grad_fn, dt)
    end
  end)

  it('rejects a bad backend, naming the op and the allowed values', function()
    local a = ds.zeros(1, 2, 3, 4)
    H.fails("scaled_dot_product_attention: backend must be 'auto', 'fused' or 'math', got 'flash'",
            sdpa, a, a, a, { backend = 'flash' })
    H.fails("qkv_attention: backend must be 'auto', 'fused' or 'math', got number",
            ds.qkv_attention, ds.zeros(1, 3, 12), 2, { backend = 1 })
    local _, err = pcall(sdpa, a, a, a, { backnd = 'math' })
    assert.matches("unknown option 'backnd' %(expected causal, scale, backend%)", err)
  end)
end)
