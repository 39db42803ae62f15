-- The cost of live reload when nothing changes, against the quickstart's
-- step: the quickstart's model, data and config (examples/quickstart), with
-- its schedule given as a Lua file, a hooks file and two modules of
-- ds.reload.require watched, and `dslua attach` served. Run by
-- bench/reload.sh on 1 and 2 ranks; prints one line on rank 0:
--   ranks=R watched=W step_ms=S boundary_us=B share_pct=P swaps=0
--   dslua bench/reload.lua [--steps N] [--calls M]
local ds = require 'dslua'

local steps, calls = 10, 2000
for i, a in ipairs(ds.args.rest) do
  if a == '--steps' then steps = assert(tonumber(ds.args.rest[i + 1]), '--steps needs a number') end
  if a == '--calls' then calls = assert(tonumber(ds.args.rest[i + 1]), '--calls needs a number') end
end
local rank = ds.comm.rank()

-- rank 0 writes the watched files, every rank reads them
local dir = '/tmp/dslua-bench-reload'
if rank == 0 then
  os.execute('rm -rf ' .. dir .. ' && mkdir -p ' .. dir)
  local function write(name, text)
    local f = assert(io.open(dir .. '/' .. name, 'w'))
    f:write(text)
    f:close()
  end
  write('schedule.lua', [[
local ds = require 'dslua'
return function(step, p)
  return 3e-3 * ds.lr.warmup_cosine_lr(step, { total_num_steps = 600, warmup_num_steps = 50, base_lr = 1 })
end
]])
  write('hooks.lua', 'local H = { state = { n = 0 } }\nfunction H.on_step(engine, info) H.state.n = H.state.n + 1 end\n'
                     .. 'return H\n')
  write('bench_util_a.lua', 'return { f = function(x) return x + 1 end }\n')
  write('bench_util_b.lua', 'return function(x) return 2 * x end\n')
end
ds.comm.barrier()
package.path = dir .. '/?.lua;' .. package.path
ds.reload.require 'bench_util_a'
ds.reload.require 'bench_util_b'

local f = assert(io.open('examples/quickstart/ds.json'))
local cfg = ds.json.decode(f:read('*a'), 'examples/quickstart/ds.json')
f:close()
cfg.scheduler = { type = 'lua', params = { path = dir .. '/schedule.lua' } }
cfg.hooks = dir .. '/hooks.lua'
cfg.steps_per_print = 100000
cfg.train_batch_size = nil                  -- the micro batch per rank stays the quickstart's

ds.manual_seed(1337)
local block = 64
local data = ds.data.text { text = ds.embedded_source(), block_size = block }
local model = require('models.gpt2') { n_layer = 2, n_head = 4, n_embd = 96, vocab_size = #data.vocab,
                                        block_size = block, dropout = 0 }
local engine, _, loader = ds.initialize { model = model, config = cfg, training_data = data }
local watched = #ds.reload.versions()

local it = loader:epoch(1)
local function step()
  local _, batch = it()
  engine:backward(engine:forward(batch))
  engine:step()
end
for _ = 1, 2 do step() end
ds.comm.barrier()
local t0 = ds.wall_time()
for _ = 1, steps do step() end
local step_s = (ds.wall_time() - t0) / steps

ds.comm.barrier()
t0 = ds.wall_time()
for _ = 1, calls do engine.reload:boundary() end
local boundary_s = (ds.wall_time() - t0) / calls

local swaps = 0
for _, ev in ipairs(ds.reload.history()) do
  if ev.status ~= 'loaded' then swaps = swaps + 1 end
end
if rank == 0 then
  print(string.format('ranks=%d watched=%d step_ms=%.1f boundary_us=%.1f share_pct=%.4f swaps=%d',
                      ds.comm.world_size(), watched, step_s * 1e3, boundary_s * 1e6, 100 * boundary_s / step_s, swaps))
  os.execute('rm -rf ' .. dir)
end
engine:destroy()
