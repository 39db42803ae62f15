-- A new version of reloadable code, prepared on every rank and changing
-- nothing until it commits: run under the time budget, refused when it
-- owns training state, its state carried from the old version, its
-- check_reload run; kinds says how each kind of file swaps in.
local ds = require 'dslua'
local guard = require 'dslua.base.guard'

local M = {}

local P = require 'samplers.policy'
local method = P.method      -- M.f(...) or M:f(...), whichever the module wrote

-- What in v owns training state, and where: parameters, ds.nn modules or
-- optimizers, found through tables and functions' upvalues (libraries in
-- package.loaded are not entered).
local function owner_in(v, where)
  local loaded = {}
  for _, m in pairs(package.loaded) do
    if type(m) == 'table' then loaded[m] = true end
  end
  loaded[_G] = true
  local seen = {}
  local function walk(x, at, depth)
    local t = type(x)
    if ds.is_tensor(x) then
      if x.requires_grad then return 'a parameter (a tensor with requires_grad)', at end
      return nil
    end
    if (t ~= 'table' and t ~= 'function') or seen[x] or depth > 8 then return nil end
    seen[x] = true
    if t == 'function' then
      for i = 1, 255 do
        local name, up = debug.getupvalue(x, i)
        if not name then break end
        local what, path = walk(up, name, depth + 1)
        if what then return what, path end
      end
      return nil
    end
    if depth > 0 and loaded[x] then return nil end
    if rawget(x, '_params') ~= nil and rawget(x, '_modules') ~= nil then return 'a ds.nn module', at end
    if type(rawget(x, 'param_groups')) == 'table' then return 'an optimizer', at end
    for k, y in pairs(x) do
      local what, path = walk(y, at .. '.' .. tostring(k), depth + 1)
      if what then return what, path end
    end
    return nil
  end
  local what, path = walk(v, where, 0)
  if what then
    error(string.format('%s holds %s: a module that owns parameters or optimizer state is not swapped (keep it in '
                        .. 'the training script and hand it in)', path, what), 0)
  end
end

-- A copy of plain tables all the way down (metatables kept; tensors,
-- functions and userdata shared): the state a new version starts from, so
-- a version rejected on some rank leaves the running one's state as it was.
local function copy_state(v, seen)
  if type(v) ~= 'table' then return v end
  seen = seen or {}
  if seen[v] then return seen[v] end
  local c = {}
  seen[v] = c
  for k, x in pairs(v) do c[copy_state(k, seen)] = copy_state(x, seen) end
  return setmetatable(c, getmetatable(v))
end

-- The new version's state from the old one's: migrate_state(state), or
-- load_state_dict(old:state_dict()), or the state table carried over (a
-- copy: it becomes the running state when the new version commits).
local function carry(old, new)
  if type(old) ~= 'table' or type(new) ~= 'table' then return end
  local migrate = method(new, 'migrate_state')
  if migrate then
    new.state = migrate(copy_state(old.state))
    return
  end
  local load, dump = method(new, 'load_state_dict'), method(old, 'state_dict')
  if load and dump then
    load(copy_state(dump()))
    return
  end
  if old.state ~= nil then new.state = copy_state(old.state) end
end

local function check(new)
  local f = type(new) == 'table' and method(new, 'check_reload')
  if f then f() end
end

-- compile and run a file's text, under guard's time budget: the chunk's
-- value. Its functions get the JIT back (they run in the training loop,
-- with no budget) unless budgeted: a schedule's get_lr runs under it.
local function run_text(text, path, budgeted, ...)
  local chunk, err = guard.load(text, '@' .. path)
  if not chunk then error(err, 0) end
  local ok, res = guard.pcall(path, chunk, ...)
  if not ok then error(tostring(res), 0) end
  if not budgeted then guard.release(chunk) end
  return res
end

-- What each kind of file does with a new version: prepare(session, entry,
-- text) -> commit(), changing nothing itself (an error rejects it).
local kinds = {}

kinds.schedule = function(session, entry, text)
  local sched = session.engine and session.engine.lr_scheduler
  if not (sched and sched.prepare_swap) then error('the engine has no Lua schedule to swap', 0) end
  local new = ds.lr.check_schedule(run_text(text, entry.path, true), entry.path, 'schedule')
  owner_in(new, entry.path)
  carry(entry.value, new)
  check(new)
  local commit = sched:prepare_swap(new)
  return function()
    commit()
    entry.value = new
  end
end

kinds.sampler = function(session, entry, text)
  local sampler = session.engine.sampler
  local policy, info = P.load_text(text, entry.path, sampler.policy_info.name)
  owner_in(policy, entry.path)
  -- the sampler carries state_dict/load_state_dict itself (prepare_swap)
  if not method(policy, 'load_state_dict') then carry(entry.value, policy) end
  check(policy)
  local commit = sampler:prepare_swap(policy, info)
  return function()
    commit()
    entry.value = policy
  end
end

local function check_hooks(hooks, path)
  if type(hooks) ~= 'table' then error(path .. ' must return a table of hook functions, it returned a ' .. type(hooks), 0) end
  local known = {}
  for _, n in ipairs(ds.config.hook_names) do known[n] = true end
  for k, v in pairs(hooks) do
    if type(k) == 'string' and k:match('^on_') then
      if not known[k] then
        local s = require('dslua.base.suggest').did_you_mean(k, ds.config.hook_names)
        error(string.format("%s: unknown hook '%s'%s (hooks: %s)", path, k, s and ', ' .. s or '',
                            table.concat(ds.config.hook_names, ', ')), 0)
      end
      if type(v) ~= 'function' then error(string.format('%s: %s must be a function, got a %s', path, k, type(v)), 0) end
    end
  end
  return hooks
end

kinds.hooks = function(session, entry, text)
  local new = check_hooks(run_text(text, entry.path, false), entry.path)
  owner_in(new, entry.path)
  carry(entry.value, new)
  check(new)
  return function()
    entry.value = new
    session.hooks = new
  end
end

-- A module of ds.reload.require: a table keeps its identity (its fields are
-- replaced), a function is called through the wrapper require returned.
kinds.module = function(_, entry, text)
  local new = run_text(text, entry.path, false, entry.name)
  if type(new) ~= type(entry.value) then
    error(string.format('%s returned a %s, the running version a %s', entry.path, type(new), type(entry.value)), 0)
  end
  owner_in(new, entry.path)
  carry(entry.value, new)
  check(new)
  return function()
    if type(new) == 'function' then
      entry.call = new
      return
    end
    local t = entry.value
    for k in pairs(t) do
      if new[k] == nil then t[k] = nil end
    end
    for k, v in pairs(new) do t[k] = v end
  end
end

M.check_hooks = check_hooks
M.kinds = kinds
M.owner_in = owner_in
M.run_text = run_text

return M
