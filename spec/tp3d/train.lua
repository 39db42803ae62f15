-- Run by spec/tp3d_spec.lua on 1 rank and under mpirun: a pipeline of
-- `pipe` stages of tensor degree `tensor`, the data degree the rest of the
-- world, ZeRO stage `zero`: kind mlp, Megatron MLP blocks
-- (examples/3d/blocks.lua); kind gpt, a tiny GPT-2's pipeline layers
-- (models.gpt2.pipe_layers, its embedding tied to the lm_head on the last
-- stage); kind llama, a tiny Llama's with grouped-query heads. 3 steps of 4 micro batches of the same global batch, each data
-- rank its share, SGD with momentum, gradient clipping; with fp8:<recipe>
-- the fp8 block on (delayed or current scaling); with save:<dir> a
-- checkpoint after the first step, with load:<dir> the steps after the
-- loaded one (losses: those steps'), with export:<dir> save_16bit_model
-- after the last. Rank 0 writes every step's loss, the
-- last gradient norm, every weight whole (gathered over the tensor group,
-- keyed by the layer's index) and the largest difference between copies of
-- one weight (data replicas, tensor ranks' replicated weights, tied
-- copies) and how many of its linears run in fp8 as JSON to the output
-- path.
local ds = require 'dslua'
package.path = 'spec/?.lua;examples/3d/?.lua;' .. package.path
local shares = require 'ranks.shares'
local P = ds.nn.parallel

local out_path, kind, pipe, tensor = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4])
local zero = tonumber(arg[5] or 0)
local ckpt, ckpt_dir, fp8
for i = 6, #arg do
  local k, v = arg[i]:match('^(%w+):(.+)$')
  if k == 'fp8' then fp8 = v elseif k then ckpt, ckpt_dir = k, v end
end
assert(out_path and (kind == 'mlp' or kind == 'gpt' or kind == 'llama') and pipe and tensor,
       'usage: train.lua out.json mlp|gpt|llama pipe tensor [zero [save:dir|load:dir|export:dir] [fp8:recipe]]')
local W, LAYERS, MICRO, B, STEPS = 16, 4, 4, 2, 3
local topo = ds.topology { pipe = pipe, tensor = tensor }

local layers, loss_fn, sample
if kind == 'mlp' then
  layers = require('blocks').layers(LAYERS, W, topo:group('tensor'))
  loss_fn = function(out, y) return ds.mse_loss(out, y) end
  sample = function() return { x = ds.randn(B, W), y = ds.randn(B, W) } end
else
  if kind == 'gpt' then
    layers, loss_fn = require('models.gpt2').pipe_layers { n_layer = 2, n_head = 4, n_embd = 16, vocab_size = 32,
                                                           block_size = 8, topology = topo }
  else
    layers, loss_fn = require('models.llama').pipe_layers { n_layer = 2, n_head = 8, n_kv_head = 4, n_embd = 32,
                                                            intermediate_size = 24, vocab_size = 32, block_size = 8,
                                                            topology = topo }
  end
  sample = function()
    local ids = (ds.rand(B, 9) * 31.99):to('i64')
    return { x = ids:narrow(2, 1, 8):contiguous(), y = ids:narrow(2, 2, 8):contiguous() }
  end
end
local model = ds.pipe.PipelineModule { layers = layers, topology = topo, loss_fn = loss_fn,
                                       partition_method = ({ mlp = 'uniform', gpt = 'type:Block',
                                                             llama = 'type:LlamaDecoderLayer' })[kind] }
local dp = model.dp_size
local gas = MICRO / dp
local engine = ds.initialize { model = model, config = {
  train_micro_batch_size_per_gpu = B, gradient_accumulation_steps = gas, steps_per_print = 1000,
  optimizer = { type = 'SGD', params = { lr = 0.1, momentum = 0.9 } }, gradient_clipping = 0.5,
  zero_optimization = { stage = zero }, fp8 = { enabled = fp8 ~= nil, recipe = fp8 },
} }

ds.manual_seed(11)
local list = {}
for i = 1, MICRO * STEPS do list[i] = sample() end
local it, losses, first = shares(list, MICRO, gas, model.dp_rank), {}, 1
if ckpt == 'load' then
  engine:load_checkpoint(ckpt_dir)
  first = engine.global_steps + 1
  for _ = 1, gas * engine.global_steps do it() end     -- the saved steps' batches
end
for s = first, STEPS do
  losses[#losses + 1] = engine:train_batch(it)
  if ckpt == 'save' and s == 1 then engine:save_checkpoint(ckpt_dir) end
end
if ckpt == 'export' then engine:save_16bit_model(ckpt_dir, 'model.safetensors') end

-- this stage's weights whole, by the global layer index
local mine, whole = {}, P.full_state_dict(model)
for _, e in ipairs(model:named_parameters()) do
  local k, rest = e[1]:match('^layers%.(%d+)%.(.+)$')
  local index = model.layer_of[tonumber(k) + 1]
  mine[index .. '.' .. rest] = whole[e[1]]:reshape(-1):to('f64'):totable()
end
-- every rank's to every rank, as JSON bytes
local text = ds.json.encode(mine)
local bytes = {}
for i = 1, #text do bytes[i] = text:byte(i) end
local all = ds.comm.world_size() > 1 and ds.comm.all_gather(ds.tensor(bytes, 'u8')) or { ds.tensor(bytes, 'u8') }
local weights, spread = {}, 0
for _, t in ipairs(all) do
  local chunks, v = {}, t:totable()
  for i = 1, #v, 4096 do chunks[#chunks + 1] = string.char(unpack(v, i, math.min(#v, i + 4095))) end
  for name, w in pairs(ds.json.decode(table.concat(chunks))) do
    if weights[name] then
      for i = 1, #w do spread = math.max(spread, math.abs(w[i] - weights[name][i])) end
    end
    weights[name] = w
  end
end
if ds.comm.rank() == 0 then
  local f = assert(io.open(out_path, 'w'))
  f:write(ds.json.encode { losses = losses, norm = engine.grad_norm, weights = weights, spread = spread,
                           stages = { model:stage_layers(0) }, fp8_layers = engine.fp8 and #engine.fp8.layers or 0 })
  f:close()
end
