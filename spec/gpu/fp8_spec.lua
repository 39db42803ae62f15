-- ds.fp8 on the GPU against the CPU on the same inputs: the casts (into
-- both layouts too) give the same codes, scales and amaxes (ds_fp8.h's
-- conversion on both; cvt on sm_89+, which tests/test_fp8_nv.cc holds to
-- the same bits); the fp8 GEMM
-- (cuBLASLt's on sm_89+ where dims are multiples of 16, else the fallback)
-- within what its other order of f32 sums allows; the loss curve of a
-- small GPT-2 in fp8 within 1% of bf16's. Skips without a GPU.
local H = require 'helpers'
local ds = H.ds
local C = require 'dslua.core'

describe('#gpu fp8 on the GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  local function meta(dev) return ds.tensor({ 1, 1, 0 }):to(dev) end

  it('casts to the codes, scale and amax the CPU gives, f32 and bf16, both recipes', function()
    ds.manual_seed(21)
    for _, dtype in ipairs({ 'f32', 'bf16' }) do
      local x = (ds.randn({ 257, 96 }) * 5):to(dtype)
      for _, f in ipairs({ 'e4m3', 'e5m2' }) do
        for _, current in ipairs({ true, false }) do
          local mc, mg = meta('cpu'), meta('cuda')
          if not current then
            mc:copy_(ds.tensor({ 3.5, 1 / 3.5, 0 }))
            mg:copy_(mc:to('cuda'))
          end
          local qc, qg = C.fp8_cast(x, mc, f, current, 1), C.fp8_cast(x:to('cuda'), mg, f, current, 1)
          H.assert_same(qg:to('cpu'), qc, string.format('%s %s codes (current %s)', dtype, f, tostring(current)))
          H.assert_same(mg:to('cpu'), mc, string.format('%s %s meta (current %s)', dtype, f, tostring(current)))
          H.assert_same(C.fp8_uncast(qg, mg, f, dtype):to('cpu'), C.fp8_uncast(qc, mc, f, dtype), 'uncast')
        end
      end
    end
  end)

  it('casts into both layouts as the CPU does: codes, transposed codes and meta, f32 and bf16, both recipes', function()
    ds.manual_seed(24)
    for _, shape in ipairs({ { 257, 96 }, { 1030, 770 } }) do      -- last tiles part full
      for _, dtype in ipairs({ 'f32', 'bf16' }) do
        local x = (ds.randn(shape) * 5):to(dtype)
        for _, f in ipairs({ 'e4m3', 'e5m2' }) do
          for _, current in ipairs({ true, false }) do
            local start = ds.tensor({ 3.5, 1 / 3.5, 0.25 })
            local mc, mg = start:clone(), start:to('cuda')
            local qc, qtc = C.fp8_cast_transpose(x, mc, f, current, 1)
            local qg, qtg = C.fp8_cast_transpose(x:to('cuda'), mg, f, current, 1)
            local what = string.format('[%d, %d] %s %s (current %s)', shape[1], shape[2], dtype, f, tostring(current))
            H.assert_same(qg:to('cpu'), qc, what .. ' codes')
            H.assert_same(qtg:to('cpu'), qtc, what .. ' transposed codes')
            H.assert_same(mg:to('cpu'), mc, what .. ' meta')
          end
        end
      end
    end
  end)

  it("takes max |x| as the CPU does, and a cast's scale from a given amax", function()
    ds.manual_seed(23)
    for _, dtype in ipairs({ 'f32', 'bf16' }) do
      local x = (ds.randn({ 129, 70 }) * 3):to(dtype)
      local ac, ag = C.fp8_amax(x), C.fp8_amax(x:to('cuda'))
      H.assert_same(ag:to('cpu'), ac, dtype .. ' amax')
      local given = ac * 4                              -- a group's larger max
      local mc, mg = meta('cpu'), meta('cuda')
      local qc, qg = C.fp8_cast(x, mc, 'e4m3', true, 0, given), C.fp8_cast(x:to('cuda'), mg, 'e4m3', true, 0,
                                                                           given:to('cuda'))
      H.assert_same(qg:to('cpu'), qc, dtype .. ' codes')
      H.assert_same(mg:to('cpu'), mc, dtype .. ' meta')
      assert.equal(C.fp8_scale(given:item(), 'e4m3', 0), mc:totable()[1])
    end
  end)

  -- The products of codes are exact in f32 on both sides; the sums are
  -- not alike: the CPU's is f32's (within gamma_k = k u / (1 - k u), u =
  -- 2^-24, of the sum of the products' magnitudes), Hopper's fp8 tensor
  -- cores keep about 14 bits in their partial sums between cuBLASLt's f32
  -- promotions (u = 2^-13 taken for the whole sum: loose, but a wrong
  -- scale, layout or format is off by far more). Then each side's few f32
  -- roundings after the sum (the scales, the bias: 3 of 2^-24) and the
  -- output's (2^-8 in bf16).
  it('multiplies as the CPU does, within the order of f32 sums', function()
    ds.manual_seed(22)
    for _, c in ipairs({ { 64, 768, 2304, 'bf16', 'e4m3' }, { 48, 32, 80, 'f32', 'e5m2' }, { 30, 40, 50, 'bf16', 'e4m3' } }) do
      local m, k, n, dtype, bf = c[1], c[2], c[3], c[4], c[5]
      -- the bias a view one element in, as a parameter in a flat buffer may be
      local a, b = ds.randn({ m, k }), ds.randn({ n, k }) * 0.02
      local bias = (ds.randn({ n + 1 }) * 0.1):to(dtype):narrow(1, 2, n)
      local ma, mb = meta('cpu'), meta('cpu')
      local qa, qb = C.fp8_cast(a, ma, 'e4m3', true), C.fp8_cast(b, mb, bf, true)
      local want = C.fp8_gemm(qa, ma, 'e4m3', qb, mb, bf, bias, dtype):to('f64')
      local got = C.fp8_gemm(qa:to('cuda'), ma:to('cuda'), 'e4m3', qb:to('cuda'), mb:to('cuda'), bf, bias:to('cuda'),
                             dtype):to('cpu'):to('f64')
      local va = C.fp8_uncast(qa, ma, 'e4m3'):to('f64'):abs()
      local vb = C.fp8_uncast(qb, mb, bf):to('f64'):abs()
      local function gamma(u) return k * u / (1 - k * u) end
      local after = 3 * 2 ^ -24 + (dtype == 'bf16' and 2 ^ -8 or 0)
      local bound = ds.matmul(va, vb:transpose(1, 2)) * ((gamma(2 ^ -24) + gamma(2 ^ -13)) * (1 + after))
                    + (want:abs() + bias:to('f64'):abs()) * (2 * after)
      local excess = ((got - want):abs() - bound):amax():item()
      assert(excess <= 0, string.format('%dx%dx%d %s %s: %.3g beyond the bound', m, k, n, dtype, bf, excess))
    end
  end)

  it("trains a small GPT-2 in fp8 within 1% of bf16's loss curve", function()
    local data, why = H.shared_data('tinyshakespeare/input.txt')
    if not data then pending(why) return end
    H.fp8_follows_bf16(H.bin(), 300, data)
  end)
end)
