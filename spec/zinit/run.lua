-- Run by spec/zinit_spec.lua under mpirun on 2 and 4 ranks: tiny GPT-2
-- and Llama models built whole and inside ds.zero.Init, from their
-- constructors and from Hugging Face folders, trained at stage 3 both
-- ways, and the scope's errors. Every rank seeds its own generator (as a
-- whole build's broadcast makes that harmless). Rank 0 writes to out.json,
-- per case, the largest difference (all ranks) and the lists to compare.
local ds = require 'dslua'
local GPT = require 'models.gpt2'
local Llama = require 'models.llama'
local Z0 = require('dslua.core')._zero

local out_path, dir = assert(arg[1], 'usage: run.lua out.json dir'), assert(arg[2])
local rank, N = ds.comm.rank(), ds.comm.world_size()

local MODELS = {     -- in one order on every rank
  { kind = 'gpt2', make = GPT, cfg = { vocab_size = 40, block_size = 8, n_layer = 2, n_head = 2, n_embd = 18 } },
  { kind = 'llama', make = Llama, cfg = { vocab_size = 40, block_size = 8, n_layer = 2, n_head = 2, n_kv_head = 1,
                                  n_embd = 20, intermediate_size = 30 } },
}

local function zero_cfg(stage, extra)
  local c = { train_batch_size = 4 * N, steps_per_print = 1000,
              optimizer = { type = 'AdamW', params = { lr = 1e-2, weight_decay = 0.01 } },
              zero_optimization = { stage = stage, stage3_param_persistence_threshold = 20,
                                    stage3_prefetch_bucket_size = 500, reduce_bucket_size = 700 } }
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end

-- the largest of every rank's x
local function max_all(x)
  local t = ds.tensor({ x }, 'f64')
  ds.comm.all_reduce(t, 'max')
  return t:item()
end

local function param_of(model, name)
  for _, e in ipairs(model:named_parameters()) do
    if e[1] == name then return e[2] end
  end
end

-- Largest difference of each shard from its range of the whole model's
-- parameter, the count of parameters built partitioned (all released), and
-- how many of this rank's elements they hold.
local function shards_vs(model, whole)
  local diff, count, held = 0, 0, 0
  for _, e in ipairs(ds.zero.shards_of(model)) do
    local rec, w = e[2], param_of(whole, e[1]):reshape({ -1 })
    assert(Z0.is_released(param_of(model, e[1])), e[1] .. ' has data')
    count, held = count + 1, held + rec.shard:numel()
    if rec.len > 0 then
      diff = math.max(diff, (w:narrow(1, rec.lo + 1, rec.len):to('f64')
                             - rec.shard:narrow(1, 1, rec.len):to('f64')):abs():amax():item())
    end
    if rec.len < rec.shard:numel() then    -- padding stays zero
      diff = math.max(diff, rec.shard:narrow(1, rec.len + 1, rec.shard:numel() - rec.len):abs():amax():item())
    end
  end
  return diff, count, held
end

local function tokens(seed)
  ds.manual_seed(seed)
  local t = (ds.rand(4 * N * 3, 9) * 40):to('i64')
  return ds.data.tensors { x = t:narrow(2, 1, 8):contiguous(), y = t:narrow(2, 2, 8):contiguous() }
end

-- Trains 3 steps at stage 3: the losses, the gathered weights as flat f64
-- lists, and the weights before the first step.
local function train(model, cfg)
  local engine, _, loader = ds.initialize { model = model, config = cfg, training_data = tokens(7) }
  local start = engine.zero:gathered_parameters()
  local losses = {}
  for _, batch in loader:epoch(1) do
    local loss = engine(batch)
    engine:backward(loss)
    engine:step()
    local mean = ds.tensor({ engine.last_loss }, 'f64')
    ds.comm.all_reduce(mean, 'avg')
    losses[#losses + 1] = mean:item()
  end
  local weights = {}
  for name, t in pairs(engine.zero:gathered_parameters()) do weights[name] = t:reshape(-1):to('f64'):totable() end
  engine:destroy()
  return losses, weights, start
end

local function state_diff(a, b)
  local d = 0
  for name, t in pairs(a) do d = math.max(d, (t:to('f64') - b[name]:to('f64')):abs():amax():item()) end
  return d
end

local results = { world_size = N }

for _, m in ipairs(MODELS) do
  local kind = m.kind
  for _, dtype in ipairs({ 'f32', 'bf16' }) do
    local cfg = zero_cfg(3, dtype == 'bf16' and { bf16 = { enabled = true } } or nil)
    ds.manual_seed(100 + rank)
    local whole = m.make(m.cfg)
    local whole_state = {}
    for _, e in ipairs(whole:named_parameters()) do whole_state[e[1]] = e[2]:clone() end
    ds.manual_seed(100 + rank)
    local part = ds.zero.Init(cfg, function() return m.make(m.cfg) end)
    local after_part = ds.get_rng_state()
    local case = {}
    if dtype == 'f32' then
      -- rank 0's whole build, as the broadcast of a whole build gives it
      for _, e in ipairs(whole:named_parameters()) do ds.comm.broadcast(e[2], 0) end
      case.shard_diff, case.partitioned = shards_vs(part, whole)
      case.partitioned = max_all(case.partitioned)
      -- the elements of the partitioned parameters, and the most any rank holds of them
      local total, held = 0, 0
      for _, e in ipairs(ds.zero.shards_of(part)) do
        total, held = total + e[2].numel, held + e[2].shard:numel()
      end
      case.held, case.total = max_all(held), total
    end
    ds.manual_seed(100 + rank)
    m.make(m.cfg)
    case.rng_same = after_part == ds.get_rng_state()
    local l1, w1, s1 = train(whole, cfg)
    local l2, w2, s2 = train(part, cfg)
    case.start_diff = max_all(state_diff(s1, s2))
    case.losses_whole, case.losses_part = l1, l2
    case.weights_whole, case.weights_part = w1, w2
    case.shard_diff = case.shard_diff and max_all(case.shard_diff)
    results[kind .. '_' .. dtype] = case
  end
end

-- Hugging Face folders: written whole by rank 0 (one f32 file; bf16 shards
-- and the index), read whole and into shards by every rank.
for _, m in ipairs(MODELS) do
  local kind = m.kind
  for _, layout in ipairs({ { 'single', {} }, { 'sharded', { dtype = 'bf16', max_shard_bytes = 2000 } } }) do
    local path = string.format('%s/%s_%s', dir, kind, layout[1])
    if rank == 0 then
      ds.manual_seed(5)
      m.make.save_hf(m.make(m.cfg), path, layout[2])
    end
    ds.comm.barrier()
    local whole = m.make.from_hf(path)
    local part = ds.zero.Init(zero_cfg(3), function() return m.make.from_hf(path, { partitioned = true }) end)
    local d, count = shards_vs(part, whole)
    results['hf_' .. kind .. '_' .. layout[1]] = { diff = max_all(d), partitioned = max_all(count) }
    local engine = ds.initialize { model = part, config = zero_cfg(3) }
    results['hf_' .. kind .. '_' .. layout[1]].gathered_diff = max_all(state_diff(engine.zero:gathered_parameters(),
                                                                                   whole:state_dict()))
    engine:destroy()
  end
end

-- The errors, as each rank raises them.
local errors = {}
local function catch(name, fn)
  local ok, e = pcall(fn)
  errors[name] = ok and 'no error' or tostring(e)
end
local tiny = MODELS[1]
catch('nested', function()
  ds.zero.Init(zero_cfg(3), function() return ds.zero.Init(zero_cfg(3), function() end) end)
end)
catch('stage', function() ds.zero.Init(zero_cfg(2), function() return tiny.make(tiny.cfg) end) end)
local Reads = ds.nn.Module:extend('Reads')
function Reads:init()
  self.proj = ds.nn.Linear(16, 8)
  self.scale = self.proj.weight:abs():mean():item()
end
catch('reads', function() ds.zero.Init(zero_cfg(3), function() return Reads() end) end)
catch('padded', function()
  ds.zero.Init(zero_cfg(3), function()
    local c = {}
    for k, v in pairs(tiny.cfg) do c[k] = v end
    c.padded_vocab_size = 48
    return tiny.make(c)
  end)
end)
catch('init_stage', function()
  ds.initialize { model = ds.zero.Init(zero_cfg(3), function() return tiny.make(tiny.cfg) end), config = zero_cfg(2) }
end)
catch('init_threshold', function()
  local c = zero_cfg(3)
  c.zero_optimization.stage3_param_persistence_threshold = 1000
  ds.initialize { model = ds.zero.Init(zero_cfg(3), function() return tiny.make(tiny.cfg) end), config = c }
end)
catch('from_hf_outside', function()
  tiny.make.from_hf(dir .. '/gpt2_single', { partitioned = true })
end)
-- after each error the next scope opens: none was left open
catch('after', function() ds.zero.Init(zero_cfg(3), function() return tiny.make(tiny.cfg) end) end)
results.errors = errors

if rank == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode(results))
  f:close()
end
ds.comm.print('done')
