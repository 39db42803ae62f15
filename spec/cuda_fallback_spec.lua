-- Without a GPU (CI, this machine) a CUDA-enabled binary runs on the CPU:
-- ds.device() is 'cpu', it says so once on stderr, and every explicit
-- request for a GPU raises an error that says why. `dslua --report` works
-- in every build. A CPU-only build says CUDA is not built.
local H = require 'helpers'
local ds = H.ds

describe('CUDA fallback without a GPU', function()
  if H.has_cuda() then
    pending('skipped: a CUDA device is present (spec/gpu covers it)')
    return
  end
  local reason = ds.cuda.unavailable_reason()

  it('sees no device and says why', function()
    assert.is_false(ds.cuda.is_available())
    assert.are.equal(0, ds.cuda.device_count())
    assert.is_true(#reason > 0)
    if not ds.cuda.is_built() then assert.are.equal('CUDA not built', reason) end
  end)

  it('places the rank on the CPU', function()
    assert.are.equal('cpu', ds.device())
    local t = ds.ones(2)
    assert.are.equal('cpu', ds.device(t))
    assert.is_false(t:is_cuda())
  end)

  it('raises a clear error for every request of a GPU', function()
    local t = ds.ones(2, 3)
    H.has(H.err(t.cuda, t), 'cuda: no CUDA device available (' .. reason .. ')')
    H.has(H.err(t.cuda, t, 1), 'cuda: no CUDA device available (' .. reason .. ')')
    H.has(H.err(t.cuda, t, 'cuda:0'), 'cuda: no CUDA device available (' .. reason .. ')')
    H.has(H.err(t.to, t, 'cuda:0'), 'to: no CUDA device available (' .. reason .. ')')
    H.has(H.err(t.to, t, 'cuda'), 'to: no CUDA device available (' .. reason .. ')')
    H.has(H.err(ds.zeros, { 2 }, 'f32', 'cuda:0'), 'cuda:0: no CUDA device available (' .. reason .. ')')
    H.has(H.err(ds.cuda.memory_info), 'memory_info: no CUDA device available (' .. reason .. ')')
    H.has(H.err(ds.cuda.attention_kernel, 'bf16', 64), 'attention_kernel: no CUDA device available (' .. reason .. ')')
    H.has(H.err(ds.cuda.attention_kernel, 'bf16', 64, 'backward'),
          'attention_kernel: no CUDA device available (' .. reason .. ')')
    H.has(H.err(ds.cuda.attention_kernel, 'bf16', 64, 'sideways'), "invalid option 'sideways'")
    H.has(H.err(t.cuda, t, 'cpu'), "cuda: 'cpu' is not a CUDA device")
    H.has(H.err(t.to, t, 'cuda:x'), "'cuda:x' is neither a dtype nor a device")
  end)

  it('keeps CPU tensors and modules where they are', function()
    local t = ds.tensor({ 1, 2, 3 })
    assert.are.same({ 1, 2, 3 }, t:cpu():totable())
    assert.are.same({ 1, 2, 3 }, t:to('cpu'):totable())
    local m = ds.nn.Linear(3, 2)
    local w = m.weight
    assert.are.equal(m, m:to('cpu'))
    assert.are.equal(w, m.weight)
    assert.is_true(m.weight.requires_grad)
    ds.cuda.synchronize()
    ds.cuda.empty_cache()
    assert.is_false(ds.cuda.allow_tf32())
  end)

  it('keeps the wgmma attention switch (on by default)', function()
    assert.is_true(ds.cuda.allow_wgmma())
    assert.is_false(ds.cuda.allow_wgmma(false))
    assert.is_false(ds.cuda.allow_wgmma())
    assert.is_true(ds.cuda.allow_wgmma(true))
    H.has(H.err(ds.cuda.allow_wgmma, 1), 'boolean expected')
  end)

  describe('TF32 switches', function()
    after_each(function() ds.cuda.allow_tf32(false) end)

    it("keep PyTorch's names and defaults, each on its own, and change no CPU result", function()
      local m, c = ds.backends.cuda.matmul, ds.backends.cudnn
      assert.is_false(m.allow_tf32)
      assert.is_false(c.allow_tf32)
      local a, b = ds.randn({ 33, 47 }), ds.randn({ 47, 29 })
      local before = ds.matmul(a, b):totable()
      m.allow_tf32 = true
      assert.is_true(m.allow_tf32)
      assert.is_false(c.allow_tf32)
      assert.is_true(ds.cuda.allow_tf32(nil, 'matmul'))
      assert.are.same(before, ds.matmul(a, b):totable())
      c.allow_tf32 = true
      m.allow_tf32 = false
      assert.is_false(m.allow_tf32)
      assert.is_true(ds.cuda.allow_tf32(nil, 'cudnn'))
      assert.is_false(ds.cuda.allow_tf32(false))          -- both, as before the split
      assert.is_false(c.allow_tf32)
    end)

    it('refuses what is not a switch, by name', function()
      H.has(H.err(function() ds.backends.cuda.matmul.allow_tf32 = 1 end),
            'ds.backends.cuda.matmul.allow_tf32: expected a boolean, got number')
      H.has(H.err(function() ds.backends.cudnn.allow_fp16 = true end),
            "ds.backends.cudnn has allow_tf32 only, not 'allow_fp16'")
      H.has(H.err(ds.cuda.allow_tf32, true, 'conv'), "invalid option 'conv'")
    end)

    it('are set by the config\'s fp32.allow_tf32 at initialize, and left as they are without it', function()
      local function init(fp32)
        ds.initialize { model = ds.nn.Linear(2, 2), config = { train_batch_size = 1, fp32 = fp32,
                                                                optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
      end
      init({ allow_tf32 = true })
      assert.is_true(ds.backends.cuda.matmul.allow_tf32)
      assert.is_false(ds.backends.cudnn.allow_tf32)
      init(nil)
      assert.is_true(ds.backends.cuda.matmul.allow_tf32)
      init({ allow_tf32 = false })
      assert.is_false(ds.backends.cuda.matmul.allow_tf32)
      H.has(H.err(ds.config.load, { train_batch_size = 1, fp32 = { allow_tf32 = 'yes' } }), 'fp32.allow_tf32')
      H.has(H.err(ds.config.load, { train_batch_size = 1, fp32 = { allow_tf16 = true } }), 'fp32.allow_tf16')
    end)
  end)

  it('says once per process that the rank uses the CPU, and why', function()
    local out, status = H.run('env -u DSLUA_DEVICE ' .. H.bin()
                              .. [[ -e "local ds = require 'dslua'; print(ds.device(), ds.device())"]])
    assert.are.equal(0, status, out)
    H.has(out, 'cpu\tcpu')
    local line = 'dslua: rank 0 uses the CPU (no CUDA device: ' .. reason .. ')'
    local _, count = out:gsub(line:gsub('%p', '%%%0'), '')
    assert.are.equal(1, count, out)
  end)
end)

describe('dslua --report', function()
  it('exits 0 and prints the libraries, CUDA and the features', function()
    local out, status = H.run(H.bin() .. ' --report')
    assert.are.equal(0, status, out)
    for _, piece in ipairs({ '--- libraries', 'LuaJIT: LuaJIT 2.', 'OpenBLAS: OpenBLAS ', 'oneDNN: ', 'MPI: ',
                             '--- CUDA', '--- features', 'CPU bf16: avx512_bf16 ', 'OpenMP threads: ' }) do
      H.has(out, piece)
    end
    if not ds.cuda.is_built() then
      H.has(out, 'CUDA: not built')
      H.has(out, 'NCCL: not built')
    else
      for _, piece in ipairs({ 'CUDA runtime: ', 'CUDA driver', 'cuBLAS(Lt): ', 'cuDNN: ', 'NCCL: 2.' }) do
        H.has(out, piece)
      end
      if H.has_cuda() then
        H.has(out, 'CUDA: on (' .. ds.cuda.device_count())
        H.has(out, 'compute capability ')
      else
        H.has(out, 'GPUs: 0 (' .. ds.cuda.unavailable_reason() .. ')')
        H.has(out, 'CUDA: built, off (' .. ds.cuda.unavailable_reason() .. ')')
      end
    end
  end)
end)
