-- ds.fp8: the e4m3 and e5m2 codes against their definitions, the casts
-- (into both layouts too), the fp8 linear against f64 within the bound
-- the formats guarantee, delayed scaling, the fp8 block's checks, and a
-- checkpoint's resume.
local ds = require 'dslua'
local C = require 'dslua.core'
local H = require 'spec.helpers'

-- The formats by definition: exponent bits, mantissa bits, bias, the
-- largest finite value.
local F = { e4m3 = { e = 4, m = 3, bias = 7, max = 448 }, e5m2 = { e = 5, m = 2, bias = 15, max = 57344 } }

local function decode_ref(c, f)
  local d = F[f]
  local s = c >= 128 and -1 or 1
  local e, m = math.floor(c % 128 / 2 ^ d.m), c % 2 ^ d.m
  local top = 2 ^ d.e - 1
  if f == 'e4m3' and e == top and m == 2 ^ d.m - 1 then return 0 / 0 end
  if f == 'e5m2' and e == top then return m == 0 and s * math.huge or 0 / 0 end
  if e == 0 then return s * m * 2 ^ (1 - d.bias - d.m) end
  return s * (1 + m / 2 ^ d.m) * 2 ^ (e - d.bias)
end

-- Every finite value of f, ascending, with its code.
local function finite_values(f)
  local out = {}
  for c = 0, 255 do
    local v = decode_ref(c, f)
    if v == v and math.abs(v) ~= math.huge and not (v == 0 and c >= 128) then out[#out + 1] = { v, c } end
  end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end

-- The nearest finite value to x (ties to the even code), saturating.
local function encode_ref(x, f)
  if x ~= x then return 0x7f end
  local vals = finite_values(f)
  if x >= F[f].max then return vals[#vals][2] end
  if x <= -F[f].max then return vals[1][2] end
  local best
  for _, p in ipairs(vals) do
    local d = math.abs(p[1] - x)
    if not best or d < best.d or (d == best.d and p[2] % 2 == 0) then best = { d = d, c = p[2], v = p[1] } end
  end
  if best.v == 0 and x < 0 then return 0x80 end     -- the sign of a value rounded to zero stays
  return best.c
end

describe('fp8 codes', function()
  for f in pairs(F) do
    it(f .. ': each of the 256 codes decodes as defined and encodes back', function()
      for c = 0, 255 do
        local v, want = C.fp8_decode(c, f), decode_ref(c, f)
        if want ~= want then
          assert(v ~= v, string.format('%s code 0x%02x: %s, expected NaN', f, c, v))
          assert.equal(0x7f, C.fp8_encode(v, f))
        else
          assert.equal(want, v, string.format('%s code 0x%02x', f, c))
          local back = math.abs(v) == math.huge and (v > 0 and (f == 'e4m3' and 0x7e or 0x7b) or
                                                      (f == 'e4m3' and 0xfe or 0xfb)) or c
          assert.equal(back, C.fp8_encode(v, f), string.format('%s code 0x%02x back', f, c))
        end
      end
    end)

    it(f .. ': halfway values round to the even code, beyond max saturates, NaN is 0x7f', function()
      local vals = finite_values(f)
      for i = 1, #vals - 1 do
        local lo, hi = vals[i], vals[i + 1]
        local mid = (lo[1] + hi[1]) / 2
        assert.equal(encode_ref(mid, f), C.fp8_encode(mid, f), string.format('%s between %g and %g', f, lo[1], hi[1]))
        local even = lo[2] % 2 == 0 and lo or hi
        if lo[1] ~= 0 and hi[1] ~= 0 then assert.equal(even[2], C.fp8_encode(mid, f)) end
      end
      local max = F[f].max
      assert.equal(C.fp8_encode(max, f), C.fp8_encode(max * 1.0625, f))
      assert.equal(C.fp8_encode(max, f), C.fp8_encode(1e30, f))
      assert.equal(C.fp8_encode(max, f), C.fp8_encode(math.huge, f))
      assert.equal(C.fp8_encode(-max, f), C.fp8_encode(-math.huge, f))
      assert.equal(0x7f, C.fp8_encode(0 / 0, f))
    end)
  end

  it('casts with current scaling: the scale from amax, each code the reference of x * scale in f32', function()
    ds.manual_seed(3)
    local x = ds.randn({ 64, 48 }) * 3
    for f in pairs(F) do
      local meta = ds.tensor({ 1, 1, 0 })
      local q = C.fp8_cast(x, meta, f, true, 1)
      local amax = x:abs():amax():item()
      local m = meta:totable()
      assert.equal(C.fp8_scale(amax, f, 1), m[1])
      assert.equal(F[f].max / 2, math.abs(C.fp8_decode(C.fp8_encode(amax * m[1], f), f)))
      assert.equal(amax, m[3])
      local xs = ds.tensor(x:reshape({ -1 }):totable(), 'f32')
      local scaled = (xs * m[1]):totable()
      local codes = q:reshape({ -1 }):totable()
      for i = 1, #codes do assert.equal(encode_ref(scaled[i], f), codes[i], f .. ' element ' .. i) end
      local back = C.fp8_uncast(q, meta, f):reshape({ -1 }):totable()
      for i = 1, #codes do assert.equal(ds.tensor({ C.fp8_decode(codes[i], f) * m[2] }, 'f32'):item(), back[i]) end
    end
  end)
end)

describe('fp8 amaxes over a group', function()
  it("takes max |x| (NaN left out, as the cast's), and casts with the scale of a given amax", function()
    local x = ds.tensor({ { 1, -6, 0 / 0 }, { 2.5, 0, -1 } })
    assert.same({ 6 }, C.fp8_amax(x):totable())
    assert.same({ 6 }, C.fp8_amax(x:to('bf16')):totable())
    ds.manual_seed(4)
    local y = ds.randn({ 16, 8 })
    local given = ds.tensor({ y:abs():amax():item() * 3 })     -- another rank's piece is larger
    local meta = ds.tensor({ 1, 1, 0 })
    local q = C.fp8_cast(y, meta, 'e4m3', true, 1, given)
    local s = C.fp8_scale(given:item(), 'e4m3', 1)
    assert.equal(s, meta:totable()[1])
    local scaled, codes = (y * s):reshape({ -1 }):totable(), q:reshape({ -1 }):totable()
    for i = 1, #codes do assert.equal(encode_ref(scaled[i], 'e4m3'), codes[i], 'element ' .. i) end
    H.fails_plain('fp8_cast: amax must be f32 [1], got f32 [2]', C.fp8_cast, y, meta, 'e4m3', true, 0, ds.ones({ 2 }))
  end)
end)

describe('fp8 casts into both layouts', function()
  -- x's codes and their transpose in one pass: each bit for bit what the
  -- cast gives and its copy transposed, the meta the cast leaves (delayed:
  -- the scale kept, the amax folded in; current: the scale from x's amax or
  -- a given one), across the CPU's 64 x 64 tiles and within one
  it('writes the cast and its transposed copy, bit for bit, for any shape, dtype, format and scaling', function()
    ds.manual_seed(6)
    local shapes = { { 1, 1 }, { 3, 70 }, { 130, 65 }, { 97, 7 }, { 300, 130 } }   -- the last over threads
    local scalings = { { 'delayed' }, { 'current', true }, { 'current, a given amax', true, ds.tensor({ 90 }) } }
    for _, shape in ipairs(shapes) do
      local v = (ds.randn(shape) * 40):view(-1):totable()
      v[1] = 0 / 0
      if #v > 2 then v[2] = 1e6 end           -- past both formats' max at scale 1
      local x = ds.tensor(v):view(shape)
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        for f in pairs(F) do
          for _, sc in ipairs(scalings) do
            local what = string.format('[%d, %d] %s %s %s', shape[1], shape[2], dt, f, sc[1])
            local meta, ref_meta = ds.tensor({ 1, 1, 3 }), ds.tensor({ 1, 1, 3 })
            local xd = x:to(dt)
            local q, qt = C.fp8_cast_transpose(xd, meta, f, sc[2], 1, sc[3])
            local want = C.fp8_cast(xd, ref_meta, f, sc[2], 1, sc[3])
            assert.same(shape, q:size(), what)
            assert.same({ shape[2], shape[1] }, qt:size(), what)
            H.assert_same(q, want, what .. ': codes')
            H.assert_same(qt, want:transpose(1, 2):contiguous(), what .. ': transposed codes')
            H.assert_same(meta, ref_meta, what .. ': meta')
          end
        end
      end
    end
    local x = ds.randn({ 9, 70 })
    local q, qt = C.fp8_cast_transpose(x:t(), ds.tensor({ 1, 1, 0 }), 'e4m3')        -- a strided view
    H.assert_same(qt, C.fp8_cast(x, ds.tensor({ 1, 1, 0 }), 'e4m3'), 'the transposed view\'s transposed codes')
    H.assert_same(q, qt:t():contiguous(), 'the transposed view\'s codes')
  end)

  it('refuses x that is not a float matrix, naming its shape or dtype', function()
    local meta = ds.tensor({ 1, 1, 0 })
    H.fails_plain('fp8_cast_transpose: x must be 2-D [m, k], got [2,3,4]', C.fp8_cast_transpose,
                  ds.ones({ 2, 3, 4 }), meta, 'e4m3')
    H.fails_plain('fp8_cast_transpose: x must be 2-D [m, k], got [5]', C.fp8_cast_transpose, ds.ones({ 5 }), meta,
                  'e4m3')
    H.fails_plain('fp8_cast_transpose: x must be floating point, got i64', C.fp8_cast_transpose,
                  ds.ones({ 2, 2 }):to('i64'), meta, 'e4m3')
    H.fails_plain('fp8_cast_transpose: meta must be f32 [3]', C.fp8_cast_transpose, ds.ones({ 2, 2 }),
                  ds.ones({ 2 }), 'e4m3')
    H.fails_plain('fp8_cast_transpose: amax must be f32 [1], got f32 [2]', C.fp8_cast_transpose, ds.ones({ 2, 2 }),
                  meta, 'e4m3', true, 0, ds.ones({ 2 }))
  end)

  -- The layer casts its input, weight and output gradient into both
  -- layouts; its gradients are those of the plain casts' codes copied
  -- transposed for the backward's GEMMs.
  for _, recipe in ipairs({ 'delayed', 'current' }) do
    it(recipe .. " scaling: a linear's gradients are those of casts and transposed copies, bit for bit", function()
      ds.manual_seed(7)
      local lin = ds.nn.Linear(70, 33)
      local x = ds.randn({ 2, 5, 70 }):requires_grad_(true)
      local g = ds.randn({ 2, 5, 33 }) * 1e-3
      ds.fp8.autocast(ds.fp8.recipe { recipe = recipe }, function() return lin(x) end):backward(g)
      local function codes(t, f)
        local meta = ds.tensor({ 1, 1, 0 })
        return C.fp8_cast(t, meta, f, recipe == 'current', 0), meta
      end
      local function t(q) return q:transpose(1, 2):contiguous() end
      local qx, mx = codes(x:detach():reshape({ -1, 70 }), 'e4m3')
      local qw, mw = codes(lin.weight:detach(), 'e4m3')
      local qg, mg = codes(g:reshape({ -1, 33 }), 'e5m2')
      H.assert_same(x.grad, C.fp8_gemm(qg, mg, 'e5m2', t(qw), mw, 'e4m3'):view({ 2, 5, 70 }), 'dx')
      H.assert_same(lin.weight.grad, C.fp8_gemm(t(qg), mg, 'e5m2', t(qx), mx, 'e4m3'), 'dw')
    end)
  end
end)

-- C = A B^T against f64 with A and B cast under current scaling. A
-- factor x comes back as Q(fl(x s)) / s: the f32 product x s rounds by at
-- most 2^-24, the cast by the format's unit roundoff u (or, below its
-- least normal, by half its subnormal spacing, over s), so |x'| <= |x|
-- (1 + ua) + ea with ua = (1 + u)(1 + 2^-24) - 1 (errs below). The
-- products of codes are exact in f32; their f32 sum over K adds at most
-- gamma_K = K 2^-24 / (1 - K 2^-24) of the sum of their magnitudes; after
-- it at most six f32 roundings (each scale_inv, their product, the
-- scaling, the bias, the result) rho = (1 + 2^-24)^6 - 1 of the rest.
local function bound(A, B, ua, ub, ea, eb)
  local M, K, N = #A, #A[1], #B
  local gamma = K * 2 ^ -24 / (1 - K * 2 ^ -24)
  local rho = (1 + 2 ^ -24) ^ 6 - 1
  local out = {}
  for i = 1, M do
    out[i] = {}
    for j = 1, N do
      local e, mag = 0, 0
      for k = 1, K do
        local a, b = math.abs(A[i][k]), math.abs(B[j][k])
        local qa, qb = a * (1 + ua) + ea, b * (1 + ub) + eb
        e = e + qa * qb - a * b
        mag = mag + qa * qb
      end
      out[i][j] = e + (gamma + rho * (1 + gamma)) * mag
    end
  end
  return out
end

local function matmul_t(A, B)
  local out = {}
  for i = 1, #A do
    out[i] = {}
    for j = 1, #B do
      local s = 0
      for k = 1, #A[1] do s = s + A[i][k] * B[j][k] end
      out[i][j] = s
    end
  end
  return out
end

local function transpose(A)
  local out = {}
  for j = 1, #A[1] do
    out[j] = {}
    for i = 1, #A do out[j][i] = A[i][j] end
  end
  return out
end

-- ua for format f, and ea for tensor t: the subnormal half-spacing over
-- the scale the cast gave t.
local function errs(f, t)
  local u = (1 + ({ e4m3 = 2 ^ -4, e5m2 = 2 ^ -3 })[f]) * (1 + 2 ^ -24) - 1
  local spacing = 2 ^ (1 - F[f].bias - F[f].m)
  return u, spacing / 2 / C.fp8_scale(t:abs():amax():item(), f, 0)
end

local function within(got, want, b, what)
  for i = 1, #want do
    for j = 1, #want[1] do
      local d = math.abs(got[i][j] - want[i][j])
      assert(d <= b[i][j], string.format('%s[%d][%d]: %.9g vs %.9g, bound %.3g', what, i, j, got[i][j], want[i][j],
                                         b[i][j]))
    end
  end
end

describe('fp8 linear', function()
  for _, format in ipairs({ 'hybrid', 'e4m3' }) do
    it(format .. ': output and gradients against f64 within the bound the formats guarantee', function()
      ds.manual_seed(5)
      local lin = ds.nn.Linear(32, 16)
      local x = ds.randn({ 6, 32 })
      x:requires_grad_(true)
      local r = ds.fp8.recipe { recipe = 'current', format = format }
      local y = ds.fp8.autocast(r, function() return lin(x) end)
      local g = ds.randn({ 6, 16 })
      y:backward(g)
      local X, W, G = x:detach():totable(), lin.weight:detach():totable(), g:totable()
      local bias = lin.bias:detach():totable()
      local ux, ex = errs('e4m3', x:detach())
      local uw, ew = errs('e4m3', lin.weight:detach())
      local gf = format == 'hybrid' and 'e5m2' or 'e4m3'
      local ug, eg = errs(gf, g)
      -- the bias joins after the sum: its f32 addition rounds within rho of |b| too
      local want, b = matmul_t(X, W), bound(X, W, ux, uw, ex, ew)
      local rho = (1 + 2 ^ -24) ^ 6 - 1
      for i = 1, #want do
        for j = 1, #bias do want[i][j], b[i][j] = want[i][j] + bias[j], b[i][j] + rho * math.abs(bias[j]) end
      end
      within(y:detach():totable(), want, b, 'y')
      -- the bias gradient: g's columns summed in f32, gamma_6 of their magnitudes
      local db, gamma6 = lin.bias.grad:totable(), 6 * 2 ^ -24 / (1 - 6 * 2 ^ -24)
      for j = 1, #bias do
        local sum, mag = 0, 0
        for i = 1, #G do sum, mag = sum + G[i][j], mag + math.abs(G[i][j]) end
        assert(math.abs(db[j] - sum) <= gamma6 * mag, string.format('db[%d]: %.9g vs %.9g', j, db[j], sum))
      end
      within(x.grad:totable(), matmul_t(G, transpose(W)), bound(G, transpose(W), ug, uw, eg, ew), 'dx')
      within(lin.weight.grad:totable(), matmul_t(transpose(G), transpose(X)),
             bound(transpose(G), transpose(X), ug, ux, eg, ex), 'dw')
    end)
  end

  it('dequantises each use of a layer with the scales of its own casts (current scaling)', function()
    ds.manual_seed(9)
    local shared, one, two = ds.nn.Linear(16, 8), ds.nn.Linear(16, 8), ds.nn.Linear(16, 8)
    ds.no_grad(function()
      for _, m in ipairs({ one, two }) do
        m.weight:copy_(shared.weight)
        m.bias:copy_(shared.bias)
      end
    end)
    local x1, x2 = ds.randn({ 4, 16 }), ds.randn({ 4, 16 }) * 64     -- two inputs 64x apart: other scales
    local function run(a, b)
      local r = ds.fp8.recipe { recipe = 'current' }
      local y = ds.fp8.autocast(r, function() return a(x1) * 3 + b(x2) end)
      y:sum():backward()
    end
    run(shared, shared)
    run(one, two)
    H.assert_same(shared.weight.grad, one.weight.grad + two.weight.grad, 'weight gradient')
  end)

  it('keeps its input for backward only as codes and scales: the 16-bit tensor goes after forward', function()
    local settle = require('dslua.engine.report').settle_garbage
    ds.manual_seed(10)
    local lin = ds.nn.Linear(1024, 8, { bias = false })
    local base = ds.randn({ 256, 1024 }):requires_grad_(true)
    local x = base * 2                  -- an activation of 1 MiB; its codes are a quarter of it
    settle()
    local before = ds.memory_stats().current.total
    local y = ds.fp8.autocast(ds.fp8.recipe { recipe = 'current' }, function() return lin(x) end)
    x = nil
    settle()
    local after = ds.memory_stats().current.total
    assert(after < before, string.format('the graph holds %d bytes more, x among them', after - before))
    y:sum():backward()                  -- from the codes: each row 2 (1 ... 1) w, the same for every row
    local g = base.grad
    assert.same({ 256, 1024 }, g:size())
    H.assert_same(g, g:narrow(1, 1, 1) * ds.ones({ 256, 1 }))
    assert.is_true(g:abs():amax():item() > 0)
  end)

  it('leaves a Linear marked fp8 = false, and runs in no other scope', function()
    ds.manual_seed(6)
    local lin, off = ds.nn.Linear(16, 8), ds.nn.Linear(16, 8)
    off.fp8 = false
    local x = ds.randn({ 4, 16 })
    local r = ds.fp8.recipe {}
    local a, b = ds.fp8.autocast(r, function() return lin(x), off(x) end)
    assert.is_true((a - ds.linear(x, lin.weight, lin.bias)):abs():amax():item() > 0)
    H.assert_same(b, ds.linear(x, off.weight, off.bias))
    assert.equal(1, #r.layers)
    assert.is_nil(ds.fp8.active())
    H.fails_plain("fp8 linear linear.1: x [4,15] does not end in the weight's in_features 16", ds.fp8.autocast, r,
                  function() return lin(ds.randn({ 4, 15 })) end)
    H.fails_plain('ds.fp8.autocast: expected a recipe', ds.fp8.autocast, {}, function() end)
  end)

  it("registers every Linear of GPT-2 and Llama but the lm_head, by name", function()
    local gpt = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16 }
    local llama = require('models.llama') { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_kv_head = 1,
                                            n_embd = 16, intermediate_size = 24 }
    for _, c in ipairs({ { gpt, 8, 'transformer.h.1.mlp.c_proj' }, { llama, 7, 'model.layers.0.mlp.down_proj' } }) do
      local names = {}
      for _, st in ipairs(ds.fp8.recipe({}):register(c[1]).layers) do
        names[#names + 1] = st.name
        assert.is_nil(st.name:find('lm_head', 1, true), st.name)
      end
      assert.equal(c[2], #names, table.concat(names, ' '))
      assert.is_true(table.concat(names, ' '):find(c[3], 1, true) ~= nil, table.concat(names, ' '))
    end
  end)
end)

describe('fp8 with activation checkpointing', function()
  it('recomputes a checkpointed block in the fp8 scope of its forward: the gradients of the plain model', function()
    local function grads(checkpoint)
      ds.manual_seed(8)
      local model = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16,
                                             checkpoint = checkpoint }
      local ids = (ds.rand(2, 9) * 31.99):to('i64')
      local r = ds.fp8.recipe { recipe = 'current' }
      local loss = ds.fp8.autocast(r, function()
        return model { x = ids:narrow(2, 1, 8):contiguous(), y = ids:narrow(2, 2, 8):contiguous() }
      end)
      loss:backward()
      local out = {}
      for _, e in ipairs(model:named_parameters()) do out[e[1]] = e[2].grad end
      return out
    end
    local plain, recomputed = grads(false), grads(true)
    for name, g in pairs(plain) do H.assert_same(recomputed[name], g, name) end
  end)
end)

describe('fp8 weights under gradient accumulation', function()
  -- Two steps of three micro batches of a small GPT-2 trained by SGD: the
  -- casts of its weights counted, and the parameters after. recast: every
  -- weight written in place (by 1) before each micro batch, which recasts
  -- it: the codes of each micro batch as if never kept.
  local function train(recipe, recast)
    ds.manual_seed(12)
    local model = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16 }
    local opt = ds.optim.SGD(model:parameters(), { lr = 0.1, momentum = 0.9 })
    local r = ds.fp8.recipe { recipe = recipe, amax_history_len = 4 }
    local casts, losses = {}, {}
    for step = 1, 2 do
      local before = r.weight_casts
      for _ = 1, 3 do
        if recast then
          ds.no_grad(function() for _, p in ipairs(model:parameters()) do p:mul_(1) end end)
        end
        local ids = (ds.rand(2, 9) * 31.99):to('i64')
        local loss = ds.fp8.autocast(r, function()
          return model { x = ids:narrow(2, 1, 8):contiguous(), y = ids:narrow(2, 2, 8):contiguous() }
        end)
        losses[#losses + 1] = loss:item()
        loss:backward()
      end
      opt:step()
      opt:zero_grad()
      r:update()
      casts[step] = r.weight_casts - before
    end
    return model, casts, losses, #r.layers
  end

  for _, recipe in ipairs({ 'current', 'delayed' }) do
    it(recipe .. ' scaling: casts each weight once per step, the training of a recast per micro batch bit for bit',
       function()
      local once, casts, losses, layers = train(recipe, false)
      local again, recasts, relosses = train(recipe, true)
      assert.same({ layers, layers }, casts)
      assert.same({ 3 * layers, 3 * layers }, recasts)
      assert.same(relosses, losses)
      local theirs = again:named_parameters()
      for i, e in ipairs(once:named_parameters()) do H.assert_same(theirs[i][2], e[2], e[1]) end
    end)
  end

  it('the engine casts each weight once per step at ZeRO stages 0-3 in bf16 with accumulation', function()
    for zero = 0, 3 do
      ds.manual_seed(1)
      local model = require('models.gpt2') { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16 }
      local engine = ds.initialize { model = model, config = {
        train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = 3, steps_per_print = 1e9,
        bf16 = { enabled = true }, fp8 = { enabled = true }, zero_optimization = { stage = zero },
        optimizer = { type = 'AdamW', params = { lr = 1e-3 } } } }
      for _ = 1, 2 * 3 do
        local ids = (ds.rand(2, 9) * 31.99):to('i64')
        engine:backward(engine { x = ids:narrow(2, 1, 8):contiguous(), y = ids:narrow(2, 2, 8):contiguous() })
        engine:step()
      end
      assert.equal(2 * #engine.fp8.layers, engine.fp8.weight_casts, 'ZeRO ' .. zero)
      engine:destroy()
    end
  end)

  it('casts a weight again, into both layouts, where a forward without gradients cast it first in the step',
     function()
    ds.manual_seed(8)
    local lin = ds.nn.Linear(20, 12, { bias = false })
    local x = ds.randn({ 4, 20 })
    local r = ds.fp8.recipe { recipe = 'current' }
    local function forward() return ds.fp8.autocast(r, function() return lin(x) end) end
    ds.no_grad(forward)                       -- its codes in one layout
    assert.equal(1, r.weight_casts)
    forward():sum():backward()
    assert.equal(2, r.weight_casts)
    local g = lin.weight.grad:clone()
    lin:zero_grad()
    forward():sum():backward()                -- both layouts kept
    assert.equal(2, r.weight_casts)
    H.assert_same(lin.weight.grad, g, 'the gradient of the kept codes')
  end)

  it('casts a weight anew when it changes between micro batches', function()
    ds.manual_seed(13)
    local lin = ds.nn.Linear(16, 8, { bias = false })
    local r = ds.fp8.recipe { recipe = 'current' }
    local x = ds.randn({ 4, 16 })
    local a = ds.fp8.autocast(r, function() return lin(x) end)
    ds.no_grad(function() lin.weight:mul_(2) end)
    local b = ds.fp8.autocast(r, function() return lin(x) end)
    assert.equal(2, r.weight_casts)
    H.assert_same(b, a * 2)     -- a power of two: the same codes, half the scale
  end)
end)

describe('fp8 delayed scaling', function()
  it("pushes each step's amax on the history and sets the scale from its max or its newest", function()
    for _, algo in ipairs({ 'max', 'most_recent' }) do
      local lin = ds.nn.Linear(8, 4, { bias = false })
      local r = ds.fp8.recipe { amax_history_len = 2, amax_compute_algo = algo, margin = 1 }
      local amaxes = {}
      for step, mult in ipairs({ 4, 1, 0.5 }) do
        local x = ds.ones({ 2, 8 }) * mult
        local st = r:layer(lin)
        local before = st.meta:totable()[1][1]
        ds.fp8.autocast(r, function() return lin(x) end)
        r:update()
        amaxes[#amaxes + 1] = mult
        local h = { unpack(amaxes, math.max(1, #amaxes - 1)) }
        assert.same(h, st.history[1])
        local want = algo == 'max' and math.max(unpack(h)) or h[#h]
        local m = st.meta:totable()
        assert.equal(C.fp8_scale(want, 'e4m3', 1, before), m[1][1], algo .. ' step ' .. step)
        assert.equal((ds.ones({ 1 }) / ds.tensor({ m[1][1] })):item(), m[1][2])    -- f32's 1 / scale
        assert.equal(0, m[1][3])
      end
    end
  end)
end)

describe('fp8 state', function()
  it('round-trips through state_dict, an overflowing amax as JSON holds it', function()
    local lin = ds.nn.Linear(8, 4)
    local r = ds.fp8.recipe { amax_history_len = 3 }
    ds.fp8.autocast(r, function() return lin(ds.ones({ 2, 8 }) * 3) end)
    r:update()
    local s = ds.json.decode(ds.json.encode(r:state_dict()))
    s.layers['linear.1'].input.amax_history[2] = 'inf'      -- what a checkpoint writes of math.huge
    local other = ds.fp8.recipe { amax_history_len = 3 }
    other:layer(ds.nn.Linear(8, 4))
    other:load_state_dict(s)
    local st = other.layers[1]
    assert.same({ 3, math.huge }, st.history[1])
    H.assert_same(st.meta, r.layers[1].meta, 'meta')
    assert.equal(math.huge, other:amax(st.history[1]))
    H.fails('no amax history for layer linear.2', function()
      local third = ds.fp8.recipe {}
      third:layer(ds.nn.Linear(8, 4))
      third:layer(ds.nn.Linear(8, 4))
      third:load_state_dict(s)
    end)
  end)
end)

describe('fp8 loaded scales', function()
  it("casts a layer's weight anew after a load: the codes of the loaded scale", function()
    ds.manual_seed(14)
    local lin = ds.nn.Linear(8, 4, { bias = false })
    local x = ds.randn({ 2, 8 })
    local r = ds.fp8.recipe { amax_history_len = 3 }
    ds.fp8.autocast(r, function() return lin(x) end)         -- the weight's codes at scale 1
    local s = r:state_dict()
    s.layers['linear.1'].weight.scale, s.layers['linear.1'].weight.scale_inv = 64, 1 / 64
    r:load_state_dict(s)
    local fresh = ds.fp8.recipe { amax_history_len = 3 }
    fresh:layer(lin)
    fresh:load_state_dict(s)
    H.assert_same(ds.fp8.autocast(r, function() return lin(x) end),
                  ds.fp8.autocast(fresh, function() return lin(x) end))
  end)
end)

describe('fp8 config', function()
  it('checks the fp8 block, naming the key', function()
    local base = { train_micro_batch_size_per_gpu = 1 }
    local function err(block)
      base.fp8 = block
      local cfg, problems = ds.config.check(base)
      assert.is_nil(cfg)
      return table.concat(problems, '\n')
    end
    H.has(err({ enabled = true, format = 'e5m2' }), 'fp8.format')
    H.has(err({ enabled = true, recipe = 'lazy' }), 'fp8.recipe')
    H.has(err({ amax_history_len = 0 }), 'fp8.amax_history_len')
    H.has(err({ amax_compute_algo = 'mean' }), 'fp8.amax_compute_algo')
    H.has(err({ margin = -1 }), 'fp8.margin')
    H.has(err({ enabled = true, amax_histroy_len = 4 }), 'amax_history_len')
    H.fails('unknown key', ds.fp8.recipe, { amax_histroy_len = 4 })
    H.fails('margin', ds.fp8.recipe, { margin = 0.5 })
  end)
end)

describe('fp8 with the engine', function()
  local dir
  setup(function() dir = H.tmpdir() end)
  teardown(function() os.execute('rm -rf ' .. dir) end)

  local function lm(out, args, np, kind)
    return H.run_json(H.ranks_cmd(np or 1) .. ' spec/ranks/lm.lua ' .. out .. ' ' .. (kind or 'gpt2') .. ' fp8=1 '
                      .. args, out)
  end

  -- The same micro batches on one rank (accumulated) and on two. Data
  -- parallelism averages after backward, so each rank's output gradients
  -- are 2x the one rank's. Current scaling: that power of two scales each
  -- gradient's amax and scale exactly, so every cast gives the same codes
  -- and the weights differ by the order of f32 sums only. Delayed scaling
  -- casts the first step with scale 1, where 2x the gradient is not the
  -- same codes; its inputs and weights are, and each cast's amax is the max
  -- over the ranks, so their histories and scales are equal.
  describe('on 2 ranks', function()
    if H.skip_without_mpirun() then return end
  it('trains under ZeRO 1, 2 and 3 with accumulation as on one rank', function()
    for _, c in ipairs({ { gas = 2, other = 'zero=1 gas=1' }, { gas = 4, other = 'zero=2 gas=2' },
                         { gas = 2, other = 'zero=3 gas=1' } }) do
      local one = lm(dir .. '/one.json', 'steps=1 fp8=2 gas=' .. c.gas)
      H.same_training(one, lm(dir .. '/two.json', 'steps=1 fp8=2 ' .. c.other, 2), 'current scaling, ' .. c.other)
      one = lm(dir .. '/one.json', 'steps=1 fp8=1 gas=' .. c.gas)
      local two = lm(dir .. '/two.json', 'steps=1 fp8=1 ' .. c.other, 2)
      for name, l in pairs(one.fp8.layers) do
        local o = assert(two.fp8.layers[name], name)
        for _, k in ipairs({ 'input', 'weight' }) do
          assert.equal(l[k].scale, o[k].scale, name .. ' ' .. k .. ', ' .. c.other)
          assert.same(l[k].amax_history, o[k].amax_history, name .. ' ' .. k .. ', ' .. c.other)
        end
      end
    end
  end)
  end)

  -- Tensor degree 2 against one rank on the same global batch (and 2 x
  -- data 2 under ZeRO 1 against one rank accumulating the data ranks'
  -- halves). Each split cast (a weight, a row-parallel input, a
  -- column-parallel output gradient) has one scale over the tensor group,
  -- so its codes are the whole tensor's: current scaling trains as one
  -- rank up to the order of the row-parallel sums. Delayed scaling agrees
  -- each step's amaxes over data x tensor: tensor 2 alone trains as one
  -- rank with every history and scale within the same order of sums;
  -- under data 2, whose first step's output gradients (2x, at scale 1) are
  -- not one rank's codes, one step's input and weight histories agree.
  describe('with tensor or sequence parallelism', function()
    if H.skip_without_mpirun() then return end
    local function close(a, b, what)
      local x, y = tonumber(a) or a, tonumber(b) or b
      assert(math.abs(x - y) <= 1e-5 * math.abs(x), string.format('%s: %.9g vs %.9g', what, x, y))
    end
    local function same_scales(one, other, rows, what)
      local n = 0
      for name, l in pairs(one.fp8.layers) do
        local o = assert(other.fp8.layers[name], what .. ': no fp8 state for ' .. name)
        for _, k in ipairs(rows) do
          local at = string.format('%s, %s %s', what, name, k)
          close(l[k].scale, o[k].scale, at .. ' scale')
          assert.equal(#l[k].amax_history, #o[k].amax_history, at)
          for i, v in ipairs(l[k].amax_history) do close(v, o[k].amax_history[i], at .. ' history ' .. i) end
        end
        n = n + 1
      end
      return n
    end

    it('trains GPT-2 and Llama at tensor degree 2, and 2 x data 2 with ZeRO 1 and 3, as one rank does', function()
      for _, c in ipairs({ { kind = 'gpt2', layers = 8 }, { kind = 'llama', layers = 14 } }) do
        local k = c.kind
        local function run(args, np) return lm(dir .. '/' .. np .. '.json', args, np, k) end
        local whole = run('fp8=2', 1)
        H.same_training(whole, run('fp8=2 tp=2', 2), k .. ' tensor 2, current scaling')
        local two_halves = run('fp8=2 gas=2', 1)
        H.same_training(two_halves, run('fp8=2 tp=2 zero=1', 4), k .. ' tensor 2 x data 2, current')
        H.same_training(two_halves, run('fp8=2 tp=2 zero=3', 4), k .. ' tensor 2 x data 2, ZeRO 3, current')
        -- the recomputing backward casts (and agrees amaxes) as the forward did
        H.same_training(whole, run('fp8=2 tp=2 recompute=1', 2), k .. ' tensor 2 recomputed, current')
        local one, two = run('fp8=1', 1), run('fp8=1 tp=2', 2)
        H.same_training(one, two, k .. ' tensor 2, delayed scaling')
        assert.equal(c.layers, same_scales(one, two, { 'input', 'weight', 'grad_output' }, k .. ' tensor 2'))
        one, two = run('steps=1 fp8=1 gas=2', 1), run('steps=1 fp8=1 tp=2 zero=1', 4)
        assert.equal(c.layers, same_scales(one, two, { 'input', 'weight' }, k .. ' tensor 2 x data 2'))
      end
    end)

    -- Sequence degree 2: each rank's Linears see its half of every
    -- sequence, whose input and output gradient agree their amaxes over the
    -- sequence group (current scaling); the output gradients are 2x one
    -- rank's (the loss counts once over the group), the same codes.
    it('trains GPT-2 and Llama at sequence degree 2 as one rank does', function()
      for _, c in ipairs({ { kind = 'gpt2', layers = 8 }, { kind = 'llama', layers = 14 } }) do
        local k = c.kind
        local function run(args, np) return lm(dir .. '/' .. np .. '.json', args, np, k) end
        H.same_training(run('fp8=2', 1), run('fp8=2 sp=2', 2), k .. ' sequence 2, current scaling')
        local one, two = run('steps=1 fp8=1', 1), run('steps=1 fp8=1 sp=2', 2)
        assert.equal(c.layers, same_scales(one, two, { 'input', 'weight' }, k .. ' sequence 2'))
      end
    end)
  end)

  it('resumes from a checkpoint with the same scales, as an uninterrupted run', function()
    local whole, out = lm(dir .. '/whole.json', 'steps=3')
    H.has(out, 'fp8 | 8 Linear layers: e4m3 forward, e5m2 gradients; delayed scaling (amax history 4, max, margin 0)')
    lm(dir .. '/first.json', 'steps=3 save=' .. dir .. '/ckpt')
    local resumed = lm(dir .. '/resumed.json', 'steps=3 load=' .. dir .. '/ckpt')
    H.same_training(whole, resumed, 'resumed')
    assert.same(whole.fp8, resumed.fp8)
    local any = false
    for _, l in pairs(whole.fp8.layers) do any = any or l.input.scale ~= 1 end
    assert.is_true(any, 'the scales moved from 1')
  end)

  -- What fp8 training must keep: the loss curve within 1% of
  -- bf16's (here its last 50 of 300 steps; 1,000 steps of it are
  -- bench/fp8.sh's).
  it("follows bf16's loss curve within 1% on a small GPT-2", function()
    local data, why = H.shared_data('tinyshakespeare/input.txt')
    if not data then pending(why) return end
    H.fp8_follows_bf16(H.ranks_cmd(1), 300, data)
  end)
end)
