-- The kernels of a training step: each residual add done by the norm
-- after it, the same bits as the unfused model; Llama's SwiGLU in one op,
-- which rounds less than silu then mul and so is held to the unfused
-- model's accuracy against f64, not to its bits (bit-equality stays the
-- rule for every other fusion here); and ds.kernel_calls() around a
-- step's forward, backward and step, counted per layer at 2 and 4 layers,
-- so one kernel more in each layer fails here.
local H = require 'helpers'
local ds = H.ds

local GPT = require 'models.gpt2'
local Llama = require 'models.llama'

local MODELS = {
  gpt2 = { build = GPT, cfg = { n_head = 4, n_embd = 32, vocab_size = 96, block_size = 16 } },
  llama = { build = Llama, cfg = { n_head = 4, n_kv_head = 2, n_embd = 32, vocab_size = 96, block_size = 16 } },
}

local function model(name, n_layer, extra)
  local cfg = { n_layer = n_layer }
  for k, v in pairs(MODELS[name].cfg) do cfg[k] = v end
  for k, v in pairs(extra or {}) do cfg[k] = v end
  ds.manual_seed(7)
  return MODELS[name].build(cfg)
end

local function batch()
  ds.manual_seed(11)
  local ids = (ds.rand(2, 17) * 96):to('i64')
  return ids:narrow(2, 1, 16):contiguous(), ids:narrow(2, 2, 16):contiguous()
end

-- The kernel calls fn makes.
local function calls(fn)
  local before = ds.kernel_calls()
  fn()
  return ds.kernel_calls() - before
end

describe('residual adds in the norms after them', function()
  local real = { add_layer_norm = ds.add_layer_norm, add_rms_norm = ds.add_rms_norm }
  local NORMS = { add_layer_norm = ds.layer_norm, add_rms_norm = ds.rms_norm }
  after_each(function()
    for name, fn in pairs(real) do ds[name] = fn end
  end)

  -- every residual add a separate kernel and the norm after it another: the model before the fusion
  local function unfuse()
    for name, norm in pairs(NORMS) do
      ds[name] = function(x, res, ...)
        local s = x + res
        return norm(s, ...), s
      end
    end
  end

  -- the loss, the logits and every gradient of m after loss's backward, as numbers
  local function results(m, loss, logits)
    loss:backward()
    local out = { loss = loss:to('f64'):item(), logits = logits:to('f64'):totable() }
    for _, p in ipairs(m:named_parameters()) do out[p.name] = p.tensor.grad:to('f64'):totable() end
    return out
  end

  -- run(...)'s results fused, then unfused, the same
  local function same_unfused(run, ...)
    local got = run(...)
    unfuse()
    local want = run(...)
    for key, v in pairs(want) do assert.are.same(v, got[key], key) end
  end

  local function run(name, extra)
    local m = model(name, 3, extra)
    local x, y = batch()
    local loss, logits = m(x, y)
    return results(m, loss, logits)
  end

  for _, name in ipairs({ 'gpt2', 'llama' }) do
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for _, ckpt in ipairs({ false, 1, 2 }) do
        it(string.format('%s %s, checkpoint %s: the loss, logits and every gradient of the unfused model exactly',
                         name, dt, tostring(ckpt)), function()
          same_unfused(run, name, { dtype = dt, checkpoint = ckpt })
        end)
      end
    end
  end

  -- the same for a pipeline of one stage over the model's pipe_layers
  local function run_pipe(name, interval)
    local layers, loss_fn = MODELS[name].build.pipe_layers(H.with(MODELS[name].cfg, { n_layer = 3 }))
    ds.manual_seed(7)
    local m = ds.pipe.PipelineModule { layers = layers, num_stages = 1, loss_fn = loss_fn,
                                       activation_checkpoint_interval = interval }
    local x, y = batch()
    local logits = m(x)
    return results(m, loss_fn(logits, y), logits)
  end

  for _, name in ipairs({ 'gpt2', 'llama' }) do
    for _, interval in ipairs({ 0, 1 }) do
      it(string.format('%s as a pipeline stage, checkpoint interval %d: the unfused stage\'s loss, logits and '
                       .. 'gradients exactly', name, interval), function()
        same_unfused(run_pipe, name, interval)
      end)
    end
  end

  it('takes the residual into every norm after one: GPT-2 and Llama call the fused norm 2 per layer', function()
    for name, norm in pairs({ gpt2 = 'add_layer_norm', llama = 'add_rms_norm' }) do
      local m, n = model(name, 3), 0
      ds[norm] = function(...)
        n = n + 1
        return real[norm](...)
      end
      m(batch())
      -- the first block's first norm has no residual before it; the final norm has the last MLP's
      assert.are.equal(2 * 3, n, name)
      n = 0
      local stage = ds.pipe.PipelineModule { layers = (MODELS[name].build.pipe_layers(H.with(MODELS[name].cfg,
                                                                                      { n_layer = 3 }))),
                                             num_stages = 1 }
      stage((batch()))
      ds[norm] = real[norm]
      assert.are.equal(2 * 3, n, name .. ' as a pipeline stage')
    end
  end)
end)

describe('Llama\'s SwiGLU in one op', function()
  local real = ds.swiglu
  after_each(function() ds.swiglu = real end)

  -- the loss and every gradient of one forward and backward, as f64 tensors; weights
  -- (name -> tensor) replace the model's own, so an f64 model runs the same values
  local function run(dt, ckpt, weights)
    local m = model('llama', 3, { dtype = dt, checkpoint = ckpt })
    if weights then
      ds.no_grad(function()
        for _, p in ipairs(m:named_parameters()) do p.tensor:copy_(weights[p.name]) end
      end)
    end
    local x, y = batch()
    local loss = m(x, y)
    loss:backward()
    local out, params = { loss = loss:to('f64') }, {}
    for _, p in ipairs(m:named_parameters()) do
      out[p.name] = p.tensor.grad:to('f64')
      params[p.name] = p.tensor:detach()
    end
    return out, params
  end

  local function norm(t) return (t * t):sum():sqrt():item() end

  for _, dt in ipairs({ 'f32', 'bf16' }) do
    for _, ckpt in ipairs({ false, 1 }) do
      it(string.format('%s, checkpoint %s: the loss and every gradient as close to f64 as silu then mul\'s', dt,
                       tostring(ckpt)), function()
        local got, weights = run(dt, ckpt)
        local ref = run('f64', ckpt, weights)
        ds.swiglu = function(g, u) return ds.silu(g) * u end
        local want = run(dt, ckpt)
        -- Each is the f64 result plus the rounding errors of its ops, the
        -- same ops but for SwiGLU, which rounds once where silu then mul
        -- round twice: the errors are of one size, twice the unfused
        -- one's allowing for them to add where the other's cancel, and
        -- one unit of the dtype's roundoff of the result for a tensor
        -- whose unfused error happens to vanish.
        local u = dt == 'f32' and 2 ^ -24 or 2 ^ -8
        for key, r in pairs(ref) do
          local e_got, e_want = norm(got[key] - r), norm(want[key] - r)
          assert(e_got <= 2 * e_want + u * norm(r),
                 string.format('%s: error %.3g against f64, the unfused model\'s %.3g', key, e_got, e_want))
        end
        if dt == 'f32' then    -- the same f32 SiLU and one product: the forward's bits
          assert.are.equal(want.loss:item(), got.loss:item())
        end
      end)
    end
  end

  it('is the MLP\'s one call per layer, on the same gate and up projections', function()
    local n = 0
    ds.swiglu = function(g, u)
      n = n + 1
      assert.are.same(g:size(), u:size())
      return real(g, u)
    end
    model('llama', 3)(batch())
    assert.are.equal(3, n)
  end)
end)

describe('kernel calls', function()
  -- forward, backward and step of one engine step after two (AdamW, clipping)
  local function step_calls(name, n_layer, dt)
    local engine = ds.initialize { model = model(name, n_layer), config = {
      train_batch_size = 2, steps_per_print = 1e9, gradient_clipping = 1.0, bf16 = { enabled = dt == 'bf16' },
      optimizer = { type = 'AdamW', params = { lr = 1e-3 } } } }
    local x, y = batch()
    for _ = 1, 2 do
      engine:backward(engine { x = x, y = y })
      engine:step()
    end
    local loss
    local f = calls(function() loss = engine { x = x, y = y } end)
    local b = calls(function() engine:backward(loss) end)
    return { f, b, calls(function() engine:step() end) }
  end

  -- Per layer, on the CPU. GPT-2 forward: ln_1, c_attn, attention, c_proj,
  -- ln_2 with the attention's residual, c_fc, GELU, c_proj (8; the MLP's
  -- residual is the next norm's); backward: the norms 2, attention 1, each
  -- Linear's input and weight gradients 2 (the bias's with the weight's)
  -- times 4, GELU 1 (12; the engine adds the parameters' gradients into
  -- its buffers a bucket at a time). Llama forward: 2 norms, 7 Linears,
  -- the rotary embedding of q and k, SwiGLU, attention (13; attention
  -- reads each kv head for its group of query heads, so k and v are not
  -- repeated; SwiGLU is silu(gate) * up in one kernel, where SiLU and the
  -- product took two); backward: 2 norms, 7 Linears' 2 each, the rotary
  -- embedding of q and k, the sums of the gradients of x's 3 uses 2 and
  -- of the MLP input's 2 uses 1, SwiGLU 1 (gate's and up's gradients
  -- together, where SiLU's and the product's two sides took 3),
  -- attention 1 (23; it sums a group's k and v gradients itself; q's, k's
  -- and v's gradients come in their projections' [B, T, H, D] layout).
  local PER_LAYER = { gpt2 = { 8, 12 }, llama = { 13, 23 } }
  -- Around the layers, measured: the embeddings (their index checks and
  -- gathers, GPT-2's position add), the final norm, the lm_head, the loss
  -- and the engine's own (its gradient buckets), each way (bf16: the
  -- embedding gradients' casts to and from their f32 sums); the step: the
  -- clip's norm and the optimizer. The layers' share is what a change to
  -- the blocks moves.
  local FIXED = {
    gpt2 = { f32 = { 16, 14, 5 }, bf16 = { 16, 18, 5 } },
    llama = { f32 = { 12, 10, 5 }, bf16 = { 12, 12, 5 } },
  }

  for _, name in ipairs({ 'gpt2', 'llama' }) do
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it(string.format('%s %s: a step makes fixed + per layer x n_layer, at 2 and 4 layers', name, dt), function()
        for _, n_layer in ipairs({ 2, 4 }) do
          local fixed, per = FIXED[name][dt], PER_LAYER[name]
          local want = { fixed[1] + per[1] * n_layer, fixed[2] + per[2] * n_layer, fixed[3] }
          assert.are.same(want, step_calls(name, n_layer, dt), string.format('%s %s %d layers', name, dt, n_layer))
        end
      end)
    end
  end

  it('a Linear with a bias: one call forward, two backward (its bias gradient with the weight\'s)', function()
    local lin = ds.nn.Linear(8, 4)
    local x, g = ds.randn(3, 8):requires_grad_(), ds.randn(3, 4)
    local y
    assert.are.equal(1, calls(function() y = lin(x) end))
    assert.are.equal(2, calls(function() y:backward(g) end))
    assert.are.same((g:t() * ds.ones(3)):sum(2):totable(), lin.bias.grad:totable())
  end)

  it('a product with a constant runs no kernel for the constant\'s gradient', function()
    local x, c = ds.randn(4, 6):requires_grad_(), ds.randn(6)
    local y = x * c
    local g = ds.randn(4, 6)
    assert.are.equal(1, calls(function() y:backward(g) end))
    assert.is_nil(c.grad)
  end)

  it('rope gives its input\'s gradient in the input\'s layout: transposed heads go back with no copy', function()
    local p = ds.randn(2, 5, 3, 8):requires_grad_()         -- [B, T, H, D], seen as heads [B, H, T, D]
    local cos, sin, g = ds.randn(5, 8), ds.randn(5, 8), ds.randn(2, 3, 5, 8)
    local y = ds.rope(p:transpose(2, 3), cos, sin)
    assert.are.equal(1, calls(function() y:backward(g) end))
    assert.is_true(p.grad:is_contiguous())
  end)

  it('repeat_interleave sums its repeats into the input\'s layout: transposed heads go back with no copy', function()
    local p = ds.randn(2, 5, 3, 8):requires_grad_()
    local y, g = p:transpose(2, 3):repeat_interleave(2, 2), ds.randn(2, 6, 5, 8)
    assert.are.equal(1, calls(function() y:backward(g) end))     -- the add of the 2 repeats
    assert.is_true(p.grad:is_contiguous())
  end)

  it('cat hands its inputs views of the gradient, copying nothing', function()
    local a, b = ds.randn(2, 3):requires_grad_(), ds.randn(2, 5):requires_grad_()
    local y = ds.cat({ a:tanh(), b:tanh() }, 2)
    local g = ds.randn(2, 8)
    assert.are.equal(2, calls(function() y:backward(g) end))     -- the two tanh's backward alone
    local a2 = a:detach():requires_grad_()
    a2:tanh():backward(g:narrow(2, 1, 3):contiguous())
    assert.are.same(a2.grad:totable(), a.grad:totable())
  end)
end)
