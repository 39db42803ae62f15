-- Checkpoint save and load of GPT-2 124M (models.gpt2: n_layer 12, n_embd
-- 768, vocab 50257, block 1024, random init) with its AdamW state, run by
-- bench/ckpt.sh (under mpirun for -n > 1). One training step first, so
-- the moments hold values; then save_checkpoint and load_checkpoint, each
-- timed on the wall clock between barriers, in MB/s of the files written
-- or read (every rank's together).
--   dslua bench/ckpt.lua DIR [dtype] [quick]
local ds = require 'dslua'
local GPT = require 'models.gpt2'

local dir = assert(arg[1], 'usage: ckpt.lua DIR [fp32|bf16] [quick]')
local dtype = arg[2] or 'fp32'
local quick = arg[3] == 'quick'
local W, rank = ds.comm.world_size(), ds.comm.rank()
local cfg_model = quick and { n_layer = 2, n_head = 4, n_embd = 128, vocab_size = 1024, block_size = 64 }
                        or { n_layer = 12, n_head = 12, n_embd = 768, vocab_size = 50257, block_size = 1024 }

local function barrier() if W > 1 then ds.comm.barrier() end end

local say = require('bench.util').say

ds.manual_seed(1)
local t0 = ds.wall_time()
local model = GPT(cfg_model)
local engine = ds.initialize { model = model, config = {
  train_batch_size = W, steps_per_print = 1e9, bf16 = { enabled = dtype == 'bf16' },
  zero_optimization = { stage = W > 1 and 1 or 0 },
  optimizer = { type = 'AdamW', params = { lr = 1e-4, weight_decay = 0.1 } },
} }
local ids = (ds.rand(1, 33) * cfg_model.vocab_size):to('i64')
engine:backward(engine { x = ids:narrow(2, 1, 32):contiguous(), y = ids:narrow(2, 2, 32):contiguous() })
engine:step()
say('model: %.1fM parameters, %s; built and stepped once in %.1f s', model:num_parameters() / 1e6, dtype,
    ds.wall_time() - t0)

local function files_mb(tag)
  local m = ds.checkpoint.read_manifest(dir .. '/' .. tag)
  local bytes = 0
  for _, f in ipairs(m.files) do bytes = bytes + f.bytes end
  return bytes / 1e6
end

barrier()
t0 = ds.wall_time()
engine:save_checkpoint(dir, 'bench')
barrier()
local save_s = ds.wall_time() - t0
local mb = files_mb('bench')

barrier()
t0 = ds.wall_time()
engine:load_checkpoint(dir, 'bench')
barrier()
local load_s = ds.wall_time() - t0

t0 = ds.wall_time()
engine:load_checkpoint(dir, 'bench', { verify = false })
barrier()
local load_nv_s = ds.wall_time() - t0

if rank == 0 then
  local f = assert(io.open(dir .. '/result.txt', 'w'))
  f:write(string.format('%.1f %.3f %.3f %.3f\n', mb, save_s, load_s, load_nv_s))
  f:close()
end
