-- dslua's side of bench/curve.sh: GPT-2 trained on a text's bytes (tokens
-- 0-255 of GPT-2's vocab) from weights and batches written to a folder,
-- which bench/curve_torch.py trains from as well, and the comparer of the
-- two loss curves.
--
--   dslua bench/curve.lua prepare DIR TEXT [key=value...]
--       DIR/run.json (the sizes and the hyper-parameters), DIR/weights
--       (save_hf: config.json and model.safetensors, f32) and
--       DIR/batches.safetensors (tokens i64 [steps, B, T+1], windows of the
--       text's bytes at starts i64 [steps, B], a seeded order). Keys, with
--       the defaults of the full run: n_layer=12 n_head=12 n_embd=768
--       block=1024 batch=8 steps=100 warmup=10 dtype=bf16 seed=1337
--   dslua bench/curve.lua train DIR OUT.json [built]
--       trains from DIR's weights (built: from the model prepare built, by
--       the seed, instead) on its batches, printing each step's loss; writes
--       {losses, lrs} (the lr each step took)
--   dslua bench/curve.lua compare OURS.json THEIRS.json
--       the worst step's relative gap and the mean over the last 20 steps;
--       exit status 1 past the bounds (compare's comment says which)
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local mode = arg[1]
local function fail(fmt, ...)
  io.stderr:write('bench/curve.lua: ', string.format(fmt, ...), '\n')
  os.exit(1)
end

local function read_json(path)
  local f = io.open(path, 'rb')
  if not f then fail("cannot read '%s'", path) end
  local text = f:read('*a')
  f:close()
  local ok, v = pcall(ds.json.decode, text, path)
  if not ok or type(v) ~= 'table' then fail("'%s' is not a JSON object: %s", path, tostring(v)) end
  return v
end

local function write_json(path, v)
  local f = io.open(path, 'wb')
  if not f then fail("cannot write '%s'", path) end
  f:write(ds.json.encode(v), '\n')
  f:close()
end

-- GPT-2's vocab padded to 50304 as bench/gpu.lua trains it (the loss over
-- the 50257 real classes; the padded rows start at zero).
local function model_config(run)
  return { n_layer = run.n_layer, n_head = run.n_head, n_embd = run.n_embd, block_size = run.block,
           vocab_size = 50257, padded_vocab_size = 50304, dropout = 0, device = ds.device() }
end

-- The model prepare builds: the same for the same seed and sizes.
local function build(run)
  ds.manual_seed(run.seed)
  return GPT(model_config(run))
end

local DEFAULTS = { n_layer = 12, n_head = 12, n_embd = 768, block = 1024, batch = 8, steps = 100, warmup = 10,
                   dtype = 'bf16', seed = 1337 }

local function prepare(dir, text_path)
  local run = {}
  for k, v in pairs(DEFAULTS) do run[k] = v end
  for i = 4, #arg do
    local k, v = arg[i]:match('^([%w_]+)=(.+)$')
    if not k or DEFAULTS[k] == nil then fail("prepare: unknown argument '%s'", arg[i]) end
    run[k] = tonumber(v) or v
  end
  if run.dtype ~= 'bf16' and run.dtype ~= 'f32' then fail("prepare: dtype must be bf16 or f32, got '%s'", run.dtype) end
  -- AdamW as nanoGPT trains GPT-2, clipping 1.0, DeepSpeed's warmup and cosine
  run.lr, run.betas, run.eps, run.weight_decay, run.clip = 6e-4, { 0.9, 0.95 }, 1e-8, 0.1, 1.0
  run.cos_min_ratio = 0.1
  -- the text's bytes as token ids 0-255: a vocab of every byte in order
  local bytes = {}
  for b = 0, 255 do bytes[b + 1] = string.char(b) end
  local data = ds.data.text { path = text_path, block_size = run.block, vocab = table.concat(bytes) }
  local tokens, S, B, T = data.tokens, run.steps, run.batch, run.block
  local windows = tokens:numel() - T
  if windows < S * B then fail('prepare: %s holds %d windows of %d tokens, fewer than %d', text_path, windows, T + 1, S * B) end
  local order = ds.data.permutation(windows, run.seed)
  local starts = order:narrow(1, 1, S * B):contiguous():view(S, B)
  local out = ds.zeros({ S, B, T + 1 }, 'i64')
  for s = 1, S do
    for b = 1, B do
      out[s][b]:copy_(tokens:narrow(1, starts[s][b]:item() + 1, T + 1))
    end
  end
  require('dslua.core').ckpt.mkdirs(dir)
  write_json(dir .. '/run.json', run)
  GPT.save_hf(build(run), dir .. '/weights', { dtype = 'f32' })
  ds.checkpoint.save_file(dir .. '/batches.safetensors', { tokens = out, starts = starts })
  print(string.format('bench/curve.lua: %d steps of %dx%d windows of %s, GPT-2 %d layers n_embd %d, written to %s',
                      S, B, T + 1, text_path, run.n_layer, run.n_embd, dir))
end

local function train(dir, out_path, built)
  local run = read_json(dir .. '/run.json')
  local model = built and build(run) or GPT.from_hf(dir .. '/weights', model_config(run))
  local tokens = ds.checkpoint.load_file(dir .. '/batches.safetensors').tokens
  local T = run.block
  local engine = ds.initialize { model = model, config = {
    train_batch_size = run.batch, train_micro_batch_size_per_gpu = run.batch, steps_per_print = 1e9,
    gradient_clipping = run.clip, bf16 = { enabled = run.dtype == 'bf16' },
    optimizer = { type = 'AdamW', params = { lr = run.lr, betas = run.betas, eps = run.eps,
                                              weight_decay = run.weight_decay } },
    scheduler = { type = 'WarmupCosineLR', params = { total_num_steps = run.steps, warmup_num_steps = run.warmup,
                                                       warmup_type = 'linear', cos_min_ratio = run.cos_min_ratio } },
  } }
  local losses, lrs = {}, {}
  for s = 1, run.steps do
    local w = tokens[s]
    local batch = { x = w:narrow(2, 1, T):contiguous():to(engine.device),
                    y = w:narrow(2, 2, T):contiguous():to(engine.device) }
    lrs[s] = engine.optimizer.param_groups[1].lr
    local loss = engine:forward(batch)
    engine:backward(loss)
    engine:step()
    losses[s] = loss:to('f32'):item()
    print(string.format('step %3d  lr %.4e  loss %.6f', s, lrs[s], losses[s]))
    io.stdout:flush()
  end
  write_json(out_path, { losses = losses, lrs = lrs })
end

-- Both sides start from the same weights and take the same batches and
-- lrs, in bf16 (dslua's bf16 block, PyTorch's autocast over fp32 weights):
-- their GEMMs, attention and reductions round in a different order, and
-- where dslua keeps the activations in bf16 PyTorch keeps the residual
-- stream and layer norms in fp32, so the weights drift apart by a few of
-- bf16's roundings (2^-8 relative) a step. AdamW's update is normalised
-- (m / sqrt(v)): a gradient off by a relative e moves the step by about
-- e, not more, and the clipping bounds it; so the curves part slowly, and
-- each step's loss, on the same batch, stays within 2% of PyTorch's.
-- Tighter where both evaluate the very same weights (every step up to
-- and including the first with an lr above 0): the start's logits are
-- small (weights N(0, 0.02) against a layer norm's unit-scale output:
-- |z| of order 0.5, a few at most), the loss about ln(50257) = 10.8, and
-- bf16's roundings through the layers move each logit by a few percent of
-- |z| at most, the cross-entropy by at most twice the largest move:
-- within 1%.
local BOUND, SAME_WEIGHTS_BOUND, LAST = 0.02, 0.01, 20

local function compare(ours_path, theirs_path)
  local ours, theirs = read_json(ours_path), read_json(theirs_path)
  local a, b = ours.losses, theirs.losses
  if type(a) ~= 'table' or type(b) ~= 'table' or #a ~= #b or #a == 0 then
    fail("compare: '%s' and '%s' must both hold losses of the same number of steps (%s and %s)", ours_path,
         theirs_path, type(a) == 'table' and #a or 'none', type(b) == 'table' and #b or 'none')
  end
  local gaps, worst, same = {}, 1, 0
  for i = 1, #a do
    gaps[i] = math.abs(a[i] - b[i]) / math.abs(b[i])
    if not (gaps[i] <= gaps[worst]) then worst = i end    -- a NaN is the worst
  end
  -- the steps that evaluate the starting weights: the lrs before them all 0
  local lrs = ours.lrs or {}
  while same < #a and (same == 0 or lrs[same] == 0) do same = same + 1 end
  local n, sum = math.min(LAST, #a), 0
  for i = #a - n + 1, #a do sum = sum + gaps[i] end
  local mean = sum / n
  print(string.format('worst step %d: %.6f against %.6f, gap %.3f%%', worst, a[worst], b[worst], 100 * gaps[worst]))
  print(string.format('mean gap over the last %d steps: %.3f%%', n, 100 * mean))
  local bad = {}
  if not (gaps[worst] <= BOUND) then bad[#bad + 1] = string.format('step %d is %.3f%% off', worst, 100 * gaps[worst]) end
  if not (mean <= BOUND) then bad[#bad + 1] = string.format('the last %d steps are %.3f%% off', n, 100 * mean) end
  for i = 1, same do
    if not (gaps[i] <= SAME_WEIGHTS_BOUND) then
      bad[#bad + 1] = string.format('step %d, at the starting weights, is %.3f%% off (bound %g%%)', i, 100 * gaps[i],
                                    100 * SAME_WEIGHTS_BOUND)
    end
  end
  if #bad > 0 then fail('compare: %s (bound %g%%)', table.concat(bad, '; '), 100 * BOUND) end
  print(string.format('within %g%% of each other (steps 1-%d within %g%%)', 100 * BOUND, same, 100 * SAME_WEIGHTS_BOUND))
end

if mode == 'prepare' and arg[2] and arg[3] then prepare(arg[2], arg[3])
elseif mode == 'train' and arg[2] and arg[3] and (arg[4] == nil or arg[4] == 'built') then
  train(arg[2], arg[3], arg[4] == 'built')
elseif mode == 'compare' and arg[2] and arg[3] then compare(arg[2], arg[3])
else
  io.stderr:write('usage: dslua bench/curve.lua prepare DIR TEXT [key=value...] | train DIR OUT.json [built] '
                  .. '| compare OURS.json THEIRS.json\n')
  os.exit(2)
end
