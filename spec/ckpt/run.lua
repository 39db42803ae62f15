-- Run by spec/checkpoint_spec.lua on 1 rank or under mpirun: a tiny GPT-2
-- trained through ds.initialize, saved and loaded as the options say.
--   run.lua out.json '<options as JSON>'
-- options: stage (0-3), dtype (fp32, bf16, fp16), gas, dropout, sampler
-- (a policy block, nil: DeepSpeed's own loader), dir (where it saves),
-- load (a tag, or "latest", of load_dir, default dir), resave (a tag: saved right after the load),
-- steps (train until global_steps reaches it), save_at (a global step at
-- which the loop saves, global_step<N>), final (a tag saved at the end),
-- tag_validation, tag (the tag every rank saves at save_at, %d the rank),
-- nvme (a folder: offload_optimizer to nvme there), micro (the micro batch
-- without a sampler, default 4), shards (a folder: the same samples read
-- from llm.c token shards written there, 4 shards of 24 windows).
-- Rank 0 writes {losses = {"<step>" = {rank losses}}, skipped, scale, lr,
-- seen = the 0-based samples of epoch 1 every rank read, epoch1_samples =
-- global_samples when epoch 1 ended}.
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local out_path = assert(arg[1], 'usage: run.lua out.json options')
local o = ds.json.decode(assert(arg[2], 'usage: run.lua out.json options'))
local W, rank = ds.comm.world_size(), ds.comm.rank()

ds.manual_seed(11)
local tokens = (ds.rand(96, 9) * 32):to('i64')
local data = ds.data.tensors { x = tokens:narrow(2, 1, 8):contiguous(), y = tokens:narrow(2, 2, 8):contiguous() }
if o.shards then
  -- the rows one after another, 24 to a shard: windows of 8 at stride 9
  -- are the rows' x and y (each rank writes its own copy)
  local dir, rows = o.shards .. '/' .. rank, tokens:totable()
  os.execute('mkdir -p ' .. dir)
  local function le32(v)
    return string.char(v % 256, math.floor(v / 256) % 256, math.floor(v / 65536) % 256, math.floor(v / 16777216))
  end
  for k = 0, 3 do
    local parts = { le32(20240520), le32(1), le32(24 * 9), string.rep('\0', 253 * 4) }
    for r = 24 * k + 1, 24 * k + 24 do
      for _, t in ipairs(rows[r]) do parts[#parts + 1] = string.char(t, 0) end
    end
    local f = assert(io.open(string.format('%s/tok_%d.bin', dir, k), 'wb'))
    f:write(table.concat(parts))
    f:close()
  end
  data = ds.data.shards { pattern = dir .. '/tok_*.bin', block_size = 8, stride = 9, vocab_size = 32 }
  assert(#data == 96)
end

ds.manual_seed(100 + rank)         -- each rank its own init: rank 0's is broadcast
local model = GPT { vocab_size = 32, block_size = 8, n_layer = 1, n_head = 2, n_embd = 16, dropout = o.dropout or 0 }
local cfg = {
  gradient_accumulation_steps = o.gas or 1, steps_per_print = 1000, gradient_clipping = 1.0,
  optimizer = { type = o.optimizer or 'AdamW', params = { lr = 1e-2, weight_decay = 0.01 } },
  scheduler = { type = 'WarmupCosineLR', params = { warmup_num_steps = 5, total_num_steps = 100 } },
  zero_optimization = { stage = o.stage or 0, reduce_bucket_size = 3000, stage3_param_persistence_threshold = 0,
                        stage3_gather_16bit_weights_on_model_save = true, sub_group_size = 1000,
                        offload_optimizer = o.nvme and { device = 'nvme', nvme_path = o.nvme .. '/' .. rank } or nil },
  bf16 = { enabled = o.dtype == 'bf16' }, fp16 = { enabled = o.dtype == 'fp16', initial_scale_power = 20 },
  checkpoint = { tag_validation = o.tag_validation or 'Warn' },
}
if o.sampler then cfg.sampler = o.sampler else cfg.train_micro_batch_size_per_gpu = o.micro or 4 end
local engine, _, loader = ds.initialize { model = model, config = cfg, training_data = data }

local client
if o.load then
  local _, c = engine:load_checkpoint(o.load_dir or o.dir, o.load ~= 'latest' and o.load or nil)
  client = c
  if o.resave then engine:save_checkpoint(o.dir, o.resave) end
end

-- a sample by its tokens: which of the dataset's rows a batch holds
local row_of = {}
for i, row in ipairs(tokens:totable()) do row_of[table.concat(row, ',')] = i - 1 end
local seen, epoch1_samples = {}, nil

local losses = {}
while engine.global_steps < (o.steps or 0) do
  local ended = true
  for _, batch in loader:epoch() do
    if engine.epoch == 1 then
      local x, y = batch.x:totable(), batch.y:totable()
      for i, row in ipairs(x) do seen[#seen + 1] = row_of[table.concat(row, ',') .. ',' .. y[i][#y[i]]] end
    end
    engine:backward(engine(batch))
    local boundary = engine:is_gradient_accumulation_boundary()
    engine:step()
    if boundary then
      losses[#losses + 1] = { engine.global_steps, engine.last_loss }
      if engine.global_steps == o.save_at then
        local tag = o.tag and string.format(o.tag, rank) or nil
        engine:save_checkpoint(o.dir, tag, { step = engine.global_steps, note = 'client', t = ds.arange(3) })
      end
      if engine.global_steps >= o.steps then
        ended = false
        break
      end
    end
  end
  if ended and engine.epoch == 1 then epoch1_samples = engine.global_samples end
end
if o.final then engine:save_checkpoint(o.dir, o.final) end

-- every rank's losses by step
local flat = {}
for _, l in ipairs(losses) do flat[#flat + 1] = l[1]; flat[#flat + 1] = l[2] end
local function gather(list)
  local t = ds.tensor(#list > 0 and list or { -1, 0 }, 'f64')
  return W > 1 and ds.comm.all_gather(t) or { t }
end
local rows = gather(flat)
for i = #seen + 1, 2 * 96 do seen[i] = -1 end        -- the same length on every rank
local all_seen = {}
for _, t in ipairs(gather(seen)) do
  for _, v in ipairs(t:totable()) do
    if v >= 0 then all_seen[#all_seen + 1] = v end
  end
end
local by_step = {}
for r, t in ipairs(rows) do
  local v = t:totable()
  for i = 1, #v, 2 do
    if v[i] >= 0 then
      local k = tostring(v[i])
      by_step[k] = by_step[k] or {}
      by_step[k][r] = v[i + 1]
    end
  end
end
if rank == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = by_step, skipped = engine.skipped_steps, global_steps = engine.global_steps,
                           global_samples = engine.global_samples, epoch = engine.epoch, seen = all_seen,
                           epoch1_samples = epoch1_samples,
                           scale = engine.scaler and engine.scaler.cur_scale or false,
                           lr = engine:get_lr()[1], client = client and { step = client.step, note = client.note,
                                                                          t = client.t and client.t:totable() } })
  f:close()
end
engine:finish()
