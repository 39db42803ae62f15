-- A character-level GPT on tiny Shakespeare, as nanoGPT's shakespeare_char:
-- the first 90% of the text trains, the last 10% gives the validation
-- loss; at the end a sample continues the prompt "ROMEO:".
--   dslua examples/shakespeare/train.lua --config examples/shakespeare/ds.json
--         [--steps N] [--data FILE] [--eval-batches N] [--sample-chars N] [--device cpu|cuda|cuda:N]
-- --steps sets the run length (the scheduler's total_num_steps, else the
-- config's); --eval-batches the validation batches behind each val loss.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
local opts = { eval_batches = 20, sample_chars = 300 }
local rest = ds.args.rest
local i = 1
while i <= #rest do
  local key, value = rest[i]:match('^%-%-([%w%-]+)$'), rest[i + 1]
  if key == 'data' then
    opts.data = assert(value, '--data needs a file name')
  elseif key == 'steps' or key == 'eval-batches' or key == 'sample-chars' then
    opts[key:gsub('%-', '_')] = assert(tonumber(value), '--' .. key .. ' needs a number')
  else
    error(string.format("unknown argument '%s' (expected --steps N, --data FILE, --eval-batches N, --sample-chars N, "
                        .. "--device cpu|cuda|cuda:N)", rest[i]), 0)
  end
  i = i + 2
end

-- <project>/../shared/data/tinyshakespeare/input.txt, `dir/..` pairs folded
local function shared_data()
  local path, n = here .. '/../../../shared/data/tinyshakespeare/input.txt', 1
  while n > 0 do path, n = path:gsub('[^/.][^/]*/%.%./', '', 1) end
  return path
end
local file = opts.data or (os.getenv('DSLUA_DATA') and os.getenv('DSLUA_DATA') .. '/tinyshakespeare/input.txt')
             or shared_data()
local f = io.open(file, 'rb')
if not f then
  print(string.format('skipping: %s is absent (pass --data FILE)', file))
  os.exit(0)
end
local text = f:read('*a')
f:close()

-- The config as a table, so --steps can set the schedule's length.
local config_path = ds.args.config or (here .. '/ds.json')
local cf = assert(io.open(config_path, 'rb'))
local config = ds.json.decode(cf:read('*a'), config_path)
cf:close()
if opts.steps and config.scheduler then
  config.scheduler.params = config.scheduler.params or {}
  config.scheduler.params.total_num_steps = opts.steps
end

ds.manual_seed(1337)
local block = 128
local vocab = ds.data.text { text = text, block_size = 1 }.vocab
local n_train = math.floor(#text * 0.9)
local train = ds.data.text { text = text:sub(1, n_train), block_size = block, vocab = vocab }
local val = ds.data.text { text = text:sub(n_train + 1), block_size = block, vocab = vocab }

local model = require('models.gpt2') { n_layer = 4, n_head = 4, n_embd = 128, vocab_size = #vocab,
                                        block_size = block, dropout = 0 }
-- nanoGPT's groups: matrices and embeddings decay, biases and norms do not.
local decay, no_decay = {}, {}
for _, p in ipairs(model:parameters()) do
  if p:dim() >= 2 then decay[#decay + 1] = p else no_decay[#no_decay + 1] = p end
end
local engine, _, loader = ds.initialize {
  model = model, config = config, training_data = train,
  model_parameters = { { params = decay }, { params = no_decay, weight_decay = 0 } },
}
local steps = opts.steps or (config.scheduler and config.scheduler.params.total_num_steps) or 500
print(string.format('tiny shakespeare: %d characters, vocabulary %d, %d train / %d val; model: %d parameters; '
                    .. '%d steps of %d x %d tokens; on %s, %d threads', #text, #vocab, n_train, #text - n_train,
                    model:num_parameters(), steps, engine:train_batch_size(), block, engine.device, ds.num_threads()))

-- Mean loss over the same eval_batches batches of val windows every time,
-- read onto the engine's device.
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
    local loss = engine:forward(batch)
    engine:backward(loss)
    engine:step()
    first_loss = first_loss or engine.last_loss
    if engine.global_steps >= steps then break end
  end
end
local train_time = ds.wall_time() - t0
print(string.format('step %d: train loss %.4f (first step %.4f), val loss %.4f; %.1f s', engine.global_steps,
                    engine.last_loss, first_loss, val_loss(), train_time))

-- the prompt is made on the CPU: generate runs it on the model's device
local prompt = train:encode('ROMEO:')
local out = model:generate(prompt:view(1, -1), opts.sample_chars, { temperature = 0.8, top_k = 20 })
print('sample:\n' .. train:decode(out:view(-1)))
