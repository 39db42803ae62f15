-- DeepSpeed's ZeroOneAdam (deepspeed/runtime/fp16/onebit/zoadam.py, its
-- compressed all-reduce from deepspeed/runtime/comm/nccl.py) and the AdamW
-- without bias correction it starts as, in float64 in plain Lua, over W
-- ranks simulated in one process: the data, the initial weights and each
-- rank's samples of run.lua, each rank's gradients from a float64 copy of
-- its model. Writes run.lua's JSON (each step's loss, the mean over ranks;
-- rank 0's final weights) plus each step's largest difference between the
-- ranks' weights: reference.lua OUT.json TYPE STEPS W [key=value ...].
local ds = require 'dslua'
local DS = require 'samplers.distributed'
local out, kind, steps, W = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4])
local o = { lr = 2e-3, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999, eps = 1e-8 }
for i = 5, #arg do
  local k, v = arg[i]:match('^(%w[%w_]*)=(.*)$')
  o[k] = tonumber(v) or v
end
local zero_one = kind == 'ZeroOneAdam'
assert(zero_one or kind == 'AdamW', 'reference.lua: ZeroOneAdam or AdamW')

local x, y, model = require('spec.onebit.task')()
local n = x:size()[1]
model:to('f64')
x = x:to('f64')
local named = model:named_parameters()

local function copy(t)
  local c = {}
  for i = 1, #t do c[i] = t[i] end
  return c
end

-- per rank: each parameter's p, m, v, acc (flat Lua lists)
local ranks = {}
for r = 1, W do
  local st = {}
  for k, e in ipairs(named) do
    local p = e[2]:view(-1):totable()
    local z = {}
    for i = 1, #p do z[i] = 0 end
    st[k] = { p = p, m = copy(z), v = copy(z), acc = copy(z) }
  end
  ranks[r] = st
end

-- rank r's batch at its step s (0-based index in the run), as the engine's
-- DistributedSampler (shuffle, seed 0) deals them, 16 a micro batch
local samplers, per_epoch = {}, nil
for r = 1, W do samplers[r] = DS(n, { num_replicas = W, rank = r - 1 }) end
per_epoch = math.floor(samplers[1]:len() / 16)
local function batch(r, s)
  local e, k = math.floor(s / per_epoch) + 1, s % per_epoch
  local idx = samplers[r]:indices(e)
  local pick = {}
  for i = 1, 16 do pick[i] = idx[k * 16 + i] end
  local t = ds.tensor(pick, 'i64')
  return x:index_select(1, t), y:index_select(1, t)
end

-- rank r's loss and gradients (per parameter, flat) at its weights
local function gradients(r, s)
  ds.no_grad(function()
    for k, e in ipairs(named) do e[2]:copy_(ds.tensor(ranks[r][k].p, 'f64'):view(e[2]:size())) end
  end)
  for _, e in ipairs(named) do e[2].grad = nil end
  local bx, by = batch(r, s)
  local loss = ds.cross_entropy(model(bx), by)
  loss:backward()
  local g = {}
  for k, e in ipairs(named) do g[k] = e[2].grad:view(-1):totable() end
  return loss:item(), g
end

-- The compressed all-reduce of one parameter's buffers bufs[r] (each
-- rank's), with its errors: every rank's result, the same on all.
local function gcd(a, b) if b == 0 then return a end return gcd(b, a % b) end
local unit = W * (W * 8 / gcd(W, 8))
local errors = {}
local function sign(v) return v >= 0 and 1 or -1 end
local function rms(t, lo, hi)
  local s = 0
  for i = lo, hi do s = s + t[i] * t[i] end
  return math.sqrt(s / (hi - lo + 1))
end
local function compressed_allreduce(k, bufs)
  local len = #bufs[1]
  local N = math.ceil(len / unit) * unit
  local chunk = N / W
  local e = errors[k]
  if not e then
    e = { worker = {}, server = {} }
    for r = 1, W do
      e.worker[r], e.server[r] = {}, {}
      for i = 1, N do e.worker[r][i] = 0 end
      for i = 1, chunk do e.server[r][i] = 0 end
    end
    errors[k] = e
  end
  local scale, signs = {}, {}
  for r = 1, W do
    local xr, we = {}, e.worker[r]
    for i = 1, N do xr[i] = (bufs[r][i] or 0) + we[i] end
    scale[r] = rms(xr, 1, N)
    signs[r] = {}
    for i = 1, N do
      signs[r][i] = sign(xr[i])
      we[i] = xr[i] - scale[r] * signs[r][i]
    end
  end
  local result = {}
  for j = 1, W do
    local s, se = {}, e.server[j]
    for i = 1, chunk do
      local acc = 0
      for r = 1, W do acc = acc + scale[r] * signs[r][(j - 1) * chunk + i] / W end
      s[i] = acc + se[i]
    end
    local sc = rms(s, 1, chunk)
    for i = 1, chunk do
      local q = sc * sign(s[i])
      se[i] = s[i] - q
      result[(j - 1) * chunk + i] = q
    end
  end
  for i = N, len + 1, -1 do result[i] = nil end
  return result
end

-- zoadam.py's schedule, on dslua's step t (DeepSpeed's t + 1)
local var_interval, var_counter, local_interval, local_counter, frozen, reduce = 1, 0, 1, 0, false, true
local lrs = 0
local function schedule(t)
  local s = t + 1
  if not frozen then
    if s % var_interval == 0 then
      var_counter = var_counter + 1
      if var_counter == o.var_update_scaler then var_counter, var_interval = 0, var_interval * 2 end
    end
    reduce = (s + 1) % var_interval == 0
  else
    local_counter = local_counter + 1
    if local_counter == o.local_step_scaler then
      local_counter, local_interval = 0, math.min(o.local_step_clipper, local_interval * 2)
    end
  end
  if s > o.var_freeze_step and not frozen then
    frozen, reduce = true, false
    errors = {}          -- from here they hold updates, not gradients
  end
end

local b1, b2, eps, lr, wd = o.beta1, o.beta2, o.eps, o.lr, o.weight_decay
local function apply(st, acc)
  for i = 1, #st.p do
    local u = st.m[i] / (math.sqrt(st.v[i]) + eps) + wd * st.p[i]
    st.p[i] = st.p[i] - lr * u
    if acc then st.acc[i] = st.acc[i] - lr * u end
  end
end

local function step(t, grads)
  local full = not zero_one or reduce
  if zero_one and frozen then lrs = lrs + lr end
  for k = 1, #named do
    local g = {}
    if full then
      local mean = {}
      for i = 1, #grads[1][k] do
        local s = 0
        for r = 1, W do s = s + grads[r][k][i] end
        mean[i] = s / W
      end
      for r = 1, W do g[r] = mean end
    elseif not frozen then
      local list = {}
      for r = 1, W do list[r] = grads[r][k] end
      local q = compressed_allreduce(k, list)
      for r = 1, W do g[r] = q end
    else
      for r = 1, W do g[r] = grads[r][k] end
    end
    for r = 1, W do
      local st = ranks[r][k]
      for i = 1, #st.p do
        st.m[i] = b1 * st.m[i] + (1 - b1) * g[r][i]
        if full then st.v[i] = b2 * st.v[i] + (1 - b2) * g[r][i] * g[r][i] end
      end
      apply(st, frozen)
    end
    if frozen and (t + 1) % local_interval == 0 then
      local list = {}
      for r = 1, W do
        local st = ranks[r][k]
        for i = 1, #st.p do
          st.p[i] = st.p[i] - st.acc[i]
          st.acc[i] = st.acc[i] * (math.sqrt(st.v[i]) + eps)
        end
        list[r] = st.acc
      end
      local q = compressed_allreduce(k, list)
      for r = 1, W do
        local st = ranks[r][k]
        for i = 1, #st.p do
          st.m[i] = -q[i] / lrs
          st.p[i] = st.p[i] + q[i] / (math.sqrt(st.v[i]) + eps)
          st.acc[i] = 0
        end
      end
    end
  end
  if zero_one and frozen and (t + 1) % local_interval == 0 then lrs = 0 end
  if zero_one then schedule(t) end
end

local rows = {}
for t = 1, steps do
  local grads, mean = {}, 0
  for r = 1, W do
    local l
    l, grads[r] = gradients(r, t - 1)
    mean = mean + l / W
  end
  step(t, grads)
  local spread = 0
  for k = 1, #named do
    for r = 2, W do
      for i = 1, #ranks[1][k].p do spread = math.max(spread, math.abs(ranks[r][k].p[i] - ranks[1][k].p[i])) end
    end
  end
  rows[t] = { loss = mean, spread = spread }
end
local weights = {}
for k, e in ipairs(named) do weights[e[1]] = ranks[1][k].p end
local f = assert(io.open(out, 'w'))
f:write(ds.json.encode({ steps = rows, weights = weights, world_size = W }))
f:close()
