-- ds.gelu_mlp: linear, GELU, linear as one op, against the composed ops
-- (forward and all five gradients), finite differences, bf16, the
-- argument checks, and GPT-2's MLP fused and composed.
local H = require 'helpers'
local ds = H.ds

local GPT = require 'models.gpt2'

local fails = H.fails

local NAMES = { 'x', 'w1', 'b1', 'w2', 'b2' }

-- x [lead..., in], w1 [hidden, in], b1 [hidden], w2 [out, hidden], b2 [out]
local function args(dtype, lead, in_f, hidden, out_f)
  local xs = {}
  for i, d in ipairs(lead) do xs[i] = d end
  xs[#xs + 1] = in_f
  return { ds.randn(xs, dtype), ds.randn({ hidden, in_f }, dtype) * 0.5, ds.randn({ hidden }, dtype),
           ds.randn({ out_f, hidden }, dtype) * 0.5, ds.randn({ out_f }, dtype) }
end

local function composed(x, w1, b1, w2, b2, how)
  return ds.linear(ds.gelu(ds.linear(x, w1, b1), how), w2, b2)
end

-- Runs fn on fresh leaves copied from a (grad where need[k]) and returns
-- the output and the five gradients (false where none).
local function run(fn, a, need, how)
  local t = {}
  for k = 1, 5 do
    if a[k] then
      t[k] = a[k]:clone()
      if need[k] then t[k]:requires_grad_() end
    end
  end
  local y = fn(t[1], t[2], t[3], t[4], t[5], how)
  local w = ds.randn(y:size(), 'f64'):to(y:dtype())
  if need[1] or need[2] or need[3] or need[4] or need[5] then (y * w):sum():backward() end
  local g = {}
  for k = 1, 5 do g[k] = t[k] and t[k].grad or false end
  return y, g, w
end

local fused = function(x, w1, b1, w2, b2, how) return ds.gelu_mlp(x, w1, b1, w2, b2, { approximate = how }) end

-- The fused op and the composed ops on the same inputs and projection.
local function agree(a, need, how, tol)
  local seed = math.random(1, 1e9)
  ds.manual_seed(seed)
  local y1, g1 = run(fused, a, need, how)
  ds.manual_seed(seed)
  local y2, g2 = run(composed, a, need, how)
  H.assert_close(y1, y2, tol, 'forward')
  for k = 1, 5 do
    if need[k] and a[k] then H.assert_close(g1[k], g2[k], tol, 'grad ' .. NAMES[k])
    else assert.is_false(g1[k] and true or false, NAMES[k] .. ' got a gradient it does not need') end
  end
end

local ALL = { true, true, true, true, true }
local tight = { f32 = { rtol = 1e-6, atol = 1e-6 }, f64 = { rtol = 1e-12, atol = 1e-12 } }

describe('gelu_mlp', function()
  for _, how in ipairs { 'tanh', 'none' } do
    for _, dt in ipairs { 'f32', 'f64' } do
      it(string.format('%s, approximate %s: forward and all five gradients equal the composed ops', dt, how),
         function() agree(args(dt, { 6 }, 5, 12, 4), ALL, how, tight[dt]) end)
    end

    it('3-D x, approximate ' .. how, function() agree(args('f32', { 2, 3 }, 5, 8, 7), ALL, how, tight.f32) end)

    it('gradients match finite differences in f64, approximate ' .. how, function()
      local a = args('f64', { 2, 3 }, 4, 6, 3)
      for k = 1, 5 do a[k]:requires_grad_() end
      H.gradcheck(function(x, w1, b1, w2, b2) return ds.gelu_mlp(x, w1, b1, w2, b2, { approximate = how }) end, a)
    end)
  end

  it('bf16 equals the composed ops in bf16', function()
    agree(args('bf16', { 3, 4 }, 8, 16, 5), ALL, 'tanh', H.tol.bf16)
  end)

  it('takes transposed views of x and the weights as they are', function()
    local bx, b1w, b2w = ds.randn(5, 6), ds.randn(5, 8) * 0.5, ds.randn(8, 3) * 0.5
    local b1, b2 = ds.randn(8), ds.randn(3)
    local function go(fn)
      local t = { bx:clone():requires_grad_(), b1w:clone():requires_grad_(), b2w:clone():requires_grad_() }
      local y = fn(t[1]:t(), t[2]:t(), b1, t[3]:t(), b2, 'tanh')
      ;(y * y):sum():backward()
      return y, t
    end
    local y1, t1 = go(fused)
    local y2, t2 = go(composed)
    H.assert_close(y1, y2, tight.f32, 'forward')
    for k = 1, 3 do H.assert_close(t1[k].grad, t2[k].grad, tight.f32, 'grad ' .. k) end
  end)

  it('takes nil biases, either or both', function()
    for _, drop in ipairs { { 3 }, { 5 }, { 3, 5 } } do
      local a = args('f32', { 2, 4 }, 5, 8, 3)
      for _, k in ipairs(drop) do a[k] = false end
      agree(a, ALL, 'tanh', tight.f32)
    end
  end)

  it('computes only the gradients asked for', function()
    for _, need in ipairs { { true }, { false, true }, { false, false, true }, { false, false, false, true },
                            { false, false, false, false, true }, { true, false, true, false, true },
                            { false, true, false, true } } do
      agree(args('f32', { 3, 2 }, 4, 6, 5), need, 'tanh', tight.f32)
    end
  end)

  it('bf16 agrees with f32 within bf16 rounding', function()
    -- within 3% of each tensor's largest element: a bf16 hidden layer of 32
    local function close(a, ref, what)
      local scale = ref:abs():amax():item()
      H.assert_close(a:to('f32') / scale, ref / scale, { rtol = 0, atol = 3e-2 }, what)
    end
    for _, how in ipairs { 'tanh', 'none' } do
      local a = args('f32', { 4, 3 }, 16, 32, 8)
      for k = 1, 5 do a[k] = a[k]:to('bf16'):to('f32') end   -- the same values in both dtypes
      local w = ds.randn({ 4, 3, 8 })
      local function go(dt)
        local t = {}
        for k = 1, 5 do t[k] = a[k]:to(dt):requires_grad_() end
        local y = ds.gelu_mlp(t[1], t[2], t[3], t[4], t[5], { approximate = how })
        ;(y * w:to(dt)):sum():backward()
        return y, t
      end
      local yb, tb = go('bf16')
      local yf, tf = go('f32')
      assert.are.equal('bf16', yb:dtype())
      close(yb, yf, how .. ' forward')
      for k = 1, 5 do
        assert.are.equal('bf16', tb[k].grad:dtype())
        close(tb[k].grad, tf[k].grad, how .. ' grad ' .. NAMES[k])
      end
    end
  end)

  it('names the op, the argument and the shapes in its errors', function()
    local x, w1, b1, w2, b2 = ds.zeros(2, 5), ds.zeros(8, 5), ds.zeros(8), ds.zeros(3, 8), ds.zeros(3)
    fails('gelu_mlp: x %[2,4%] and w1 %[8,5%] do not match %(w1 takes 5 features%)', ds.gelu_mlp,
          ds.zeros(2, 4), w1, b1, w2, b2)
    fails('gelu_mlp: w1 must be 2%-D %[out,in%], got %[8%]', ds.gelu_mlp, x, ds.zeros(8), b1, w2, b2)
    fails('gelu_mlp: b1 %[7%] does not match w1 %[8,5%] %(expected %[8%]%)', ds.gelu_mlp, x, w1, ds.zeros(7), w2, b2)
    fails('gelu_mlp: hidden %[2,8%] and w2 %[3,7%] do not match %(w2 takes 7 features%)', ds.gelu_mlp,
          x, w1, b1, ds.zeros(3, 7), b2)
    fails('gelu_mlp: b2 %[8%] does not match w2 %[3,8%] %(expected %[3%]%)', ds.gelu_mlp, x, w1, b1, w2, ds.zeros(8))
    fails('gelu_mlp: w2 is f64 but x is f32', ds.gelu_mlp, x, w1, b1, ds.zeros({ 3, 8 }, 'f64'), b2)
    fails('gelu_mlp: b1 is bf16 but x is f32', ds.gelu_mlp, x, w1, ds.zeros({ 8 }, 'bf16'), w2, b2)
    fails('gelu_mlp: x must be floating point, got i64', ds.gelu_mlp, ds.zeros({ 2, 5 }, 'i64'), w1, b1, w2, b2)
    fails("gelu_mlp: approximate must be 'none' or 'tanh', got erff", ds.gelu_mlp, x, w1, b1, w2, b2,
          { approximate = 'erff' })
    fails("gelu_mlp: unknown option 'approx' %(expected approximate%)", ds.gelu_mlp, x, w1, b1, w2, b2,
          { approx = 'tanh' })
    fails('expected an options table', ds.gelu_mlp, x, w1, b1, w2, b2, 'tanh')
    if H.has_cuda() then
      fails('gelu_mlp: w1 is on cuda:0 but x is on cpu', ds.gelu_mlp, x, w1:to('cuda'), b1, w2, b2)
    end
  end)
end)

describe('models.gpt2 MLP', function()
  local cfg = GPT.config { n_layer = 1, n_head = 2, n_embd = 8, vocab_size = 11, block_size = 8 }

  -- output and parameter gradients of mlp on x, with the composed path
  -- forced by a forward set on the instance (as ZeRO stage 3 does)
  local function run_mlp(mlp, x, force_composed)
    if force_composed then rawset(mlp.c_fc, 'forward', getmetatable(mlp.c_fc).forward) end
    for _, p in ipairs(mlp:named_parameters()) do p[2].grad = nil end
    local xi = x:clone():requires_grad_()
    local y = mlp(xi)
    ds.manual_seed(4)
    ;(y * ds.randn(y:size())):sum():backward()
    local grads = { x = xi.grad }
    for _, p in ipairs(mlp:named_parameters()) do grads[p[1]] = p[2].grad:clone() end
    rawset(mlp.c_fc, 'forward', nil)
    return y, grads
  end

  it('fused and composed agree (forward and every gradient)', function()
    ds.manual_seed(3)
    local mlp = GPT.MLP(cfg)
    local x = ds.randn({ 2, 5, 8 })
    local y1, g1 = run_mlp(mlp, x, false)
    local y2, g2 = run_mlp(mlp, x, true)
    H.assert_close(y1, y2, tight.f32, 'forward')
    local n = 0
    for k, g in pairs(g2) do H.assert_close(g1[k], g, tight.f32, k); n = n + 1 end
    assert.are.equal(5, n)
  end)

  it('runs gelu_mlp only for plain Linear and GELU modules', function()
    local mlp = GPT.MLP(cfg)
    local calls, real = 0, ds.gelu_mlp
    ds.gelu_mlp = function(...) calls = calls + 1; return real(...) end
    local ok, err = pcall(function()
      mlp(ds.randn({ 3, 8 }))
      assert.are.equal(1, calls)
      rawset(mlp.c_proj, 'forward', function(m, x) return ds.linear(x, m.weight, m.bias) end)
      mlp(ds.randn({ 3, 8 }))
      assert.are.equal(1, calls)
    end)
    ds.gelu_mlp = real
    assert(ok, err)
  end)
end)

describe('flops_profiler and gelu_mlp', function()
  it('counts its two GEMMs as the linears would', function()
    local Net = ds.nn.Module:extend('Net')
    function Net:init()
      self.fc1 = ds.nn.Linear(6, 8)
      self.fc2 = ds.nn.Linear(8, 2)
    end
    function Net:forward(b)
      local y = ds.gelu_mlp(b.x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
      return ds.mse_loss(y, b.y)
    end
    local path = H.tmpdir() .. '/p.txt'
    local engine = ds.initialize { model = Net(), config = {
      train_micro_batch_size_per_gpu = 4, steps_per_print = 1000, optimizer = { type = 'SGD', params = { lr = 0.1 } },
      flops_profiler = { enabled = true, profile_step = 1, output_file = path } } }
    engine:backward(engine:forward { x = ds.randn(4, 6), y = ds.randn(4, 2) })
    engine:step()
    local f = assert(io.open(path))
    local text = f:read('*a')
    f:close()
    -- 4*6*8 + 4*8*2 MACs per micro batch of 4
    assert.is_truthy(text:find('fwd MACs per GPU:%s+256 MACs\n'), text)
  end)
end)
