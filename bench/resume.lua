-- Run by bench/resume.sh under mpirun. Two modes:
--   dslua bench/resume.lua save DIR CKPT STEPS POLICY   2 ranks train STEPS steps and save CKPT/mid
--   dslua bench/resume.lua load DIR CKPT POLICY         other ranks load it and read 5 steps
-- DIR holds bench/shards.lua's llm.c shards, read in windows of 8 tokens;
-- POLICY is uneven (the sampler block's policy) or deepspeed (DeepSpeed's
-- loader). save prints the checkpoint's bytes of sampler state per rank;
-- load prints what load_checkpoint added on each rank to the anonymous
-- resident memory (RssAnon, after a collection), to the peak resident
-- memory (VmHWM) and to the Lua heap.
local ds = require 'dslua'

local mode, dir, ckpt = arg[1], arg[2], arg[3]
local policy = mode == 'save' and arg[5] or arg[4]
assert((mode == 'save' or mode == 'load') and dir and ckpt and (policy == 'uneven' or policy == 'deepspeed'),
       'usage: resume.lua save DIR CKPT STEPS POLICY | load DIR CKPT POLICY (POLICY: uneven or deepspeed)')
local rank, W = ds.comm.rank(), ds.comm.world_size()

-- RssAnon and VmHWM (KB): the anonymous resident memory and the peak of all
local function memory()
  local f = assert(io.open('/proc/self/status'))
  local s = f:read('*a')
  f:close()
  return tonumber(s:match('RssAnon:%s*(%d+)')), tonumber(s:match('VmHWM:%s*(%d+)'))
end

local data = ds.data.shards { pattern = dir .. '/bench_train_*.bin', block_size = 8 }
ds.manual_seed(1)
local model = require('models.gpt2') { vocab_size = 50257, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16 }
local config = { steps_per_print = 1e9, optimizer = { type = 'AdamW', params = { lr = 1e-3 } } }
if policy == 'uneven' then
  local micro = {}
  for r = 1, W do micro[r] = 4 end
  config.sampler = { policy = 'uneven', micro_batch_per_rank = micro, seed = 1 }
else
  config.train_micro_batch_size_per_gpu = 4
end
local engine = ds.initialize { model = model, config = config, training_data = data }
local loader = engine.training_dataloader

local function gather(values)
  local t = ds.tensor(values, 'f64')
  return W > 1 and ds.comm.all_gather(t) or { t }
end

if mode == 'save' then
  local steps = assert(tonumber(arg[4]), 'STEPS must be a number')
  for step, batch in loader:epoch() do
    engine:backward(engine(batch))
    engine:step()
    if step == steps then break end
  end
  engine:save_checkpoint(ckpt, 'mid')
  -- the sampler's part of this rank's file: its state's JSON and tensors
  local tensors, meta = ds.checkpoint.load_file(string.format('%s/mid/rank_%05d.safetensors', ckpt, rank))
  local st = ds.json.decode(meta.dslua)
  local bytes = #ds.json.encode { loader = st.loader, sampler = st.sampler, plan = st.plan }
  for name, t in pairs(tensors) do
    if name:match('^sampler/') or name:match('^loader/') then bytes = bytes + 8 * t:numel() end
  end
  local all = gather({ bytes })
  if rank == 0 then
    print(string.format('corpus: %d shards, %d windows of 8 tokens; %s; saved after %d steps on %d ranks',
                        #data.paths, #data, policy == 'uneven' and 'the uneven policy' or 'DeepSpeed\'s loader', steps,
                        W))
    for r, t in ipairs(all) do print(string.format('rank %d | sampler and loader state %d bytes', r - 1, t:item())) end
  end
else
  collectgarbage()
  local anon, peak = memory()
  local lua = collectgarbage('count')
  engine:load_checkpoint(ckpt, 'mid')
  collectgarbage()
  local anon2, peak2 = memory()
  local all = gather({ anon2 - anon, peak2 - peak, collectgarbage('count') - lua })
  for step in loader:epoch(engine.epoch) do
    if step == 5 then break end
  end
  if rank == 0 then
    for r, t in ipairs(all) do
      local v = t:totable()
      print(string.format('rank %d | load_checkpoint: anonymous memory %+d KB, peak resident %+d KB, Lua heap %+.0f KB',
                          r - 1, v[1], v[2], v[3]))
    end
  end
end
engine:finish()
