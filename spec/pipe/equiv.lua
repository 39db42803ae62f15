-- Run by spec/pipe_spec.lua on 1 rank (one stage) and under mpirun on 2
-- ranks (two stages): trains the MNIST-shaped MLP as a PipelineModule
-- with engine:train_batch on the same batches and writes, from the last
-- stage, every step's loss and every rank's weights (keyed by the layer's
-- global index) as JSON to arg[1].
local ds = require 'dslua'
local MLP = require 'models.mlp'

local out_path = assert(arg[1], 'usage: equiv.lua out.json')
local S = ds.comm.world_size()
local MB, GAS, STEPS = 4, 3, 4

local function batches()
  ds.manual_seed(11)
  local list = {}
  for i = 1, GAS * STEPS do list[i] = { x = ds.randn(MB, 1, 8, 8), y = (ds.rand(MB) * 9.99):to('i64') } end
  local i = 0
  return function()
    i = i + 1
    return list[i]
  end
end

local function weights(m)
  local out = {}
  for k, f in ipairs(m.funcs) do
    if type(f) == 'table' and f.named_parameters then
      for _, p in ipairs(f:named_parameters()) do
        out[(m.parts[m.stage_id + 1] + k - 2) .. '.' .. p[1]] = p[2]:to('f64'):reshape({ -1 }):totable()
      end
    end
  end
  return out
end

local model = ds.pipe.PipelineModule {
  layers = MLP.pipe_layers { input_size = 64, hidden = { 32, 16 }, num_classes = 10 },
  num_stages = S, loss_fn = ds.cross_entropy, partition_method = 'parameters',
}
local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = MB, gradient_accumulation_steps = GAS, steps_per_print = 1000,
  optimizer = { type = 'AdamW', params = { lr = 1e-2 } },
} }
local it = batches()
local losses = {}
for step = 1, STEPS do losses[step] = engine:train_batch(it) end
local eval = engine:eval_batch(batches())

-- every stage's weights to rank 0, as JSON text
local mine = ds.json.encode(weights(model))
local all = { mine }
if S > 1 then
  if ds.comm.rank() == 0 then
    for r = 1, S - 1 do
      local n = ds.comm.recv(ds.zeros({ 1 }, 'i64'), r):item()
      local bytes = ds.comm.recv(ds.zeros({ n }, 'i64'), r):totable()
      local chars = {}
      for i, b in ipairs(bytes) do chars[i] = string.char(b) end
      all[#all + 1] = table.concat(chars)
    end
  else
    local bytes = {}
    for i = 1, #mine do bytes[i] = mine:byte(i) end
    ds.comm.send(ds.tensor({ #bytes }, 'i64'), 0)
    ds.comm.send(ds.tensor(bytes, 'i64'), 0)
  end
end
if ds.comm.rank() == 0 then
  local w = {}
  for _, text in ipairs(all) do
    for k, v in pairs(ds.json.decode(text)) do w[k] = v end
  end
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses, eval = eval, weights = w,
                           stages = { model:stage_layers(0) } })
  f:close()
end
