-- ds.reload: Lua code that changes while a job runs, the same way on every
-- rank, and the step boundary where `dslua attach` requests take effect.
--
-- What reloads: the files the config names (a "lua" scheduler's params.path,
-- a sampler policy file, the hooks file) and modules loaded with
-- ds.reload.require(name). The config's reload block ({enabled = true,
-- every = 1, attach = true}) turns it off or thins it out.
--
-- At each step boundary (Engine:step, every `reload.every` global steps):
--  1. each rank takes what its attach socket queued (dslua/live/attach.lua):
--     code for that rank runs now; what must happen on every rank (set_lr,
--     set_schedule, save, pause, resume, all(code)) becomes a message;
--  2. rank 0 stats the watched files (mtime, size, inode: no read when
--     nothing changed); a changed one is read and hashed (SHA-256) and
--     becomes a message with its bytes;
--  3. every rank learns every rank's messages: one all_reduce of their
--     lengths, then a broadcast from each rank that has some (one small
--     all_reduce per boundary when there are none);
--  4. every rank prepares each message and changes nothing: a file's bytes
--     are checked against their hash, compiled and run, the module's state
--     is carried to the new version and its checks run;
--  5. all ranks agree: an all_reduce(min) gives, per message, the first
--     rank where it failed, and that rank sends its error to all;
--  6. a message that passed on every rank commits on every rank, in order;
--     one that failed anywhere is dropped everywhere and rank 0 prints
--     `reload: <file> rejected on rank <r>: <error>`.
-- So new code starts at the same step on every rank, or nowhere. A new
-- version's own code runs under dslua/base/guard.lua's time budget; a swapped
-- schedule that fails at a later step on some rank (that rank uses the
-- version before it for the step, sched.failed) is rolled back on every
-- rank at that step's boundary, which has a round while that can happen.
--
-- A reloadable module (a schedule or policy table, the hooks table, a
-- module of ds.reload.require) may define:
--   state                  a table carried from version to version (the
--                          default; the new version gets a copy, so one
--                          rejected somewhere leaves the running state alone)
--   migrate_state(old)     -> the new version's state, from the old one's
--   state_dict() / load_state_dict(t)   the old version's state_dict handed
--                          to the new version's load_state_dict (policies)
--   check_reload()         raises to refuse the new version (runs on every rank)
-- A version that holds parameters (tensors with requires_grad), ds.nn
-- modules or optimizers is refused: they belong to the engine.
--
-- Every load, swap and rejection is recorded: ds.reload.versions() (the
-- running version of each watched file, with its hash and step),
-- ds.reload.history(), and engine.reload:state_dict() / :restore(sd) for
-- checkpoints (a resume runs the recorded versions and says which files
-- changed since).
local ds = require 'dslua'
local K = require('dslua.core')._reload
local sha256 = require('dslua.core').ckpt.sha256
local read_file = require('dslua.base.file').read
local guard = require 'dslua.base.guard'
local version = require 'dslua.live.version'
local owner_in, run_text, kinds = version.owner_in, version.run_text, version.kinds
local check_hooks = version.check_hooks

local M = {}

local now = ds.wall_time

M.sha256 = sha256

---------------------------------------------------------------- messages between ranks

-- Plain data (strings, numbers, booleans, tables of them) as Lua source,
-- read back by deserialize: what travels between ranks.
local function serialize(v, seen)
  local t = type(v)
  if t == 'string' then return string.format('%q', v) end
  if t == 'number' then
    if v ~= v then return '0/0' end
    if v == math.huge then return '1/0' end
    if v == -math.huge then return '-1/0' end
    return string.format('%.17g', v)
  end
  if t == 'boolean' or t == 'nil' then return tostring(v) end
  if t == 'table' and getmetatable(v) == nil then
    seen = seen or {}
    if seen[v] then error('cannot send a table that contains itself to the other ranks', 0) end
    seen[v] = true
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = '[' .. serialize(k, seen) .. ']=' .. serialize(x, seen) end
    seen[v] = nil
    return '{' .. table.concat(parts, ',') .. '}'
  end
  error(string.format('cannot send a %s to the other ranks (only strings, numbers, booleans and tables of them)',
                      ds.is_tensor(v) and 'tensor' or t), 0)
end
M.serialize = serialize

local function deserialize(text)
  local f = assert(loadstring('return ' .. text, '=reload message'))
  setfenv(f, {})
  return f()
end

-- Every rank's list of messages, in rank order (msg.from set): one
-- all_reduce of the payload lengths, a broadcast from each rank that has one.
-- lrs, this rank's {lowest, highest} lr, rides in the all_reduce: every
-- rank's comes back second (spans[r + 1] for rank r).
local function exchange(session, list, lrs)
  local W, rank = session.world_size, session.rank
  if W == 1 then
    for _, m in ipairs(list) do m.from = 0 end
    return list
  end
  local payload = #list > 0 and serialize(list) or ''
  local lens = {}
  for r = 1, 3 * W do lens[r] = 0 end
  lens[rank + 1] = #payload
  if lrs then lens[W + 2 * rank + 1], lens[W + 2 * rank + 2] = lrs[1], lrs[2] end
  lens = ds.comm.all_reduce(ds.tensor(lens, 'f64'), 'sum', { log_name = 'reload' }):totable()
  local spans = {}
  for r = 1, W do spans[r] = { lens[W + 2 * r - 1], lens[W + 2 * r] } end
  local out = {}
  for r = 0, W - 1 do
    local n = lens[r + 1]
    if n > 0 then
      local buf = r == rank and K.to_bytes(payload) or ds.zeros(n, 'u8')
      ds.comm.broadcast(buf, r, { log_name = 'reload' })
      for _, m in ipairs(deserialize(K.from_bytes(buf))) do
        m.from = r
        out[#out + 1] = m
      end
    end
  end
  return out, spans
end

---------------------------------------------------------------- versions

local history = {}       -- every load, swap and rejection, in order
local current = {}       -- path -> the latest version {path, kind, hash, step, status, source}
local sessions = setmetatable({}, { __mode = 'k' })    -- the live sessions (closed ones leave)
local modules = {}       -- ds.reload.require's entries, watched by every session

local function short(hash) return hash and hash:sub(1, 12) or '-' end

local function record(ev)
  ev.time = os.time()
  history[#history + 1] = ev
  if ev.status ~= 'rejected' then current[ev.path] = ev end
end

local function say(session, fmt, ...)
  if session.rank ~= 0 then return end
  io.stdout:write(string.format(fmt, ...), '\n')
  io.stdout:flush()
end

-- The watched files of the live sessions and ds.reload.require, by path.
local function watched()
  local out = {}
  for s in pairs(sessions) do
    for _, e in ipairs(s.entries) do out[e.path] = e end
  end
  for _, e in ipairs(modules) do out[e.path] = e end
  return out
end

-- versions() -> list of {path, kind, hash, step, status ('loaded',
-- 'swapped' or 'rolled back')}, one per watched file, sorted by path: the
-- code running now.
function M.versions()
  local out = {}
  for path, e in pairs(watched()) do
    local v = current[path]
    out[#out + 1] = { path = path, kind = e.kind, hash = e.hash, step = v and v.step, status = v and v.status }
  end
  table.sort(out, function(a, b) return a.path < b.path end)
  return out
end

-- history() -> every event: {path, kind, hash, step, status ('loaded',
-- 'swapped', 'rejected', 'rolled back'), rank and error when rejected or
-- rolled back (the rank where it failed), time}.
function M.history()
  local out = {}
  for i, ev in ipairs(history) do
    out[i] = { path = ev.path, kind = ev.kind, hash = ev.hash, step = ev.step, status = ev.status, rank = ev.rank,
               error = ev.error, time = ev.time }
  end
  return out
end

---------------------------------------------------------------- watched files

-- A watched file: key (its path), kind, the running value, the signature
-- and hash of the version running.
local function new_entry(kind, path, value, text)
  return { kind = kind, path = path, value = value, sig = K.stat(path), hash = sha256(text), source = text }
end

-- ds.reload.require(name) -> the module, as require gives it, reloading
-- when its file changes (found through package.path). A table module keeps
-- its identity across versions; a function module is returned as a
-- function that calls the running version.
function M.require(name)
  if type(name) ~= 'string' then error('ds.reload.require: expected a module name, got ' .. type(name), 2) end
  for _, e in ipairs(modules) do
    if e.name == name then return e.proxy end
  end
  local path, err = package.searchpath(name, package.path)
  if not path then error(string.format("ds.reload.require: module '%s' not found:%s", name, err), 2) end
  local text = assert(read_file(path))
  local ok, value = pcall(run_text, text, path, false, name)
  if ok then ok, value = pcall(function() owner_in(value, path) return value end) end
  if not ok then error('ds.reload.require: ' .. tostring(value), 2) end
  if type(value) ~= 'table' and type(value) ~= 'function' then
    error(string.format('ds.reload.require: %s returned a %s; a reloadable module returns a table or a function',
                        path, type(value)), 2)
  end
  local entry = new_entry('module', path, value, text)
  entry.name = name
  if type(value) == 'function' then
    entry.call = value
    entry.proxy = function(...) return entry.call(...) end
  else
    entry.proxy = value
  end
  modules[#modules + 1] = entry
  package.loaded[name] = entry.proxy
  record { path = path, kind = 'module', hash = entry.hash, step = 0, status = 'loaded', source = text }
  return entry.proxy
end

-- unwatch(name): ds.reload.require's module name reloads no more (it stays
-- loaded as it is).
function M.unwatch(name)
  for i, e in ipairs(modules) do
    if e.name == name then
      table.remove(modules, i)
      return
    end
  end
end

---------------------------------------------------------------- the session of an engine

local Session = {}
Session.__index = Session

-- session(engine, cfg) -> the engine's reload session: watches the files
-- cfg names, serves attach (cfg.reload.attach), calls the hooks. Every
-- rank builds it in ds.initialize, in the same order.
function M.session(engine, cfg)
  local rc = cfg.reload
  local self = setmetatable({
    engine = engine, rank = engine.rank, world_size = ds.comm.world_size(), enabled = rc.enabled, every = rc.every,
    entries = {}, outbox = {}, paused = false, last_end = now(), step_time = nil,
  }, Session)
  sessions[self] = true
  local sched = engine.lr_scheduler
  if rc.enabled and sched and sched.kind == 'lua' and sched.path and sched.source then
    self:_watch(new_entry('schedule', sched.path, sched.schedule, sched.source))
  end
  local sampler = engine.sampler
  if rc.enabled and sampler and sampler.policy_info.path and sampler.policy_info.source then
    self:_watch(new_entry('sampler', sampler.policy_info.path, sampler.policy, sampler.policy_info.source))
  end
  if type(cfg.hooks) == 'table' then
    self.hooks = cfg.hooks
  elseif type(cfg.hooks) == 'string' then
    local path = cfg.hooks
    local text = assert(read_file(path))
    local ok, hooks = pcall(function()
      local h = check_hooks(run_text(text, path, false), path)
      owner_in(h, path)
      return h
    end)
    if not ok then error('hooks: ' .. tostring(hooks), 0) end
    self.hooks = hooks
    local entry = new_entry('hooks', path, hooks, text)
    if rc.enabled then self:_watch(entry) else record { path = path, kind = 'hooks', hash = entry.hash, step = 0,
                                                       status = 'loaded', source = text } end
  end
  if rc.attach then require('dslua.live.attach').serve(self) end
  return self
end

function Session:_watch(entry)
  self.entries[#self.entries + 1] = entry
  record { path = entry.path, kind = entry.kind, hash = entry.hash, step = self.engine.global_steps,
           status = 'loaded', source = entry.source }
end

function Session:_entry(path)
  for _, e in ipairs(self.entries) do
    if e.path == path then return e end
  end
  for _, e in ipairs(modules) do
    if e.path == path then return e end
  end
end

-- hook(name, ...): the hooks file's function, if it has one.
function Session:hook(name, ...)
  local f = self.hooks and self.hooks[name]
  if f then return f(...) end
end

-- queue(msg): a message for every rank at the next boundary (attach's
-- actions, pause).
function Session:queue(msg)
  self.outbox[#self.outbox + 1] = msg
end

-- Rank 0: a message per watched file whose signature changed and whose
-- bytes did (a file read while it is being written, whose signature moved
-- meanwhile, waits for the next boundary).
function Session:_scan()
  if not self.enabled then return end
  local function look(e)
    local sig, why = K.stat(e.path)
    if sig == e.sig or e.pending then return end
    if not sig then
      if not e.gone then say(self, 'reload: %s: %s; the loaded version keeps running', e.path, why) end
      e.gone, e.sig = true, nil
      return
    end
    e.gone = nil
    local readable, text = pcall(read_file, e.path)
    if not readable then          -- a FIFO, a device, a planted link: never read
      say(self, 'reload: %s; the loaded version keeps running', text)
      e.gone, e.sig = true, nil
      return
    end
    if not text or K.stat(e.path) ~= sig then return end
    local hash = sha256(text)
    if hash == e.hash then
      e.sig = sig                  -- touched, not changed
      return
    end
    e.pending = sig
    self:queue { type = 'file', path = e.path, text = text, hash = hash }
  end
  for _, e in ipairs(self.entries) do look(e) end
  for _, e in ipairs(modules) do look(e) end
end

-- message type -> prepare(session, msg) -> commit() -> text for the
-- requester (attach), or nothing. Prepare checks and changes nothing.
local actions = {}

function actions.file(session, m)
  local e = session:_entry(m.path)
  if not e then error(m.path .. ' is not watched here', 0) end
  if sha256(m.text) ~= m.hash then error('the bytes received do not match their SHA-256', 0) end
  -- the new version's own code (its chunk, migrate_state, check_reload, ...) under the budget
  local ok, commit = guard.pcall(m.path, kinds[e.kind], session, e, m.text)
  if not ok then error(commit, 0) end
  return function()
    local was = e.hash
    -- a schedule keeps the version it replaces, to go back to if it fails at a later step
    if e.kind == 'schedule' then e.prev = { value = e.value, hash = e.hash, source = e.source } end
    commit()
    e.hash, e.source = m.hash, m.text
    local step = session.engine.global_steps
    record { path = e.path, kind = e.kind, hash = m.hash, step = step, status = 'swapped', source = m.text }
    say(session, 'reload: %s swapped at step %d (sha256 %s, was %s)', e.path, step, short(m.hash), short(was))
  end
end

local function scheduler_of(session)
  local s = session.engine.lr_scheduler
  if not s then error('the engine has no lr scheduler', 0) end
  return s
end

-- The schedule swapped in failed on rank m.from (its get_lr raised, ran
-- past the budget or gave a bad lr; that rank used the version before it
-- for this step): every rank goes back to that version, at this step.
function actions.rollback(session, m)
  local e = session:_entry(m.path)
  if not (e and e.prev) then error(m.path .. ' has no earlier version here', 0) end
  local commit = scheduler_of(session):prepare_rollback()
  return function()
    if not e.prev then return end       -- two ranks asked in one round
    local was, prev = e.hash, e.prev
    commit()
    e.value, e.hash, e.source, e.prev = prev.value, prev.hash, prev.source, nil
    local step = session.engine.global_steps
    record { path = e.path, kind = e.kind, hash = e.hash, step = step, status = 'rolled back', rank = m.from,
             error = m.error, source = e.source }
    say(session, 'reload: %s failed on rank %d: %s; rolled back to sha256 %s (was %s) on every rank at step %d', e.path,
        m.from, m.error, short(e.hash), short(was), step)
  end
end

function actions.set_lr(session, m)
  local lr = m.lr
  local why = lr ~= nil and require('dslua.optim.lr').lr_problem(lr)
  if why then error('set_lr: lr (or nil to hand it back to the schedule) ' .. why, 0) end
  local engine = session.engine
  if lr == nil then scheduler_of(session) end
  return function()
    local step = engine.global_steps
    if engine.lr_scheduler then
      engine.lr_scheduler:pin_lr(lr)
    else
      for _, g in ipairs(engine.optimizer.param_groups) do g.lr = lr end
    end
    if lr == nil then return string.format('set_lr: the schedule sets the lr again from step %d', step + 1) end
    say(session, 'reload: lr set to %s at step %d by attach', tostring(lr), step)
    return string.format('set_lr: lr %s on every rank from step %d%s', tostring(lr), step + 1,
                         engine.lr_scheduler and ' (set_lr(nil) hands it back to the schedule)' or '')
  end
end

-- {a = 1, b = 'x'} as `a = 1, b = "x"`, for log lines.
local function params_text(t)
  local keys, parts = {}, {}
  for k in pairs(t) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  for i, k in ipairs(keys) do
    local v = t[k]
    parts[i] = k .. ' = ' .. (type(v) == 'string' and string.format('%q', v) or tostring(v))
  end
  return table.concat(parts, ', ')
end

function actions.set_schedule(session, m)
  local commit = scheduler_of(session):prepare_params(m.params)
  return function()
    commit()
    local step = session.engine.global_steps
    say(session, 'reload: schedule params %s set at step %d by attach', params_text(m.params), step)
    return string.format('set_schedule: %s on every rank from step %d', params_text(m.params), step + 1)
  end
end

function actions.save(session, m)
  local engine = session.engine
  if type(engine.save_checkpoint) ~= 'function' then error('the engine has no save_checkpoint', 0) end
  return function()
    local step = engine.global_steps
    local ok, res = pcall(engine.save_checkpoint, engine, m.dir, m.tag)
    if not ok then return string.format('save: failed on rank %d at step %d: %s', session.rank, step, tostring(res)) end
    return string.format('save: save_checkpoint(%q, %s) requested at step %d', m.dir,
                         m.tag and string.format('%q', m.tag) or 'nil', step)
  end
end

function actions.pause(session, m)
  if m.seconds ~= nil and not (type(m.seconds) == 'number' and m.seconds > 0) then
    error('pause: seconds must be a number > 0, got ' .. tostring(m.seconds), 0)
  end
  return function()
    session.paused = true
    session.pause_until = m.seconds and now() + m.seconds or nil
    local step = session.engine.global_steps
    say(session, 'reload: paused at step %d%s', step, m.seconds and string.format(' for at most %g s', m.seconds) or '')
    return string.format('pause: every rank paused after step %d; resume() goes on', step)
  end
end

function actions.resume(session)
  return function()
    local was = session.paused
    session.paused, session.pause_until = false, nil
    local step = session.engine.global_steps
    if was then say(session, 'reload: resumed at step %d', step) end
    return was and string.format('resume: every rank goes on from step %d', step + 1) or 'resume: the job was not paused'
  end
end

-- all(code): compiled on every rank (a syntax error is rejected before any
-- runs), then run on every rank; its output comes back from each.
function actions.run(_, m)
  local fn, err = guard.load(m.code, '=all')
  if not fn then error(err, 0) end
  return function() return require('dslua.live.attach').run_everywhere(fn) end, true
end

-- Prepares, agrees on and commits the messages of one boundary.
function Session:_apply(msgs)
  local W, rank = self.world_size, self.rank
  local commits, errs, gathers = {}, {}, {}
  for i, m in ipairs(msgs) do
    local prepare = actions[m.type]
    local ok, res, gather
    if prepare then
      ok, res, gather = pcall(prepare, self, m)
    else
      ok, res = false, 'unknown message ' .. tostring(m.type)
    end
    if ok then commits[i], gathers[i] = res, gather else errs[i] = tostring(res) end
  end
  -- the first rank where each failed (W: none), and that rank's reason
  local first = {}
  for i = 1, #msgs do first[i] = errs[i] and rank or W end
  if W > 1 and #msgs > 0 then
    first = ds.comm.all_reduce(ds.tensor(first, 'f64'), 'min', { log_name = 'reload' }):totable()
    local mine = {}
    for i = 1, #msgs do
      if first[i] == rank then mine[#mine + 1] = { i = i, error = errs[i] } end
    end
    for _, r in ipairs(exchange(self, mine)) do errs[r.i] = r.error end
  end
  local outputs = {}
  for i, m in ipairs(msgs) do
    if first[i] == W then
      outputs[i] = commits[i]()
    else
      local what = m.type == 'file' and m.path or m.type
      if m.type == 'file' then
        local e = self:_entry(m.path)
        record { path = m.path, kind = e and e.kind, hash = m.hash, step = self.engine.global_steps,
                 status = 'rejected', rank = first[i], error = errs[i] }
      end
      say(self, 'reload: %s rejected on rank %d: %s', what, first[i], errs[i])
      outputs[i] = string.format('%s: rejected on rank %d: %s', what, first[i], errs[i])
    end
    if m.type == 'file' then      -- swapped or not, this version is done with until the file changes again
      local e = self:_entry(m.path)
      if e and e.pending then e.sig, e.pending = e.pending, nil end
    end
  end
  -- outputs of all(code) come from every rank to the one that asked
  local any = false
  for i in pairs(gathers) do any = any or first[i] == W end
  if any then
    local mine = {}
    for i in pairs(gathers) do
      if first[i] == W then mine[#mine + 1] = { i = i, out = outputs[i] } end
    end
    local per = {}
    for _, r in ipairs(exchange(self, mine)) do
      per[r.i] = per[r.i] or {}
      per[r.i][#per[r.i] + 1] = string.format('[rank %d] %s', r.from, r.out)
    end
    for i, lines in pairs(per) do outputs[i] = table.concat(lines, '\n') end
  end
  local A = package.loaded['dslua.live.attach']
  for i, m in ipairs(msgs) do
    if m.from == rank and m.req and A then A.done(m.req, outputs[i] or '', first[i] == W) end
  end
end

-- One exchange: this rank's attach requests, rank 0's changed files, then
-- every rank's messages prepared, agreed on and committed.
function Session:_round()
  local A = self.server and package.loaded['dslua.live.attach']
  if A then A.take() end
  if self.rank == 0 then
    self:_scan()
    if self.pause_until and now() >= self.pause_until then self:queue { type = 'resume' } end
  end
  local lr, engine = require('dslua.optim.lr'), self.engine
  local msgs, spans = exchange(self, self.outbox, lr.span(engine.optimizer))
  self.outbox = {}
  if #msgs > 0 then      -- the lr once a reload, set_lr or rollback has set it
    self:_apply(msgs)
    spans = select(2, exchange(self, {}, lr.span(engine.optimizer)))
  end
  if spans then lr.agree(spans, engine.global_steps + 1, engine.lr_scheduler) end
end

-- The step boundary (Engine:step after its report): the on_step and on_log
-- hooks, then, every `every` global steps, a round; while paused, a round
-- every quarter second (or as soon as an attach request comes).
function Session:boundary()
  if self.busy then
    error('reload: engine:step was called inside a step boundary (from attach code or a hook); it steps this '
          .. 'rank alone', 2)
  end
  self.busy = true
  local engine = self.engine
  local t0 = now()
  self.step_time = t0 - self.last_end
  local step = engine.global_steps
  if self.hooks then
    local info = { step = step, loss = engine.last_loss, lr = engine:get_lr(), step_time = self.step_time }
    self:hook('on_step', engine, info)
    if step % engine.config.steps_per_print == 0 then self:hook('on_log', engine, info) end
  end
  -- a swapped schedule that failed at this step goes back everywhere in
  -- this round: while one could fail, every boundary has a round
  local sched, fallback = engine.lr_scheduler, false
  for _, e in ipairs(self.entries) do
    if e.prev then
      fallback = true
      if sched.failed then self:queue { type = 'rollback', path = e.path, error = sched.failed.error } end
    end
  end
  if sched then sched.failed = nil end
  if step % self.every == 0 or self.paused or fallback then self:_round() end
  while self.paused do
    local A = self.server and package.loaded['dslua.live.attach']
    if A then A.wait(0.25) else K.sleep(0.25) end
    self:_round()
  end
  self.last_end = now()
  self.busy = false
end

-- pause([seconds]): every rank stops at the next boundary until resume()
-- from `dslua attach` or until seconds have passed (rank 0's clock). Any
-- rank may ask (a hook, say); one asking is enough.
function Session:pause(seconds) self:queue { type = 'pause', seconds = seconds } end

function Session:close()
  sessions[self] = nil
  local A = package.loaded['dslua.live.attach']
  if A then A.forget(self) end
end

---------------------------------------------------------------- checkpoints

-- session:state_dict() -> {files = {[path] = {kind, hash, step, source}}}:
-- the running version of each file this session watches (and of
-- ds.reload.require's modules), for a checkpoint.
function Session:state_dict()
  local files = {}
  local function add(e)
    local v = current[e.path]
    files[e.path] = { kind = e.kind, hash = e.hash, step = v and v.step or 0, source = e.source }
  end
  for _, e in ipairs(self.entries) do add(e) end
  for _, e in ipairs(modules) do add(e) end
  return { files = files }
end

-- session:restore(sd) (every rank calls it, with the same sd): each watched
-- file whose running version differs from the recorded one runs the
-- recorded source again, through the same checks and agreement as an
-- edit; the file on disk reloads when it next changes. Returns the list of
-- files that differ from the checkpoint's, and prints them (rank 0).
function Session:restore(sd)
  if type(sd) ~= 'table' or type(sd.files) ~= 'table' then
    error('reload: restore: expected a table from ds.reload.state_dict()', 2)
  end
  local changed, msgs = {}, {}
  local paths = {}
  for path in pairs(sd.files) do paths[#paths + 1] = path end
  table.sort(paths)
  for _, path in ipairs(paths) do
    local rec, e = sd.files[path], self:_entry(path)
    if not e then
      say(self, 'reload: %s (sha256 %s in the checkpoint) is not watched in this run', path, short(rec.hash))
    elseif e.hash ~= rec.hash then
      changed[#changed + 1] = path
      say(self, 'reload: %s changed since the checkpoint (sha256 %s at step %d, now %s)%s', path, short(rec.hash),
          rec.step or 0, short(e.hash), rec.source and '; running the checkpoint\'s version' or '')
      if rec.source then msgs[#msgs + 1] = { type = 'file', path = path, text = rec.source, hash = rec.hash } end
    end
  end
  -- rank 0's list on every rank, so the agreement matches even if the
  -- ranks were handed different tables
  msgs = exchange(self, self.rank == 0 and msgs or {})
  if #msgs > 0 then self:_apply(msgs) end
  return changed
end

return M
