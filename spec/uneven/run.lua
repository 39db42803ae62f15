-- Run by spec/uneven_spec.lua under mpirun (2 or 3 ranks): trains an MLP
-- through ds.initialize with a sampler block (unequal micro batches and
-- shares) for each case, and every rank writes to <prefix>.<rank>.json,
-- per case, the dataset indices of each of its micro steps ({epoch, step,
-- indices}), the engine's counters and (rank 0) the final weights and the
-- largest difference between any rank's weights and rank 0's.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local rank_weights = require 'ranks.weights'
local write_json = require 'ranks.write_json'
local MLP = require 'models.mlp'

local prefix = assert(arg[1], 'usage: run.lua out_prefix')
local N, rank = ds.comm.world_size(), ds.comm.rank()
local here = arg[0]:match('^(.*)/') or '.'
local SAMPLES, EPOCHS = 97, 2

local MICRO = { [2] = { 7, 3 }, [3] = { 5, 3, 2 } }                   -- uneven: 10 steps an epoch
local UNEQUAL = { [2] = { micro = { 4, 5 }, share = { 0.6, 0.4 } },   -- 15 and 8 steps
                  [3] = { micro = { 4, 5, 3 }, share = { 0.4, 0.35, 0.25 } } }   -- 10, 7, 9 steps

local function data()
  ds.manual_seed(11)
  return ds.data.tensors { x = ds.randn(SAMPLES, 12), y = (ds.rand(SAMPLES) * 3):to('i64') }
end

local CASES = {
  { name = 'uneven', sampler = { policy = 'uneven', micro_batch_per_rank = MICRO[N] } },
  { name = 'uneven_gas2', gas = 2, sampler = { policy = 'uneven', micro_batch_per_rank = MICRO[N] } },
  { name = 'unequal', sampler = { policy = here .. '/unequal_policy.lua', micro_batch_per_rank = UNEQUAL[N].micro,
                                  data_share = UNEQUAL[N].share } },
  { name = 'unequal_gas2', gas = 2,
    sampler = { policy = here .. '/unequal_policy.lua', micro_batch_per_rank = UNEQUAL[N].micro,
                data_share = UNEQUAL[N].share } },
  { name = 'auto', sampler = { policy = 'auto', micro_batch_per_rank = MICRO[N], measure_steps = 3, skip_steps = 1 } },
  -- the same through ZeRO's partitioned optimizer and in bf16
  { name = 'uneven_z1', stage = 1, sampler = { policy = 'uneven', micro_batch_per_rank = MICRO[N] } },
  { name = 'uneven_z2_gas2', stage = 2, gas = 2, sampler = { policy = 'uneven', micro_batch_per_rank = MICRO[N] } },
  { name = 'unequal_z3', stage = 3,
    sampler = { policy = here .. '/unequal_policy.lua', micro_batch_per_rank = UNEQUAL[N].micro,
                data_share = UNEQUAL[N].share } },
  { name = 'uneven_z2_bf16', stage = 2, bf16 = true, sampler = { policy = 'uneven', micro_batch_per_rank = MICRO[N] } },
}

local function run(case)
  ds.manual_seed(5 + rank)           -- each rank its own init: rank 0's is broadcast
  local model = MLP { input_size = 12, hidden = { 16 }, num_classes = 3 }
  local engine, _, loader = ds.initialize { model = model, training_data = data(), config = {
    gradient_accumulation_steps = case.gas or 1, steps_per_print = 1000, sampler = case.sampler,
    optimizer = { type = 'SGD', params = { lr = 0.05, momentum = 0.9 } },
    zero_optimization = { stage = case.stage or 0, stage3_param_persistence_threshold = 0 },
    bf16 = { enabled = case.bf16 or false },
  } }
  local steps = {}
  for e = 0, EPOCHS - 1 do
    local order, pos = nil, 0
    for j, batch in loader:epoch(e) do
      order = order or engine.sampler:indices(e)
      if ds.is_tensor(order) then order = order:totable() end
      local b, idx = engine.sampler:batch_size(j), {}
      for k = 1, b do idx[k] = order[pos + k] end
      pos = pos + b
      assert(batch.x:size(1) == b, 'the loader gave a batch of another size')
      steps[#steps + 1] = { epoch = e, step = j, indices = idx }
      engine:backward(engine(batch))
      engine:step()
    end
  end
  local weights, rank_diff = rank_weights(model)     -- stage 3: the reads gather the parameters
  engine:finish()
  engine:destroy()
  return { steps = steps, weights = weights, rank_diff = rank_diff, global_steps = engine.global_steps,
           global_samples = engine.global_samples, micro_steps = engine.micro_steps }
end

local results = { world_size = N, rank = rank }
for _, case in ipairs(CASES) do results[case.name] = run(case) end
write_json(prefix .. '.' .. rank .. '.json', results)
ds.comm.print('done')
