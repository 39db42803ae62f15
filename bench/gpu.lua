-- dslua's side of bench/gpu.sh, on the GPU:
--   dslua bench/gpu.lua train B DTYPE V [MODEL [offload]] [quick]
--                                                DTYPE bf16, f32, tf32 (f32 under allow_tf32) or
--                                                fp8 (bf16 with the fp8 block: its Linears in fp8);
--                                                MODEL (gpt2_124M by default, T=1024; gpt2_xl,
--                                                T=1024; llama_1B, TinyLlama's 1.1B, T=2048) built on
--                                                the GPU and trained with AdamW, clip 1.0; offload:
--                                                ZeRO-Offload (stage 2, offload_optimizer cpu)
--   dslua bench/gpu.lua ops [quick]              the per-op rows
--   dslua bench/gpu.lua steps B DTYPE V N         N plain steps of GPT-2 124M, for a profiler
--   dslua bench/gpu.lua probe                     exits 2 naming the reason when there is no GPU
-- Prints `result dslua <row> <shape> <value> <unit>` lines, and for each
-- model trained `flops <row> <FLOPs per token>`, that bench/gpu.sh joins
-- with bench/gpu_torch.py's.
local ds = require 'dslua'
local GPT, Llama = require 'models.gpt2', require 'models.llama'

local mode, quick = arg[1], arg[#arg] == 'quick'
if arg[#arg] == 'quick' then arg[#arg] = nil end
local dev = 'cuda'
if ds.device() == 'cpu' then
  io.stderr:write('bench/gpu.lua: no GPU: ' .. ds.cuda.unavailable_reason() .. '\n')
  os.exit(2)
end
local sync = ds.cuda.synchronize

local function median(xs)
  table.sort(xs)
  return xs[math.floor((#xs + 1) / 2)]
end

local function result(row, shape, value, unit)
  print(string.format('result\tdslua\t%s\t%s\t%.6g\t%s', row, shape, value, unit))
  io.stdout:flush()
end

-- Seconds per call: warm-up, then the median of 5 samples of k calls,
-- the device synchronized around each sample.
local function time_per_call(fn)
  fn(); sync()
  local t0 = ds.wall_time()
  fn(); sync()
  local k = math.max(1, math.floor((quick and 0.02 or 0.2) / math.max(ds.wall_time() - t0, 1e-6)))
  local t = {}
  for s = 1, 5 do
    t0 = ds.wall_time()
    for _ = 1, k do fn() end
    sync()
    t[s] = (ds.wall_time() - t0) / k
  end
  return median(t)
end

local function randn(shape, dt) return ds.randn(shape, dt, dev) end

-- The models of the train rows: config, context length, and FLOPs per
-- token by nanoGPT's count, 6 N + 12 L C T (N the parameters in matmuls:
-- a tied lm_head counted once, Llama's embedding left out).
local MODELS = {
  gpt2_124M = { build = GPT, T = 1024, cfg = { n_layer = 12, n_head = 12, n_embd = 768 } },
  gpt2_xl = { build = GPT, T = 1024, cfg = { n_layer = 48, n_head = 25, n_embd = 1600 } },
  llama_1B = { build = Llama, T = 2048, cfg = { name = 'tinyllama-1.1b' } },
}

local function flops_per_token(spec, model)
  local c, n = model.config, model:num_parameters()
  if spec.build == Llama then
    n = n - model.model.embed_tokens.weight:numel()
  else
    n = n - (model.transformer.wte.weight:size(1) - c.vocab_size) * c.n_embd    -- the real vocab's
  end
  return 6 * n + 12 * c.n_layer * c.n_embd * spec.T
end

-- The engine over a model and four random batches of B x T tokens. GPT-2
-- at V 50304 pads the vocab as nanoGPT and llm.c train it (the loss still
-- over the 50257 real classes); at 50257 the model pads its lm_head GEMMs
-- itself. offload: ZeRO-Offload, the masters and AdamW's state in host
-- memory and the step on the CPU. The model is built on the GPU (on the
-- host GPT-2 XL's initialisation alone takes tens of seconds).
local function setup(B, dtype, V, name, offload)
  local spec = assert(MODELS[name or 'gpt2_124M'], 'bench/gpu.lua: no model ' .. tostring(name))
  ds.manual_seed(0)
  local cfg = { block_size = spec.T, device = dev }
  for k, v in pairs(spec.cfg) do cfg[k] = v end
  if spec.build == GPT then
    cfg.vocab_size, cfg.padded_vocab_size = 50257, V > 50257 and V or nil
  else
    cfg.vocab_size = V
  end
  local model = spec.build(cfg)
  local engine = ds.initialize { model = model, config = {
    train_batch_size = B, steps_per_print = 1e9, gradient_clipping = 1.0,
    bf16 = { enabled = dtype == 'bf16' or dtype == 'fp8' }, fp32 = { allow_tf32 = dtype == 'tf32' },
    fp8 = { enabled = dtype == 'fp8' },
    zero_optimization = offload and { stage = 2, offload_optimizer = { device = 'cpu' } } or nil,
    optimizer = { type = 'AdamW', params = { lr = 3e-4, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-8 } },
  } }
  local batches, real = {}, math.min(V, 50257)
  for i = 1, 4 do
    local ids = (ds.rand(B, spec.T + 1) * real):to('i64')
    batches[i] = { x = ids:narrow(2, 1, spec.T):contiguous():to(dev), y = ids:narrow(2, 2, spec.T):contiguous():to(dev) }
  end
  return engine, batches, model, spec
end

local function train(B, dtype, V, name, offload)
  name = name or 'gpt2_124M'
  local n_steps = quick and 3 or 10
  local engine, batches, model, spec = setup(B, dtype, V, name, offload)
  local function step(i)
    engine:backward(engine(batches[(i - 1) % #batches + 1]))
    engine:step()
  end
  for i = 1, 3 do step(i) end
  sync()
  ds.cuda.reset_peak()
  local t0 = ds.wall_time()
  for i = 1, n_steps do step(i) end
  sync()
  local sec = (ds.wall_time() - t0) / n_steps
  local shape = string.format('B%dxT%d_%s_V%d%s', B, spec.T, dtype, V, offload and '_offload' or '')
  print(string.format('flops\t%s\t%.0f', name, flops_per_token(spec, model)))
  result(name, shape, B * spec.T / sec, 'tokens/s')
  result(name .. '_peak', shape, ds.cuda.memory_info().peak / 2^30, 'GiB')
  -- Phases apart, each synchronized: where a step's time goes.
  local f, b, s = {}, {}, {}
  for i = 1, quick and 2 or 5 do
    sync(); local t = ds.wall_time()
    local loss = engine(batches[i % #batches + 1]); sync(); f[i] = ds.wall_time() - t; t = ds.wall_time()
    engine:backward(loss); sync(); b[i] = ds.wall_time() - t; t = ds.wall_time()
    engine:step(); sync(); s[i] = ds.wall_time() - t
  end
  result(name .. '_forward', shape, median(f), 's')
  result(name .. '_backward', shape, median(b), 's')
  result(name .. '_step', shape, median(s), 's')
  -- The kernels of one step (ds.kernel_calls(): the GPU's launches)
  local calls = ds.kernel_calls()
  step(1)
  result(name .. '_kernels', shape, ds.kernel_calls() - calls, 'kernels per step')
  io.stderr:write(string.format('bench/gpu.lua: %s %s %d params, %.1f ms/step, last loss %.4f\n', name, shape,
                                model:num_parameters(), 1000 * sec, engine.last_loss or 0))
end

-- N steps and nothing else: what bench/gpu_kernels.sh profiles.
local function steps(B, dtype, V, n)
  local engine, batches = setup(B, dtype, V)
  local t0
  for i = 1, n do
    if i == 2 then sync(); t0 = ds.wall_time() end
    engine:backward(engine(batches[(i - 1) % #batches + 1]))
    engine:step()
  end
  sync()
  if n > 1 then print(string.format('%.1f ms/step after the first', 1000 * (ds.wall_time() - t0) / (n - 1))) end
end

-- The memory-bound kernels on 2^28 elements, as bytes moved per second
-- (each input read once, the output written once): at this size the GPU's
-- time dominates, not the call's host side, so the rate is the kernel's.
-- bench/gpu.sh sets each against the copy row.
local function bandwidth()
  local n = 2^28
  for _, dt in ipairs { 'bf16', 'f32' } do
    local es = dt == 'bf16' and 2 or 4
    local function rate(row, shape, moved, fn)
      result(row, shape .. '_' .. dt, moved * n * es / time_per_call(fn) / 1e12, 'TB/s')
    end
    local a, c = randn({ n }, dt), randn({ n }, dt)
    rate('bw_add', '256Mi', 3, function() local _ = a + c end)
    rate('bw_gelu_tanh', '256Mi', 2, function() ds.gelu(a, 'tanh') end)
    c = nil
    local rows = math.floor(n / 768)
    local x, w, b = a:narrow(1, 1, rows * 768):view(rows, 768), randn({ 768 }, dt), randn({ 768 }, dt)
    rate('bw_layer_norm', rows .. 'x768', 2 * rows * 768 / n, function() ds.layer_norm(x, w, b) end)
    rate('bw_softmax', (n / 1024) .. 'x1024', 2, function() ds.softmax(a:view(n / 1024, 1024), -1) end)
    -- an fp8 linear's cast (delayed scaling: one read) into its codes and
    -- their transpose, one byte each
    local meta = ds.tensor({ 1, 1, 0 }):to(dev)
    rate('bw_fp8_cast_transpose', rows .. 'x768', rows * 768 * (es + 2) / es / n, function()
      ds.fp8_cast_transpose(x, meta, 'e4m3')
    end)
    a, x = nil, nil
    collectgarbage(); collectgarbage()
  end
end

-- A bf16 attention op at 8x12x1024x64 timed on the kernels its passes run
-- with the wgmma kernels allowed (compute capability 9.0: both passes fed
-- by TMA), then on mma.sync; each row names them, pass by pass
-- ('attention_fwd_bwd_wgmma-tma/wgmma-tma').
local function by_kernel(name, passes, fn)
  for _, on in ipairs { true, false } do
    ds.cuda.allow_wgmma(on)
    local kernels, hopper = {}, false
    for _, pass in ipairs(passes) do
      kernels[#kernels + 1] = ds.cuda.attention_kernel('bf16', 64, pass)
      hopper = hopper or kernels[#kernels] ~= 'mma.sync'
    end
    if hopper or not on then
      local named = hopper and table.concat(kernels, '/') or 'mma.sync'
      result(name .. '_' .. named, '8x12x1024x64_bf16', time_per_call(fn), 's')
    end
  end
  ds.cuda.allow_wgmma(true)
end

local function ops()
  -- attention on the default backend, fused on tensor cores: bf16 (forward and backward on wgmma
  -- fed by TMA on a compute capability 9.0 device, else mma.sync); f32 in 3xTF32 (the f32 rows, the switch
  -- off); f32 in TF32 under allow_tf32 (the tf32 rows)
  for _, dt in ipairs { 'bf16', 'f32', 'tf32' } do
    local et = dt == 'tf32' and 'f32' or dt
    ds.backends.cuda.matmul.allow_tf32 = dt == 'tf32'
    local q, k, v = randn({ 8, 12, 1024, 64 }, et), randn({ 8, 12, 1024, 64 }, et), randn({ 8, 12, 1024, 64 }, et)
    result('attention_fwd', '8x12x1024x64_' .. dt, time_per_call(function()
      ds.scaled_dot_product_attention(q, k, v)
    end), 's')
    if dt == 'bf16' then
      by_kernel('attention_fwd', { 'forward' }, function() ds.scaled_dot_product_attention(q, k, v) end)
    end
    q:requires_grad_(); k:requires_grad_(); v:requires_grad_()
    local g = randn({ 8, 12, 1024, 64 }, et)
    result('attention_fwd_bwd', '8x12x1024x64_' .. dt, time_per_call(function()
      ds.scaled_dot_product_attention(q, k, v):backward(g)
    end), 's')
    if dt == 'bf16' then
      by_kernel('attention_fwd_bwd', { 'forward', 'backward' }, function()
        ds.scaled_dot_product_attention(q, k, v):backward(g)
      end)
    end
    -- f32 on the math backend too (cuBLAS's f32 GEMMs around a softmax),
    -- against auto's fused 3xTF32: whether auto takes the faster
    if dt == 'f32' then
      result('attention_fwd_bwd', '8x12x1024x64_f32_math', time_per_call(function()
        ds.scaled_dot_product_attention(q, k, v, { backend = 'math' }):backward(g)
      end), 's')
    end
  end
  ds.backends.cuda.matmul.allow_tf32 = false
  collectgarbage(); collectgarbage()
  for _, dt in ipairs { 'bf16', 'f32' } do
    local x, w, b = randn({ 8192, 768 }, dt), randn({ 768 }, dt), randn({ 768 }, dt)
    result('layer_norm', '8192x768_' .. dt, time_per_call(function() ds.layer_norm(x, w, b) end), 's')
    local h = randn({ 8192, 3072 }, dt)
    result('gelu_tanh', '8192x3072_' .. dt, time_per_call(function() ds.gelu(h, 'tanh') end), 's')
    local wl, bl = randn({ 2304, 768 }, dt), randn({ 2304 }, dt)
    result('linear_bias', '8192x768x2304_' .. dt, time_per_call(function() ds.linear(x, wl, bl) end), 's')
    -- GPT-2's MLP: linear, tanh GELU, linear (in bf16 the GELU rides in cuBLASLt's epilogues)
    local w1, b1 = (randn({ 3072, 768 }, dt) * 0.03):requires_grad_(), randn({ 3072 }, dt):requires_grad_()
    local w2, b2 = (randn({ 768, 3072 }, dt) * 0.02):requires_grad_(), randn({ 768 }, dt):requires_grad_()
    local gm = randn({ 8192, 768 }, dt)
    result('mlp_fwd_bwd', '8192x768x3072_' .. dt, time_per_call(function()
      ds.gelu_mlp(x, w1, b1, w2, b2, { approximate = 'tanh' }):backward(gm)
    end), 's')
    w1, b1, w2, b2, gm = nil, nil, nil, nil, nil
    local logits = randn({ 8192, 50257 }, dt):requires_grad_()
    local y = (ds.rand(8192) * 50257):to('i64'):to(dev)
    result('cross_entropy_fwd_bwd', '8192x50257_' .. dt, time_per_call(function()
      ds.cross_entropy(logits, y):backward()
    end), 's')
    logits = nil
    local a, c = randn({ 124 * 2^20 }, dt), randn({ 124 * 2^20 }, dt)
    result('add', '124Mi_' .. dt, time_per_call(function() local _ = a + c end), 's')
    local n = 8192
    local m1, m2 = randn({ n, n }, dt), randn({ n, n }, dt)
    local sec = time_per_call(function() ds.matmul(m1, m2) end)
    result('matmul', '8192^3_' .. dt, 2 * n ^ 3 / sec / 1e12, 'TFLOP/s')
    a, c, m1, m2 = nil, nil, nil, nil
    collectgarbage(); collectgarbage()
  end
  bandwidth()
  local big = randn({ 2^28 }, 'f32')
  local out = ds.zeros({ 2^28 }, 'f32', dev)
  local sec = time_per_call(function() out:copy_(big) end)
  result('copy', '1GiB', 2 * 2^30 / sec / 1e12, 'TB/s')
end

print(string.format('info\tdslua\tdevice\t%s', ds.device()))
if mode == 'probe' then os.exit(0)
elseif mode == 'train' and (arg[6] == nil or arg[6] == 'offload') then
  train(tonumber(arg[2]), arg[3], tonumber(arg[4]), arg[5], arg[6] == 'offload')
elseif mode == 'ops' then ops()
elseif mode == 'steps' then steps(tonumber(arg[2]), arg[3], tonumber(arg[4]), tonumber(arg[5]))
else
  io.stderr:write('usage: dslua bench/gpu.lua train B bf16|f32|tf32|fp8 V [gpt2_124M|gpt2_xl|llama_1B [offload]] '
                  .. '[quick] | '
                  .. 'ops [quick] | steps B bf16|f32|tf32 V N | probe\n')
  os.exit(2)
end
