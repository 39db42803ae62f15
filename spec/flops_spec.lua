-- flops_profiler (dslua/nn/flops.lua): DeepSpeed's profile at profile_step
-- from the MACs the ops count.
local H = require 'helpers'
local ds = H.ds

local Two = H.two_layer('Two')

-- fused q,k,v projection and attention over 2 heads, on the backend given
local Attn = ds.nn.Module:extend('Attn')
function Attn:init(backend)
  self.c_attn = ds.nn.Linear(8, 24)
  self.backend = backend
end
function Attn:forward(batch)
  return ds.mse_loss(ds.qkv_attention(self.c_attn(batch.x), 2, { backend = self.backend }), batch.y)
end

local function run(profiler, steps, model, x, y)
  ds.manual_seed(2)
  x, y = x or ds.randn(32, 6), y or ds.randn(32, 2)
  local engine = ds.initialize { model = model or Two(), training_data = ds.data.tensors { x = x, y = y }, config = {
    train_micro_batch_size_per_gpu = 4, steps_per_print = 1000, optimizer = { type = 'SGD', params = { lr = 0.1 } },
    flops_profiler = profiler } }
  local n = 0
  for _, b in engine.training_dataloader:epoch(1) do
    engine:backward(engine:forward(b))
    engine:step()
    n = n + 1
    if n == steps then break end
  end
  return engine
end

local read = H.read

describe('flops_profiler', function()
  it('profiles profile_step: params, MACs from the ops, latencies, the module tree', function()
    local dir = H.tmpdir()
    local linear = ds.linear
    local engine = run({ enabled = true, profile_step = 2, output_file = dir .. '/p.txt' }, 4)
    local text = read(dir .. '/p.txt')
    H.has(text, 'Profile Summary at step 2:')
    local _, n = text:gsub('DeepSpeed Flops Profiler', '')
    assert.are.equal(1, n)                          -- one profile, at its step only
    -- 6*8+8 + 8*2+2 parameters; MACs 4*6*8 + 4*8*2 per micro batch of 4
    assert.is_truthy(text:find('params per GPU:%s+74\n'))
    assert.is_truthy(text:find('fwd MACs per GPU:%s+256 MACs\n'))
    assert.is_truthy(text:find('fwd flops per GPU:%s+512\n'))
    assert.is_truthy(text:find('batch size per GPU:%s+4\n'))
    assert.is_truthy(text:find('fwd latency:%s+[%d.]+ [mu]?s\n'))
    H.has(text, "    params      - {'Two': '74'}")
    H.has(text, "    params      - {'Linear': '74'}")            -- depth 1, by class
    H.has(text, '  (fc1): Linear(56 = 75.68% Params, 192 MACs = 75.00% MACs, ')
    H.has(text, '  (fc2): Linear(18 = 24.32% Params, 64 MACs = 25.00% MACs, ')
    -- everything it wrapped is back
    assert.are.equal(linear, ds.linear)
    assert.is_nil(rawget(engine, 'forward'))
    assert.is_nil(rawget(engine.module.fc1, 'forward'))
  end)

  it('stops the tree at module_depth, shows top_modules, leaves out the tree when not detailed', function()
    local dir = H.tmpdir()
    run({ enabled = true, profile_step = 1, module_depth = 0, top_modules = 3, output_file = dir .. '/a.txt' }, 1)
    local text = read(dir .. '/a.txt')
    H.has(text, 'Top 3 modules')
    H.has(text, 'Two(74 = 100.00% Params, 256 MACs = 100.00% MACs')
    assert.is_nil(text:find('(fc1)', 1, true))
    run({ enabled = true, profile_step = 1, detailed = false, output_file = dir .. '/b.txt' }, 1)
    assert.is_nil(read(dir .. '/b.txt'):find('Detailed Profile', 1, true))
  end)

  it('counts attention once, the same on either backend', function()
    local dir = H.tmpdir()
    for _, backend in ipairs { 'fused', 'math' } do
      local path = dir .. '/' .. backend .. '.txt'
      run({ enabled = true, profile_step = 1, output_file = path }, 1, Attn(backend), ds.randn(32, 5, 8),
          ds.randn(32, 5, 8))
      -- per micro batch of 4: c_attn 4*5*8*24, q k^T and p v 2*(4*5*8)*5
      assert.is_truthy(read(path):find('fwd MACs per GPU:%s+5.44 KMACs\n'), backend)
    end
  end)

  it('refuses an output_file it cannot write at initialize', function()
    local dir = H.tmpdir()
    local e = H.err(run, { enabled = true, output_file = dir .. '/no/such/p.txt' }, 1)
    H.has(e, 'initialize: flops_profiler.output_file: cannot write "' .. dir .. '/no/such/p.txt"')
    H.has(H.err(run, { enabled = true, profile_step = 0 }, 1), 'flops_profiler.profile_step: must be a positive integer')
  end)
end)
