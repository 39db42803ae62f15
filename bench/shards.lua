-- Run by bench/shards.sh. Two modes:
--   dslua bench/shards.lua write DIR SHARDS TOKENS   llm.c uint16 shards DIR/bench_train_NNNN.bin
--   dslua bench/shards.lua train DIR STEPS [quick]    a tiny GPT-2 trained on them (under mpirun)
-- The tokens follow t[i] = (5 t[i-1] + r) mod 50257 with r uniform in
-- [0, 4): a next token the model can learn, down to a loss of ln 4.
-- train prints each rank's resident memory from /proc/self/status (VmHWM:
-- the peak of all of it, RssAnon: what is not a file's pages, the corpus
-- mapped is a file's pages) and rank 0 the tokens/s.
local ffi = require 'ffi'
local ds = require 'dslua'

local V = 50257
local mode, dir = arg[1], arg[2]

-- Little-endian int32s in a string: the shard header's fields.
local function le32(v)
  return string.char(v % 256, math.floor(v / 256) % 256, math.floor(v / 65536) % 256, math.floor(v / 16777216))
end

-- One shard of n tokens, written in chunks of CHUNK from the state x (the
-- last token) and the generator state s; returns both for the next shard.
local CHUNK = 2 ^ 20
local buf = ffi.new('uint16_t[?]', CHUNK)
local function write_shard(path, n, x, s)
  local f = assert(io.open(path, 'wb'))
  assert(f:write(le32(20240520), le32(1), le32(n), string.rep('\0', 253 * 4)))
  local left = n
  while left > 0 do
    local m = math.min(left, CHUNK)
    for i = 0, m - 1 do
      s = (s * 1103515245 + 12345) % 2147483648    -- exact in a double: the product stays below 2^53
      x = (5 * x + math.floor(s / 65536) % 4) % V
      buf[i] = x
    end
    assert(f:write(ffi.string(buf, 2 * m)))
    left = left - m
  end
  assert(f:close())
  return x, s
end

local function kb(status, key) return tonumber(status:match(key .. ':%s*(%d+)')) end
local function memory()
  local f = assert(io.open('/proc/self/status'))
  local s = f:read('*a')
  f:close()
  return { peak = kb(s, 'VmHWM'), anon = kb(s, 'RssAnon'), file = kb(s, 'RssFile') }
end

if mode == 'write' then
  local shards, tokens = assert(tonumber(arg[3])), assert(tonumber(arg[4]))
  local x, s = 0, 1
  for k = 0, shards - 1 do x, s = write_shard(string.format('%s/bench_train_%04d.bin', dir, k), tokens, x, s) end
  return
end
assert(mode == 'train', 'usage: shards.lua write DIR SHARDS TOKENS | train DIR STEPS [quick]')

local STEPS, quick = assert(tonumber(arg[3])), arg[4] == 'quick'
local B, T = 8, 128
local rank, W = ds.comm.rank(), ds.comm.world_size()
local before = memory()
-- quick skips the vocabulary check, which reads every shard once
local data = ds.data.shards { pattern = dir .. '/bench_train_*.bin', block_size = T, vocab_size = not quick and V or nil }
local opened = memory()
ds.manual_seed(1)
local model = require('models.gpt2') { vocab_size = V, block_size = T, n_layer = 2, n_head = 2, n_embd = 64 }
local engine = ds.initialize {
  model = model,
  config = { train_micro_batch_size_per_gpu = B, steps_per_print = 1e9, gradient_clipping = 1.0,
             optimizer = { type = 'AdamW', params = { lr = 3e-3, weight_decay = 0.1 } } },
}
-- each rank its windows, shuffled, read in two threads with 4 batches in flight
local sampler = require('samplers.distributed').new(data, { num_replicas = W, rank = rank })
local loader = ds.data.loader(data, { batch_size = B, sampler = sampler, num_workers = 2, prefetch_factor = 2 })

local first, last, t0
for step, batch in loader:epoch(0) do
  local loss = engine(batch)
  engine:backward(loss)
  engine:step()
  if step == 1 then first, t0 = loss:item(), ds.wall_time() end
  if step == STEPS + 1 then
    last = loss:item()
    break
  end
end
loader:close()
local seconds = ds.wall_time() - t0
local m = memory()
local mine = ds.tensor({ m.peak, m.anon, before.anon, opened.anon, m.file }, 'f64')
local all = W > 1 and ds.comm.all_gather(mine) or { mine }
if rank == 0 then
  local tokens = 0
  for _, n in ipairs(data.lengths) do tokens = tokens + n end
  print(string.format('corpus: %d shards, %.2f billion tokens (%.2f GB); %d windows of %d tokens',
                      #data.paths, tokens / 1e9, (2 * tokens + 1024 * #data.paths) / 1e9, #data, T))
  print(string.format('GPT-2 %s parameters (2 layers, 64 wide, vocab %d), micro batch %d x %d on %d ranks, AdamW',
                      require('dslua.engine.zero').commas(model:num_parameters()), V, B, T, W))
  print(string.format('%d steps after the first: loss %.3f -> %.3f, %.0f tokens/s (all ranks)', STEPS, first, last,
                      STEPS * B * T * W / seconds))
  for r, t in ipairs(all) do
    local v = t:totable()
    print(string.format('rank %d | peak resident %.0f MB | anonymous %.0f MB (%.0f before the data, %.0f after mapping '
                        .. 'it) | file pages %.0f MB', r - 1, v[1] / 1024, v[2] / 1024, v[3] / 1024, v[4] / 1024,
                        v[5] / 1024))
  end
end
engine:finish()
