-- Run by bench/pipe.sh. Two measurements:
--   bubble M...   (under mpirun, one rank per stage) the pipeline's idle
--                 fraction per train_batch for each count of micro batches M,
--                 against 1F1B's (S-1)/(M+S-1) for S equal stages
--   ckpt none|every [quick]  (one process) GPT-2 small's forward and
--                 backward without activation checkpointing or with it on
--                 every block: peak activation bytes, peak bytes, time
-- Prints `result ...` lines; bench/pipe.sh adds the header.
local ds = require 'dslua'
local nn = ds.nn

local args = ds.args.rest   -- without the launcher's --local_rank
local mode = args[1]
local fmt = string.format
local now = ds.wall_time

-- Each stage 4 Linear(W, W) + ReLU, split uniformly; rows of B per micro
-- batch. Busy time: forward, backward and the optimizer step; the rest of
-- train_batch is the bubble (waiting for the neighbouring stage, in a
-- receive or in the boundary's collectives).
local function bubble(M, W, B, batches)
  local S = ds.comm.world_size()
  local layers = {}
  for _ = 1, 4 * S do
    layers[#layers + 1] = ds.pipe.LayerSpec(nn.Linear, W, W)
    layers[#layers + 1] = ds.pipe.LayerSpec(nn.ReLU)
  end
  local model = ds.pipe.PipelineModule { layers = layers, num_stages = S, partition_method = 'uniform',
                                         loss_fn = function(out) return (out * out):mean() end }
  local engine = ds.initialize { model = model, config = {
    train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = M, steps_per_print = 10 ^ 9,
    optimizer = { type = 'SGD', params = { lr = 1e-6 } } } }
  local busy = 0
  local function timed(f)
    return function(...)
      local t0 = now()
      local out = { f(...) }
      busy = busy + now() - t0
      return unpack(out, 1, table.maxn(out))
    end
  end
  rawset(model, 'forward', timed(model.forward))
  engine._backward = timed(engine._backward)
  engine._take_step = timed(engine._take_step)   -- the optimizer: not the boundary's collectives after it
  ds.manual_seed(1)
  local x = ds.randn(B, W)
  local function data() return { x = x, y = x } end
  for _ = 1, 2 do engine:train_batch(data) end      -- warm-up
  ds.comm.barrier()
  busy = 0
  local t0 = now()
  for _ = 1, batches do engine:train_batch(data) end
  local wall = now() - t0
  local idle = {}
  for s = 1, S do idle[s] = 0 end
  idle[model.stage_id + 1] = 1 - busy / wall
  idle = ds.comm.all_reduce(ds.tensor(idle, 'f64'), 'sum'):totable()
  engine:destroy()
  return idle, wall / batches
end

-- GPT-2 small on token ids [B, T]: (peak activation bytes, peak bytes in
-- all, seconds per forward and backward), the mean of `reps` after one
-- warm-up.
local function ckpt(cfg, every, B, reps)
  local GPT = require 'models.gpt2'
  ds.manual_seed(1)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.checkpoint = every
  local model = GPT(c)
  c = model.config
  local ids = (ds.rand(B, c.block_size + 1) * (c.vocab_size - 0.01)):to('i64')
  local x, y = ids:narrow(2, 1, c.block_size):contiguous(), ids:narrow(2, 2, c.block_size):contiguous()
  local function step()
    model(x, y):backward()
    model:zero_grad()
  end
  step()
  require('dslua.engine').settle_garbage()
  ds.reset_peak_memory()
  local t0 = now()
  for _ = 1, reps do step() end
  local dt = (now() - t0) / reps
  local peak = ds.memory_stats().peak
  return peak.activations, peak.total, dt
end

if mode == 'bubble' then
  local quick = args[2] == 'quick'
  local W, B, batches = quick and 128 or 512, quick and 8 or 64, quick and 2 or 8
  local S = ds.comm.world_size()
  for i = 3, #args do
    local M = tonumber(args[i])
    local idle, per = bubble(M, W, B, batches)
    local mean = 0
    for s = 1, S do mean = mean + idle[s] / S end
    local ideal = (S - 1) / (M + S - 1)
    if ds.comm.rank() == 0 then
      local stages = {}
      for s = 1, S do stages[s] = fmt('%.3f', idle[s]) end
      print(fmt('result bubble %d %d %.4f %.4f %.4f %s', S, M, mean, ideal, per, table.concat(stages, ',')))
    end
  end
elseif mode == 'ckpt' then
  -- one setting per process: nothing of the other run's model is left in the counters
  local every, quick = args[2] == 'every', args[3] == 'quick'
  local cfg = quick and { name = 'gpt-micro', vocab_size = 512, block_size = 64 } or { name = 'gpt2', block_size = 256 }
  local B, reps = quick and 2 or 1, quick and 2 or 3
  local act, total, dt = ckpt(cfg, every, B, reps)
  print(fmt('result ckpt %s %s %d %d %d %d %.4f', args[2], cfg.name, B, cfg.block_size, act, total, dt))
else
  error('usage: pipe.lua bubble full|quick M... | ckpt none|every [quick]', 0)
end
