-- LR schedulers: DeepSpeed's (deepspeed/runtime/lr_schedules.py) over an
-- optimizer's param_groups, computed by the C formulas (core.lr_formulas,
-- re-exported here: ds.lr.warmup_lr(iteration, params) ...), plus schedules
-- written in Lua.
--
-- Stepping is DeepSpeed's: last_batch_iteration starts at -1, the
-- constructor sets each group's lr (the value of iteration -1), and step(),
-- called after each optimizer step, increments it and sets lr again.
local F = require('dslua.core').lr_formulas
local file = require 'dslua.base.file'
local suggest = require 'dslua.base.suggest'
local guard = require 'dslua.base.guard'

local M = {}
for k, v in pairs(F) do M[k] = v end

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

local function warn(fmt, ...)
  io.stderr:write('[dslua] warning: ', string.format(fmt, ...), '\n')
end

-- ' (did you mean 'x'?)', or the list of valid names when none is close.
local function hint(name, names)
  local s = suggest.did_you_mean(name, names)
  return s and ' (' .. s .. ')' or ' (valid: ' .. table.concat(names, ', ') .. ')'
end

local function check_names(params, names, who)
  if type(params) ~= 'table' then fail('%s: params must be a table, got %s', who, type(params)) end
  local valid = {}
  for _, n in ipairs(names) do valid[n] = true end
  for k in pairs(params) do
    if not valid[k] then fail("%s: unknown param '%s'%s", who, tostring(k), hint(tostring(k), names)) end
  end
end

local function is_integer(v) return type(v) == 'number' and v == math.floor(v) and v > -2^53 and v < 2^53 end

-- The largest lr: the optimizers' kernels take it as an fp32 number, where
-- anything larger is inf.
local LR_MAX = 3.4028234663852886e38

-- lr_problem(v) -> why v cannot be an lr, or nil. As PyTorch a negative lr
-- is refused; so is one the fp32 step would make inf or NaN (1/0, 1e300).
function M.lr_problem(v)
  if type(v) ~= 'number' or not (v >= 0 and v <= LR_MAX) then
    return 'must be >= 0 and finite in fp32 (at most 3.4e38), got ' .. tostring(v)
  end
end

-- span(optimizer) -> {lowest, highest} lr of its param groups: what ranks
-- compare, one size whatever their groups (a pipeline's stages differ).
function M.span(optimizer)
  local lo, hi = math.huge, -math.huge
  for _, g in ipairs(optimizer.param_groups) do lo, hi = math.min(lo, g.lr), math.max(hi, g.lr) end
  return { lo, hi }
end

-- agree(spans, step [, scheduler]): spans[r + 1] is rank r's span; raises
-- naming each rank whose lrs differ from rank 0's, and the schedule (a
-- schedule reading the rank would let the ranks' weights drift apart).
function M.agree(spans, step, scheduler)
  local num = require('dslua.base.json').number
  local function shown(s) return s[1] == s[2] and num(s[1]) or num(s[1]) .. ' to ' .. num(s[2]) end
  local bad = {}
  for r = 2, #spans do
    if spans[r][1] ~= spans[1][1] or spans[r][2] ~= spans[1][2] then
      bad[#bad + 1] = string.format('rank %d %s', r - 1, shown(spans[r]))
    end
  end
  if #bad > 0 then
    local from = scheduler and ' (set by ' .. (scheduler.who or scheduler.kind or 'the scheduler') .. ')' or ''
    fail('the lr differs across ranks from step %d%s: rank 0 steps with %s, %s; every rank must step with the same lr',
         step, from, shown(spans[1]), table.concat(bad, ', '))
  end
end

-- Raises naming who and the step unless every lr of lrs can be one.
local function check_lrs(lrs, who, step)
  for i, v in ipairs(lrs) do
    local why = M.lr_problem(v)
    if why then
      fail('%s: the lr%s at step %d %s', who, #lrs > 1 and ' of param group ' .. i or '', step, why)
    end
  end
end

local function groups_of(optimizer, who)
  local groups = type(optimizer) == 'table' and optimizer.param_groups
  if type(groups) ~= 'table' or #groups == 0 then
    fail('%s: optimizer must have param_groups, a non-empty list of tables with lr', who)
  end
  for i, g in ipairs(groups) do
    if type(g) ~= 'table' or type(g.lr) ~= 'number' then
      fail('%s: optimizer.param_groups[%d] must be a table with a number lr', who, i)
    end
  end
  return groups
end

-- A value per group from a scalar or a list of one per group
-- (DeepSpeed's _format_param).
local function per_group(value, n, who, key)
  if type(value) ~= 'table' then
    local out = {}
    for i = 1, n do out[i] = value end
    return out
  end
  if #value ~= n then fail('%s: params.%s: expected %d values (one per param group), got %d', who, key, n, #value) end
  local out = {}
  for i = 1, n do out[i] = value[i] end
  return out
end

local function copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  return out
end

local function last_iteration(params, who)
  local it = params.last_batch_iteration
  if it == nil then return -1 end
  if not is_integer(it) or it < -1 then
    fail('%s: params.last_batch_iteration must be an integer >= -1, got %s', who, tostring(it))
  end
  return it
end

-- The scheduler object. A kind fills `compute(self, it) -> lrs [, betas]`.
local Scheduler = {}
Scheduler.__index = Scheduler

local builders = {}      -- kind -> function(optimizer, params, who) -> scheduler, below

local function new_scheduler(optimizer, kind, compute, last_batch_iteration)
  return setmetatable({ optimizer = optimizer, kind = kind, compute = compute,
                        last_batch_iteration = last_batch_iteration }, Scheduler)
end

local function set_lrs(self, lrs)
  check_lrs(lrs, self.who or self.kind, self.last_batch_iteration + 1)
  for i, g in ipairs(self.optimizer.param_groups) do g.lr = lrs[i] end
  self._last_lr = copy(lrs)
end

-- step([batch_iteration]): advances (or jumps) to the iteration and sets
-- every group's lr (and OneCycle's betas) for it.
function Scheduler:step(batch_iteration)
  if batch_iteration == nil then batch_iteration = self.last_batch_iteration + 1 end
  if not is_integer(batch_iteration) then
    fail('%s: step: batch_iteration must be an integer, got %s', self.kind, tostring(batch_iteration))
  end
  self.last_batch_iteration = batch_iteration
  local lrs, betas = self:compute(batch_iteration)
  if self.pinned then
    lrs = {}
    for i = 1, #self.optimizer.param_groups do lrs[i] = self.pinned end
  end
  set_lrs(self, lrs)
  if betas then
    for i, g in ipairs(self.optimizer.param_groups) do g.betas = betas[i] end
  end
end

-- The lrs of the current iteration, one per group.
function Scheduler:get_lr()
  return (self:compute(self.last_batch_iteration))
end

-- The lrs the last step() (or the constructor) set.
function Scheduler:get_last_lr()
  if self._last_lr == nil then fail('%s: get_last_lr: need to call step() first', self.kind) end
  return copy(self._last_lr)
end

function Scheduler:state_dict()
  return { last_batch_iteration = self.last_batch_iteration }
end

-- pin_lr(lr): every group's lr is lr from now on, whatever the schedule
-- says (it keeps counting steps); pin_lr(nil) hands the lr back to it.
-- How `dslua attach`'s set_lr overrides a schedule.
function Scheduler:pin_lr(lr)
  if lr ~= nil and M.lr_problem(lr) then fail('%s: pin_lr: lr %s', self.kind, M.lr_problem(lr)) end
  self.pinned = lr
  self:step(self.last_batch_iteration)
end

-- prepare_params(changes) -> commit(): the schedule with some of its params
-- changed, checked at the current iteration without changing anything;
-- commit() makes it the schedule, its lrs set for the current iteration.
-- For schedulers built by name (from_config or ds.lr.<Kind>), from the
-- params and group lrs they were built with.
function Scheduler:prepare_params(changes)
  local who = 'set_params ' .. self.kind
  if type(changes) ~= 'table' then fail('%s: expected a table of params, got %s', who, type(changes)) end
  if not (self.base_lrs and builders[self.kind]) then
    fail('%s: this scheduler was not built from a config block or by name; its params cannot be changed', who)
  end
  local params = copy(self.params)
  for k, v in pairs(changes) do params[k] = v end
  params.last_batch_iteration = nil
  local groups = {}
  for i, g in ipairs(self.optimizer.param_groups) do
    groups[i] = setmetatable({ lr = self.base_lrs[i] }, { __index = g })   -- writes stay off the real groups
  end
  local fresh = builders[self.kind]({ param_groups = groups }, params, who)
  fresh:compute(self.last_batch_iteration)
  return function()
    self.compute, self.params = fresh.compute, params
    self:step(self.last_batch_iteration)
  end
end

-- Restores the iteration; the lr itself comes back with the optimizer's
-- state and is set again by the next step(), as in DeepSpeed.
function Scheduler:load_state_dict(sd)
  if type(sd) ~= 'table' or not is_integer(sd.last_batch_iteration) then
    fail('%s: load_state_dict: expected a table with an integer last_batch_iteration', self.kind)
  end
  self.last_batch_iteration = sd.last_batch_iteration
end

local LR_RANGE_TEST = { 'lr_range_test_min_lr', 'lr_range_test_step_size', 'lr_range_test_step_rate',
                        'lr_range_test_staircase', 'last_batch_iteration' }
local ONE_CYCLE = { 'cycle_min_lr', 'cycle_max_lr', 'decay_lr_rate', 'cycle_first_step_size',
                    'cycle_second_step_size', 'cycle_first_stair_count', 'cycle_second_stair_count',
                    'decay_step_size', 'cycle_momentum', 'cycle_min_mom', 'cycle_max_mom', 'decay_mom_rate',
                    'last_batch_iteration' }
local WARMUP = { 'warmup_min_lr', 'warmup_max_lr', 'warmup_num_steps', 'warmup_type', 'last_batch_iteration' }
local WARMUP_DECAY = { 'total_num_steps', 'warmup_min_lr', 'warmup_max_lr', 'warmup_num_steps', 'warmup_type',
                       'last_batch_iteration' }
local WARMUP_COSINE = { 'total_num_steps', 'warmup_min_ratio', 'warmup_num_steps', 'cos_min_ratio', 'warmup_type',
                        'last_batch_iteration' }

-- One formula per group: each group's params checked once here (the
-- formula raises on bad ones), then evaluated at every step.
local function per_group_scheduler(optimizer, kind, formula, group_params, who, last_batch_iteration)
  for _, p in ipairs(group_params) do formula(-1, p, who) end
  return new_scheduler(optimizer, kind, function(_, it)
    local lrs = {}
    for i, p in ipairs(group_params) do lrs[i] = formula(it, p) end
    return lrs
  end, last_batch_iteration)
end

function builders.LRRangeTest(optimizer, params, who)
  check_names(params, LR_RANGE_TEST, who)
  local groups = groups_of(optimizer, who)
  local min_lrs = per_group(params.lr_range_test_min_lr, #groups, who, 'lr_range_test_min_lr')
  local gp = {}
  for i = 1, #groups do
    gp[i] = copy(params)
    gp[i].last_batch_iteration = nil
    gp[i].lr_range_test_min_lr = min_lrs[i]
  end
  local s = per_group_scheduler(optimizer, 'LRRangeTest', F.lr_range_test, gp, who, last_iteration(params, who))
  if s.last_batch_iteration == -1 then set_lrs(s, s:get_lr()) end
  return s
end

-- OneCycle cycles the first beta as momentum and, as DeepSpeed does, sets
-- the second to 0.99; it does so only on optimizers with betas. The lr and
-- momentum bounds are numbers or lists of one per group.
function builders.OneCycle(optimizer, params, who)
  check_names(params, ONE_CYCLE, who)
  local groups = groups_of(optimizer, who)
  local n = #groups
  local bounds = {}
  for _, key in ipairs { 'cycle_min_lr', 'cycle_max_lr', 'cycle_min_mom', 'cycle_max_mom' } do
    bounds[key] = per_group(params[key], n, who, key)
  end
  local cycle_momentum = params.cycle_momentum ~= false
  if cycle_momentum then
    for _, g in ipairs(groups) do
      if type(g.betas) ~= 'table' then
        warn('%s: cycle_momentum is disabled because the optimizer has no betas', who)
        cycle_momentum = false
        break
      end
    end
  end
  local gp = {}
  for i = 1, n do
    gp[i] = copy(params)
    gp[i].last_batch_iteration = nil
    for key, values in pairs(bounds) do gp[i][key] = values[i] end
    gp[i].cycle_momentum = cycle_momentum
    F.one_cycle(-1, gp[i], who)
  end
  local last = last_iteration(params, who)
  local s = new_scheduler(optimizer, 'OneCycle', function(_, it)
    local lrs, betas = {}, cycle_momentum and {} or nil
    for i = 1, n do
      local lr, mom = F.one_cycle(it, gp[i])
      lrs[i] = lr
      if betas then betas[i] = { mom, 0.99 } end
    end
    return lrs, betas
  end, last)
  -- the constructor starts at the bounds, not at the formula's iteration -1:
  -- lr at cycle_min_lr, momentum at cycle_min_mom
  if last == -1 then
    for i, g in ipairs(groups) do
      g.lr = bounds.cycle_min_lr[i]
      if cycle_momentum then g.betas = { bounds.cycle_min_mom[i] or 0.8, 0.99 } end
    end
  end
  return s
end

-- The betas OneCycle sets for the current iteration, or nil without
-- momentum cycling.
function Scheduler:get_mom()
  if self.kind ~= 'OneCycle' then return nil end
  return (select(2, self:compute(self.last_batch_iteration)))
end

local function warmup(kind, names, formula, default_max)
  return function(optimizer, params, who)
    check_names(params, names, who)
    local groups = groups_of(optimizer, who)
    local n = #groups
    local min_lrs = per_group(params.warmup_min_lr, n, who, 'warmup_min_lr')
    local max_lrs
    if params.warmup_max_lr ~= nil or default_max then
      max_lrs = per_group(params.warmup_max_lr or default_max, n, who, 'warmup_max_lr')
    else
      max_lrs = {}
      for i, g in ipairs(groups) do max_lrs[i] = g.lr end
    end
    local gp = {}
    for i = 1, n do
      gp[i] = copy(params)
      gp[i].last_batch_iteration = nil
      gp[i].warmup_min_lr, gp[i].warmup_max_lr = min_lrs[i], max_lrs[i]
    end
    local s = per_group_scheduler(optimizer, kind, formula, gp, who, last_iteration(params, who))
    local total, steps = params.total_num_steps, params.warmup_num_steps or 1000
    if total and total < steps then
      warn('%s: total_num_steps %d is less than warmup_num_steps %d', who, total, steps)
    end
    if s.last_batch_iteration == -1 then set_lrs(s, s:get_lr()) end
    return s
  end
end

builders.WarmupLR = warmup('WarmupLR', WARMUP, F.warmup_lr, nil)
builders.WarmupDecayLR = warmup('WarmupDecayLR', WARMUP_DECAY, F.warmup_decay_lr, 0.001)

-- Ratios of each group's lr at construction.
function builders.WarmupCosineLR(optimizer, params, who)
  check_names(params, WARMUP_COSINE, who)
  local groups = groups_of(optimizer, who)
  local gp = {}
  for i, g in ipairs(groups) do
    gp[i] = copy(params)
    gp[i].last_batch_iteration = nil
    gp[i].base_lr = g.lr
  end
  local s = per_group_scheduler(optimizer, 'WarmupCosineLR', F.warmup_cosine_lr, gp, who,
                                last_iteration(params, who))
  local total, steps = params.total_num_steps, params.warmup_num_steps or 1000
  if total < steps then warn('%s: total_num_steps %d is less than warmup_num_steps %d', who, total, steps) end
  if s.last_batch_iteration == -1 then set_lrs(s, s:get_lr()) end
  return s
end

local TYPES = { 'LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'lua' }

-- The group lrs before a builder sets its own, and the params it was built
-- with: what prepare_params rebuilds from.
local function build(kind, optimizer, params, who)
  local base = {}
  for i, g in ipairs(groups_of(optimizer, who)) do base[i] = g.lr end
  local s = builders[kind](optimizer, params, who)
  s.base_lrs, s.params = base, copy(params)
  return s
end

for _, kind in ipairs(TYPES) do
  if builders[kind] then
    M[kind] = function(optimizer, params) return build(kind, optimizer, params or {}, kind) end
  end
end

-- Sets a group's momentum from a Lua schedule: the first beta, or momentum.
local function set_momentum(g, i, mom, who)
  if type(g.betas) == 'table' then
    g.betas = { mom, g.betas[2] }
  elseif g.momentum ~= nil then
    g.momentum = mom
  else
    fail('%s: the schedule returned a momentum, but param_groups[%d] has neither betas nor momentum', who, i)
  end
end

-- A number for every group from a number or a list of one per group.
local function values_for(v, n, what, step, who)
  local out = {}
  if type(v) == 'table' then
    if #v ~= n then
      fail('%s: %s at step %d: expected %d values (one per param group), got %d', who, what, step, n, #v)
    end
    for i = 1, n do out[i] = v[i] end
  else
    for i = 1, n do out[i] = v end
  end
  for i = 1, n do
    if type(out[i]) ~= 'number' or out[i] ~= out[i] then
      fail('%s: %s at step %d must be a number, got %s', who, what, step, tostring(out[i]))
    end
  end
  if what == 'lr' then check_lrs(out, who, step) end
  return out
end

-- lambda(optimizer, schedule [, params [, name]]): schedule is function(step, params)
-- -> lr[, momentum] or a table with get_lr(step, params) and optional
-- state_dict() / load_state_dict(sd). lr and momentum are numbers for every
-- group or lists of one per group; momentum goes to the first beta (or
-- momentum) of each group. step counts the scheduler steps taken: 0 at
-- construction (the lr of the first optimizer step), n after n step()s,
-- i.e. DeepSpeed's last_batch_iteration + 1. name prefixes error messages.
-- A schedule's get_lr function and its table (nil for a bare function).
local function schedule_parts(schedule, who)
  if type(schedule) == 'table' then
    if type(schedule.get_lr) ~= 'function' then fail('%s: the schedule table has no get_lr function', who) end
    return schedule.get_lr, schedule
  elseif type(schedule) ~= 'function' then
    fail('%s: schedule must be a function(step, params) -> lr[, momentum] or a table with get_lr, got %s',
         who, type(schedule))
  end
  return schedule, nil
end

function M.lambda(optimizer, schedule, params, who)
  who = who or 'lambda'
  local groups = groups_of(optimizer, who)
  local get_lr, tbl = schedule_parts(schedule, who)
  params = params or {}
  local cache_at, cache_lrs, cache_moms
  -- the version before the latest swap ({get_lr, tbl}), whose lrs stand in
  -- when the latest fails; live reload then rolls back to it on every rank
  local fallback
  -- fn's lrs and momenta at step, checked (fn runs under guard's budget)
  local function values_at(fn, step, p)
    local ok, lr, mom = guard.pcall(who, fn, step, p)
    if not ok then fail('%s: get_lr at step %d: %s', who, step, tostring(lr)) end
    return values_for(lr, #groups, 'lr', step, who), mom ~= nil and values_for(mom, #groups, 'momentum', step, who) or nil
  end
  local s = new_scheduler(optimizer, 'lambda', function(self, it)
    if cache_at ~= it then
      local step = it + 1
      local ok, lrs, moms = pcall(values_at, get_lr, step, params)
      if not ok and not fallback then error(lrs, 0) end
      if not ok then
        self.failed = self.failed or { step = step, error = lrs }
        lrs, moms = values_at(fallback.get_lr, step, params)
      end
      cache_lrs, cache_moms, cache_at = lrs, moms, it
    end
    return cache_lrs, nil
  end, -1)
  s.schedule = tbl or schedule
  s.params, s.who = params, who
  -- what fn gives at the current step, checked as step() would check it
  local function check_at(fn, p)
    local step = s.last_batch_iteration + 1
    return values_at(fn, step, p)
  end
  -- prepare_swap(schedule) -> commit(): another schedule (function or
  -- table), checked at the current step; commit() makes it the schedule,
  -- this step's lrs the checked ones (live reload swaps the schedule file so).
  function s:prepare_swap(new)
    local new_get, new_tbl = schedule_parts(new, who)
    local lrs, moms = check_at(new_get, params)
    return function()
      fallback = { get_lr = get_lr, tbl = tbl }
      get_lr, tbl = new_get, new_tbl
      self.schedule = new_tbl or new
      self.failed = nil
      cache_at, cache_lrs, cache_moms = self.last_batch_iteration, lrs, moms
      self:step(self.last_batch_iteration)
    end
  end
  -- prepare_rollback() -> commit(): back to the version before the latest
  -- swap, this step's lrs set from it (live reload, on every rank at the
  -- same step, when the latest failed on some rank: self.failed).
  function s:prepare_rollback()
    if not fallback then fail('%s: no earlier version of the schedule to go back to', who) end
    return function()
      if not fallback then return end     -- two ranks asked in one round
      get_lr, tbl = fallback.get_lr, fallback.tbl
      self.schedule = tbl or get_lr
      fallback, self.failed, cache_at = nil, nil, nil
      self:step(self.last_batch_iteration)
    end
  end
  -- prepare_params(changes) -> commit(): the params handed to get_lr, some
  -- changed (the same table, updated in place), checked at the current step;
  -- commit() sets the lrs checked (get_lr is not asked again).
  function s:prepare_params(changes)
    if type(changes) ~= 'table' then fail('%s: set_params: expected a table of params, got %s', who, type(changes)) end
    local merged = copy(params)
    for k, v in pairs(changes) do merged[k] = v end
    local lrs, moms = check_at(get_lr, merged)
    return function()
      for k, v in pairs(changes) do params[k] = v end
      cache_at, cache_lrs, cache_moms = self.last_batch_iteration, lrs, moms
      self:step(self.last_batch_iteration)
    end
  end
  local step = Scheduler.step
  -- momentum is set per group in place of OneCycle's betas
  function s:step(batch_iteration)
    step(self, batch_iteration)
    if cache_moms then
      for i, g in ipairs(self.optimizer.param_groups) do set_momentum(g, i, cache_moms[i], who) end
    end
  end
  function s:state_dict()
    local sd = { last_batch_iteration = self.last_batch_iteration }
    if tbl and type(tbl.state_dict) == 'function' then sd.schedule = tbl.state_dict() end
    return sd
  end
  function s:load_state_dict(sd)
    Scheduler.load_state_dict(self, sd)
    cache_at = nil        -- the schedule's state may have changed
    if sd.schedule ~= nil and tbl and type(tbl.load_state_dict) == 'function' then
      tbl.load_state_dict(sd.schedule)
    end
  end
  s:step(-1)
  return s
end

-- A Lua schedule file: returns function(step, params) or a table with get_lr.
-- What a schedule file's chunk returned, checked.
function M.check_schedule(res, path, who)
  if type(res) == 'function' or (type(res) == 'table' and type(res.get_lr) == 'function') then return res end
  local got = type(res) == 'table' and 'table without get_lr' or type(res)
  fail('%s: schedule file %s returned a %s; expected function(step, params) -> lr[, momentum]'
       .. ' or a table with get_lr(step, params)', who, path, got)
end

-- The schedule a file returns, and the file's text (live reload hashes it).
local function load_schedule(path, who)
  if type(path) ~= 'string' then fail('%s: params.path must be the path of a Lua file, got %s', who, type(path)) end
  local text, why = file.text(path)
  if not text then fail('%s: cannot load schedule file %s: %s', who, path, why) end
  local chunk, cerr = guard.load(text, '@' .. path)
  if not chunk then fail('%s: cannot load schedule file %s: %s', who, path, cerr) end
  local ok, res = guard.pcall('the schedule file ' .. path, chunk)
  if not ok then fail('%s: schedule file %s failed while loading: %s', who, path, tostring(res)) end
  return M.check_schedule(res, path, who), text
end

-- from_config(optimizer, {type=, params=}): DeepSpeed's scheduler block.
-- type "lua": params.path names a Lua schedule file (relative to the
-- current directory or absolute; ds.initialize takes a config file's from
-- its folder); the other params go to its get_lr.
function M.from_config(optimizer, block)
  if type(block) ~= 'table' then fail('scheduler: expected a table {type=, params=}, got %s', type(block)) end
  for k in pairs(block) do
    if k ~= 'type' and k ~= 'params' then
      fail("scheduler: unknown key '%s'%s", tostring(k), hint(tostring(k), { 'type', 'params' }))
    end
  end
  local kind, params = block.type, block.params or {}
  if type(kind) ~= 'string' then fail('scheduler.type: expected a scheduler name, got %s', type(kind)) end
  if type(params) ~= 'table' then fail('scheduler.params: expected a table, got %s', type(params)) end
  -- a JSON null is Python's None: the default
  local null = (require('dslua.core').json or {}).null
  params = copy(params)
  for k, v in pairs(params) do
    if v == null then params[k] = nil end
  end
  local who = 'scheduler ' .. kind
  if kind == 'lua' then
    local rest = copy(params)
    rest.path = nil
    local schedule, text = load_schedule(params.path, who)
    local s = M.lambda(optimizer, schedule, rest, who .. ' (' .. tostring(params.path) .. ')')
    s.kind, s.path, s.source = 'lua', params.path, text
    return s
  end
  if not builders[kind] then fail("scheduler.type: unknown scheduler '%s'%s", kind, hint(kind, TYPES)) end
  return build(kind, optimizer, params, who)
end

return M
