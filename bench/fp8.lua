-- bench/fp8.sh's run (and, shorter, spec/fp8_spec.lua's): a small
-- character-level GPT-2 trained through ds.initialize in bf16, then again
-- from the same weights and batches with the fp8 block on (delayed
-- scaling, hybrid), on the text the binary carries or on a file, on this
-- rank's device. Writes both runs' per-step losses, seconds and mean
-- losses of their first 10 and last 50 steps as JSON, and prints the means.
--
--   dslua bench/fp8.lua out.json [steps=300] [text=path] [n_layer=2] [n_embd=64] [block=32] [batch=16]
local ds = require 'dslua'

local out_path = assert(arg[1], 'usage: fp8.lua out.json [key=value...]')
local o = { steps = 300, n_layer = 2, n_embd = 64, block = 32, batch = 16 }
for i = 2, #arg do
  local k, v = arg[i]:match('^(%w+)=(.+)$')
  if k then
    assert(o[k] ~= nil or k == 'text', 'fp8.lua: unknown argument ' .. arg[i])
    o[k] = tonumber(v) or v
  end
end

local text = ds.embedded_source()
if o.text then
  local f = assert(io.open(o.text, 'rb'))
  text = f:read('*a')
  f:close()
end
local data = ds.data.text { text = text, block_size = o.block }

local function run(fp8)
  ds.manual_seed(1337)
  local model = require('models.gpt2') { n_layer = o.n_layer, n_head = 4, n_embd = o.n_embd,
                                          vocab_size = #data.vocab, block_size = o.block, dropout = 0 }
  local engine, _, loader = ds.initialize { model = model, training_data = data, config = {
    train_batch_size = o.batch, train_micro_batch_size_per_gpu = o.batch, steps_per_print = 1e9,
    gradient_clipping = 1.0, bf16 = { enabled = true }, fp8 = { enabled = fp8 },
    optimizer = { type = 'AdamW', params = { lr = 3e-3, betas = { 0.9, 0.99 }, weight_decay = 0.01 } },
    scheduler = { type = 'WarmupCosineLR', params = { total_num_steps = o.steps, warmup_num_steps = 50 } },
  } }
  local losses, epoch, t0 = {}, 0, ds.wall_time()
  while engine.global_steps < o.steps do
    epoch = epoch + 1
    for _, batch in loader:epoch(epoch) do
      local loss = engine:forward(batch)
      engine:backward(loss)
      engine:step()
      losses[#losses + 1] = loss:to('f32'):item()
      if engine.global_steps >= o.steps then break end
    end
  end
  return losses, ds.wall_time() - t0
end

local bf16, t_bf16 = run(false)
local fp8, t_fp8 = run(true)

local function mean(t, a, b)
  local sum = 0
  for i = a, b do sum = sum + t[i] end
  return sum / (b - a + 1)
end
local n = #bf16
local first10 = { bf16 = mean(bf16, 1, 10), fp8 = mean(fp8, 1, 10) }
local last50 = { bf16 = mean(bf16, n - 49, n), fp8 = mean(fp8, n - 49, n) }
local f = assert(io.open(out_path, 'w'))
f:write(ds.json.encode { bf16 = bf16, fp8 = fp8, seconds = { bf16 = t_bf16, fp8 = t_fp8 }, first10 = first10,
                         last50 = last50 })
f:close()
print(string.format('%-6s %14s %14s %10s', 'run', 'first 10 loss', 'last 50 loss', 'seconds'))
for _, r in ipairs({ { 'bf16', t_bf16 }, { 'fp8', t_fp8 } }) do
  print(string.format('%-6s %14.4f %14.4f %10.1f', r[1], first10[r[1]], last50[r[1]], r[2]))
end
print(string.format('fp8 last 50 against bf16: %+.2f%%', 100 * (last50.fp8 - last50.bf16) / last50.bf16))
