-- Run by spec/pipe_spec.lua on 1 rank and under mpirun: trains a model
-- (mlp: the MNIST-shaped MLP; gpt: a tiny GPT-2 with its embedding tied to
-- the lm_head) as a PipelineModule of `stages` stages (the other ranks
-- data parallel, with ZeRO stage `zero`, gradient_clipping `clip`, fp16
-- or bf16 when `precision` says (fp8: bf16 with the fp8 block, current
-- scaling), and the pipeline block's
-- activation_checkpoint_interval `interval`) with
-- engine:train_batch on the same batches: each step's 4 micro batches
-- split over the data-parallel ranks. Rank 0 writes every step's loss, the
-- evaluation loss, the last gradient norm, every weight (keyed by the
-- layer's global index, tied ones by key) and the largest difference
-- between copies of one weight (data-parallel replicas, tied copies) as
-- JSON to the output path. With `save:<dir>` it saves a checkpoint in dir
-- after the first step (client_state {step = 1}) and the 16-bit model
-- after the last (dir/model.safetensors); with `load:<dir>` it loads that
-- checkpoint and runs the steps after it (losses: those steps').
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local shares = require 'ranks.shares'

local out_path, kind, stages = arg[1], arg[2], tonumber(arg[3])
local zero, clip, precision, interval = tonumber(arg[4] or 0), tonumber(arg[5] or 0), arg[6], tonumber(arg[7] or 0)
local ckpt, ckpt_dir = (arg[8] or ''):match('^(%a+):(.+)$')
assert(out_path and (kind == 'mlp' or kind == 'gpt') and stages,
       'usage: equiv.lua out.json mlp|gpt stages [zero [clip [fp16|bf16|fp8|fp32 [interval [save:dir|load:dir]]]]]')
local world = ds.comm.world_size()
local MICRO, STEPS = 4, 3
local dp = world / stages
local gas = MICRO / dp

local layers, loss_fn, sample
if kind == 'mlp' then
  local MLP = require 'models.mlp'
  layers = MLP.pipe_layers { input_size = 64, hidden = { 32, 16 }, num_classes = 10 }
  loss_fn = ds.cross_entropy
  sample = function() return { x = ds.randn(4, 1, 8, 8), y = (ds.rand(4) * 9.99):to('i64') } end
else
  local GPT = require 'models.gpt2'
  layers = GPT.pipe_layers { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 32, block_size = 8 }
  loss_fn = GPT.pipe_loss
  sample = function()
    local ids = (ds.rand(2, 9) * 31.99):to('i64')
    return { x = ids:narrow(2, 1, 8):contiguous(), y = ids:narrow(2, 2, 8):contiguous() }
  end
end

local model = ds.pipe.PipelineModule { layers = layers, num_stages = stages, loss_fn = loss_fn }

-- this data-parallel rank's share of each step's micro batches
local function batches()
  ds.manual_seed(11)
  local list = {}
  for i = 1, MICRO * STEPS do list[i] = sample() end
  return shares(list, MICRO, gas, model.dp_rank)
end

local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = kind == 'mlp' and 4 or 2, gradient_accumulation_steps = gas,
  steps_per_print = 1000, optimizer = { type = 'AdamW', params = { lr = 1e-2 } },
  zero_optimization = { stage = zero }, gradient_clipping = clip,
  fp16 = { enabled = precision == 'fp16' }, bf16 = { enabled = precision == 'bf16' or precision == 'fp8' },
  fp8 = { enabled = precision == 'fp8', recipe = 'current' },
  pipeline = { activation_checkpoint_interval = interval },
} }
local it = batches()
local losses, first, client = {}, 1, nil
if ckpt == 'load' then
  local _
  _, client = engine:load_checkpoint(ckpt_dir)
  first = engine.global_steps + 1
  for _ = 1, gas * engine.global_steps do it() end     -- the saved steps' batches
end
for step = first, STEPS do
  losses[#losses + 1] = engine:train_batch(it)
  if ckpt == 'save' and step == 1 then engine:save_checkpoint(ckpt_dir, nil, { step = 1 }) end
end
if ckpt == 'save' then engine:save_16bit_model(ckpt_dir, 'model.safetensors') end
local eval = engine:eval_batch(batches())

local function weights()
  local out, tied = {}, {}
  for _, mod in pairs(model.tied_modules) do tied[mod] = true end
  local function add(prefix, mod)
    for _, p in ipairs(mod:named_parameters()) do out[prefix .. p[1]] = p[2]:to('f64'):reshape({ -1 }):totable() end
  end
  for k, f in ipairs(model.funcs) do
    if type(f) == 'table' and f.named_parameters and not tied[f] then
      add((model.parts[model.stage_id + 1] + k - 2) .. '.', f)
    end
  end
  for key, mod in pairs(model.tied_modules) do add('tied.' .. key .. '.', mod) end
  return out
end

-- every rank's weights to rank 0, as JSON text
local mine = ds.json.encode(weights())
local all = { mine }
if ds.comm.rank() == 0 then
  for r = 1, world - 1 do
    local n = ds.comm.recv(ds.zeros({ 1 }, 'i64'), r):item()
    local bytes = ds.comm.recv(ds.zeros({ n }, 'i64'), r):totable()
    local chars = {}
    for i, b in ipairs(bytes) do chars[i] = string.char(b) end
    all[#all + 1] = table.concat(chars)
  end
  local w, spread = {}, 0
  for _, text in ipairs(all) do
    for k, v in pairs(ds.json.decode(text)) do
      if w[k] then
        for i = 1, #v do spread = math.max(spread, math.abs(v[i] - w[k][i])) end
      end
      w[k] = v
    end
  end
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses, eval = eval, weights = w, spread = spread, norm = engine.grad_norm,
                           stages = { model:stage_layers(0) }, client = client })
  f:close()
elseif world > 1 then
  local bytes = {}
  for i = 1, #mine do bytes[i] = mine:byte(i) end
  ds.comm.send(ds.tensor({ #bytes }, 'i64'), 0)
  ds.comm.send(ds.tensor(bytes, 'i64'), 0)
end
