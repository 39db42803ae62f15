-- The quickstart: a character-level GPT trained on the Lua source text that
-- the dslua binary carries (so nothing is downloaded), then a sample.
--   dslua examples/quickstart/train.lua [--config ds.json] [--steps N] [--device cpu|cuda|cuda:N]
-- The engine puts the model on this rank's GPU when there is one, else on
-- the CPU (--device or DSLUA_DEVICE choose), and its loader the batches.
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
local steps = 600
for i, a in ipairs(ds.args.rest) do
  if a == '--steps' then steps = assert(tonumber(ds.args.rest[i + 1]), '--steps needs a number') end
end

ds.manual_seed(1337)
local block = 64
local data = ds.data.text { text = ds.embedded_source(), block_size = block }
local model = require('models.gpt2') { n_layer = 2, n_head = 4, n_embd = 96, vocab_size = #data.vocab,
                                        block_size = block, dropout = 0 }
local engine, _, loader = ds.initialize {
  model = model, config = ds.args.config or (here .. '/ds.json'), training_data = data,
}
print(string.format('corpus: %d characters, vocabulary %d; model: %d parameters; on %s, %d threads',
                    #data + block, #data.vocab, model:num_parameters(), engine.device, ds.num_threads()))

local epoch, first_loss = 0, nil
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
print(string.format('final loss %.4f after %d steps (%d samples), first step %.4f', engine.last_loss,
                    engine.global_steps, engine.global_samples, first_loss))

engine:eval()
-- a CPU tensor: generate runs it on the model's device and returns it here
local prompt = data:encode('local function ')
local out = ds.no_grad(function()
  return model:generate(prompt:view(1, -1), 200, { temperature = 0.8, top_k = 20 })
end)
print('sample:\n' .. data:decode(out:view(-1)))
