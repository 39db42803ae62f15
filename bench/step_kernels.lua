-- Kernels of a training step (ds.kernel_calls): a 12-layer GPT-2 or Llama
-- (grouped-query, 4 heads over 2) of n_embd 64 through ds.initialize,
-- AdamW, the same batches on every rank; the kernels of the last micro
-- step's forward, engine:backward and engine:step on the third step, on
-- rank 0. With OUT, every rank's weights after the three steps go there
-- as hex floats (OUT.rank), to compare two builds.
--   dslua [-n 2] bench/step_kernels.lua [gpt2|llama] DTYPE STAGE [GAS [CLIP [OUT]]]
-- GPT-2 unless named; DTYPE f32, bf16 or f16 (under a dynamic loss scale);
-- CLIP 1.0 unless given (0: none).
local ds = require 'dslua'

local a = {}     -- ds.args.rest: without the launcher's --local_rank
for i, v in ipairs(ds.args.rest) do a[i] = v end
local name = (a[1] == 'gpt2' or a[1] == 'llama') and table.remove(a, 1) or 'gpt2'
local dtype, stage = a[1] or 'bf16', tonumber(a[2] or 0)
local gas, clip, out = tonumber(a[3] or 1), tonumber(a[4] or 1.0), a[5]

ds.manual_seed(1)
local cfg = { vocab_size = 256, block_size = 32, n_layer = 12, n_head = 4, n_embd = 64 }
if name == 'llama' then cfg.n_kv_head = 2 end
local model = require('models.' .. name)(cfg)
local config = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = gas, steps_per_print = 1e9,
                 gradient_clipping = clip,
                 zero_optimization = { stage = stage, stage3_param_persistence_threshold = 0 },
                 optimizer = { type = 'AdamW', params = { lr = 1e-3, weight_decay = 0.1 } } }
if dtype == 'bf16' then config.bf16 = { enabled = true } end
if dtype == 'f16' then config.fp16 = { enabled = true, initial_scale_power = 12 } end
local engine = ds.initialize { model = model, config = config }
local dev = ds.device()
local forward, backward, step
for _ = 1, 3 do
  for _ = 1, gas do
    local x = (ds.rand(2, 32) * 256):to('i64'):to(dev)
    local y = (ds.rand(2, 32) * 256):to('i64'):to(dev)
    local k0 = ds.kernel_calls()
    local loss = engine { x = x, y = y }
    local k1 = ds.kernel_calls()
    engine:backward(loss)
    local k2 = ds.kernel_calls()
    engine:step()
    forward, backward, step = k1 - k0, k2 - k1, ds.kernel_calls() - k2
  end
end
local rank, world = ds.comm.rank(), ds.comm.world_size()
if rank == 0 then
  print(string.format('result kernels %s %s stage %d gas %d ranks %d parameters %d forward %d backward %d step %d',
                      name, dtype, stage, gas, world, #model:parameters(), forward, backward, step))
end
if out then
  local f = assert(io.open(out .. '.' .. rank, 'w'))
  for _, p in ipairs(model:parameters()) do
    ds.no_grad(function()
      for _, v in ipairs(p:to('f32'):view(-1):totable()) do f:write(string.format('%a\n', v)) end
    end)
  end
  f:close()
end
engine:destroy()
