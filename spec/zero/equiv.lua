-- Run by spec/zero_spec.lua on 1 rank and under mpirun on 2 and 4: a tiny
-- GPT-2 trained 50 steps (global batch 8) through ds.initialize with
-- zero_optimization stages 0-3, in fp32 and bf16, with nvme offload and
-- with accumulation + clipping. Rank 0 writes per case: the losses
-- (averaged over ranks), the final weights, the largest difference of any
-- rank's weights from rank 0's, the per-rank memory (bytes by category,
-- counted from before the model was made) and the ZeRO lines printed.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local rank_weights = require 'ranks.weights'
local write_json = require 'ranks.write_json'
local train_epochs = require 'ranks.epochs'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: equiv.lua out.json [nvme_dir]')
local nvme_dir = arg[2] and not arg[2]:match('^%-%-') and arg[2] or nil   -- not a launcher's --local_rank
local N = ds.comm.world_size()
local GLOBAL, SAMPLES = 8, 200          -- 25 steps per epoch, 2 epochs

local function data()
  ds.manual_seed(11)
  local tokens = (ds.rand(SAMPLES, 9) * 32):to('i64')
  return ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
end

local CASES = {}
for stage = 0, 3 do
  CASES[#CASES + 1] = { name = 'z' .. stage, stage = stage }
  CASES[#CASES + 1] = { name = 'z' .. stage .. '_bf16', stage = stage, cfg = { bf16 = { enabled = true } } }
end
CASES[#CASES + 1] = { name = 'z3_gas2_clip', stage = 3, gas = 2, cfg = { gradient_clipping = 0.5 } }
CASES[#CASES + 1] = { name = 'z1_gas2_clip', stage = 1, gas = 2, cfg = { gradient_clipping = 0.5 } }
CASES[#CASES + 1] = { name = 'z0_gas2_clip', stage = 0, gas = 2, cfg = { gradient_clipping = 0.5 } }
-- Lamb: each parameter's trust ratio from its norms summed over the ranks' shards
local LAMB = { type = 'Lamb', params = { lr = 1e-2, weight_decay = 0.01 } }
CASES[#CASES + 1] = { name = 'z0_lamb', stage = 0, cfg = { optimizer = LAMB } }
CASES[#CASES + 1] = { name = 'z1_lamb', stage = 1, cfg = { optimizer = LAMB } }
CASES[#CASES + 1] = { name = 'z3_lamb', stage = 3, cfg = { optimizer = LAMB } }
CASES[#CASES + 1] = { name = 'z2_lamb_bf16', stage = 2, cfg = { optimizer = LAMB, bf16 = { enabled = true } } }
CASES[#CASES + 1] = { name = 'z3_param_cpu', stage = 3, offload_param = { device = 'cpu' } }
if nvme_dir then
  CASES[#CASES + 1] = { name = 'z2_nvme', stage = 2,
                        offload = { device = 'nvme', nvme_path = nvme_dir }, sub_group_size = 1000 }
  CASES[#CASES + 1] = { name = 'z3_param_nvme', stage = 3, offload_param = { device = 'nvme', nvme_path = nvme_dir } }
end

local KEYS = { 'parameters', 'gradients', 'master_weights', 'optimizer_state' }

local function run(case)
  local gas = case.gas or 1
  local cfg = {
    train_batch_size = GLOBAL, gradient_accumulation_steps = gas, steps_per_print = 1000,
    -- lr below AdamW's stability edge on this task (about 5e-3, where N-rank and 1-rank
    -- rounding starts to grow by step 40): spec/zero_spec.lua's tolerances rest on it
    optimizer = { type = 'AdamW', params = { lr = 3e-3, weight_decay = 0.01 } },
    zero_optimization = { stage = case.stage, reduce_bucket_size = 3000, stage3_param_persistence_threshold = 0,
                          stage3_prefetch_bucket_size = 2000, stage3_gather_16bit_weights_on_model_save = true,
                          offload_optimizer = case.offload, sub_group_size = case.sub_group_size,
                          offload_param = case.offload_param },
  }
  for k, v in pairs(case.cfg or {}) do cfg[k] = v end
  jit.flush()      -- compiled traces keep the objects they specialised on (the last engine) alive
  require('dslua.engine').settle_garbage()
  local base = ds.memory_stats().current
  ds.manual_seed(100 + ds.comm.rank())     -- each rank its own init: rank 0's is broadcast
  local m = GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16, bias = false }
  local engine, _, loader = ds.initialize { model = m, config = cfg, training_data = data() }
  local losses = train_epochs(engine, loader, 2)
  local report = engine:memory_report()
  -- each rank's bytes counted from its own base
  local own = {}
  for i, k in ipairs(KEYS) do own[i] = report[ds.comm.rank() + 1].current[k] - base[k] end
  local memory = {}
  local rows = N > 1 and ds.comm.all_gather(ds.tensor(own, 'f64')) or { ds.tensor(own, 'f64') }
  for r, t in ipairs(rows) do
    memory[r] = {}
    for i, k in ipairs(KEYS) do memory[r][k] = t:totable()[i] end
  end
  -- the whole weights (stage 3 gathers them), as f64 lists by name
  local weights = {}
  for name, t in pairs(engine:module_state_dict()) do weights[name] = t:reshape(-1):to('f64'):totable() end
  local rank_diff = 0
  if case.stage < 3 then
    local _, d = rank_weights(m)
    rank_diff = d
  end
  local lines = engine.zero and engine.zero:describe() or false
  engine:finish()
  engine:destroy()
  return { losses = losses, weights = weights, rank_diff = rank_diff, memory = memory, zero_lines = lines }
end

local results = { world_size = N }
for _, case in ipairs(CASES) do results[case.name] = run(case) end
if ds.comm.rank() == 0 then write_json(out_path, results) end
ds.comm.print('done')
