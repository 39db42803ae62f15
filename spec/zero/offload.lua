-- Run by spec/zero_spec.lua under mpirun on 2 CPU ranks with
-- DSLUA_TEST_OFFLOAD_CPU set: a tiny GPT-2 trained through ds.initialize
-- with offload_optimizer device cpu (ZeRO-Offload's pipeline, its copies
-- made on the host when waited for) and without, stages 1-3, fp32 and
-- bf16, one and three micro steps, and at stage 3 with offload_param cpu
-- too (the prefetched shards loaded through the same copies). Rank 0
-- writes per case the largest difference between the two runs' losses
-- and weights, and the chunks, reduced rows and shards the pipeline took
-- (0 without it).
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local write_json = require 'ranks.write_json'
local train_epochs = require 'ranks.epochs'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: offload.lua out.json')
local GLOBAL, SAMPLES = 12, 96          -- 8 steps

local function data()
  ds.manual_seed(11)
  local tokens = (ds.rand(SAMPLES, 9) * 32):to('i64')
  return ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
end

local function run(case, offload)
  local cfg = {
    train_batch_size = GLOBAL, gradient_accumulation_steps = case.gas, steps_per_print = 1000,
    gradient_clipping = 0.5, bf16 = { enabled = case.bf16 },
    optimizer = { type = 'AdamW', params = { lr = 3e-3, weight_decay = 0.01 } },
    zero_optimization = { stage = case.stage, reduce_bucket_size = 3000, stage3_param_persistence_threshold = 0,
                          stage3_prefetch_bucket_size = 2000, stage3_gather_16bit_weights_on_model_save = true,
                          offload_optimizer = { device = offload },
                          offload_param = { device = case.param and offload or 'none' } },
  }
  jit.flush()
  require('dslua.engine').settle_garbage()
  ds.manual_seed(100 + ds.comm.rank())     -- each rank its own init: rank 0's is broadcast
  local m = GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16, bias = false }
  local engine, _, loader = ds.initialize { model = m, config = cfg, training_data = data() }
  local losses = train_epochs(engine, loader, 1)
  local weights = {}
  for name, t in pairs(engine:module_state_dict()) do weights[name] = t:reshape(-1):to('f64'):totable() end
  local chunks, rows, shards = engine.zero.engine:offload_counts()
  engine:finish()
  engine:destroy()
  return { losses = losses, weights = weights, chunks = chunks or 0, rows = rows or 0, shards = shards or 0 }
end

local function largest_difference(a, b)
  local worst = 0
  for i, l in ipairs(a.losses) do worst = math.max(worst, math.abs(l - b.losses[i])) end
  for name, w in pairs(a.weights) do
    for i, v in ipairs(w) do worst = math.max(worst, math.abs(v - b.weights[name][i])) end
  end
  return worst
end

local cases = {}
for stage = 1, 3 do
  for _, bf16 in ipairs({ false, true }) do
    for _, gas in ipairs({ 1, 3 }) do cases[#cases + 1] = { stage = stage, bf16 = bf16, gas = gas } end
  end
end
cases[#cases + 1] = { stage = 3, bf16 = false, gas = 1, param = true }
cases[#cases + 1] = { stage = 3, bf16 = true, gas = 3, param = true }
local results = {}
for _, case in ipairs(cases) do
  local none, cpu = run(case, 'none'), run(case, 'cpu')
  results[#results + 1] = { stage = case.stage, bf16 = case.bf16, gas = case.gas, param = case.param or false,
                            steps = #cpu.losses, difference = largest_difference(cpu, none), chunks = cpu.chunks,
                            rows = cpu.rows, shards = cpu.shards, none_chunks = none.chunks }
end
if ds.comm.rank() == 0 then write_json(out_path, results) end
ds.comm.print('done')
