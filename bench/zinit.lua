-- Peak resident memory of a Llama at ZeRO stage 3 built whole or inside
-- ds.zero.Init (run by bench/zinit.sh under mpirun, once per way): each
-- rank's VmHWM (kernel's peak resident set) at start-up, after the build,
-- after initialize and (with step) after one training step, in MiB,
-- printed by rank 0 as one line per rank.
--   dslua bench/zinit.lua whole|zinit n_layer n_embd [step]
local ds = require 'dslua'
local Llama = require 'models.llama'

local way, n_layer, n_embd, step = arg[1], tonumber(arg[2]), tonumber(arg[3]), arg[4] == 'step'
assert((way == 'whole' or way == 'zinit') and n_layer and n_embd, 'usage: zinit.lua whole|zinit n_layer n_embd')
local N, rank = ds.comm.world_size(), ds.comm.rank()
local T = 32

local function hwm_mib()
  local f = assert(io.open('/proc/self/status'))
  local kb = tonumber(f:read('*a'):match('VmHWM:%s*(%d+)'))
  f:close()
  return kb / 1024
end

-- stage 3 as a model larger than a rank is run: modules released after
-- their forward (no reuse distance), a bounded prefetch
local cfg = {
  train_batch_size = N, steps_per_print = 1e9,
  optimizer = { type = 'AdamW', params = { lr = 1e-4 } },
  zero_optimization = { stage = 3, stage3_max_reuse_distance = 0, stage3_prefetch_bucket_size = 5e6,
                        stage3_max_live_parameters = 1e8, reduce_bucket_size = 5e6 },
}
local mcfg = { n_layer = n_layer, n_embd = n_embd, n_head = n_embd / 64, vocab_size = 32000, block_size = T }

collectgarbage()
local marks = { hwm_mib() }
ds.manual_seed(1)
local model = way == 'zinit' and ds.zero.Init(cfg, function() return Llama(mcfg) end) or Llama(mcfg)
marks[2] = hwm_mib()
local engine = ds.initialize { model = model, config = cfg }
collectgarbage()
marks[3] = hwm_mib()
marks[4] = marks[3]
if step then
  ds.manual_seed(2)
  local ids = (ds.rand(1, T + 1) * 32000):to('i64')
  local loss = engine(ids:narrow(2, 1, T):contiguous(), ids:narrow(2, 2, T):contiguous())
  engine:backward(loss)
  engine:step()
  marks[4] = hwm_mib()
end

local params = 0
for _, p in ipairs(model:parameters()) do params = params + p:numel() end
local rows = ds.comm.all_gather(ds.tensor(marks, 'f64'))
if rank == 0 then
  for r, t in ipairs(rows) do
    local m = t:totable()
    print(string.format('%s rank %d params %d start %.0f built %.0f initialized %.0f stepped %.0f', way, r - 1,
                        params, m[1], m[2], m[3], m[4]))
  end
end
engine:destroy()
