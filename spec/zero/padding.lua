-- Run by spec/zero_spec.lua under mpirun on 2 ranks: the rows a bucket's
-- gradients are reduced through (core/train/ds_zero.c, launch_rows) hold
-- padding where a parameter's last shard is short, and it must reduce as
-- zeros. Before each backward a freed block of NaN is left in the
-- allocator's cache at exactly the rows' size, so the rows get its bytes
-- unless they are zeroed. Rank 0 writes each case's gradient norms: stage
-- 0 (no shards), then stages 1-3, for parameters of odd sizes (padded
-- shards) and of even ones (no padding: the copies fill the rows).
local ds = require 'dslua'

local out_path = assert(arg[1], 'usage: padding.lua out.json')
local rank = ds.comm.rank()

local Lin = ds.nn.Module:extend('PaddingLin')
function Lin:init(n_in, n_out) self.fc = ds.nn.Linear(n_in, n_out) end
function Lin:forward(b) return ds.mse_loss(self.fc(b.x), b.y) end

local SIZES = { { 'odd', 257, 255 }, { 'even', 256, 256 } }

-- shards of 2 ranks: ceil(n_in * n_out / 2) + ceil(n_out / 2) columns
local function rows_elements(n_in, n_out)
  return 2 * (math.ceil(n_in * n_out / 2) + math.ceil(n_out / 2))
end

local function norms(n_in, n_out, stage)
  ds.manual_seed(5)
  local e = ds.initialize { model = Lin(n_in, n_out), config = {
    train_batch_size = 8, steps_per_print = 1e9, gradient_clipping = 1.0, zero_optimization = { stage = stage },
    optimizer = { type = 'AdamW', params = { lr = 1e-3 } } } }
  ds.manual_seed(100 + rank)
  local out = {}
  for step = 1, 3 do
    local loss = e { x = ds.randn(4, n_in), y = ds.randn(4, n_out) }
    ds.full({ rows_elements(n_in, n_out) }, 0 / 0)
    collectgarbage()
    collectgarbage()
    e:backward(loss)
    e:step()
    out[step] = e.grad_norm
  end
  e:destroy()
  return out
end

local cases = {}
for _, s in ipairs(SIZES) do
  for stage = 0, 3 do cases[s[1] .. stage] = norms(s[2], s[3], stage) end
end
if rank == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode(cases))
  f:close()
end
