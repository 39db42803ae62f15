-- Run by spec/ddp_spec.lua on 1 rank and under mpirun on 2 and 4: trains
-- the MLP and a tiny GPT-2 through ds.initialize on one global batch of 8
-- samples per step (8 / world_size per rank, through the engine's own
-- loader: one shuffled loader on 1 rank, the distributed sampler on N) and
-- rank 0 writes, per case, the loss of every step averaged across ranks,
-- the final weights, the largest difference between any rank's weights
-- and rank 0's, and the engine's comm_stats, as JSON to arg[1].
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local rank_weights = require 'ranks.weights'
local write_json = require 'ranks.write_json'
local train_epochs = require 'ranks.epochs'
local MLP = require 'models.mlp'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: equiv.lua out.json')
local N = ds.comm.world_size()
local GLOBAL, SAMPLES = 8, 48          -- 6 steps per epoch, 2 epochs

local function data(kind)
  ds.manual_seed(11)
  if kind == 'mlp' then
    return ds.data.tensors { x = ds.randn(SAMPLES, 1, 4, 4), y = (ds.rand(SAMPLES) * 4):to('i64') }
  end
  local tokens = (ds.rand(SAMPLES, 9) * 32):to('i64')
  return ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
end

local function model(kind, checkpoint)
  ds.manual_seed(100 + ds.comm.rank())  -- each rank its own init: rank 0's is broadcast
  if kind == 'mlp' then return MLP { input_size = 16, hidden = { 32, 32 }, num_classes = 4 } end
  return GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16, bias = false,
               checkpoint = checkpoint or false }
end

-- Adam is blind to a constant factor on the gradient, SGD is not: the
-- scaling variants train with SGD so a wrong scale would show.
local SGD = { type = 'SGD', params = { lr = 0.05, momentum = 0.9 } }
local CASES = {
  { name = 'mlp', kind = 'mlp' },
  { name = 'mlp_sgd', kind = 'mlp', cfg = { optimizer = SGD } },
  { name = 'mlp_prescale', kind = 'mlp', cfg = { optimizer = SGD, prescale_gradients = true } },
  { name = 'mlp_predivide', kind = 'mlp', cfg = { optimizer = SGD, gradient_predivide_factor = 3.0 } },
  { name = 'mlp_gas2_clip', kind = 'mlp', gas = 2,
    cfg = { optimizer = SGD, gradient_clipping = 0.5, comms_logger = { enabled = true } } },
  { name = 'gpt2', kind = 'gpt2', cfg = { steps_per_print = 6 } },
  { name = 'gpt2_buckets', kind = 'gpt2', cfg = { zero_optimization = { reduce_bucket_size = 2000 } } },
  -- activation checkpointing: gradients reduced from inside the recomputing backward
  { name = 'gpt2_checkpoint', kind = 'gpt2', checkpoint = true,
    cfg = { zero_optimization = { reduce_bucket_size = 2000 } } },
  { name = 'gpt2_prescale_predivide', kind = 'gpt2',
    cfg = { optimizer = SGD, prescale_gradients = true, gradient_predivide_factor = 3.0,
            zero_optimization = { reduce_bucket_size = 3000 } } },
  { name = 'gpt2_predivide', kind = 'gpt2',
    cfg = { optimizer = SGD, gradient_predivide_factor = 3.0, zero_optimization = { reduce_bucket_size = 3000 } } },
}

-- how many times each message size went through op, from the comms logger
local function counts(op)
  local out = {}
  for size, r in pairs(ds.comm.logger_records()[op] or {}) do out[tostring(size)] = r.count end
  return out
end

local function run(case)
  local gas = case.gas or 1
  local cfg = {
    train_batch_size = GLOBAL, gradient_accumulation_steps = gas, steps_per_print = 1000,
    optimizer = { type = 'AdamW', params = { lr = 1e-2, weight_decay = 0.01 } },
  }
  for k, v in pairs(case.cfg or {}) do cfg[k] = v end
  ds.comm.configure_logger({ enabled = false })
  ds.comm.reset_logger()
  local m = model(case.kind, case.checkpoint)
  local engine, _, loader = ds.initialize { model = m, config = cfg, training_data = data(case.kind) }
  local losses = train_epochs(engine, loader, 2)
  local logged = { all_reduce = counts('all_reduce'), broadcast = counts('broadcast') }
  local weights, rank_diff = rank_weights(m)
  engine:finish()
  return { losses = losses, weights = weights, rank_diff = rank_diff, stats = engine.comm_stats or false,
           micro_batch = engine:train_micro_batch_size_per_gpu(), logged = logged }
end

local results = { world_size = N }
for _, case in ipairs(CASES) do results[case.name] = run(case) end
if ds.comm.rank() == 0 then write_json(out_path, results) end
ds.comm.print('done')
