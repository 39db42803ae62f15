-- models/: GPT-2 and the Llama-style decoder against PyTorch references
-- that share their initial weights (spec/fixtures/gen_models.py): logits,
-- loss and every gradient, and GPT-2's loss over 50 AdamW steps; then the
-- configurations, sampling, the MLP and the CNN.
local H = require 'helpers'
local ffi = require 'ffi'
local ds = H.ds

local GPT = require 'models.gpt2'
local Llama = require 'models.llama'

local fails = H.fails

local function shape(t) return table.concat(t:size(), 'x') end

-- "name:shape" of each parameter of m, in order
local function param_shapes(m)
  local names = {}
  for i, p in ipairs(m:named_parameters()) do names[i] = p.name .. ':' .. shape(p.tensor) end
  return names
end

-- ---- fixture records: base64 of little-endian int16 (times scale) or float32 ----

local B64 = {}
do
  local alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
  for i = 1, 64 do B64[alphabet:byte(i)] = i - 1 end
end

local function unbase64(s)
  local out, n = {}, 0
  for i = 1, #s, 4 do
    local a, b, c, d = s:byte(i, i + 3)
    local v = B64[a] * 262144 + B64[b] * 4096 + (B64[c] or 0) * 64 + (B64[d] or 0)
    n = n + 1
    out[n] = string.char(math.floor(v / 65536), math.floor(v / 256) % 256, v % 256)
    if d == 61 then out[n] = out[n]:sub(1, c == 61 and 1 or 2) end    -- '=' padding
  end
  return table.concat(out)
end

local function record(rec)
  local bytes = unbase64(rec.i16 or rec.f32)
  local n = #bytes / (rec.i16 and 2 or 4)
  local p = ffi.cast(rec.i16 and 'const int16_t *' or 'const float *', bytes)
  local scale, vals = rec.scale or 1, {}
  for i = 0, n - 1 do vals[i + 1] = p[i] * scale end
  return ds.tensor(vals, 'f32'):reshape(rec.shape)
end

local function state(weights)
  local sd = {}
  for name, rec in pairs(weights) do sd[name] = record(rec) end
  return sd
end

local function rel_diff(a, b) return math.abs(a - b) / math.abs(b) end

local function max_rel(a, b)
  local scale = b:to('f64'):abs():amax():item()
  return (a:to('f64') - b:to('f64')):abs():amax():item() / scale
end

-- Every gradient against PyTorch's: elementwise within 5e-5 of the
-- tensor's largest value (the fixture's int16 grid is 1.5e-5 of it), and
-- the norm (exact in the fixture) within 1e-5 relative. Returns the worst
-- elementwise and norm figures.
local function check_grads(model, grads)
  local worst, worst_norm, n = 0, 0, 0
  for _, p in ipairs(model:named_parameters()) do
    local rec = assert(grads[p.name], 'no reference gradient for ' .. p.name)
    assert.is_not_nil(p.tensor.grad, 'no gradient for ' .. p.name)
    local g = p.tensor.grad
    assert.are.equal(table.concat(rec.shape, 'x'), shape(g), p.name)
    local d = (g:to('f64') - record(rec):to('f64')):abs():amax():item() / rec.maxabs
    assert.is_true(d < 5e-5, string.format('%s: gradient off by %.3g of its largest value', p.name, d))
    local nd = rel_diff(g:to('f64'):norm():item(), rec.norm)
    assert.is_true(nd < 1e-5, string.format('%s: gradient norm off by %.3g relative', p.name, nd))
    worst, worst_norm = math.max(worst, d), math.max(worst_norm, nd)
    n = n + 1
  end
  local count = 0
  for _ in pairs(grads) do count = count + 1 end
  assert.are.equal(count, n)
  return worst, worst_norm
end

local function gpt_from_fixture(F)
  local model = GPT(F.config)
  model:load_state_dict(state(F.weights))
  return model
end

describe('models.gpt2 against PyTorch (nanoGPT, same initial weights)', function()
  local F = H.fixture('models_gpt2')

  it('has exactly torch\'s state_dict names, the head tied to wte', function()
    local model = GPT(F.config)
    local keys = model:state_keys()
    local want = {}
    for k in pairs(F.weights) do want[#want + 1] = k end
    table.sort(want)
    table.sort(keys)
    assert.are.same(want, keys)
    assert.is_true(rawequal(model.lm_head.weight, model.transformer.wte.weight))
    assert.are.equal(#keys - 1, #model:named_parameters())
  end)

  it('gives PyTorch\'s logits and loss for the initial weights', function()
    local model = gpt_from_fixture(F)
    local b = H.token_batch(F.windows[1], F.batch, F.seq)
    local loss, logits = model(b)
    local dl = max_rel(logits, record(F.logits))
    local dloss = rel_diff(loss:item(), F.loss)
    print(string.format('gpt2 forward parity: logits max diff %.3g of max |logit|, loss rel diff %.3g', dl, dloss))
    assert.is_true(dl < 1e-5)
    assert.is_true(dloss < 1e-6)
    assert.are.equal(0, (model(b.x) - logits):abs():amax():item())
    assert.are.equal(loss:item(), model(b.x, b.y):item())
  end)

  it('gives PyTorch\'s gradient for every parameter', function()
    local model = gpt_from_fixture(F)
    model(H.token_batch(F.windows[1], F.batch, F.seq)):backward()
    local worst, worst_norm = check_grads(model, H.fixture('models_gpt2_grads').grads)
    print(string.format('gpt2 gradient parity: worst element off by %.3g of its tensor\'s max |grad|, '
                        .. 'worst norm rel diff %.3g', worst, worst_norm))
  end)

  it('follows PyTorch\'s loss over 50 AdamW steps within 1e-4 relative', function()
    if not (ds.optim and ds.optim.AdamW) then
      pending('ds.optim.AdamW is not available yet')
      return
    end
    local model = gpt_from_fixture(F)
    -- weight decay on every parameter, as the reference applies it
    local opt = ds.optim.AdamW(model:parameters(), { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
    local worst = 0
    for step, w in ipairs(F.windows) do
      local loss = model(H.token_batch(w, F.batch, F.seq))
      local d = rel_diff(loss:item(), F.losses[step])
      assert.is_true(d < 1e-4, string.format('step %d: loss %.9g, PyTorch %.9g (rel diff %.3g)', step, loss:item(),
                                             F.losses[step], d))
      worst = math.max(worst, d)
      opt:zero_grad()
      loss:backward()
      opt:step()
    end
    assert.are.equal(50, #F.losses)
    assert.is_true(F.losses[50] < F.losses[1] - 0.3)
    print(string.format('gpt2 training parity: 50 AdamW steps, loss %.4f -> %.4f, max relative loss diff %.3g',
                        F.losses[1], F.losses[50], worst))
  end)
end)

describe('models.llama against PyTorch (rotate_half rotary, GQA, same initial weights)', function()
  local F = H.fixture('models_llama')
  local cfg = {}
  for k, v in pairs(F.config) do cfg[k] = v end

  it('has Hugging Face\'s state_dict names', function()
    local keys = Llama(cfg):state_keys()
    local want = {}
    for k in pairs(F.weights) do want[#want + 1] = k end
    table.sort(want)
    table.sort(keys)
    assert.are.same(want, keys)
  end)

  it('gives PyTorch\'s logits, loss and every gradient', function()
    local model = Llama(cfg)
    model:load_state_dict(state(F.weights))
    local loss, logits = model(H.token_batch(F.window, F.batch, F.seq))
    local dl, dloss = max_rel(logits, record(F.logits)), rel_diff(loss:item(), F.loss)
    loss:backward()
    local worst, worst_norm = check_grads(model, F.grads)
    print(string.format('llama parity: logits max diff %.3g of max |logit|, loss rel diff %.3g, '
                        .. 'worst gradient element %.3g of its max, worst gradient norm rel diff %.3g',
                        dl, dloss, worst, worst_norm))
    assert.is_true(dl < 1e-5)
    assert.is_true(dloss < 1e-6)
  end)
end)

describe('models.gpt2', function()
  local tiny = { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 11, block_size = 8 }

  it('builds the 124M configuration by name', function()
    local model = GPT 'gpt2'
    local c = model.config
    assert.are.same({ 12, 12, 768, 50257, 1024 }, { c.n_layer, c.n_head, c.n_embd, c.vocab_size, c.block_size })
    assert.are.equal(124439808, model:num_parameters())
    assert.are.equal(123653376, model:num_params())
    assert.are.equal(12, #model.transformer.h)
    -- nanoGPT's init: N(0, 0.02), residual projections N(0, 0.02/sqrt(24))
    local std = math.sqrt(model.transformer.h[1].mlp.c_fc.weight:to('f64'):var():item())
    local std_proj = math.sqrt(model.transformer.h[1].attn.c_proj.weight:to('f64'):var():item())
    assert.is_true(math.abs(std / 0.02 - 1) < 0.01)
    assert.is_true(math.abs(std_proj / (0.02 / math.sqrt(24)) - 1) < 0.01)
    assert.are.equal(0, model.transformer.h[1].attn.c_attn.bias:abs():amax():item())
  end)

  it('takes named sizes with overrides and rejects bad configs', function()
    local m = GPT { name = 'gpt-nano', vocab_size = 10, block_size = 4 }
    assert.are.same({ 3, 3, 48, 10 }, { m.config.n_layer, m.config.n_head, m.config.n_embd, m.config.vocab_size })
    fails("gpt2: unknown config 'gpt3'", GPT, 'gpt3')
    fails("gpt2: unknown config key 'n_layers'", GPT, { n_layers = 2 })
    fails('gpt2: n_embd 10 is not divisible by n_head 3', GPT, { n_embd = 10, n_head = 3, n_layer = 1 })
    fails('gpt2: block_size must be a positive integer, got 0', GPT, { block_size = 0 })
  end)

  it('returns logits without targets and refuses sequences past block_size', function()
    local m = GPT(tiny)
    assert.are.equal('3x5x11', shape(m(ds.zeros({ 3, 5 }, 'i64'))))
    fails('GPT: cannot forward sequence of length 9, block size is only 8', m, ds.zeros({ 1, 9 }, 'i64'))
    fails('GPT: expected token ids %[B, T%], got %[4%]', m, ds.zeros({ 4 }, 'i64'))
  end)

  describe('a block', function()
    local real = ds.add_layer_norm
    after_each(function() ds.add_layer_norm = real end)

    it('adds its attention residual and runs the second norm as one op, as the unfused block', function()
      local blk = GPT(tiny).transformer.h[1]
      local calls = 0
      ds.add_layer_norm = function(...)
        calls = calls + 1
        return real(...)
      end
      local x = ds.randn(2, 5, 16)
      local y = blk(x)
      assert.are.equal(1, calls)
      local h = x + blk.attn(blk.ln_1(x))
      assert.are.same((h + blk.mlp(blk.ln_2(h))):totable(), y:totable())
    end)
  end)

  it('takes either attention backend with the same loss and gradients', function()
    local x = ds.tensor({ { 1, 2, 3, 4, 5 }, { 6, 7, 8, 9, 10 } }, 'i64')
    local function run(backend)
      ds.manual_seed(5)
      local cfg = {}
      for k, v in pairs(tiny) do cfg[k] = v end
      cfg.attention_backend = backend
      local m = GPT(cfg)
      local loss = m(x, x)
      loss:backward()
      return loss, m.transformer.h[1].attn.c_attn.weight.grad
    end
    local lf, gf = run('fused')
    local lm, gm = run('math')
    H.assert_close(lm, lf, { rtol = 1e-6, atol = 1e-6 })
    H.assert_close(gm, gf, { rtol = 1e-5, atol = 1e-6 })
    fails("attention_backend must be 'auto', 'fused' or 'math', got flash", GPT, { attention_backend = 'flash' })
  end)

  it('ignores targets of -1, as nanoGPT', function()
    local m = GPT(tiny)
    local x = ds.tensor({ { 1, 2, 3, 4 } }, 'i64')
    local _, logits = m(x, ds.tensor({ { 2, 3, 4, 5 } }, 'i64'))
    local part = m(x, ds.tensor({ { 2, -1, 4, -1 } }, 'i64'))
    local want = ds.cross_entropy(logits:narrow(2, 1, 1):reshape({ 1, 11 }), ds.tensor({ 2 }, 'i64')) +
                 ds.cross_entropy(logits:narrow(2, 3, 1):reshape({ 1, 11 }), ds.tensor({ 4 }, 'i64'))
    assert.is_true(math.abs(part:item() - want:item() / 2) < 1e-5)
  end)

  it('pads the vocab (padded_vocab_size): the loss and logits of the unpadded model on the same weights', function()
    ds.manual_seed(5)
    local m = GPT(tiny)
    local p = GPT { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 11, block_size = 8, padded_vocab_size = 16 }
    assert.are.equal('16x16', shape(p.transformer.wte.weight))
    assert.is_true(p.lm_head.weight == p.transformer.wte.weight)
    assert.are.equal(0, p.transformer.wte.weight:narrow(1, 12, 5):abs():amax():item())
    local sd = m:state_dict()
    local wte = ds.zeros({ 16, 16 })
    wte:narrow(1, 1, 11):copy_(sd['transformer.wte.weight'])
    sd['transformer.wte.weight'], sd['lm_head.weight'] = wte, wte
    p:load_state_dict(sd)
    local x, y = ds.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 10 } }, 'i64'), ds.tensor({ { 2, -1, 4, 5 }, { 6, 7, 10, 0 } }, 'i64')
    local lm, logits_m = m(x, y)
    local lp, logits_p = p(x, y)
    assert.is_true(math.abs(lm:item() - lp:item()) <= 1e-6, string.format('%.9g vs %.9g', lm:item(), lp:item()))
    assert.are.equal('2x4x11', shape(logits_p))
    assert.is_true((logits_m - logits_p):abs():amax():item() <= 1e-6)
    lp:backward()
    assert.are.equal(0, p.transformer.wte.weight.grad:narrow(1, 12, 5):abs():amax():item())
    assert.are.equal('2x12', shape(p:generate(x, 8, { temperature = 0 })))
    assert.are.same(m:generate(x, 8, { temperature = 0 }):totable(), p:generate(x, 8, { temperature = 0 }):totable())
    fails('gpt2: padded_vocab_size must be false or an integer >= vocab_size 11, got 8', GPT,
          { n_layer = 1, n_head = 2, n_embd = 16, vocab_size = 11, block_size = 8, padded_vocab_size = 8 })
  end)

  it('uses dropout only in training', function()
    local m = GPT { n_layer = 1, n_head = 2, n_embd = 16, vocab_size = 11, block_size = 8, dropout = 0.2 }
    local x = ds.tensor({ { 1, 2, 3, 4 } }, 'i64')
    m:eval()
    local a, b = m(x), m(x)
    assert.are.equal(0, (a - b):abs():amax():item())
    m:train()
    assert.is_true((m(x) - a):abs():amax():item() > 0)
  end)

  it('generates: greedy is repeatable, top_k = 1 is greedy, context is cropped', function()
    local m = GPT(tiny)
    local start = ds.tensor({ { 1, 2 }, { 3, 4 } }, 'i64')
    local g = m:generate(start, 10, { temperature = 0 })
    assert.are.equal('2x12', shape(g))
    assert.are.equal('cpu', m:device())
    assert.are.equal('cpu', g:device())
    assert.are.equal('cpu', ds.nn.Module():device())        -- no parameters: the CPU
    assert.are.equal(0, (g:narrow(2, 1, 2) - start):abs():amax():item())
    assert.are.same(g:totable(), m:generate(start, 10, { temperature = 0 }):totable())
    assert.are.same(g:totable(), m:generate(start, 10, { top_k = 1 }):totable())
    ds.manual_seed(3)
    local s1 = m:generate(start, 6, { temperature = 1.5, top_k = 5 })
    ds.manual_seed(3)
    assert.are.same(s1:totable(), m:generate(start, 6, { temperature = 1.5, top_k = 5 }):totable())
    for _, row in ipairs(s1:totable()) do
      for _, id in ipairs(row) do assert.is_true(id >= 0 and id < 11) end
    end
    assert.is_true(m.training)
    fails('generate: temperature must be a number >= 0', m.generate, m, start, 1, { temperature = -1 })
    fails("generate: unknown option 'topk'", m.generate, m, start, 1, { topk = 2 })
  end)

  it('greedy generation follows the argmax of the full forward', function()
    local m = GPT(tiny)
    local start = ds.tensor({ { 5, 6, 7 } }, 'i64')
    local g = m:generate(start, 1, { temperature = 0 })
    local want = m(start):narrow(2, 3, 1):reshape({ 11 }):argmax():item()
    assert.are.equal(want, g:totable()[1][4])
  end)
end)

describe('models.llama', function()
  local tiny = { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 16, vocab_size = 13, block_size = 8 }

  it('fills intermediate_size by Llama\'s rule and n_kv_head from n_head', function()
    local c = Llama.config { n_embd = 4096, n_head = 32 }
    assert.are.equal(11008, c.intermediate_size)
    assert.are.equal(32, c.n_kv_head)
    local m = Llama(tiny)
    assert.are.equal(256, m.config.intermediate_size)
    assert.are.equal('8x16', shape(m.model.layers[1].self_attn.k_proj.weight))
  end)

  it('ties or unties the head', function()
    assert.is_false(rawequal(Llama(tiny).lm_head.weight, Llama(tiny).model.embed_tokens.weight))
    local cfg = { tie_embeddings = true }
    for k, v in pairs(tiny) do cfg[k] = v end
    local m = Llama(cfg)
    assert.is_true(rawequal(m.lm_head.weight, m.model.embed_tokens.weight))
    local keys = m:state_keys()
    assert.are.equal(#keys - 1, #m:named_parameters())
  end)

  describe('attention on grouped k and v', function()
    local sdpa = ds.scaled_dot_product_attention
    after_each(function() ds.scaled_dot_product_attention = sdpa end)

    it('gives the loss and every gradient of repeating k and v first, to the bit (f32 and bf16)', function()
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        local function run(repeated)
          ds.manual_seed(3)
          local cfg = { dtype = dt }
          for k, v in pairs(tiny) do cfg[k] = v end
          local m = Llama(cfg)
          ds.scaled_dot_product_attention = repeated and function(q, k, v, opts)
            local r = q:size(2) / k:size(2)
            return sdpa(q, k:repeat_interleave(r, 2), v:repeat_interleave(r, 2), opts)
          end or sdpa
          local x = ds.tensor({ { 1, 5, 2, 7, 3, 9, 4, 0 } }, 'i64')
          local loss = m { x = x, y = x }
          loss:backward()
          ds.scaled_dot_product_attention = sdpa
          return loss, m:named_parameters()
        end
        local la, pa = run(false)
        local lb, pb = run(true)
        H.assert_same(la, lb, dt .. ' loss')
        for i, p in ipairs(pa) do H.assert_same(p[2].grad, pb[i][2].grad, dt .. ' ' .. p[1]) end
      end
    end)
  end)

  it('with n_kv_head = n_head equals grouped attention with the kv weights repeated', function()
    local gqa = Llama(tiny)
    local cfg = {}
    for k, v in pairs(tiny) do cfg[k] = v end
    cfg.n_kv_head = 4
    local mha = Llama(cfg)
    local sd = gqa:state_dict()
    for l = 0, 1 do
      for _, w in ipairs({ 'k_proj', 'v_proj' }) do
        local key = string.format('model.layers.%d.self_attn.%s.weight', l, w)
        local h = sd[key]:split(4, 1)         -- two kv heads of 4 rows, each shared by two query heads
        sd[key] = ds.cat({ h[1], h[1], h[2], h[2] }, 1)
      end
    end
    mha:load_state_dict(sd)
    local x = ds.tensor({ { 1, 5, 2, 7, 3 } }, 'i64')
    assert.is_true((gqa(x) - mha(x)):abs():amax():item() < 1e-5)
  end)

  it('generates and refuses bad configs', function()
    local m = Llama(tiny)
    assert.are.equal('1x7', shape(m:generate(ds.tensor({ { 1, 2 } }, 'i64'), 5, { temperature = 0.7 })))
    assert.are.equal('2x3x13', shape(m(ds.zeros({ 2, 3 }, 'i64'))))
    fails('llama: n_head 4 is not a multiple of n_kv_head 3', Llama, { n_head = 4, n_kv_head = 3, n_embd = 16 })
    fails('llama: n_embd 12 must split into n_head 4 heads of an even size', Llama, { n_head = 4, n_embd = 12 })
    fails("llama: unknown config key 'kv_heads'", Llama, { kv_heads = 2 })
    fails('Llama: cannot forward sequence of length 9, block size is only 8', m, ds.zeros({ 1, 9 }, 'i64'))
  end)
end)

describe('models.gpt2 and models.llama at a vocab not a multiple of 64 (pad_vocab)', function()
  local V = 1001                  -- GPT-2's 50257 in small: 1001 = 15 x 64 + 41
  local models = {
    { 'gpt2', GPT, { n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }, 'transformer.wte.weight' },
    { 'llama', Llama, { n_layer = 2, n_head = 4, n_kv_head = 2, n_embd = 16, block_size = 8 }, 'model.embed_tokens.weight' },
  }
  local function build(M, base, pad)
    local cfg = { vocab_size = V, dtype = 'f64', pad_vocab = pad }
    for k, v in pairs(base) do cfg[k] = v end
    return M(cfg)
  end
  -- f64: the padded GEMMs add only zeros to the unpadded ones' sums, in
  -- another order at most, so they agree to rounding of ~1e-16 per term
  local function close(a, b, what)
    local d, scale = (a - b):abs():amax():item(), a:abs():amax():item()
    assert.is_true(d <= 1e-12 * (1 + scale), string.format('%s differs by %g (largest %g)', what, d, scale))
  end

  for _, m in ipairs(models) do
    local name, M, base, embed = m[1], m[2], m[3], m[4]
    it(name .. ': the loss, logits and every gradient of the unpadded model; the real vocab everywhere else', function()
      ds.manual_seed(9)
      local plain, padded = build(M, base, false), build(M, base, 64)
      padded:load_state_dict(plain:state_dict())
      -- the GEMM runs on 1024 rows, on the CPU only when asked
      assert.are.equal(1024, padded.lm_head(ds.randn({ 3, 16 }, 'f64')):size(2))
      assert.are.equal(V, build(M, base, 'auto').lm_head(ds.randn({ 3, 16 }, 'f64')):size(2))
      -- what the user sees: parameters and state_dict of the real vocab
      local sd = padded:state_dict()
      assert.are.equal(V .. 'x16', shape(sd['lm_head.weight']))
      assert.are.equal(V .. 'x16', shape(sd[embed]))
      local n = 0
      for _, e in ipairs(padded:named_parameters()) do
        assert.are.equal(shape(plain:state_dict()[e[1]]), shape(e[2]), e[1])
        n = n + e[2]:numel()
      end
      assert.are.equal(plain:num_parameters(), n)
      -- targets at the top of the vocab, where the padded columns follow
      local x = ds.tensor({ { 1, 999, 1000, 4 }, { 1000, 6, 7, 998 } }, 'i64')
      local y = ds.tensor({ { 1000, 999, 4, 5 }, { 6, 1000, 998, 0 } }, 'i64')
      local l0, logits0 = plain(x, y)
      local l1, logits1 = padded(x, y)
      assert.are.equal('2x4x' .. V, shape(logits1))
      close(l0, l1, 'the loss')
      close(logits0, logits1, 'the logits')
      assert.are.equal('2x4x' .. V, shape(padded(x)))
      l0:backward()
      l1:backward()
      local g0 = {}
      for _, e in ipairs(plain:named_parameters()) do g0[e[1]] = e[2].grad end
      for _, e in ipairs(padded:named_parameters()) do close(g0[e[1]], e[2].grad, e[1] .. "'s gradient") end
      -- a padded column never wins: greedy sampling picks what the unpadded model picks
      assert.are.same(plain:generate(x, 4, { temperature = 0 }):totable(),
                      padded:generate(x, 4, { temperature = 0 }):totable())
      fails(name .. ": pad_vocab must be 'auto', false or an integer >= 1, got 0", build, M, base, 0)
    end)
  end
end)

describe('models.mlp', function()
  it('is 784-256-10 by default with torch names', function()
    local m = require('models.mlp')()
    local names = param_shapes(m)
    assert.are.equal('net.0.weight:256x784 net.0.bias:256 net.2.weight:10x256 net.2.bias:10', table.concat(names, ' '))
    local x = ds.randn({ 4, 1, 28, 28 })
    assert.are.equal('4x10', shape(m(x)))
    local loss, logits = m { x = x, y = ds.tensor({ 1, 2, 3, 4 }, 'i64') }
    assert.are.equal(0, loss:dim())
    assert.are.equal('4x10', shape(logits))
  end)

  it('learns a fixed batch with plain gradient descent', function()
    ds.manual_seed(1)
    local m = require('models.mlp') { input_size = 20, hidden = { 32, 16 }, num_classes = 3, activation = 'gelu' }
    local b = { x = ds.randn({ 16, 20 }), y = ds.tensor({ 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0 }, 'i64') }
    local first
    for _ = 1, 60 do
      local loss = m(b)
      first = first or loss:item()
      m:zero_grad()
      loss:backward()
      ds.no_grad(function()
        for _, p in ipairs(m:parameters()) do p:sub_(p.grad * 0.5) end
      end)
    end
    assert.is_true(m(b):item() < first * 0.2)
  end)

  it('refuses bad configs and inputs', function()
    local MLP = require('models.mlp')
    fails("mlp: unknown config key 'hiden'", MLP, { hiden = 3 })
    fails("mlp: activation must be relu, gelu, silu or tanh, got 'elu'", MLP, { activation = 'elu' })
    fails('mlp: hidden%[2%] must be a positive integer, got 0', MLP, { hidden = { 3, 0 } })
    fails('MLP: expected inputs %[B, ...%] of 784 features each, got %[2x3%]', MLP(), ds.zeros({ 2, 3 }))
  end)
end)

describe('models.cnn', function()
  it('takes CIFAR images by default with torch names', function()
    local m = require('models.cnn')()
    local names = param_shapes(m)
    assert.are.equal('features.0.weight:32x3x3x3 features.0.bias:32 features.3.weight:64x32x3x3 features.3.bias:64 '
                     .. 'classifier.0.weight:128x4096 classifier.0.bias:128 classifier.2.weight:10x128 '
                     .. 'classifier.2.bias:10', table.concat(names, ' '))
    assert.are.equal('2x10', shape(m(ds.randn({ 2, 3, 32, 32 }))))
  end)

  it('takes MNIST images with a config and trains', function()
    local m = require('models.cnn') { in_channels = 1, image_size = 28, channels = { 4, 8 }, hidden = 16, dropout = 0.1 }
    assert.are.equal(8 * 7 * 7, m.flat)
    local loss, logits = m { x = ds.randn({ 3, 1, 28, 28 }), y = ds.tensor({ 1, 0, 9 }, 'i64') }
    assert.are.equal('3x10', shape(logits))
    loss:backward()
    assert.is_not_nil(m.features[1].weight.grad)
    m:eval()
    local x = ds.randn({ 1, 1, 28, 28 })
    assert.are.equal(0, (m(x) - m(x)):abs():amax():item())
  end)

  it('refuses bad configs and inputs', function()
    local CNN = require('models.cnn')
    fails('cnn: kernel_size must be odd, got 4', CNN, { kernel_size = 4 })
    fails('cnn: 4 pooling stages shrink a 8x8 image to nothing', CNN, { image_size = 8, channels = { 1, 1, 1, 1 } })
    fails('CNN: expected images %[B, 3, 32, 32%], got %[2x1x28x28%]', CNN(), ds.zeros({ 2, 1, 28, 28 }))
  end)
end)
