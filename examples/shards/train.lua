-- GPT-2 trained on llm.c token shards (write_shards.py makes them from a
-- text file): ds.data.shards maps every DIR/*_train_*.bin, the engine's
-- loader reads each rank's windows out of the files, and the
-- DIR/*_val_*.bin windows give the validation loss.
--   dslua examples/shards/train.lua --data DIR [--vocab 50257] [--steps N] [--eval-batches N]
--         [--config examples/shards/ds.json] [--device cpu|cuda|cuda:N]
-- --vocab is the tokens' vocabulary (GPT-2's 50257, or 256 for byte-level
-- shards); --steps sets the run length (the scheduler's total_num_steps).
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
local opts = { vocab = 50257, eval_batches = 20 }
local rest = ds.args.rest
local i = 1
while i <= #rest do
  local key, value = rest[i]:match('^%-%-([%w%-]+)$'), rest[i + 1]
  if key == 'data' then
    opts.data = assert(value, '--data needs a folder')
  elseif key == 'vocab' or key == 'steps' or key == 'eval-batches' then
    opts[key:gsub('%-', '_')] = assert(tonumber(value), '--' .. key .. ' needs a number')
  else
    error(string.format("unknown argument '%s' (expected --data DIR, --vocab N, --steps N, --eval-batches N, "
                        .. "--device cpu|cuda|cuda:N)", rest[i]), 0)
  end
  i = i + 2
end
if not opts.data then error('--data DIR is needed: the folder write_shards.py wrote', 0) end

local config_path = ds.args.config or (here .. '/ds.json')
local cf = assert(io.open(config_path, 'rb'))
local config = ds.json.decode(cf:read('*a'), config_path)
cf:close()
if opts.steps and config.scheduler then
  config.scheduler.params = config.scheduler.params or {}
  config.scheduler.params.total_num_steps = opts.steps
end

local block = 128
local function shards(split)
  return ds.data.shards { pattern = opts.data .. '/*_' .. split .. '_*.bin', block_size = block,
                          vocab_size = opts.vocab }
end
local train, val = shards('train'), shards('val')

ds.manual_seed(1337)
local model = require('models.gpt2') { n_layer = 4, n_head = 4, n_embd = 128, vocab_size = opts.vocab,
                                        block_size = block }
local engine, _, loader = ds.initialize { model = model, config = config, training_data = train }
local steps = opts.steps or (config.scheduler and config.scheduler.params.total_num_steps) or 300
local tokens = 0
for _, n in ipairs(train.lengths) do tokens = tokens + n end
print(string.format('%d train shards (%d tokens, %d windows of %d), %d val windows; vocabulary %d; model: %d '
                    .. 'parameters; %d steps of %d x %d tokens on %d rank(s)', #train.paths, tokens, #train, block,
                    #val, opts.vocab, model:num_parameters(), steps, engine:train_batch_size(), block,
                    ds.comm.world_size()))

-- Mean loss over the same eval_batches batches of val windows every time.
local val_loader = ds.data.loader(val, { batch_size = engine:train_micro_batch_size_per_gpu(), seed = 1,
                                         device = engine.device })
local function val_loss()
  engine:eval()
  local sum, n = 0, 0
  ds.no_grad(function()
    for k, batch in val_loader:epoch(1) do
      sum, n = sum + model(batch):item(), n + 1
      if k >= opts.eval_batches then break end
    end
  end)
  engine:train()
  return sum / n
end

local t0 = ds.wall_time()
print(string.format('step 0: val loss %.4f', val_loss()))
local first_loss
local epoch = 0
while engine.global_steps < steps do
  epoch = epoch + 1
  for _, batch in loader:epoch(epoch) do
    engine:backward(engine:forward(batch))
    engine:step()
    first_loss = first_loss or engine.last_loss
    if engine.global_steps >= steps then break end
  end
end
local seconds = ds.wall_time() - t0
print(string.format('step %d: train loss %.4f (first step %.4f), val loss %.4f; %.0f tokens/s', engine.global_steps,
                    engine.last_loss, first_loss, val_loss(),
                    steps * engine:train_batch_size() * block / seconds))
engine:finish()
