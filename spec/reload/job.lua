-- Run by spec/reload_spec.lua under mpirun (2 ranks): a small MLP trained
-- through ds.initialize with a config the spec wrote (a Lua schedule file,
-- a sampler policy file, a hooks file), while rank 0 itself rewrites a
-- watched file after given steps, so every edit lands at a known step.
--
--   job.lua CONFIG OUT_PREFIX STEPS [EDITS]
--
-- EDITS: a file of lines `after_step source target`: after that global
-- step, rank 0 puts source's text at target (write and rename, as editors
-- save). Each rank writes OUT_PREFIX.<rank>.json: the lr of each step (as
-- the optimizer used it), the dataset indices of each step, the reload
-- history and versions, what the hooks saw, and the sampler policy's state.
local ds = require 'dslua'

local config, prefix, steps, edits_file = arg[1], arg[2], tonumber(arg[3]), arg[4]
local rank = ds.comm.rank()

local edits = {}
if edits_file then
  for line in io.lines(edits_file) do
    local after, source, target = line:match('^(%d+) (%S+) (%S+)$')
    edits[tonumber(after)] = { source = source, target = target }
  end
end

local function put(source, target)
  local f = assert(io.open(source, 'rb'))
  local text = f:read('*a')
  f:close()
  local tmp = target .. '.tmp'
  f = assert(io.open(tmp, 'wb'))
  f:write(text)
  f:close()
  assert(os.rename(tmp, target))
end

ds.manual_seed(3)
local N = 40
local data = ds.data.tensors { x = ds.randn(N, 4), y = (ds.rand(N) * 2):to('i64') }
local model = require('models.mlp') { input_size = 4, hidden = { 8 }, num_classes = 2 }
local engine, _, loader = ds.initialize { model = model, training_data = data, config = config }

local lrs, seen = {}, {}
local epoch = 0
while engine.global_steps < steps do
  local order, pos = nil, 0
  for j, batch in loader:epoch(epoch) do
    if engine.sampler then
      order = order or engine.sampler:indices(epoch)
      if ds.is_tensor(order) then order = order:totable() end
      local b, idx = engine.sampler:batch_size(j), {}
      for k = 1, b do idx[k] = order[pos + k] end
      pos = pos + b
      seen[#seen + 1] = { epoch = epoch, step = j, indices = idx }
    end
    lrs[#lrs + 1] = engine:get_lr()[1]
    engine:backward(engine(batch))
    engine:step()
    local edit = edits[engine.global_steps]
    if edit and rank == 0 then put(edit.source, edit.target) end
    if engine.global_steps >= steps then break end
  end
  epoch = epoch + 1
end
engine:eval()

local hooks = engine.reload.hooks
local policy = engine.sampler and engine.sampler.policy
local out = {
  rank = rank, lrs = lrs, steps = seen, history = ds.reload.history(), versions = ds.reload.versions(),
  hooks = hooks and hooks.state or nil, policy_state = policy and policy.state or nil,
}
local f = assert(io.open(prefix .. '.' .. rank .. '.json', 'w'))
f:write(ds.json.encode(out))
f:close()
engine:destroy()
