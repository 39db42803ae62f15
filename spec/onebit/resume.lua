-- A 1-bit optimizer resumed from a checkpoint takes up its schedule at the
-- saved step: trains STEPS steps, saves after SAVE, builds a fresh engine
-- that loads it and trains the rest; writes, from rank 0, each resumed
-- step's compressed flag and loss, or the error initialize or the first
-- step raised, and the losses of those steps in a run that went on
-- without the checkpoint. resume.lua OUT.json TYPE DIR SAVE STEPS
-- [key=value ...] (first=TYPE2: the saved run is a TYPE2's).
local ds = require 'dslua'
local out, kind, dir, save, steps = arg[1], arg[2], arg[3], tonumber(arg[4]), tonumber(arg[5])
local params, first = { lr = 2e-3 }, kind
for i = 6, #arg do
  local k, v = arg[i]:match('^(%w[%w_]*)=(.*)$')
  if k == 'first' then first = v elseif k then params[k] = tonumber(v) end
end
ds.manual_seed(7)
local x, y = ds.randn(512, 16), (ds.rand(512) * 3):to('i64')

local function engine(type)
  ds.manual_seed(3)
  local model = ds.nn.Sequential(ds.nn.Linear(16, 32), ds.nn.GELU(), ds.nn.Linear(32, 3))
  local p = type == kind and params or { lr = params.lr, bias_correction = false }
  return ds.initialize { model = model, training_data = ds.data.tensors { x = x, y = y },
                         config = { train_micro_batch_size_per_gpu = 8, steps_per_print = 1e9,
                                    optimizer = { type = type, params = p } } }
end

local function train(e, loader, n)
  local rows = {}
  while #rows < n do
    for _, b in loader:epoch() do
      e:backward(ds.cross_entropy(e(b.x), b.y))
      e:step()
      rows[#rows + 1] = { compressed = e.onebit_stats and e.onebit_stats.compressed, loss = e.last_loss }
      if #rows == n then break end
    end
  end
  return rows
end

local e, _, loader = engine(first)
train(e, loader, save)
e:save_checkpoint(dir)
e:destroy()
local ok, result = pcall(function()
  local f, _, l = engine(kind)
  f:load_checkpoint(dir)
  local rows = train(f, l, steps - save)
  f:destroy()
  return rows
end)
local straight = {}
if ok then
  local s, _, l = engine(kind)
  for i, r in ipairs(train(s, l, steps)) do if i > save then straight[#straight + 1] = r.loss end end
  s:destroy()
end
if ds.comm.rank() == 0 then
  local fh = assert(io.open(out, 'w'))
  fh:write(ds.json.encode(ok and { steps = result, straight = straight } or { error = tostring(result) }))
  fh:close()
end
