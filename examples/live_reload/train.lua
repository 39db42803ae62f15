-- Live reload: the quickstart's character-level GPT, its learning rate
-- from schedule.lua, which you may edit while this runs (on every rank the
-- new version takes over at the same step; a broken one is refused and the
-- old one goes on). `dslua attach` reads and steers the running job.
--   dslua -n 2 examples/live_reload/train.lua [--config ds.json] [--steps N]
local ds = require 'dslua'

local here = arg[0]:match('^(.*)/') or '.'
local steps = 400
for i, a in ipairs(ds.args.rest) do
  if a == '--steps' then steps = assert(tonumber(ds.args.rest[i + 1]), '--steps needs a number') end
end

-- the schedule's path is taken next to the config file, wherever it runs from
local config_path = ds.args.config or (here .. '/ds.json')

ds.manual_seed(1337)
local block = 64
local data = ds.data.text { text = ds.embedded_source(), block_size = block }
local model = require('models.gpt2') { n_layer = 2, n_head = 4, n_embd = 96, vocab_size = #data.vocab,
                                        block_size = block, dropout = 0 }
local engine, _, loader = ds.initialize { model = model, config = config_path, training_data = data }
local sched = engine.config.scheduler.params
if engine.rank == 0 then
  print(string.format('model: %d parameters on %d rank(s); edit %s while it trains', model:num_parameters(),
                      engine.world_size, sched.path))
end

local epoch = 0
while engine.global_steps < steps do
  epoch = epoch + 1
  for _, batch in loader:epoch(epoch) do
    engine:backward(engine:forward(batch))
    engine:step()
    if engine.global_steps >= steps then break end
  end
end
if engine.rank == 0 then
  print(string.format('final loss %.4f after %d steps', engine.last_loss, engine.global_steps))
  for _, v in ipairs(ds.reload.versions()) do
    print(string.format('%s: sha256 %s, %s at step %d', v.path, v.hash:sub(1, 12), v.status, v.step))
  end
end
engine:finish()
