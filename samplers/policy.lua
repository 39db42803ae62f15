-- Sampler policies: what each rank reads of an epoch, and in what batches.
--
-- A policy is a Lua table with plan(ctx), ctx = {rank, world_size, epoch,
-- seed, dataset_len, params}, returning {indices = this rank's 0-based
-- dataset indices (a Lua list, a 1-D i64/i32 tensor or a ds.data.order,
-- which holds a large epoch's order without a per-sample cost), micro_batch = n
-- (every step n, the last one the rest) or {n1, n2, ...} (step j takes nj;
-- they sum to #indices), note = optional text rank 0 prints}. Optional:
-- state_dict() -> table and load_state_dict(t) (state that must survive a
-- resume or a swap to new code), observe{rank, samples, seconds} and
-- observing() (see Sampler:exchange). Each may be written P.f(...) or
-- P:f(...): a first parameter named self gets the policy table.
--
-- Built in: "uneven" (samplers/uneven.lua), "auto" (samplers/auto.lua),
-- "distributed" (PyTorch's DistributedSampler, samplers/distributed.lua,
-- every rank the same micro batch). Anything else is a file: a chunk
-- returning the policy table (or a table whose new() returns one), run
-- afresh for every sampler, so each has its own state.
--
-- ctx.params is the resolved sampler block (policy, micro_batch_per_rank,
-- data_share, shuffle, seed, drop_last, ...) with a custom policy's
-- `params` entries merged in; ctx.seed is the block's seed (shuffle with
-- ds.data.permutation(n, seed + epoch) to agree with the loader).
--
--   local P = require 'samplers.policy'
--   local sampler = P.new(cfg.sampler, { dataset = data, rank = r, world_size = n, source = 'ds.json' })
--   local loader = P.loader(data, sampler)        -- per-step batch sizes, a line per epoch
--   for step, batch in loader:epoch(e) do ... end
local ds = require 'dslua'
local guard = require 'dslua.base.guard'
local file = require 'dslua.base.file'

local M = {}

local floor = math.floor

---------------------------------------------------------------- loading

M.builtin = { uneven = 'samplers.uneven', auto = 'samplers.auto' }

-- The distributed policy: samplers/distributed.lua's indices.
local Distributed = {}
Distributed.__index = Distributed

function Distributed.plan(ctx)
  local p = ctx.params
  local s = require('samplers.distributed').new(ctx.dataset_len, {
    num_replicas = ctx.world_size, rank = ctx.rank, shuffle = p.shuffle, seed = ctx.seed, drop_last = p.drop_last,
  })
  return { indices = s:order(ctx.epoch), micro_batch = p.micro_batch_per_rank[ctx.rank + 1] }
end

local function builtin(name)
  if name == 'distributed' then return setmetatable({}, Distributed) end
  return require(M.builtin[name]).new()
end

-- FNV-1a over the bytes, 8 hex digits: names the code a run used.
function M.hash(text)
  local h = bit.tobit(0x811c9dc5)
  for i = 1, #text do
    h = bit.bxor(h, text:byte(i))
    h = bit.tobit(bit.lshift(h, 24) + h * 403)      -- * 16777619 (2^24 + 403), mod 2^32
  end
  return bit.tohex(h)
end

local function fail(where, msg) error('sampler policy ' .. where .. ': ' .. msg, 0) end

-- load(spec [, source]) -> policy table, {name =, path =, hash =}. spec: a
-- built-in name, a file path (tried as given, then next to the file
-- source, the config), or a policy table.
function M.load(spec, source)
  if type(spec) == 'table' then
    if type(spec.plan) ~= 'function' then fail('(a table)', 'has no plan function') end
    return spec, { name = tostring(spec.name or 'table'), hash = 'table' }
  end
  if type(spec) ~= 'string' then fail(tostring(spec), 'expected a policy name, a file path or a table') end
  if spec == 'distributed' or M.builtin[spec] then
    return builtin(spec), { name = spec, hash = 'builtin' }
  end
  local path = spec
  local function read(p)
    local ok, text = pcall(file.read, p)
    if not ok then fail(spec, file.reason(text, p)) end
    return text
  end
  local text = read(path)
  local dir = type(source) == 'string' and source:match('^(.*)/[^/]*$')
  if not text and dir and spec:sub(1, 1) ~= '/' then
    path = dir .. '/' .. spec
    text = read(path)
  end
  if not text then
    if not (spec:find('/', 1, true) or spec:match('%.lua$')) then
      fail(spec, "unknown policy (built in: auto, distributed, uneven; or the path of a .lua file)")
    end
    fail(spec, 'cannot read the file' .. (path ~= spec and ' (tried ' .. spec .. ', ' .. path .. ')' or ''))
  end
  return M.load_text(text, path, spec)
end

-- load_text(text, path [, name]) -> policy table, {name =, path =, hash =}:
-- a policy file's text (read already, as live reload has it) compiled and
-- run with the JIT off, so that live reload's time budget (dslua/base/guard.lua)
-- can stop a loop in it; plan and the rest get the JIT back after.
function M.load_text(text, path, name)
  local chunk, err = guard.load(text, '@' .. path)
  if not chunk then fail(path, err) end
  local ok, policy = pcall(chunk)
  if not ok then fail(path, tostring(policy)) end
  if type(policy) == 'table' and type(policy.plan) ~= 'function' and type(policy.new) == 'function' then
    ok, policy = pcall(policy.new)
    if not ok then fail(path, 'new() failed: ' .. tostring(policy)) end
  end
  guard.release(chunk)
  if type(policy) ~= 'table' or type(policy.plan) ~= 'function' then
    fail(path, 'the file must return a table with a plan(ctx) function, it returned ' .. (type(policy) == 'table'
         and 'a table without plan' or 'a ' .. type(policy)))
  end
  return policy, { name = name or path, path = path, hash = M.hash(text), source = text }
end

-- policy.name as a callable: P.f(...) or, when its first parameter is
-- self, P:f(...). nil when the policy has no such function.
local function method(policy, name)
  local f = policy[name]
  if type(f) ~= 'function' then return nil end
  if debug.getlocal(f, 1) == 'self' then return function(...) return f(policy, ...) end end
  return f
end
M.method = method

---------------------------------------------------------------- plans

local function copy(v)
  if type(v) ~= 'table' or ds.is_tensor(v) then return v end
  local c = {}
  for k, x in pairs(v) do c[k] = copy(x) end
  return c
end

local function integer(v) return type(v) == 'number' and v == floor(v) end

-- check_plan(plan, n, where) -> {indices, count, micro_batch, steps, note}:
-- what plan() returned, checked against the dataset length n.
function M.check_plan(plan, n, where)
  local function bad(msg, ...) fail(where, 'plan() ' .. string.format(msg, ...)) end
  if type(plan) ~= 'table' then bad('must return a table {indices =, micro_batch =}, returned a %s', type(plan)) end
  for k in pairs(plan) do
    if k ~= 'indices' and k ~= 'micro_batch' and k ~= 'note' then
      bad("returned an unknown field '%s' (indices, micro_batch, note)", tostring(k))
    end
  end
  local idx, count = plan.indices, nil
  if ds.is_tensor(idx) then
    local dt = idx:dtype()
    if dt ~= 'i64' and dt ~= 'i32' then bad('indices must be an i64 or i32 tensor, got %s', dt) end
    if idx:dim() > 1 then bad('indices must be a 1-D tensor, got %d dims', idx:dim()) end
    count = idx:numel()
    if count > 0 then
      local lo, hi = idx:amin():item(), idx:amax():item()
      if lo < 0 or hi >= n then
        bad('indices hold %d, outside the dataset [0, %d)', lo < 0 and lo or hi, n)
      end
    end
  elseif ds.data.is_order(idx) then
    count = #idx
    if count > 0 and idx:domain() > n then
      bad('indices are an order of [0, %d), the dataset has %d', idx:domain(), n)
    end
  elseif type(idx) == 'table' then
    count = #idx
    for i = 1, count do
      local v = idx[i]
      if not integer(v) or v < 0 or v >= n then
        bad('indices[%d] = %s is not an index of the dataset [0, %d) (indices are 0-based)', i, tostring(v), n)
      end
    end
    if next(idx, count > 0 and count or nil) ~= nil then bad('indices must be a list (keys 1..n)') end
  else
    bad('must return indices (a list or a tensor of 0-based indices), got %s', type(idx))
  end
  local mb, steps = plan.micro_batch, nil
  if integer(mb) and mb >= 1 then
    steps = math.ceil(count / mb)
  elseif type(mb) == 'table' then
    local sum = 0
    for j = 1, #mb do
      if not integer(mb[j]) or mb[j] < 1 then
        bad('micro_batch[%d] = %s must be a positive integer', j, tostring(mb[j]))
      end
      sum = sum + mb[j]
    end
    if sum ~= count then bad('micro_batch sizes sum to %d, indices has %d', sum, count) end
    steps = #mb
  else
    bad('micro_batch must be a positive integer or a list of them, got %s', tostring(mb))
  end
  if plan.note ~= nil and type(plan.note) ~= 'string' then bad('note must be a string, got %s', type(plan.note)) end
  return { indices = idx, count = count, micro_batch = mb, steps = steps, note = plan.note }
end

-- The line each rank prints per epoch:
-- `rank 1 | epoch 0 | micro batch 16 | samples 2500 | steps 157`.
-- micro_batch: a number or a list (shown: the largest).
function M.format_epoch_line(t)
  local mb = t.micro_batch
  if type(mb) == 'table' then
    local m = 0
    for _, x in ipairs(mb) do m = math.max(m, x) end
    mb = m
  end
  return string.format('rank %d | epoch %s | micro batch %d | samples %d | steps %d', t.rank, tostring(t.epoch), mb,
                       t.samples, t.steps)
end

---------------------------------------------------------------- the sampler

local Sampler = {}
Sampler.__index = Sampler

local function dataset_len(d)
  if type(d) == 'number' then return d end
  if type(d) == 'userdata' then return #d end
  if type(d) == 'table' then return type(d.len) == 'function' and d:len() or #d end
  error('sampler: expected a dataset or its length, got a ' .. type(d), 3)
end

-- new(block, opts) -> sampler. block: the config's sampler block (checked
-- again here against the world size; raw blocks get their defaults).
-- opts: dataset or dataset_len, rank and world_size (default ds.comm's),
-- source (the config file: custom policy paths may be relative to it),
-- micro_batch (train_micro_batch_size_per_gpu, for a block without
-- micro_batch_per_rank).
function M.new(block, opts)
  opts = opts or {}
  local ws = opts.world_size or ds.comm.world_size()
  local rank = opts.rank or ds.comm.rank()
  if not integer(rank) or rank < 0 or rank >= ws then
    error(string.format('sampler: rank %s is outside [0, %d)', tostring(rank), ws), 2)
  end
  local n = opts.dataset_len or dataset_len(opts.dataset)
  local resolved, problems = ds.config.check_sampler(block, { world_size = ws, micro_batch = opts.micro_batch,
                                                              source = opts.source })
  if not resolved then error(table.concat(problems, '\n'), 2) end
  local policy, info = M.load(resolved.policy, opts.source)
  return setmetatable({
    block = resolved, rank = rank, world_size = ws, dataset_len = n, epoch = 0,
    policy = policy, policy_info = info, plans = {},
  }, Sampler)
end

M.Sampler = Sampler

function Sampler:where() return self.policy_info.path or self.policy_info.name end

-- ctx for epoch e (a fresh copy each call: a policy cannot edit the config).
function Sampler:ctx(e)
  local params = copy(self.block)
  if type(params.params) == 'table' then
    for k, v in pairs(params.params) do params[k] = v end
    params.params = nil
  end
  if type(self.block.policy) == 'table' then params.policy = self.block.policy end
  return { rank = self.rank, world_size = self.world_size, epoch = e, seed = self.block.seed,
           dataset_len = self.dataset_len, params = params }
end

-- plan(e) -> the checked plan of epoch e (computed once per epoch).
function Sampler:plan(e)
  e = e == nil and self.epoch or e
  local cached = self.plans[e]
  if cached then return cached end
  local plan_fn = method(self.policy, 'plan')
  local ok, plan = pcall(plan_fn, self:ctx(e))
  if not ok then fail(self:where(), 'plan() failed: ' .. tostring(plan)) end
  plan = M.check_plan(plan, self.dataset_len, self:where())
  plan.epoch = e
  self.plans = { [e] = plan }        -- the current epoch only
  return plan
end

-- plan_of(e, rest) -> {epoch, indices, micro_batch, note}: epoch e's plan
-- over the dataset indices `rest` only (what a run on other ranks had not
-- read of it: a list, or an order, M.unread's window), planned as a
-- dataset of #rest samples in that order (no shuffle) and mapped onto
-- them (M.over); restore_plan makes it the epoch's.
function Sampler:plan_of(e, rest)
  local ctx, m = self:ctx(e), #rest
  ctx.dataset_len, ctx.params.shuffle = m, false
  local ok, plan = pcall(method(self.policy, 'plan'), ctx)
  if not ok then fail(self:where(), 'plan() failed: ' .. tostring(plan)) end
  plan = M.check_plan(plan, m, self:where())
  return { epoch = e, indices = M.over(rest, plan.indices), micro_batch = plan.micro_batch, note = plan.note }
end

-- M.over(rest, idx) -> the dataset indices at the 0-based positions idx (a
-- list, a tensor or an order) of rest (a list or an order): an order when
-- both are and idx is unshuffled over the whole of rest (its runs taken
-- over rest's window), else a list.
function M.over(rest, idx)
  local m, lazy = #rest, ds.data.is_order(rest)
  if lazy and ds.data.is_order(idx) then
    local d = idx:describe()
    if d.seed == nil and d.n == m and d.window[1] == 0 and d.window[2] == m then return rest:cut(d.runs) end
  end
  if ds.is_tensor(idx) or ds.data.is_order(idx) then idx = idx:totable() end
  local out = {}
  for i, k in ipairs(idx) do out[i] = lazy and rest:at(k) or rest[k + 1] end
  return out
end

-- The end of the first k positions of runs (one past the largest), or
-- nil when a run's blocks overlap (its positions do not increase).
local function read_end(runs, k)
  local e = 0
  for _, r in ipairs(runs) do
    local block, count = r[3], r[4]
    if count > 1 and r[2] < block then return nil end
    local m = math.min(k, block * count)
    if m > 0 then e = math.max(e, r[1] + floor((m - 1) / block) * r[2] + (m - 1) % block + 1) end
    k = k - m
  end
  return e
end

-- M.unread(saved) -> an order of the samples of an epoch that the saved
-- ranks had not read (each once), or nil when their plans do not allow
-- one. saved: a rank's {order = its plan's order:describe(), samples =
-- positions read} for every saved rank. The ranks' orders must share one
-- permutation and window and together cover the run positions [0, a_all)
-- of it, the read ones [0, a) (every built-in policy cuts the epoch so, in
-- steps): the rest is the window's positions [a, min(a_all, span)), those
-- past span being the padding that repeats the order's start.
function M.unread(saved)
  local first = saved[1] and saved[1].order
  if not first then return nil end
  local read, all, read_sum, all_sum = 0, 0, 0, 0
  for _, s in ipairs(saved) do
    local d = s.order
    if not d or d.n ~= first.n or d.seed ~= first.seed or d.window[1] ~= first.window[1]
       or d.window[2] ~= first.window[2] then
      return nil
    end
    local len = 0
    for _, r in ipairs(d.runs) do len = len + r[3] * r[4] end
    local re, ae = read_end(d.runs, s.samples), read_end(d.runs, len)
    if not re or s.samples > len then return nil end
    read, all, read_sum, all_sum = math.max(read, re), math.max(all, ae), read_sum + s.samples, all_sum + len
  end
  if read ~= read_sum or all ~= all_sum then return nil end
  local lo, span = first.window[1], first.window[2]
  local hi = math.min(all, span)
  return ds.data.order(first.n, { seed = first.seed, window = { lo + math.min(read, hi), hi - math.min(read, hi) } })
end

-- The loader's interface: set_epoch(e) plans epoch e; order([e]) its
-- 0-based indices as planned (what the loader reads); indices([e]) the
-- same as a list or a tensor (an order given as its i64 tensor); len() its
-- sample count.
function Sampler:set_epoch(e)
  if not integer(e) or e < 0 then error('sampler:set_epoch: epoch must be an integer >= 0, got ' .. tostring(e), 2) end
  self.epoch = e
  return self:plan(e)
end

function Sampler:order(e) return self:plan(e).indices end

function Sampler:indices(e)
  local idx = self:plan(e).indices
  return ds.data.is_order(idx) and idx:tensor() or idx
end
function Sampler:len() return self:plan().count end

-- The current epoch's micro_batch (a number or a list), its steps, and the
-- size of step j (1-based; 0 past the end).
function Sampler:micro_batch() return self:plan().micro_batch end
function Sampler:steps() return self:plan().steps end

function Sampler:batch_size(j)
  local p = self:plan()
  if j < 1 or j > p.steps then return 0 end
  if type(p.micro_batch) == 'table' then return p.micro_batch[j] end
  return math.min(p.micro_batch, p.count - (j - 1) * p.micro_batch)
end

function Sampler:epoch_line()
  local p = self:plan()
  return M.format_epoch_line { rank = self.rank, epoch = p.epoch, micro_batch = p.micro_batch, samples = p.count,
                               steps = p.steps }
end

-- The policy's note for the epoch (nil when none), for rank 0 to print.
function Sampler:note() return self:plan().note end

---------------------------------------------------------------- measurements

-- Whether the policy takes observations now. The same on every rank (the
-- policies see the same observations), so every rank calls exchange or none.
function Sampler:observing()
  if not method(self.policy, 'observe') then return false end
  local f = method(self.policy, 'observing')
  return f == nil or f() == true
end

-- observe{rank = r, samples = n, seconds = t}: one step of rank r.
function Sampler:observe(o)
  local f = method(self.policy, 'observe')
  if not f then return end
  local ok, err = pcall(f, o)
  if not ok then fail(self:where(), 'observe failed: ' .. tostring(err)) end
end

-- exchange(samples, seconds): every rank calls it with what it did since
-- the last call (samples read, seconds of forward and backward); the
-- numbers are all-gathered and every rank's are observed on every rank.
function Sampler:exchange(samples, seconds)
  if self.world_size == 1 then
    return self:observe { rank = 0, samples = samples, seconds = seconds }
  end
  local all = ds.comm.all_gather(ds.tensor({ samples, seconds }, 'f64'))
  for r, t in ipairs(all) do
    local v = t:totable()
    self:observe { rank = r - 1, samples = v[1], seconds = v[2] }
  end
end

---------------------------------------------------------------- state

-- state_dict() -> {policy = name, hash = code hash, epoch = e, state = the
-- policy's own state or nil}: plain numbers and strings.
function Sampler:state_dict()
  local f = method(self.policy, 'state_dict')
  local state
  if f then
    local ok, s = pcall(f)
    if not ok then fail(self:where(), 'state_dict failed: ' .. tostring(s)) end
    state = s
  end
  return { policy = self.policy_info.name, hash = self.policy_info.hash, epoch = self.epoch, state = state }
end

-- load_state_dict(sd): the epoch and the policy's state (handed to the
-- policy's load_state_dict even when the code's hash differs: a swap or
-- a resume with edited code continues from the old state).
function Sampler:load_state_dict(sd)
  if type(sd) ~= 'table' then error('sampler:load_state_dict: expected a table, got a ' .. type(sd), 2) end
  if sd.epoch ~= nil then self.epoch = sd.epoch end
  self.plans = {}
  local f = method(self.policy, 'load_state_dict')
  if f and sd.state ~= nil then
    local ok, err = pcall(f, sd.state)
    if not ok then fail(self:where(), 'load_state_dict failed: ' .. tostring(err)) end
  end
end

-- Runs of equal sizes, {{size, count}, ...}, of a list of batch sizes.
local function size_runs(list)
  local out = {}
  for _, b in ipairs(list) do
    local last = out[#out]
    if last and last[1] == b then last[2] = last[2] + 1 else out[#out + 1] = { b, 1 } end
  end
  return out
end

local MAX_SIZE_RUNS = 64      -- more: the list is kept as a tensor

-- saved_plan() -> record, tensors, or nil (no plan, or an empty one): what a
-- checkpoint keeps of the current epoch's plan. An order (every built-in
-- policy's) is kept as its description and the micro batches as runs of
-- equal sizes, a few hundred bytes however long the epoch; indices given
-- as a list or a tensor (a policy whose plan nothing regenerates) as an
-- i64 tensor, sampler/indices, and micro batches of many runs as
-- sampler/micro_batch. tensors: {{name, tensor}, ...}.
function Sampler:saved_plan()
  local plan = self.plans[self.epoch]
  if not plan or plan.count == 0 then return nil end
  local idx, mb = plan.indices, plan.micro_batch
  local rec, tensors = { epoch = plan.epoch, note = plan.note }, {}
  if ds.data.is_order(idx) then
    rec.order = idx:describe()
  else
    tensors[#tensors + 1] = { 'sampler/indices', ds.is_tensor(idx) and idx:to('i64') or ds.tensor(idx, 'i64') }
  end
  if type(mb) == 'number' then
    rec.micro_batch = mb
  else
    local runs = size_runs(mb)
    if #runs <= MAX_SIZE_RUNS then
      rec.micro_batch_runs = runs
    else
      tensors[#tensors + 1] = { 'sampler/micro_batch', ds.tensor(mb, 'i64') }
    end
  end
  return rec, tensors
end

-- saved_plan_of(rec, read) -> {epoch, indices, micro_batch, note} for
-- restore_plan from saved_plan's record (or an older checkpoint's, its
-- indices always a tensor); read(name) -> that tensor of the file.
function M.saved_plan_of(rec, read)
  local idx = rec.order and ds.data.order(rec.order.n, rec.order) or read('sampler/indices')
  local mb = rec.micro_batch
  if not mb and rec.micro_batch_runs then
    -- checked before they are written out: their sizes must fill the indices
    local total = 0
    for k, r in ipairs(rec.micro_batch_runs) do
      if type(r) ~= 'table' or not integer(r[1]) or r[1] < 1 or not integer(r[2]) or r[2] < 0 then
        error(string.format('micro_batch_runs[%d] is not {size >= 1, count >= 0}', k), 0)
      end
      total = total + r[1] * r[2]
    end
    local count = ds.is_tensor(idx) and idx:numel() or #idx
    if total ~= count then
      error(string.format('micro_batch_runs hold %d samples, the indices %d', total, count), 0)
    end
    mb = {}
    for _, r in ipairs(rec.micro_batch_runs) do
      for _ = 1, r[2] do mb[#mb + 1] = r[1] end
    end
  end
  mb = mb or read('sampler/micro_batch'):totable()
  return { epoch = rec.epoch, indices = idx, micro_batch = mb, note = rec.note }
end

-- restore_plan(plan): a checkpoint's plan of its epoch ({epoch, indices,
-- micro_batch, note}) becomes that epoch's, as it was when saved (a policy
-- whose state changed during the epoch would plan it otherwise now).
function Sampler:restore_plan(plan)
  local p = M.check_plan({ indices = plan.indices, micro_batch = plan.micro_batch, note = plan.note }, self.dataset_len,
                         self:where())
  p.epoch = plan.epoch
  self.plans = { [plan.epoch] = p }
end

-- swap(spec): another policy (name, path or table) from the next epoch on,
-- carrying the old one's state over. The current epoch's plan stays.
function Sampler:swap(spec)
  self:prepare_swap(M.load(spec, nil))()
end

-- prepare_swap(policy, info) -> commit(): the new policy given the old
-- one's state and made to plan the next epoch, nothing changed yet (a
-- failure raises); commit() swaps it in. The current epoch's plan stays,
-- so the loader goes on where it is. Live reload's checks and swap.
function Sampler:prepare_swap(policy, info)
  local old = self:state_dict()
  local probe = setmetatable({ policy = policy, policy_info = info, plans = {} }, { __index = self })
  Sampler.load_state_dict(probe, copy(old))      -- the running policy's state stays its own
  local next_plan = Sampler.plan(probe, self.epoch + 1)
  return function()
    self.policy, self.policy_info = policy, info
    self.plans[next_plan.epoch] = next_plan
  end
end

---------------------------------------------------------------- the loader

local function print_line(line)
  io.stdout:write(line, '\n')
  io.stdout:flush()
end

-- attach(loader, sampler [, {print = fn(line), quiet = false}]): each
-- loader:epoch(e) plans the epoch, prints the policy's note (rank 0) and
-- the rank's epoch line, and feeds the loader each step's batch size.
function M.attach(loader, sampler, opts)
  opts = opts or {}
  local out = opts.print or print_line
  local epoch = loader.epoch
  loader.epoch = function(l, e)
    e = e or (l.current_epoch or 0) + 1
    local plan = sampler:set_epoch(e)
    if not opts.quiet then
      if plan.note and sampler.rank == 0 then out(plan.note) end
      out(sampler:epoch_line())
    end
    local per_step = type(plan.micro_batch) == 'table'
    -- a checkpoint's position (loader:resume) starts after its step
    local resume = l._resume
    local step = resume and resume.epoch == e and resume.step or 0
    l:set_batch_size(per_step and (plan.micro_batch[step + 1] or 1) or plan.micro_batch)
    local it = epoch(l, e)
    if not per_step then return it end
    return function()
      step = step + 1
      local b = plan.micro_batch[step]
      if b and b ~= l.batch_size then l:set_batch_size(b) end
      return it()
    end
  end
  return loader
end

-- loader(dataset, sampler [, opts]) -> ds.data.loader over the sampler's
-- indices (opts: collate_fn, num_workers, prefetch_factor, device, and attach's
-- print and quiet).
function M.loader(dataset, sampler, opts)
  opts = opts or {}
  local l = ds.data.loader(dataset, {
    batch_size = 1, shuffle = false, sampler = sampler, collate_fn = opts.collate_fn,
    num_workers = opts.num_workers, prefetch_factor = opts.prefetch_factor, device = opts.device,
  })
  return M.attach(l, sampler, { print = opts.print, quiet = opts.quiet })
end

return M
