-- Run by spec/zero_spec.lua on 1 rank and under mpirun on 2: a tiny
-- GPT-2 (its embedding tied to its head: two gradients into one
-- parameter) trained through ds.initialize with the same batches on every
-- rank, in each case of the list. On one rank nothing is communicated
-- (the gradients are added into the master or flat gradients as they
-- come); on two the same gradients travel and are summed, twice each, an
-- exact doubling the mean halves again. Rank 0 writes each case's losses
-- and weights as hex floats.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local write_json = require 'ranks.write_json'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: fold.lua out.json')

-- clipping where the norm is summed in one order on any world size
-- (stage 0); f16 under a dynamic loss scale
local CASES = {
  { name = 'f32 stage 0', stage = 0, clip = 0.5 },
  { name = 'bf16 stage 0', dtype = 'bf16', stage = 0, clip = 0.5 },
  { name = 'f16 stage 0', dtype = 'f16', stage = 0, clip = 0.5 },
  { name = 'f32 stage 1', stage = 1 },
  { name = 'bf16 stage 1', dtype = 'bf16', stage = 1 },
  { name = 'bf16 stage 2', dtype = 'bf16', stage = 2 },
  { name = 'f16 stage 2', dtype = 'f16', stage = 2 },
  { name = 'bf16 stage 3', dtype = 'bf16', stage = 3 },
}

local function hex(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = string.format('%a', v) end
  return table.concat(s, ' ')
end

local function run(case, gas)
  local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = gas, steps_per_print = 1e9,
                gradient_clipping = case.clip or 0,
                optimizer = { type = 'AdamW', params = { lr = 3e-3, weight_decay = 0.01 } },
                zero_optimization = { stage = case.stage, reduce_bucket_size = 600,
                                      stage3_param_persistence_threshold = 0 } }
  if case.dtype == 'bf16' then cfg.bf16 = { enabled = true } end
  if case.dtype == 'f16' then cfg.fp16 = { enabled = true, initial_scale_power = 8 } end
  ds.manual_seed(3)
  local m = GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 2, n_embd = 16, bias = true }
  local engine = ds.initialize { model = m, config = cfg }
  ds.manual_seed(4)
  local losses = {}
  for _ = 1, 3 * gas do
    local tokens = (ds.rand(2, 9) * 32):to('i64')
    local loss = engine { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
    losses[#losses + 1] = loss:to('f32'):item()
    engine:backward(loss)
    engine:step()
  end
  local weights = {}
  ds.no_grad(function()
    for _, p in ipairs(m:parameters()) do weights[#weights + 1] = hex(p:to('f32'):view(-1):totable()) end
  end)
  engine:destroy()
  return { losses = hex(losses), weights = weights, steps = engine.global_steps }
end

local out = {}
for _, case in ipairs(CASES) do
  for _, gas in ipairs({ 1, 3 }) do out[case.name .. ', ' .. gas .. ' micro steps'] = run(case, gas) end
end
if ds.comm.rank() == 0 then write_json(out_path, out) end
