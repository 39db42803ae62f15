-- Run by spec/sp_spec.lua and spec/tp3d_spec.lua on 1 rank and under
-- mpirun: trains a tiny GPT-2 or Llama (grouped-query heads) through
-- ds.initialize on the same global batch of 4 sequences of 8 tokens per
-- step (some targets ignored, unevenly over each sequence's chunks, evenly
-- over the halves of the batch), every data index its slice.
--
--   lm.lua out.json gpt2|llama [sp=P] [tp=T] [zero=Z] [optim=sgd|adamw] [steps=3] [log=1] [recompute=1]
--          [gas=1] [fp8=0] [save=dir] [load=dir] [resave=dir] [export=file]
--
-- sp: sequence_parallel, tp: the tensor degree (the data degree the rest
-- of the world), zero: ZeRO's stage; SGD with momentum (blind to no factor
-- on the gradient) or AdamW (a state to reshard); steps in all;
-- recompute: activation checkpointing on every block; gas: each rank's
-- part of the batch in gas micro batches of one step; fp8=1: the fp8 block
-- on (delayed scaling, hybrid, a history of 4; its state written as fp8),
-- fp8=2: the same with current scaling. save: a
-- checkpoint after the first step; load: one loaded, then the steps after
-- it (losses: those steps'), resave: saved again at once after the load;
-- export: save_16bit_model after the last; log: the comms logger on, each
-- step's bytes and calls of the sequence group's collectives printed and
-- written (comm). Rank 0 writes every step's loss (the mean over the data
-- indices), the weights whole (gathered over the tensor group) and the
-- largest difference of any rank's whole weights from rank 0's as JSON to
-- out.json.
local ds = require 'dslua'

local out_path, kind = arg[1], arg[2]
assert(out_path and (kind == 'gpt2' or kind == 'llama'), 'usage: lm.lua out.json gpt2|llama [key=value...]')
local o = { sp = 1, tp = 1, zero = 0, optim = 'sgd', steps = 3, log = 0, recompute = 0, gas = 1, fp8 = 0 }
local PATHS = { save = true, load = true, resave = true, export = true }
for i = 3, #arg do
  local k, v = arg[i]:match('^(%w+)=(.+)$')    -- the launcher's --local_rank=N is not one
  if k then
    assert(o[k] ~= nil or PATHS[k], 'lm.lua: unknown argument ' .. arg[i])
    o[k] = tonumber(v) or v
  end
end
local GLOBAL, T, STEPS = 4, 8, o.steps
local world = ds.comm.world_size()
local dp = world / (o.sp * o.tp)
local micro = GLOBAL / dp / o.gas

-- each rank its own init, rank 0's broadcast; a tensor group draws the same
-- full weights and keeps its pieces
ds.manual_seed(100 + (o.tp == 1 and ds.comm.rank() or 0))
local model, ignore
if kind == 'gpt2' then
  model = require('models.gpt2') { vocab_size = 32, block_size = T, n_layer = 2, n_head = 4, n_embd = 16,
                                   sequence_parallel = o.sp, tp = o.tp, checkpoint = o.recompute == 1 }
  ignore = -1
else
  model = require('models.llama') { vocab_size = 32, block_size = T, n_layer = 2, n_head = 8, n_kv_head = 4,
                                    n_embd = 32, intermediate_size = 24, sequence_parallel = o.sp, tp = o.tp,
                                    checkpoint = o.recompute == 1 }
  ignore = -100
end

local OPTIM = { sgd = { type = 'SGD', params = { lr = 0.2, momentum = 0.9 } },
                adamw = { type = 'AdamW', params = { lr = 1e-3 } } }
local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = micro, gradient_accumulation_steps = o.gas, steps_per_print = 1000,
  fp8 = { enabled = o.fp8 > 0, recipe = o.fp8 == 2 and 'current' or 'delayed', amax_history_len = 4 },
  optimizer = OPTIM[o.optim], zero_optimization = { stage = o.zero }, sequence_parallel_size = o.sp,
  comms_logger = { enabled = o.log == 1 },
} }

-- the bytes and calls of the sequence group's collectives since the logger's reset, by name
local function sequence_bytes()
  local out = {}
  for name, by_size in pairs(ds.comm.logger_records()) do
    if name:match('^sequence_') then
      local e = { bytes = 0, calls = 0 }
      for size, r in pairs(by_size) do e.bytes, e.calls = e.bytes + size * r.count, e.calls + r.count end
      out[name] = e
    end
  end
  return out
end

-- in each half of the batch the targets of one row's last 3 tokens and of
-- the other's second ignored
ds.manual_seed(11)
local batches = {}
for s = 1, STEPS do
  local ids = (ds.rand(GLOBAL, T + 1) * 31.99):to('i64')
  local y = ids:narrow(2, 2, T):contiguous()
  ds.no_grad(function()
    for r = 1, GLOBAL, 2 do
      y:narrow(1, r, 1):narrow(2, T - 2, 3):fill_(ignore)
      y:narrow(1, r + 1, 1):narrow(2, 2, 1):fill_(ignore)
    end
  end)
  batches[s] = { x = ids:narrow(2, 1, T):contiguous(), y = y }
end

local losses, first = {}, 1
if o.load then
  engine:load_checkpoint(o.load)
  first = engine.global_steps + 1
  if o.resave then engine:save_checkpoint(o.resave) end
end
local comm = {}
for s = first, STEPS do
  local b = batches[s]
  ds.comm.reset_logger()
  local sum = 0
  for j = 0, o.gas - 1 do
    local rows = ((model.dp_rank or ds.comm.rank()) * o.gas + j) * micro + 1
    local loss = engine:forward { x = b.x:narrow(1, rows, micro):contiguous(),
                                  y = b.y:narrow(1, rows, micro):contiguous() }
    engine:backward(loss)
    engine:step()
    sum = sum + loss:item() / o.gas
  end
  -- each data index's loss covers its whole sequences, on world / dp ranks
  local l = ds.tensor({ sum / world }, 'f64')
  ds.comm.all_reduce(l, 'sum')
  losses[#losses + 1] = l:item()
  if o.log == 1 then
    comm[#comm + 1] = sequence_bytes()
    local a2a = comm[#comm].sequence_all_to_all or { bytes = 0, calls = 0 }
    ds.comm.print0(string.format('step %d: sequence group all-to-all %d bytes (%d calls)', s, a2a.bytes, a2a.calls))
  end
  if o.save and s == 1 then engine:save_checkpoint(o.save) end
end
if o.export then engine:save_16bit_model(o.export:match('^(.*)/') or '.', o.export:match('[^/]+$')) end

local weights, spread = {}, 0
local whole = model.tensor_group and ds.nn.parallel.full_state_dict(model) or model:state_dict()
for _, e in ipairs(model:named_parameters()) do
  local t = whole[e[1]]
  spread = math.max(spread, (ds.comm.broadcast(t:clone(), 0) - t):abs():amax():item())
  weights[e[1]] = t:reshape(-1):to('f64'):totable()
end
local d = ds.tensor({ spread }, 'f64')
ds.comm.all_reduce(d, 'max')
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses, weights = weights, spread = d:item(), comm = comm,
                           fp8 = engine.fp8 and engine.fp8:state_dict() or nil })
  f:close()
end
