-- ds.checkpoint: recomputing in backward gives the gradients of keeping
-- every activation (same ops, same order: exactly), dropout draws the same
-- masks both times, and fewer activation bytes are alive at the peak.
local H = require 'helpers'
local ds = H.ds
local GPT = require 'models.gpt2'
local Llama = require 'models.llama'

local function max_diff(a, b) return (a - b):abs():amax():item() end

-- a tiny MLP block with dropout, and its gradients with and without ds.checkpoint
local function mlp_grads(checkpointed, p)
  ds.manual_seed(11)
  local fc1, fc2 = ds.nn.Linear(6, 16), ds.nn.Linear(16, 6)
  local drop = ds.nn.Dropout(p)
  local x = ds.randn(5, 6):requires_grad_(true)
  local function block(h, scale) return fc2(drop(fc1(h):tanh())) * scale end
  local y = checkpointed and ds.checkpoint(block, x, 0.5) or block(x, 0.5)
  local after_forward = ds.get_rng_state()
  y:pow(2):sum():backward()
  return { x = x.grad, w1 = fc1.weight.grad, b1 = fc1.bias.grad, w2 = fc2.weight.grad, y = y:detach() },
         after_forward, ds.get_rng_state()
end

local function model_grads(model, ids, targets)
  local loss = model(ids, targets)
  loss:backward()
  local g = {}
  for _, p in ipairs(model:named_parameters()) do g[p[1]] = p[2].grad end
  return loss:item(), g
end

local function gpt(checkpoint, dropout)
  ds.manual_seed(5)
  return GPT { n_layer = 4, n_head = 2, n_embd = 32, vocab_size = 50, block_size = 16, dropout = dropout,
               checkpoint = checkpoint }
end

local function tokens()
  ds.manual_seed(9)
  local function ids() return (ds.rand(4, 16) * 49.99):to('i64') end
  return ids(), ids()
end

describe('ds.checkpoint', function()
  it('gives the gradients of no checkpointing, exactly, and keeps the random stream', function()
    local plain, rng1, rng1b = mlp_grads(false, 0)
    local ckpt, rng2, rng2b = mlp_grads(true, 0)
    for k, g in pairs(plain) do assert.are.equal(0, max_diff(ckpt[k], g), k) end
    assert.are.equal(rng1, rng2)
    assert.are.equal(rng1b, rng2b)   -- the replay in backward leaves the stream where it was
  end)

  it('replays the random state, so dropout draws the same masks in backward', function()
    local plain = mlp_grads(false, 0.5)
    local ckpt = mlp_grads(true, 0.5)
    for k, g in pairs(plain) do assert.are.equal(0, max_diff(ckpt[k], g), k) end
    assert.is_true(max_diff(plain.w1, mlp_grads(false, 0).w1) > 1e-3)   -- dropout did drop
  end)

  it('records a checkpoint node, and none with autograd off', function()
    local lin = ds.nn.Linear(3, 3)
    local x = ds.randn(2, 3)
    assert.are.equal('checkpoint', ds.checkpoint(lin, x).grad_fn)   -- x needs no grad; lin's weights do
    local y = ds.no_grad(ds.checkpoint, lin, x)
    assert.is_false(y.requires_grad)
    lin(x):sum():backward()
    local want = lin.weight.grad:clone()
    lin.weight.grad, lin.bias.grad = nil, nil
    ds.checkpoint(lin, x):sum():backward()
    assert.are.equal(0, max_diff(lin.weight.grad, want))
  end)

  it('names what is wrong', function()
    H.fails('expected a function to run, got a number', ds.checkpoint, 42)
    H.fails('fn must return one tensor, it returned a number', ds.checkpoint, function() return 1 end)
    -- fn fails only when backward recomputes it
    local calls = 0
    local x = ds.randn(2, 2):requires_grad_(true)
    local y = ds.checkpoint(function(h)
      calls = calls + 1
      if calls > 1 then error('second call fails') end
      return h * 2
    end, x)
    H.fails('backward of checkpoint: ds.checkpoint: recomputing in backward: .*second call fails',
            function() y:sum():backward() end)
  end)

  it('leaves ds.checkpoint.save and the checkpoint files module as they were', function()
    assert.is_function(ds.checkpoint.save)
    assert.is_function(ds.checkpointing.checkpoint)
  end)
end)

describe('the checkpoint option of models.gpt2 and models.llama', function()
  it('gpt2: same loss and gradients (fp32, dropout on) as keeping every activation', function()
    local ids, targets = tokens()
    local l0, g0 = model_grads(gpt(false, 0.1), ids, targets)
    for _, every in ipairs { true, 3 } do
      local l1, g1 = model_grads(gpt(every, 0.1), ids, targets)
      assert.are.equal(l0, l1)
      for name, g in pairs(g0) do
        assert(max_diff(g1[name], g) <= 1e-6, name .. ' with checkpoint=' .. tostring(every))
      end
    end
  end)

  it('llama: same loss and gradients as keeping every activation', function()
    local ids, targets = tokens()
    local function llama(every)
      ds.manual_seed(5)
      return Llama { n_layer = 3, n_head = 2, n_embd = 32, vocab_size = 50, block_size = 16, multiple_of = 16,
                     checkpoint = every }
    end
    local l0, g0 = model_grads(llama(false), ids, targets)
    local l1, g1 = model_grads(llama(2), ids, targets)
    assert.are.equal(l0, l1)
    for name, g in pairs(g0) do assert(max_diff(g1[name], g) <= 1e-6, name) end
  end)

  it('gpt2: fewer activation bytes at the peak of forward and backward', function()
    local ids, targets = tokens()
    local function peak(every)
      local model = gpt(every, 0.1)
      collectgarbage()
      ds.reset_peak_memory()
      model(ids, targets):backward()
      local p = ds.memory_stats().peak
      return p.activations, p.total
    end
    local none, none_total = peak(false)
    local each, each_total = peak(true)
    print(string.format('gpt2 4 layers: peak activation bytes %d with checkpoint=true, %d without (%.2fx); '
                        .. 'peak bytes in all %.2fx', each, none, each / none, each_total / none_total))
    assert.is_true(each < 0.5 * none)
    assert.is_true(each_total < none_total)
  end)

  it('rejects a checkpoint option that is not false, true or a block count', function()
    H.fails('gpt2: checkpoint must be false, true or a positive number of blocks per segment, got 0',
            GPT, { n_layer = 2, n_head = 2, n_embd = 8, checkpoint = 0 })
  end)
end)

describe('the activation_checkpointing config block', function()
  local base = { train_micro_batch_size_per_gpu = 1 }
  local function load(block)
    local c = {}
    for k, v in pairs(base) do c[k] = v end
    c.activation_checkpointing = block
    return ds.config.load(c, { world_size = 1 })
  end

  it("is read with DeepSpeed's keys and defaults", function()
    local cfg = load({ number_checkpoints = 4 })
    local a = cfg.activation_checkpointing
    assert.are.equal(4, a.number_checkpoints)
    assert.is_false(a.partition_activations)
    assert.is_false(a.cpu_checkpointing)
    assert.is_false(a.profile)
  end)

  it('names an unknown key', function()
    H.fails('activation_checkpointing.partition_activation', load, { partition_activation = true })
  end)

  it('configures ds.checkpointing through ds.initialize', function()
    local c = { train_micro_batch_size_per_gpu = 1, optimizer = { type = 'SGD', params = { lr = 0.1 } },
                activation_checkpointing = { profile = true } }
    local engine = ds.initialize { model = ds.nn.Linear(2, 2), config = c }
    assert.is_true(ds.checkpointing.is_configured())
    assert.is_true(ds.checkpointing.config.profile)
    engine:destroy()
  end)
end)
