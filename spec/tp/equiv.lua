-- Run by spec/tp_spec.lua on 1 rank (tp 1) and under mpirun: trains a
-- tiny GPT-2 and a tiny Llama with grouped-query attention through
-- ds.initialize with tensor degree arg[2] (the data degree the rest of the
-- world), on one global batch of 8 sequences per step, every data rank
-- its slice; rank 0 writes per case the loss and gradient norm of every
-- step, the full weights gathered over the tensor group, the largest
-- difference of a replicated weight between tensor ranks, and the bytes
-- the comms logger saw per step by group, as JSON to arg[1].
local ds = require 'dslua'
local GPT = require 'models.gpt2'
local Llama = require 'models.llama'
local P = ds.nn.parallel

local out_path, tp = assert(arg[1], 'usage: equiv.lua out.json tp [case...]'), tonumber(arg[2] or 1)
local GLOBAL, STEPS, B_T = 8, 5, 8

local function model(kind, bias, degree, checkpoint)
  ds.manual_seed(7)      -- every rank draws the same full weights; each keeps its piece
  if kind == 'gpt2' then
    return GPT { vocab_size = 32, block_size = B_T, n_layer = 2, n_head = 4, n_embd = 16, bias = bias, tp = degree,
                 checkpoint = checkpoint }
  end
  return Llama { vocab_size = 32, block_size = B_T, n_layer = 2, n_head = 8, n_kv_head = 4, n_embd = 32,
                 intermediate_size = 24, tp = degree }
end

-- Biases train with SGD: a key's bias has no gradient but rounding (the
-- softmax does not see it), which Adam would scale up to full steps.
local SGD = { type = 'SGD', params = { lr = 0.05, momentum = 0.9 } }
local CASES = {
  { name = 'gpt2', kind = 'gpt2' },
  { name = 'gpt2_bias_sgd', kind = 'gpt2', bias = true, optimizer = SGD },
  { name = 'llama', kind = 'llama' },
  { name = 'gpt2_zero1', kind = 'gpt2', zero = 1 },
  { name = 'llama_zero2', kind = 'llama', zero = 2 },
  { name = 'gpt2_zero3', kind = 'gpt2', zero = 3 },
  -- the tensor group's collectives run again in the recomputing backward
  { name = 'gpt2_checkpoint', kind = 'gpt2', checkpoint = true },
  -- built whole, split by initialize for DeepSpeed's AutoTP size
  { name = 'gpt2_autotp', kind = 'gpt2', autotp = true },
}

-- the bytes the comms logger saw since its reset: the tensor group's
-- (tensor_*), the data group's (the step engine's: all_reduce, zero_*),
-- and the calls by name
local function logged()
  local out = { tensor = 0, data = 0, calls = {} }
  for name, by_size in pairs(ds.comm.logger_records()) do
    local group = name:match('^tensor_') and 'tensor' or (name == 'all_reduce' or name:match('^zero_')) and 'data'
    for size, r in pairs(by_size) do
      if group then out[group] = out[group] + size * r.count end
      out.calls[name] = (out.calls[name] or 0) + r.count
    end
  end
  return out
end

local function run(case)
  local cfg = {
    train_batch_size = GLOBAL, steps_per_print = 1000, gradient_clipping = 0.05,
    optimizer = case.optimizer or { type = 'AdamW', params = { lr = 1e-3, weight_decay = 0.01 } },
    comms_logger = { enabled = true },
  }
  if case.zero then cfg.zero_optimization = { stage = case.zero, stage3_param_persistence_threshold = 0 } end
  if case.autotp then cfg.tensor_parallel = { autotp_size = tp } end
  local m = model(case.kind, case.bias or false, case.autotp and 1 or tp, case.checkpoint or false)
  local engine = ds.initialize { model = m, config = cfg }
  local dp, dp_rank = m.dp_size or 1, m.dp_rank or 0
  local mb = GLOBAL / dp
  ds.manual_seed(11)
  local tokens = (ds.rand(STEPS * GLOBAL, B_T + 1) * 32):to('i64')
  local losses, norms, per_step = {}, {}, {}
  for s = 1, STEPS do
    local rows = tokens:narrow(1, (s - 1) * GLOBAL + dp_rank * mb + 1, mb)
    ds.comm.reset_logger()
    local loss = engine { x = rows:narrow(2, 1, B_T):contiguous(), y = rows:narrow(2, 2, B_T):contiguous() }
    engine:backward(loss)
    engine:step()
    per_step[s] = logged()
    local mean = ds.tensor({ loss:item() / dp }, 'f64')
    if dp > 1 then ds.comm.all_reduce(mean, 'sum', m.dp_group) end
    losses[s], norms[s] = mean:item(), engine.grad_norm
  end
  -- replicated weights equal on every tensor rank, split ones gathered whole
  local diff = 0
  for _, p in ipairs(P.params(m)) do
    if p.replicated and m.tensor_group then
      local r0 = ds.comm.broadcast(p.tensor:detach():clone(), ds.comm.rank() - m.tensor_group:rank(), m.tensor_group)
      diff = math.max(diff, (r0 - p.tensor):abs():amax():item())
    end
  end
  local weights = {}
  for name, t in pairs(P.full_state_dict(m)) do weights[name] = t:reshape(-1):to('f64'):totable() end
  engine:destroy()
  local n_local = 0
  for _, p in ipairs(m:parameters()) do n_local = n_local + p:numel() end
  return { losses = losses, norms = norms, weights = weights, replicated_diff = diff, comm = per_step,
           n_local = n_local,
           micro_batch = engine:train_micro_batch_size_per_gpu(), dp = dp }
end

local results = { world_size = ds.comm.world_size(), tp = tp }
local only = {}
for i = 3, #arg do
  if not arg[i]:match('^%-%-') then only[arg[i]] = true end     -- mpirun adds --local_rank
end
for _, case in ipairs(CASES) do
  if next(only) == nil or only[case.name] then results[case.name] = run(case) end
end
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode(results))
  f:close()
end
