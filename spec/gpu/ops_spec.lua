-- Every op of the tensor API on the GPU against the CPU on the same inputs:
-- the outputs, then the gradient of every floating point input after one
-- backward from fixed random weights, in f32, bf16, f16 and f64 (integer
-- dtypes where an op takes them). Needs a GPU: `build/dslua /usr/bin/busted
-- --run=gpu`, or name this file; without one each block says
-- "skipped: no CUDA device". DSLUA_OPS_SPEC_ON_CPU=1 puts a second CPU copy
-- in the GPU's place, which checks the spec itself on any machine.
local H = require 'helpers'
local ds = H.ds

local ON_CPU = os.getenv('DSLUA_OPS_SPEC_ON_CPU') == '1'
local has_cuda = H.has_cuda or function()
  return ds.cuda ~= nil and ds.cuda.is_available ~= nil and ds.cuda.is_available()
end
local skip = not ON_CPU and not has_cuda()

-- GPU against CPU on the same inputs. Both sides round every element the
-- same way; they differ in summation order (cuBLASLt, cuDNN and tree
-- reductions against OpenBLAS, oneDNN and sequential loops), in f64 exp and
-- log (libdevice against glibc, both within an ulp), in bf16/f16 rows that
-- the CPU sums in f64 and the GPU in f32, and so, for bf16/f16, in a
-- rounding that lands on the other side now and then: a few units in the
-- last place of the dtype. TF32 stays off.
local TOL = {
  f64 = { rtol = 1e-10, atol = 1e-12 },
  f32 = { rtol = 1e-4, atol = 1e-5 },
  bf16 = { rtol = 2e-2, atol = 2e-2 },
  f16 = { rtol = 4e-3, atol = 4e-3 },
  i64 = { rtol = 0, atol = 0 },
  i32 = { rtol = 0, atol = 0 },
}
local FLOATS = { 'f32', 'bf16', 'f16', 'f64' }
local INTS = { 'i64', 'i32' }

local function to_dev(x) if ON_CPU then return x:clone() end return x:cuda() end
local function to_host(x) if ON_CPU then return x end return x:cpu() end
local function on_dev(x) return ON_CPU or x:device():match('^cuda') ~= nil end

local function is_float(x)
  local d = x:dtype()
  return d == 'f32' or d == 'f64' or d == 'bf16' or d == 'f16'
end

-- Random inputs, drawn in f32 and rounded once to dt, so both devices see
-- the same values.
local function randn(dt, ...) return ds.randn({ ... }, 'f32'):to(dt) end
local function positive(dt, ...) return (ds.rand({ ... }, 'f32') * 2 + 0.25):to(dt) end
local function ints(dt, lo, hi, ...)
  return (ds.rand({ ... }, 'f32') * (hi - lo + 1) + lo):to('f64'):to('i64'):to(dt)
end
local function index(values, dt) return ds.tensor(values, dt or 'i64') end

local function pack(...) return { n = select('#', ...), ... } end

-- Runs fn on CPU copies of inputs and on GPU copies, compares every tensor
-- it returns, then backward from the first output (projected on random
-- weights) and compares the gradients. Float inputs need grad unless
-- opts.grad is false or opts.const[i] is set.
local function same(name, dt, fn, inputs, opts)
  opts = opts or {}
  local tol = opts.tol or TOL[dt]
  local cin, gin = {}, {}
  for i, x in ipairs(inputs) do
    local c, g = x:detach():clone(), to_dev(x:detach())
    if is_float(x) and opts.grad ~= false and not (opts.const and opts.const[i]) then
      c:requires_grad_()
      g:requires_grad_()
    end
    cin[i], gin[i] = c, g
  end
  local what = name .. ' ' .. dt
  local cout, gout = pack(fn(unpack(cin))), pack(fn(unpack(gin)))
  assert(cout.n == gout.n, what .. ': different numbers of results')
  for j = 1, cout.n do
    local c, g = cout[j], gout[j]
    if ds.is_tensor(c) then
      assert(on_dev(g), what .. ': result ' .. j .. ' is on ' .. g:device())
      assert(g:dtype() == c:dtype(), what .. ': result ' .. j .. ' is ' .. g:dtype() .. ', expected ' .. c:dtype())
      H.assert_close(to_host(g), c, tol, what .. ' result ' .. j)
    else
      assert(c == g, what .. ': result ' .. j .. ' differs')
    end
  end
  local y = cout[1]
  if opts.grad == false or not (ds.is_tensor(y) and is_float(y) and y.requires_grad) then return end
  local w = ds.randn(y:size(), 'f32'):to(y:dtype())
  ;(y * w):sum():backward()
  ;(gout[1] * to_dev(w)):sum():backward()
  for i, c in ipairs(cin) do
    if c.requires_grad then
      assert((c.grad == nil) == (gin[i].grad == nil), what .. ': only one device has a gradient for input ' .. i)
      if c.grad then
        assert(on_dev(gin[i].grad), what .. ': the gradient of input ' .. i .. ' is on ' .. gin[i].grad:device())
        H.assert_close(to_host(gin[i].grad), c.grad, tol, what .. ' gradient of input ' .. i)
      end
    end
  end
end

-- One `it` per dtype: make(dt) returns fn, inputs [, opts].
local function each(dtypes, name, make)
  for _, dt in ipairs(dtypes) do
    it(name .. ' ' .. dt, function()
      ds.manual_seed(17)
      local fn, inputs, opts = make(dt)
      same(name, dt, fn, inputs, opts)
    end)
  end
end

describe('elementwise ops on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  for _, op in ipairs { 'add', 'sub', 'mul', 'div', 'maximum', 'minimum' } do
    each(FLOATS, op .. ' (broadcast)', function(dt)
      return function(a, b) return ds[op](a, b) end, { randn(dt, 3, 4, 5), positive(dt, 4, 1) }
    end)
    each(FLOATS, op .. ' (strided views)', function(dt)
      return function(a, b) return ds[op](a:transpose(1, 3), b:narrow(3, 2, 5)) end,
             { randn(dt, 5, 4, 3), positive(dt, 3, 4, 7) }
    end)
    each(INTS, op, function(dt)
      local b = op == 'div' and ints(dt, 1, 9, 4, 1) or ints(dt, -9, 9, 4, 1)
      return function(x, y) return ds[op](x, y) end, { ints(dt, -20, 20, 3, 4, 5), b }
    end)
  end
  each(FLOATS, 'pow (tensor exponent)', function(dt)
    return function(a, b) return ds.pow(a, b) end, { positive(dt, 4, 6), randn(dt, 6) }
  end)
  each(FLOATS, 'scalar operands', function(dt)
    return function(a) return ((a + 2.5) * 0.5 - 3) / 1.5 + (1 - a) end, { randn(dt, 7, 9) }
  end)
  for _, op in ipairs { 'eq', 'ne', 'lt', 'le', 'gt', 'ge' } do
    each(FLOATS, op, function(dt)
      return function(a, b) return ds[op](a, ds.where(a:gt(0), a, b)) end, { randn(dt, 6, 7), randn(dt, 6, 7) },
             { grad = false }
    end)
    each(INTS, op, function(dt)
      return function(a, b) return ds[op](a, b) end, { ints(dt, -3, 3, 6, 7), ints(dt, -3, 3, 7) }
    end)
  end
  each(FLOATS, 'where', function(dt)
    return function(c, a, b) return ds.where(c, a, b) end,
           { randn('f32', 4, 5):gt(0), randn(dt, 4, 5), randn(dt, 5) }
  end)
  local unary = {
    neg = randn, exp = randn, tanh = randn, sigmoid = randn, abs = randn, relu = randn, silu = randn,
    log = positive, sqrt = positive, rsqrt = positive,
  }
  for op, gen in pairs(unary) do
    each(FLOATS, op, function(dt) return function(x) return x[op](x) end, { gen(dt, 5, 6, 7) } end)
  end
  each(FLOATS, 'gelu (erf)', function(dt) return function(x) return x:gelu() end, { randn(dt, 300) } end)
  each(FLOATS, 'gelu (tanh)', function(dt) return function(x) return x:gelu('tanh') end, { randn(dt, 300) } end)
  each(FLOATS, 'pow (scalar exponents)', function(dt)
    return function(x) return x:pow(3) + x:pow(0.5) + x:pow(-1.5) end, { positive(dt, 40, 3) }
  end)
  each(FLOATS, 'exp of a large tensor', function(dt) return function(x) return x:exp() end, { randn(dt, 70001) } end)
  each(FLOATS, 'in-place add_, sub_, mul_, div_, fill_, copy_', function(dt)
    return function(a, b)
      local t = a:clone()
      t:add_(b):mul_(2):sub_(a):div_(3)
      local u = a:clone():fill_(0)
      u:narrow(2, 2, 3):fill_(7)
      u:narrow(1, 1, 2):copy_(t:narrow(1, 1, 2))
      return t, u
    end, { randn(dt, 4, 5), randn(dt, 5) }, { grad = false }
  end)
  -- The float fast path (contiguous f32/bf16/f16, a chunk of 16 elements
  -- a thread, a bias row or one value broadcast) against the strided one.
  each(FLOATS, 'add, mul, div of contiguous tensors (16 at a time, 8 over)', function(dt)
    return function(a, b) return (a + b) * a / (b:abs() + 1) end, { randn(dt, 37, 24), randn(dt, 37, 24) }
  end)
  each(FLOATS, 'add and sub of contiguous tensors with a tail (n % 16 ~= 0)', function(dt)
    return function(a, b) return a + b - a * 0.5 end, { randn(dt, 1001), randn(dt, 1001) }
  end)
  each(FLOATS, 'bias add [N, C] + [C], C a multiple of 8 and not', function(dt)
    return function(a, w, b, v) return a + w, b + v, w + a end,
           { randn(dt, 33, 64), randn(dt, 64), randn(dt, 33, 13), randn(dt, 13) }
  end)
  each(FLOATS, 'bias add with rows of 24 (words of 8 in chunks of 16 across rows)', function(dt)
    return function(a, w) return a * w + w end, { randn(dt, 33, 24), randn(dt, 24) }
  end)
  each(FLOATS, 'misaligned contiguous views (one element in)', function(dt)
    return function(a, b) return a:narrow(1, 2, 999) + b:narrow(1, 1, 999), a:narrow(1, 2, 999):tanh() end,
           { randn(dt, 1001), randn(dt, 1001) }
  end)
  each(FLOATS, 'gelu (tanh) of long rows, forward and backward', function(dt)
    return function(x) return x:gelu('tanh') end, { randn(dt, 64, 3 * 8 + 40) * 3 }
  end)
  each(FLOATS, 'tanh and sigmoid backward (16 at a time)', function(dt)
    return function(x) return x:tanh() + x:sigmoid() end, { randn(dt, 40, 16) }
  end)
  for _, n in ipairs { 4096, 4099 } do
    each({ 'f32', 'bf16', 'f16' }, 'casts of ' .. n .. ' contiguous elements', function(dt)
      return function(x) return x:to('f32'), x:to('bf16'), x:to('f16') end, { randn(dt, n) * 100 }
    end)
  end
  for _, from in ipairs(FLOATS) do
    each(FLOATS, 'to from ' .. from, function(dt)
      return function(x) return x:to(dt) * 1 end, { randn(from, 9, 11):transpose(1, 2) }
    end)
  end
  each(INTS, 'to and from integers', function(dt)
    return function(x) return x:to('f32'), x:to('f64'):to(dt), x:to('u8'), x:to('bool') end,
           { ints(dt, 0, 200, 50) }
  end)
end)

describe('shape ops on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  each(FLOATS, 'view, reshape, transpose, permute, narrow, squeeze, unsqueeze, contiguous, clone', function(dt)
    return function(x)
      local y = x:permute(3, 1, 2):contiguous():view(4, 6, 5):narrow(3, 2, 3):transpose(1, 2):reshape(6, 12)
      return y:unsqueeze(2):squeeze(2):clone() * 1.5
    end, { randn(dt, 2, 3, 4, 5):view(6, 5, 4) }
  end)
  -- strided copies whose rows are whole 16-byte words go a word a thread
  each(FLOATS, 'contiguous of transposed heads [B, T, H, D] (rows of 16-byte words) and of narrowed rows', function(dt)
    return function(x)
      return x:transpose(2, 3):contiguous(), x:narrow(4, 2, 15):transpose(2, 3):contiguous(),
             x:narrow(4, 1, 8):contiguous()
    end, { randn(dt, 2, 5, 3, 16) }
  end)
  each(INTS, 'contiguous of transposed heads', function(dt)
    return function(x) return x:transpose(1, 2):contiguous() end, { ints(dt, -99, 99, 6, 4, 8) }
  end)
end)

describe('reductions on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  for _, op in ipairs { 'sum', 'mean', 'amax', 'amin' } do
    each(FLOATS, op .. ' over all', function(dt) return function(x) return x[op](x) end, { randn(dt, 5, 7, 9) } end)
    each(FLOATS, op .. ' over dims', function(dt)
      return function(x) return x[op](x, { 1, 3 }), x[op](x, 2, true) end, { randn(dt, 5, 7, 9) }
    end)
    each(FLOATS, op .. ' of long rows', function(dt)
      return function(x) return x[op](x, 2) end, { randn(dt, 3, 5000) }
    end)
    each(FLOATS, op .. ' of a strided view', function(dt)
      return function(x) return x:transpose(1, 2)[op](x:transpose(1, 2), 1) end, { randn(dt, 6, 1100) }
    end)
  end
  each(FLOATS, 'sum of many elements', function(dt) return function(x) return x:sum() end, { randn(dt, 100003) } end)
  -- column sums with 8 neighbouring outputs a thread (inner a multiple of 8), short and long lines
  each(FLOATS, 'sum and mean over rows of 8-multiple columns', function(dt)
    return function(x, y) return x:sum(1), x:mean(1, true), y:sum(2), y:sum(1) end,
           { randn(dt, 300, 264), randn(dt, 3, 5000, 16) }
  end)
  for _, op in ipairs { 'sum', 'amax', 'amin' } do
    each(INTS, op, function(dt)
      return function(x) return x[op](x), x[op](x, 2) end, { ints(dt, -1000, 1000, 9, 333) }
    end)
  end
  for _, op in ipairs { 'argmax', 'argmin' } do
    each(FLOATS, op, function(dt)
      return function(x) return x[op](x), x[op](x, 2), x[op](x, 1, true) end, { randn(dt, 7, 300) }
    end)
  end
  each(FLOATS, 'var', function(dt)
    return function(x) return x:var(2), x:var({ 1, 2 }, 0, true) end, { randn(dt, 6, 50) }
  end)
  for _, p in ipairs { 1, 2, 3, math.huge } do
    each(FLOATS, 'norm p=' .. p, function(dt)
      return function(x) return x:norm(p, 2) end, { randn(dt, 6, 50) }
    end)
  end
end)

describe('matrix products on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  -- a [5,7] matrix with no unit stride, which BLAS cannot read in place
  local function unstrided(x) return x:narrow(3, 2, 1):squeeze(3) end

  each(FLOATS, 'mm', function(dt)
    return function(a, b) return ds.mm(a, b) end, { randn(dt, 5, 7), randn(dt, 7, 3) }
  end)
  each(FLOATS, 'mm of transposed views', function(dt)
    return function(a, b) return ds.mm(a:t(), b:t()) end, { randn(dt, 7, 5), randn(dt, 3, 7) }
  end)
  each(FLOATS, 'mm of views with no unit stride', function(dt)
    return function(a, b) return ds.mm(unstrided(a), unstrided(b):t()) end, { randn(dt, 5, 7, 2), randn(dt, 5, 7, 2) }
  end)
  each(FLOATS, 'mm of a larger product', function(dt)
    return function(a, b) return ds.mm(a, b) end, { randn(dt, 96, 80), randn(dt, 80, 112) }
  end)
  each(FLOATS, 'mm with an empty inner dim', function(dt)
    return function(a, b) return ds.mm(a, b) end, { randn(dt, 4, 0), randn(dt, 0, 3) }
  end)
  each(FLOATS, 'bmm', function(dt)
    return function(a, b) return ds.bmm(a, b) end, { randn(dt, 4, 5, 6), randn(dt, 4, 6, 3) }
  end)
  each(FLOATS, 'bmm of transposed batches', function(dt)
    return function(a, b) return ds.bmm(a:transpose(2, 3), b:transpose(1, 2)) end,
           { randn(dt, 4, 6, 5), randn(dt, 6, 4, 3) }
  end)
  each(FLOATS, 'matmul with a broadcast matrix', function(dt)
    return function(a, b) return ds.matmul(a, b) end, { randn(dt, 2, 3, 4, 5), randn(dt, 5, 6) }
  end)
  each(FLOATS, 'matmul with broadcast batch dims', function(dt)
    return function(a, b) return ds.matmul(a, b) end, { randn(dt, 3, 1, 4, 5), randn(dt, 2, 5, 6) }
  end)
  each(FLOATS, 'matmul of vectors', function(dt)
    return function(a, b, c) return ds.matmul(a, b), ds.matmul(b:t(), a), ds.matmul(c, a) end,
           { randn(dt, 5), randn(dt, 5, 3), randn(dt, 2, 4, 5) }
  end)
  each(FLOATS, 'matmul of a non-contiguous batch', function(dt)
    return function(a, b) return ds.matmul(a:permute(2, 1, 3, 4), b) end,
           { randn(dt, 3, 2, 4, 5), randn(dt, 2, 3, 5, 6) }
  end)
  each(FLOATS, 'linear', function(dt)
    return function(x, w, b) return ds.linear(x, w, b) end, { randn(dt, 2, 3, 7), randn(dt, 4, 7), randn(dt, 4) }
  end)
  -- the bias in cuBLASLt's epilogue, and copied first where the epilogue does not take it
  each(FLOATS, 'linear with bias of training shapes', function(dt)
    return function(x, w, b) return ds.linear(x, w, b) end, { randn(dt, 4, 16, 64), randn(dt, 48, 64), randn(dt, 48) }
  end)
  each(FLOATS, 'linear with a misaligned bias view and a strided input', function(dt)
    return function(x, w, b) return ds.linear(x:transpose(1, 2), w, b:narrow(1, 2, 24)) end,
           { randn(dt, 32, 5), randn(dt, 24, 32), randn(dt, 25) }
  end)
  each(FLOATS, 'linear without bias', function(dt)
    return function(x, w) return ds.linear(x, w) end, { randn(dt, 6, 7), randn(dt, 4, 7) }
  end)
end)

describe('gelu_mlp on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  -- The tanh form in bf16 fuses its GELU into cuBLASLt's epilogues where
  -- the hidden rows are a multiple of 8 elements (3072); 3070, f32 and the
  -- erf form run the composed kernels. Sums over 8192 rows, and a GELU the fused
  -- path takes from the f32 accumulator where the CPU takes it from the
  -- rounded pre-activation, put each tensor's error on its scale: the
  -- file's tolerances against each tensor's largest element.
  local function close(got, want, tol, what)
    local scale = want:to('f64'):abs():amax():item()
    local err = (got:to('f64') - want:to('f64')):abs():amax():item()
    assert(err <= tol.atol + tol.rtol * scale,
           string.format('%s: off by %.3g, scale %.3g (atol %g, rtol %g)', what, err, scale, tol.atol, tol.rtol))
  end

  -- gelu_mlp on the CPU and the GPU from the same inputs, x [lead..., 64];
  -- nobias leaves b1 and b2 out, need lists the inputs needing grad
  local function check(name, dt, how, lead, hidden, nobias, need)
    ds.manual_seed(23)
    local in_f, out_f = 64, 48
    local xs = { unpack(lead) }
    xs[#xs + 1] = in_f
    local inputs = { randn(dt, unpack(xs)), (ds.randn({ hidden, in_f }) / math.sqrt(in_f)):to(dt),
                     not nobias and randn(dt, hidden), (ds.randn({ out_f, hidden }) / math.sqrt(hidden)):to(dt),
                     not nobias and randn(dt, out_f) }
    local function run(move)
      local t = {}
      for k = 1, 5 do
        t[k] = inputs[k] and move(inputs[k])
        if t[k] and need[k] then t[k]:requires_grad_() end
      end
      local y = ds.gelu_mlp(t[1], t[2], t[3] or nil, t[4], t[5] or nil, { approximate = how })
      ds.manual_seed(29)
      ;(y * move(ds.randn(y:size(), 'f32'):to(dt))):sum():backward()
      return y, t
    end
    local yc, tc = run(function(x) return x:clone() end)
    local yg, tg = run(to_dev)
    assert(on_dev(yg), name .. ': the output left the GPU')
    assert.are.equal(dt, yg:dtype())
    close(to_host(yg), yc, TOL[dt], name .. ' output')
    for k = 1, 5 do
      if tc[k] and need[k] then
        assert(on_dev(tg[k].grad), name .. ': gradient ' .. k .. ' left the GPU')
        close(to_host(tg[k].grad), tc[k].grad, TOL[dt], name .. ' gradient of input ' .. k)
      elseif tg[k] then
        assert(tg[k].grad == nil, name .. ': input ' .. k .. ' got a gradient it does not need')
      end
    end
  end

  local ALL = { true, true, true, true, true }
  for _, dt in ipairs { 'f32', 'bf16' } do
    for _, how in ipairs { 'tanh', 'none' } do
      for _, rows in ipairs { 8192, 37 } do
        for _, hidden in ipairs { 3072, 3070 } do
          local name = string.format('gelu_mlp %s, approximate %s, %d rows, hidden %d', dt, how, rows, hidden)
          it(name, function() check(name, dt, how, { rows }, hidden, false, ALL) end)
        end
      end
    end
    -- the epilogues without a bias (GELU_AUX forward, DGELU backward), 3-D x
    it('gelu_mlp ' .. dt .. ' without biases, 3-D x', function()
      check('no biases', dt, 'tanh', { 4, 64 }, 512, true, ALL)
    end)
    it('gelu_mlp ' .. dt .. ' with only x and w1 needing grad', function()
      check('x and w1', dt, 'tanh', { 4, 64 }, 512, false, { true, true })
    end)
  end
end)

describe('convolution and pooling on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  local cases = {
    { 'plain', { 2, 4, 9, 8 }, { 6, 4, 3, 3 }, {} },
    { 'stride and padding', { 2, 4, 9, 8 }, { 6, 4, 3, 3 }, { stride = 2, padding = 1 } },
    { 'dilation and groups', { 2, 4, 9, 8 }, { 6, 2, 3, 2 }, { dilation = { 2, 1 }, groups = 2, padding = { 1, 2 } } },
    { 'depthwise', { 3, 4, 7, 7 }, { 4, 1, 3, 3 }, { groups = 4, padding = 1 } },
    { '1x1', { 2, 8, 5, 6 }, { 3, 8, 1, 1 }, {} },
  }
  for _, c in ipairs(cases) do
    local name, xs, ws, opts = c[1], c[2], c[3], c[4]
    each(FLOATS, 'conv2d ' .. name, function(dt)
      return function(x, w, b) return ds.conv2d(x, w, b, opts) end,
             { randn(dt, unpack(xs)), randn(dt, unpack(ws)), randn(dt, ws[1]) }
    end)
    each(FLOATS, 'conv2d ' .. name .. ' without bias', function(dt)
      return function(x, w) return ds.conv2d(x, w, opts) end, { randn(dt, unpack(xs)), randn(dt, unpack(ws)) }
    end)
  end
  local pools = {
    { 'kernel 2', 2, nil },
    { 'overlapping windows', 3, { stride = 2, padding = 1 } },
    { 'uneven kernel', { 2, 3 }, { stride = 1, padding = { 1, 1 } } },
  }
  for _, c in ipairs(pools) do
    each(FLOATS, 'max_pool2d ' .. c[1], function(dt)
      return function(x) return x:max_pool2d(c[2], c[3]) end, { randn(dt, 2, 3, 9, 8) }
    end)
    each(FLOATS, 'avg_pool2d ' .. c[1], function(dt)
      return function(x) return x:avg_pool2d(c[2], c[3]) end, { randn(dt, 2, 3, 9, 8) }
    end)
  end
  each(FLOATS, 'avg_pool2d without padding in the count', function(dt)
    return function(x) return x:avg_pool2d(3, { stride = 2, padding = 1, count_include_pad = false }) end,
           { randn(dt, 2, 3, 9, 8) }
  end)
end)

describe('index ops on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  for _, it_dt in ipairs(INTS) do
    each(FLOATS, 'index_select with ' .. it_dt .. ' indices', function(dt)
      return function(x, i) return x:index_select(2, i), x:index_select(1, i:narrow(1, 2, 3)) end,
             { randn(dt, 3, 6, 4), index({ 5, 0, 2, 2, 5 }, it_dt) }
    end)
    each(FLOATS, 'gather with ' .. it_dt .. ' indices', function(dt)
      return function(x, i) return x:gather(2, i) end,
             { randn(dt, 3, 5, 2),
               index({ { { 0, 1 }, { 4, 4 } }, { { 2, 2 }, { 3, 0 } }, { { 1, 0 }, { 0, 1 } } }, it_dt) }
    end)
    each(FLOATS, 'scatter_add with ' .. it_dt .. ' indices', function(dt)
      return function(x, i, s) return ds.scatter_add(x, 1, i, s) end,
             { randn(dt, 4, 3), index({ { 0, 3, 3 }, { 3, 1, 0 }, { 0, 0, 2 } }, it_dt), randn(dt, 3, 3) }
    end)
    each(FLOATS, 'embedding with ' .. it_dt .. ' ids', function(dt)
      return function(w, i) return ds.embedding(w, i) end,
             { randn(dt, 7, 5), index({ { 1, 6, 1 }, { 0, 1, 3 } }, it_dt) }
    end)
  end
  each(FLOATS, 'embedding of many repeated ids', function(dt)
    return function(w, i) return ds.embedding(w, i) end, { randn(dt, 50, 16), ints('i64', 0, 49, 4000) }
  end)
  each(FLOATS, 'cat and stack', function(dt)
    return function(a, b) return ds.cat({ a, b:t() }, 2), ds.stack({ a, a * 2 }, 2) end,
           { randn(dt, 3, 4), randn(dt, 5, 3) }
  end)
  each(FLOATS, 'split and chunk', function(dt)
    return function(x)
      local s, c = x:split(2, 2), x:chunk(2, 1)
      return s[1] * 1, s[2], s[3], c[1], c[2]
    end, { randn(dt, 4, 5) }
  end)
  -- A GPU's range check is not waited for: the call returns, and the first
  -- read back (or ds.cuda.synchronize) raises the check's own message.
  local function fails_by_next_sync(pattern, call, sync)
    local ok, err = pcall(call)
    if not ON_CPU then
      assert(ok, err)
      ok, err = pcall(sync, err)
      pattern = pattern .. '.*%(checked on cuda:0, reported at the first synchronisation after%)'
    end
    assert.is_false(ok)
    assert.matches(pattern, tostring(err))
  end
  it('reports an index out of range at the next synchronisation, and carries on', function()
    local w = to_dev(ds.randn(10, 3))
    local bad = to_dev(ds.tensor({ { 0, 1 }, { 12, 3 } }, 'i64'))
    local out
    fails_by_next_sync('embedding: ids value 12 at position %(2,1%) of ids %[2,2%] is out of range '
                       .. '%[0, 10%) for weight of shape %[10,3%]',
                       function() out = ds.embedding(w, bad) end, function() return out:sum():item() end)
    fails_by_next_sync('gather: index value %-1 at position %(1,2%)',
                       function() out = w:gather(2, to_dev(ds.tensor({ { 0, -1 } }, 'i64'))) end,
                       function() return ds.cuda.synchronize() end)
    local x, t = to_dev(ds.randn(3, 5)), to_dev(ds.tensor({ 1, 7, -100 }, 'i64'))
    fails_by_next_sync('cross_entropy: target value 7 at position %(2%) of target %[3%]',
                       function() out = ds.cross_entropy(x, t) end, function() return out:item() end)
    -- only the first of several bad calls is reported, and nothing after
    if not ON_CPU then
      ds.embedding(w, bad)
      ds.embedding(w, to_dev(ds.tensor({ 99 }, 'i64')))
      local ok, err = pcall(ds.cuda.synchronize)
      assert.is_false(ok)
      assert.matches('ids value 12 at', err)
      ds.cuda.synchronize()
    end
    local good = ds.embedding(w, to_dev(ds.tensor({ 2, 9 }, 'i64')))
    H.assert_close(to_host(good), to_host(w):index_select(1, ds.tensor({ 2, 9 }, 'i64')))
    -- many calls with no read back between them stay checked
    for _ = 1, 150 do ds.embedding(w, to_dev(ds.tensor({ 0, 9 }, 'i64'))) end
    assert.are.same({ 2, 3 }, to_host(ds.embedding(w, to_dev(ds.tensor({ 0, 9 }, 'i64')))):size())
  end)
  each(INTS, 'index_select, gather, cat of integers', function(dt)
    return function(x, i, j) return x:index_select(2, i), x:gather(2, j), ds.cat({ x, x }, 1) end,
           { ints(dt, -50, 50, 4, 6), index({ 3, 0, 5 }), index({ { 1, 5 }, { 0, 0 }, { 2, 3 }, { 4, 1 } }) }
  end)
end)

describe('nn row ops on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  for _, op in ipairs { 'softmax', 'log_softmax' } do
    -- rows of 64, 768 and 1024 take the warp path (a row in registers)
    for _, c in ipairs { { 'the last dim', -1, { 5, 33 } }, { 'a middle dim', 2, { 3, 7, 4 } },
                         { 'long rows', 2, { 3, 5000 } }, { 'rows of 64', -1, { 6, 64 } },
                         { 'rows of 768', -1, { 4, 768 } }, { 'rows of 1024', -1, { 2, 3, 1024 } } } do
      each(FLOATS, op .. ' over ' .. c[1], function(dt)
        return function(x) return x[op](x, c[2]) end, { randn(dt, unpack(c[3])) }
      end)
    end
    -- causal attention's scores: -inf above the diagonal
    each(FLOATS, op .. ' of masked rows of 1024', function(dt)
      local hidden = ds.arange(0, 1024):view(1, 1024):gt(ds.arange(0, 4):view(4, 1) * 300)
      local mask = ds.where(hidden, ds.zeros({ 4, 1024 }) - math.huge, 0):to(dt)
      return function(x, m) return (x + m)[op](x + m, -1) end, { randn(dt, 4, 1024), mask }, { const = { false, true } }
    end)
  end
  for _, opts in ipairs {
    {}, { reduction = 'sum' }, { reduction = 'none' }, { label_smoothing = 0.2 },
    { ignore_index = 3, label_smoothing = 0.1, reduction = 'none' },
  } do
    local name = 'cross_entropy ' .. (opts.reduction or 'mean') .. (opts.label_smoothing and ' smoothed' or '')
                 .. (opts.ignore_index and ' ignoring 3' or '')
    for _, it_dt in ipairs(INTS) do
      each(FLOATS, name .. ' (' .. it_dt .. ' targets)', function(dt)
        local targets = opts.ignore_index and { 2, 3, 0, 3, 1, 4 } or { 2, -100, 0, 3, 1, 3 }
        return function(x, t) return ds.cross_entropy(x, t, opts) end, { randn(dt, 6, 5), index(targets, it_dt) }
      end)
    end
  end
  each(FLOATS, 'cross_entropy of [B,T,C] logits', function(dt)
    return function(x, t) return ds.cross_entropy(x, t) end, { randn(dt, 2, 3, 4), index({ { 1, 0, 3 }, { 0, 2, 1 } }) }
  end)
  each(FLOATS, 'cross_entropy of many classes', function(dt)
    return function(x, t) return ds.cross_entropy(x, t) end, { randn(dt, 4, 3000), index({ 5, 2999, 0, 1234 }) }
  end)
  each(FLOATS, 'cross_entropy of many classes, not a multiple of 8', function(dt)
    return function(x, t) return ds.cross_entropy(x, t, { label_smoothing = 0.1 }) end,
           { randn(dt, 4, 3001) * 4, index({ 5, 3000, 0, 1234 }) }
  end)
  -- a padded vocab (classes): 8 a load when the row length is a multiple of 8
  for _, c in ipairs { { 72, 67 }, { 70, 65 }, { 50304, 50257 } } do
    each(FLOATS, 'cross_entropy of ' .. c[2] .. ' classes in rows of ' .. c[1], function(dt)
      local rows = c[1] > 1000 and 4 or 6
      local t = { 2, -100, c[2] - 1, 0, 7, 1 }
      return function(x, tt) return ds.cross_entropy(x, tt, { classes = c[2], label_smoothing = 0.1 }) end,
             { randn(dt, rows, c[1]) * 3, index({ unpack(t, 1, rows) }) }
    end)
  end
  for _, red in ipairs { 'mean', 'sum', 'none' } do
    each(FLOATS, 'mse_loss ' .. red, function(dt)
      return function(a, b) return ds.mse_loss(a, b, red) end, { randn(dt, 4, 6), randn(dt, 4, 6) }
    end)
  end
  each(FLOATS, 'layer_norm', function(dt)
    return function(x, w, b) return ds.layer_norm(x, w, b) end, { randn(dt, 3, 4, 20), randn(dt, 20), randn(dt, 20) }
  end)
  each(FLOATS, 'layer_norm over two dims, weight only', function(dt)
    return function(x, w) return ds.layer_norm(x, { 4, 20 }, w, nil, 1e-3) end,
           { randn(dt, 3, 4, 20), randn(dt, 4, 20) }
  end)
  each(FLOATS, 'layer_norm without affine of long rows', function(dt)
    return function(x) return ds.layer_norm(x, nil, nil) end, { randn(dt, 3, 4000) }
  end)
  each(FLOATS, 'layer_norm of GPT-2 rows (a warp a row, 8 at a time)', function(dt)
    return function(x, w, b) return ds.layer_norm(x, w, b) end, { randn(dt, 2, 37, 768) * 2 + 1, randn(dt, 768), randn(dt, 768) }
  end)
  each(FLOATS, 'layer_norm of a misaligned view, weight only', function(dt)
    return function(x, w) return ds.layer_norm(x:narrow(2, 2, 64), w, nil) end, { randn(dt, 9, 65), randn(dt, 64) }
  end)
  -- the sum used after the norm: its gradient is folded into the norm's backward kernel
  local function add_norm(x, r, w, b)
    local y, s = ds.add_layer_norm(x, r, w, b)
    return s + y, y, s
  end
  each(FLOATS, 'add_layer_norm of GPT-2 rows (a warp a row, 8 at a time)', function(dt)
    return add_norm, { randn(dt, 2, 37, 768) * 2 + 1, randn(dt, 2, 37, 768), randn(dt, 768), randn(dt, 768) }
  end)
  each(FLOATS, 'add_layer_norm of rows not a multiple of 8 (a block a row)', function(dt)
    return add_norm, { randn(dt, 5, 3, 20), randn(dt, 5, 3, 20), randn(dt, 20), randn(dt, 20) }
  end)
  each(FLOATS, 'rms_norm of rows of 8 (the warp kernels)', function(dt)
    return function(x, w) return ds.rms_norm(x, w, 1e-6) end, { randn(dt, 50, 8), randn(dt, 8) }
  end)
  each(FLOATS, 'rms_norm', function(dt)
    return function(x, w) return ds.rms_norm(x, w, 1e-6) end, { randn(dt, 5, 24), randn(dt, 24) }
  end)
  each(FLOATS, 'rms_norm without weight of long rows', function(dt)
    return function(x) return ds.rms_norm(x, { 3000 }, nil) end, { randn(dt, 2, 3000) }
  end)
  each(FLOATS, 'add_rms_norm of rows of 8 (the warp kernels)', function(dt)
    return function(x, r, w)
      local y, s = ds.add_rms_norm(x, r, w, 1e-6)
      return s + y, y, s
    end, { randn(dt, 50, 8), randn(dt, 50, 8), randn(dt, 8) }
  end)
  each(FLOATS, 'repeat_interleave of a transposed input (repeat_kv)', function(dt)
    return function(x) return x:transpose(2, 3):repeat_interleave(3, 2) end, { randn(dt, 2, 5, 2, 8) }
  end)
  each(FLOATS, 'rope of a transposed input (the rotary tables constant)', function(dt)
    return function(x, c, s) return ds.rope(x:transpose(2, 3), c, s) end,
           { randn(dt, 2, 7, 3, 16), randn(dt, 7, 16), randn(dt, 7, 16) }, { const = { false, true, true } }
  end)
  -- contiguous: 16-byte words and a tail (2331 = 8 x 291 + 3); transposed: the strided kernels
  each(FLOATS, 'swiglu, contiguous', function(dt)
    return function(g, u) return ds.swiglu(g, u) end, { randn(dt, 7, 333) * 3, randn(dt, 7, 333) }
  end)
  each(FLOATS, 'swiglu of a transposed gate', function(dt)
    return function(g, u) return ds.swiglu(g:t(), u) end, { randn(dt, 9, 5) * 3, randn(dt, 5, 9) }
  end)
  each(FLOATS, 'dropout (the same mask on both devices)', function(dt)
    return function(x)
      ds.manual_seed(1234)
      return ds.dropout(x, 0.3)
    end, { randn(dt, 7, 333) }
  end)
end)

describe('attention on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  -- q and k come [B,T,H,D], the layout of a fused projection, and attend as [B,H,T,D] views
  local cases = {
    { 'causal', 2, 3, 37, 37, 16, 16, { causal = true } },
    { 'not causal', 2, 3, 37, 37, 16, 16, { causal = false } },
    { 'cross attention, Dv ~= D', 1, 2, 5, 70, 24, 20, { causal = false, scale = 0.3 } },
    { 'many tiles', 1, 2, 150, 150, 32, 32, { causal = true } },
    { 'head dim 64', 2, 2, 65, 65, 64, 64, { causal = true } },
    { 'head dim 128', 1, 2, 40, 40, 128, 128, { causal = true } },
    { 'head dim 64, many tiles', 1, 2, 200, 200, 64, 64, { causal = true } },
    { 'head dim 64, cross attention', 1, 2, 70, 130, 64, 64, { causal = false, scale = 0.2 } },
    { 'head dim 128, many tiles', 1, 1, 130, 130, 128, 128, { causal = false } },
    -- whole 64-row tiles: the ones below the diagonal take no mask
    { 'head dim 64, causal, whole tiles', 1, 2, 256, 256, 64, 64, { causal = true } },
    { 'head dim 128, causal, whole tiles', 1, 1, 192, 192, 128, 128, { causal = true } },
    { 'head dim 64, cross attention, whole tiles', 1, 2, 128, 192, 64, 64, { causal = false } },
    { 'one query', 1, 1, 1, 1, 8, 8, { causal = true } },
  }
  local function sdpa_case(dtypes, label, c, opts)
    local _, B, Hn, Tq, Tk, D, Dv = unpack(c)
    each(dtypes, label, function(dt)
      return function(q, k, v)
               return ds.scaled_dot_product_attention(q:transpose(2, 3), k:transpose(2, 3), v, opts)
             end,
             { randn(dt, B, Tq, Hn, D), randn(dt, B, Tk, Hn, D), randn(dt, B, Hn, Tk, Dv) }
    end)
  end
  for _, c in ipairs(cases) do sdpa_case(FLOATS, 'scaled_dot_product_attention ' .. c[1], c, c[8]) end

  -- grouped-query attention, k and v with fewer heads than q: the tensor-core kernels (mma.sync
  -- and Hopper's wgmma) read each kv head for its group (head dims 64 and 128), the scalar kernel
  -- and the math backend take them repeated in the op (head dim 16, f64);
  -- a transposed output's gradient reaches the grouped backward with a head dim stride it copies
  for _, c in ipairs {
    { 'grouped, 2 query heads per kv head, head dim 64', 2, 4, 2, 130, 64, { causal = true } },
    { 'grouped, 4 query heads per kv head, head dim 128', 1, 4, 1, 100, 128, { causal = false } },
    { 'grouped, 4 query heads per kv head, head dim 16', 1, 8, 2, 37, 16, { causal = true } },
    { 'grouped, head dim 64, backend fused', 1, 4, 2, 70, 64, { causal = true, backend = 'fused' } },
    { 'grouped, head dim 64, backend math', 1, 4, 2, 70, 64, { causal = true, backend = 'math' } },
    { 'grouped, head dim 64, transposed output', 1, 4, 2, 70, 64, { causal = true }, true },
  } do
    local name, B, Hn, KV, T, D, opts, transposed = unpack(c)
    each(FLOATS, 'scaled_dot_product_attention ' .. name, function(dt)
      return function(q, k, v)
               local y = ds.scaled_dot_product_attention(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3), opts)
               return transposed and y:transpose(3, 4) or y
             end,
             { randn(dt, B, T, Hn, D), randn(dt, B, T, KV, D), randn(dt, B, T, KV, D) }
    end)
  end

  -- the heads of a fused projection, as GPT-2's attention runs them
  for _, c in ipairs { { 'causal', 2, 100, 3, 64, nil }, { 'not causal', 1, 70, 2, 128, { causal = false } },
                       { 'head dim 16', 2, 33, 2, 16, nil } } do
    local name, B, T, Hn, D, opts = unpack(c)
    each(FLOATS, 'qkv_attention ' .. name .. ', head dim ' .. D, function(dt)
      return function(qkv) return ds.qkv_attention(qkv, Hn, opts) end, { randn(dt, B, T, 3 * Hn * D) }
    end)
  end

  -- Where the fused kernel has no tensor-core path (f64; f32, bf16 and f16
  -- with head dims other than 64 and 128) auto takes the math backend on
  -- the GPU (cuBLAS GEMMs, B*H*Tq*Tk scores in memory) and the fused one on
  -- the CPU, so the cases above compare the two; forced, the fused kernel
  -- still runs them
  for i = 1, 4 do
    local c = cases[i]
    sdpa_case(FLOATS, 'scaled_dot_product_attention, backend fused, ' .. c[1], c,
              { causal = c[8].causal, scale = c[8].scale, backend = 'fused' })
  end
  each({ 'f32' }, 'qkv_attention, backend fused', function(dt)
    return function(qkv) return ds.qkv_attention(qkv, 3, { backend = 'fused' }) end, { randn(dt, 2, 100, 3 * 3 * 64) }
  end)

  if not ON_CPU then
    it('auto takes math where the fused kernel has no tensor-core path', function()
      -- head dim 16: math in every dtype; head dim 64: fused (tensor cores) in f32, bf16 and f16
      for _, c in ipairs { { 16, 'permute' }, { 64, 'scaled_dot_product_attention' } } do
        local x = randn('f32', 1, 2, 8, c[1]):cuda():requires_grad_()
        for dt, op in pairs { f32 = c[2], f64 = 'permute', bf16 = c[2], f16 = c[2] } do
          local y = x:to(dt)
          assert.are.equal(op, ds.scaled_dot_product_attention(y, y, y).grad_fn, dt .. ' head dim ' .. c[1])
        end
      end
      local qkv = randn('f32', 1, 8, 3 * 2 * 64):cuda():requires_grad_()
      for _, dt in ipairs { 'f32', 'bf16' } do
        assert.are.equal('qkv_attention', ds.qkv_attention(qkv:to(dt), 2).grad_fn, dt)
        assert.are.equal('view', ds.qkv_attention(qkv:to(dt), 8).grad_fn, dt)      -- head dim 16
      end
      -- past 2 GiB of scores (1 x 3 x 16384^2 f32: 3 GiB) auto keeps to the fused kernel
      local long = randn('f32', 1, 3, 16384, 16):cuda():requires_grad_()
      assert.are.equal('scaled_dot_product_attention', ds.scaled_dot_product_attention(long, long, long).grad_fn)
    end)
  end
end)

-- On a device of compute capability 9.0 bf16 and f16 attention forwards
-- and backwards at head dims 64 and 128 run the wgmma kernels, both
-- passes fed by TMA (the cases above compare them with the CPU); here
-- they are held against the mma.sync kernels they replace: outputs and
-- gradients within twice the 16-bit tolerance (each kernel is within one
-- of exact attention).
describe('attention on Hopper wgmma against mma.sync #gpu', function()
  if skip or ON_CPU then pending('skipped: no CUDA device') return end
  local kernel, why = ds.cuda.attention_kernel('bf16', 64)
  if not kernel:match('^wgmma') and why ~= 'off from mma.sync on its check' then
    pending('skipped: attention runs mma.sync here (' .. why .. ')')
    return
  end

  after_each(function() ds.cuda.allow_wgmma(true) end)

  -- each pass's first choice is its kernels fed by TMA
  local want = { forward = 'wgmma-tma', backward = 'wgmma-tma' }

  it('passes its first-call checks against mma.sync in every variant, the TMA forward and backward', function()
    for _, dt in ipairs { 'bf16', 'f16' } do
      for _, D in ipairs { 64, 128 } do
        for _, pass in ipairs { 'forward', 'backward' } do
          local k, w = ds.cuda.attention_kernel(dt, D, pass)
          assert.are.equal(want[pass], k, dt .. ' head dim ' .. D .. ' ' .. pass .. ': ' .. tostring(w))
        end
      end
    end
  end)

  it('turns the TMA forward and backward off with the other wgmma kernels', function()
    ds.cuda.allow_wgmma(false)
    for _, pass in ipairs { 'forward', 'backward' } do
      local k, w = ds.cuda.attention_kernel('bf16', 64, pass)
      assert.are.equal('mma.sync', k, pass)
      assert.are.equal('switched off', w, pass)
    end
  end)

  -- q's Hn heads against KV of k and v: grouped-query where KV < Hn, the wgmma kernels reading k
  -- and v as they are (the forward launches as many kernels as with Hn kv heads: no repeat
  -- before it), against the grouped mma.sync kernels
  for _, c in ipairs { { 1, 2, 2, 300, 300, true }, { 1, 2, 2, 300, 300, false }, { 2, 1, 1, 70, 290, false },
                       { 1, 2, 2, 290, 70, true }, { 1, 1, 1, 1, 1, true }, { 1, 4, 2, 300, 300, true },
                       { 2, 4, 1, 200, 200, false }, { 1, 8, 2, 130, 70, true } } do
    for _, dt in ipairs { 'bf16', 'f16' } do
      for _, D in ipairs { 64, 128 } do
        local B, Hn, KV, Tq, Tk, causal = unpack(c)
        local grouped = KV < Hn and string.format(', %d query heads per kv head', Hn / KV) or ''
        it(string.format('%s head dim %d, %dx%d queries x %d keys, causal %s%s', dt, D, B * Hn, Tq, Tk,
                         tostring(causal), grouped), function()
          local q, k, v = randn(dt, B, Hn, Tq, D):cuda(), randn(dt, B, KV, Tk, D):cuda(), randn(dt, B, KV, Tk, D):cuda()
          local g = randn(dt, B, Hn, Tq, D):cuda()
          local function launches(kk, vv)
            local before = ds.kernel_calls()
            ds.scaled_dot_product_attention(q, kk, vv, { causal = causal })
            return ds.kernel_calls() - before
          end
          local function run(wgmma)
            ds.cuda.allow_wgmma(wgmma)
            assert.are.equal(wgmma and want.forward or 'mma.sync', (ds.cuda.attention_kernel(dt, D)))
            assert.are.equal(wgmma and want.backward or 'mma.sync', (ds.cuda.attention_kernel(dt, D, 'backward')))
            if KV < Hn then
              local kr, vr = k:repeat_interleave(Hn / KV, 2), v:repeat_interleave(Hn / KV, 2)
              assert.are.equal(launches(kr, vr), launches(k, v), 'kernels of the grouped forward')
            end
            local qs, ks, vs = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
            local out = ds.scaled_dot_product_attention(qs, ks, vs, { causal = causal })
            out:backward(g)
            return { out:cpu(), qs.grad:cpu(), ks.grad:cpu(), vs.grad:cpu() }
          end
          local w, m = run(true), run(false)
          local tol = { rtol = 2 * TOL[dt].rtol, atol = 2 * TOL[dt].atol }
          for i, name in ipairs { 'out', 'dq', 'dk', 'dv' } do H.assert_close(w[i], m[i], tol, name) end
        end)
      end
    end
  end
end)

describe('optimizer steps on the GPU #gpu', function()
  if skip then pending('skipped: no CUDA device') return end

  local kinds = {
    { 'SGD', { lr = 0.1 } },
    { 'SGD', { lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01 } },
    { 'SGD', { lr = 0.1, momentum = 0.9, dampening = 0.1 } },
    { 'Adam', { lr = 0.01, weight_decay = 0.01 } },
    { 'AdamW', { lr = 0.01, weight_decay = 0.1 } },
    { 'Adagrad', { lr = 0.05, lr_decay = 0.01, weight_decay = 0.01 } },
    { 'Lamb', { lr = 0.01, weight_decay = 0.01 } },
    { 'Lion', { lr = 0.001, weight_decay = 0.1 } },
  }
  for i, k in ipairs(kinds) do
    it(k[1] .. ' (setting ' .. i .. '), 5 steps', function()
      ds.manual_seed(5)
      local init = { randn('f32', 300, 400), randn('f32', 7), randn('f32', 3, 5) }
      local grads = {}
      for t = 1, 5 do
        grads[t] = {}
        for j, p in ipairs(init) do grads[t][j] = ds.randn(p:size(), 'f32') end
      end
      local function run(move)
        local ps = {}
        for j, p in ipairs(init) do ps[j] = move(p:clone()):requires_grad_() end
        local opt = ds.optim[k[1]](ps, k[2])
        for t = 1, 5 do
          for j, p in ipairs(ps) do p.grad:copy_(move(grads[t][j])) end
          opt:step()
        end
        return ps
      end
      local cpu, gpu = run(function(x) return x end), run(to_dev)
      for j = 1, #init do
        assert(on_dev(gpu[j]), k[1] .. ': parameter ' .. j .. ' left the GPU')
        H.assert_close(to_host(gpu[j]:detach()), cpu[j]:detach(), TOL.f32, k[1] .. ' parameter ' .. j)
      end
    end)
  end

  -- the step engine's clip factor, taken inside the kernel's pass
  it('apply with a grad_scale equals scaling the gradient first, bit for bit', function()
    ds.manual_seed(6)
    for i, k in ipairs(kinds) do
      if k[1] ~= 'Lamb' then
        local group = ds.optim.defaults(k[1])
        for key, v in pairs(k[2]) do group[key] = v end
        local p0, g = to_dev(randn('f32', 40007)), to_dev(randn('f32', 40007))
        local function step(scaled)
          local p, state = p0:clone(), {}
          for s = 1, #ds.optim.state_names(k[1]) do state[s] = to_dev(ds.zeros({ 40007 })) end
          if scaled then ds.optim.apply(k[1], group, 1, p, g, state, nil, 0.37)
          else ds.optim.apply(k[1], group, 1, p, g:clone():mul_(0.37), state) end
          return p
        end
        H.assert_same(to_host(step(true)), to_host(step(false)), k[1] .. ' (setting ' .. i .. ')')
      end
    end
  end)
end)

-- TF32 rounds an f32 GEMM's inputs to 10 mantissa bits: 1 + 2^-15 is 1
-- there, so a row of 512 of them times ones sums to 512 with the switch on
-- and to 512 (1 + 2^-15) with it off; sums of integers and of one repeated
-- f32 value are exact either way. Only the GPU can show it.
describe('TF32 on the GPU #gpu', function()
  if skip or ON_CPU then pending('skipped: no CUDA device') return end
  after_each(function() ds.cuda.allow_tf32(false) end)

  it('rounds f32 matmul inputs under ds.backends.cuda.matmul.allow_tf32 only', function()
    local a = to_dev(ds.full({ 512, 512 }, 1 + 2 ^ -15))
    local b = to_dev(ds.ones(512, 512))
    local function corner() return to_host(ds.matmul(a, b)):narrow(1, 1, 1):narrow(2, 1, 1):item() end
    assert.are.equal(512 * (1 + 2 ^ -15), corner())
    ds.backends.cudnn.allow_tf32 = true
    assert.are.equal(512 * (1 + 2 ^ -15), corner())
    ds.backends.cuda.matmul.allow_tf32 = true
    assert.are.equal(512, corner())
  end)

  -- Keys of zeros give every score 0 and every probability 1/64 (64 keys),
  -- all exact, so with v and the output's gradient all 1 + 2^-15 the output
  -- and dv are 1 + 2^-15 in f32 and in 3xTF32 (1 and 2^-15 are its two
  -- parts; to its roundings, far below 2^-18) and 1 where TF32 rounds v
  -- and the gradient to 1.
  it('puts f32 attention on tensor cores in TF32 under the matmul switch only, in 3xTF32 without it', function()
    local q = to_dev(ds.randn({ 1, 2, 64, 64 }, 'f32'))
    local k = to_dev(ds.zeros({ 1, 2, 64, 64 }, 'f32'))
    local fine = 1 + 2 ^ -15
    local function run(backend)
      local v = to_dev(ds.full({ 1, 2, 64, 64 }, fine)):requires_grad_()
      local out = ds.scaled_dot_product_attention(q, k, v, { causal = false, backend = backend })
      out:backward(to_dev(ds.full({ 1, 2, 64, 64 }, fine)))
      local function off_by(x, want) return to_host((x - want):abs():amax()):item() end
      return off_by(out, fine), off_by(out, 1), off_by(v.grad, fine), off_by(v.grad, 1), out.grad_fn
    end
    local o_f32, _, g_f32, _, auto_off = run(nil)
    assert.is_true(o_f32 <= 2 ^ -18 and g_f32 <= 2 ^ -18, 'switch off: out and dv in 3xTF32')
    assert.are.equal('scaled_dot_product_attention', auto_off)   -- auto: the fused kernel, on tensor cores
    _, _, g_f32 = run('math')
    assert.is_true(g_f32 <= 2 ^ -18, 'switch off, math: cuBLAS in f32')
    ds.backends.cuda.matmul.allow_tf32 = true
    local _, o_tf32, _, g_tf32, auto_on = run(nil)
    assert.is_true(o_tf32 <= 2 ^ -18 and g_tf32 <= 2 ^ -18, 'switch on: out and dv from TF32 inputs')
    assert.are.equal('scaled_dot_product_attention', auto_on)    -- auto: the fused kernel, on tensor cores
  end)

  it('gives 3xTF32\'s bits back once the switch is off again', function()
    local function r() return to_dev(ds.randn({ 1, 2, 70, 64 }, 'f32')) end
    local q, k, v, g = r(), r(), r(), r()
    local function run()
      local vd = v:clone():requires_grad_()
      local out = ds.scaled_dot_product_attention(q, k, vd, { causal = true, backend = 'fused' })
      out:backward(g)
      return to_host(out), to_host(vd.grad)
    end
    local out0, dv0 = run()
    ds.backends.cuda.matmul.allow_tf32 = true
    local out1 = run()
    ds.backends.cuda.matmul.allow_tf32 = false
    local out2, dv2 = run()
    H.assert_same(out2, out0, 'out, switched on and off again')
    H.assert_same(dv2, dv0, 'dv, switched on and off again')
    assert.is_true((out1 - out0):abs():amax():item() > 0, 'the switch on changes the result')
  end)

  -- The bound the tensor cores' f32 arithmetic guarantees (derived in
  -- tests/test_attention_mma.cc, whose emulated kernels meet it for every
  -- output), for out and dv: each product is off by prod relative (TF32:
  -- (1 + u)^2 - 1, u = 2^-11, its unit roundoff; 3xTF32: (3 + 2^-9) 2^-22,
  -- what the split leaves) and costs `per` additions (TF32 one, 3xTF32
  -- three), each rounded in f32 (tensor cores may truncate: 2^-23 an
  -- addition, so gamma counts twice). A score is off by at most delta_i =
  -- scale max_j |q_i|.|k_j| e_dot (e_dot: a dot product's error), a
  -- probability by a factor exp(+-(2 delta_i + 2 eta)) (eta: exp2's
  -- error), the backward's by (1 + rho_i) with lse's error lam_i, and each
  -- goes into the mma as v and dout do.
  local TF32 = { prod = (1 + 2 ^ -11) ^ 2 - 1, per = 1 }
  local TF32X3 = { prod = (3 + 2 ^ -9) * 2 ^ -22, per = 3 }
  local function f32_bounds(q, k, v, g, scale, causal, model)
    local e, prod, per = 2 ^ -24, model.prod, model.per
    local function gamma(n) return 2 * n * e / (1 - 2 * n * e) end
    local Tq, Tk, D = q:size(3), k:size(3), q:size(4)
    q, k, v, g = q:to('f64'), k:to('f64'), v:to('f64'), g:to('f64')
    local rows = {}          -- -inf where the causal mask hides key j from query i
    for i = 1, Tq do
      rows[i] = {}
      for j = 1, Tk do rows[i][j] = causal and j > i and -math.huge or 0 end
    end
    local mask = ds.tensor(rows, 'f64')
    local s = ds.matmul(q, k:transpose(3, 4)) * scale + mask
    local mx = s:amax(4, true)
    local lse = mx + ds.log(ds.exp(s - mx):sum(4, true))
    local p = ds.exp(s - lse)
    local e_dot = (1 + prod) * (1 + gamma(per * D + 8)) - 1
    local delta = (ds.matmul(q:abs(), k:abs():transpose(3, 4)) + mask):amax(4, true) * (scale * (e_dot + 8 * e))
    local ratio = ds.exp(delta * 2 + 8 * e) * ((1 + prod) * (1 + gamma((per + 1) * Tk + 8))) - 1
    local lam = delta + (8 * e + gamma(2 * Tk + 8) + 8 * e * (math.log(Tk, 2) + 2)) + lse:abs() * (8 * e)
    local rho = ds.exp(delta + lam + lse:abs() * (8 * e) + (4 * e + 8 * e * 130)) - 1
    local c = (rho + 1) * ((1 + prod) * (1 + gamma(per * Tq + 4))) - 1
    local tiny = 2 * math.max(Tq, Tk) * 2 ^ -126 * 16      -- flushed probabilities, |v| and |dout| < 16
    return ds.matmul(p, v), ratio * ds.matmul(p, v:abs()) + tiny,
           ds.matmul(p:transpose(3, 4), g), ds.matmul(p:transpose(3, 4), c * g:abs()) + tiny
  end

  -- out and dv of random inputs within the model's bound, head dims 64 and
  -- 128, causal or not, lengths that leave partial tiles
  local function within_bound(model)
    for _, c in ipairs { { 64, 100, 70, false }, { 128, 100, 70, false }, { 64, 130, 130, true },
                         { 128, 100, 100, true } } do
      local D, Tq, Tk, causal = unpack(c)
      local q, k = ds.randn({ 1, 2, Tq, D }, 'f32'), ds.randn({ 1, 2, Tk, D }, 'f32')
      local v, g = ds.randn({ 1, 2, Tk, D }, 'f32'), ds.randn({ 1, 2, Tq, D }, 'f32')
      local vd = to_dev(v):requires_grad_()
      local out = ds.scaled_dot_product_attention(to_dev(q), to_dev(k), vd, { causal = causal })
      out:backward(to_dev(g))
      local out_ref, out_bound, dv_ref, dv_bound = f32_bounds(q, k, v, g, 1 / math.sqrt(D), causal, model)
      local function over(got, want, bound)
        return ((to_host(got):to('f64') - want):abs() / bound):amax():item()
      end
      local what = string.format('head dim %d, %d x %d, causal %s', D, Tq, Tk, tostring(causal))
      assert.is_true(over(out, out_ref, out_bound) <= 1, 'out, ' .. what)
      assert.is_true(over(vd.grad, dv_ref, dv_bound) <= 1, 'dv, ' .. what)
    end
  end

  it('keeps f32 attention within the TF32 bound under the switch, head dims 64 and 128', function()
    ds.backends.cuda.matmul.allow_tf32 = true
    within_bound(TF32)
  end)

  it('keeps f32 attention within the 3xTF32 bound with the switch off, head dims 64 and 128', function()
    within_bound(TF32X3)
  end)
end)
