-- `dslua attach`, the job's side. Each rank serves a Unix socket
-- (core/io/ds_attach.h: a C thread accepts connections and queues their
-- requests, so training never waits on a client); at the step boundary the
-- reload session (dslua/live/reload.lua) takes them: code typed into the REPL
-- runs at once on this rank, in an environment of its own per client, and
-- what must happen on every rank (set_lr, set_schedule, save, pause,
-- resume, all) becomes a message that every rank checks, agrees on and
-- commits at the same step, as a reloaded file. The reply goes back when
-- those messages are done.
--
-- The socket: <dir>/<job>.r<rank>.sock, job = <script name>-<pid of rank
-- 0>, dir = $DSLUA_ATTACH_DIR, else $XDG_RUNTIME_DIR/dslua, else
-- /tmp/dslua-<uid>; the directory 0700, the socket 0600, peers of another
-- uid refused (SO_PEERCRED). One server per process, serving the latest
-- engine's session.
--
-- Requests are "<verb> <id>\n<body>" (verbs: hello, eval), replies
-- "<ok|error> <id>\n<text>".
local ds = require 'dslua'
local A = require('dslua.core')._attach
local glob = require('dslua.core').data_core.glob
local repl = require 'dslua.live.repl'
local guard = require 'dslua.base.guard'

local M = {}

local server               -- this process's, once serve has run
local failed               -- why it could not serve, once tried
local job, socket
local session_of           -- where requests go: the latest engine's session
local envs = {}            -- client -> the environment its code runs in
local pending = {}         -- message id -> the request waiting for it
local last_msg = 0
local current              -- the request whose code is running

-- The directory sockets live in.
function M.dir()
  local d = os.getenv('DSLUA_ATTACH_DIR')
  if d and d ~= '' then return d end
  local x = os.getenv('XDG_RUNTIME_DIR')
  if x and x ~= '' then return x .. '/dslua' end
  return '/tmp/dslua-' .. string.format('%d', A.uid())
end

function M.socket_path(dir, name, rank) return string.format('%s/%s.r%d.sock', dir, name, rank) end

-- Whether a job serves the socket at path; one that no job serves (its job
-- was killed) is removed.
function M.serving(path)
  local ok, c = pcall(A.dial, path)
  if ok then
    c:close()
    return true
  end
  if tostring(c):find('no longer running', 1, true) then os.remove(path) end
  return false
end

-- The job's name and socket (nil before serve, or when it could not serve).
function M.job() return job, socket end

---------------------------------------------------------------- what a client sees

local function session()
  if not session_of then error('the engine is gone (destroyed, or training has ended)', 0) end
  return session_of
end

local function engine() return session().engine end

local function lrs()
  local l = engine():get_lr()
  return #l == 1 and l[1] or l
end

local function memory()
  local st = ds.memory_stats()
  local m = { allocated_mib = st.current.total / 2^20, peak_mib = st.peak.total / 2^20 }
  if ds.cuda and ds.cuda.is_available() then m.cuda = ds.cuda.memory_info() end
  return m
end

local function schedule()
  local s = engine().lr_scheduler
  if not s then return nil end
  local params = {}
  for k, v in pairs(s.params or {}) do params[k] = v end
  return { kind = s.kind, path = s.path, params = params, step = s.last_batch_iteration + 1, pinned_lr = s.pinned }
end

-- Names whose value is read when used: `loss` is the latest loss.
local live = {
  engine = engine,
  loss = function() return engine().last_loss end,
  lr = lrs,
  step = function() return engine().global_steps end,
  step_time = function() return session().step_time end,
  memory = memory,
  schedule = schedule,
  rank = function() return ds.comm.rank() end,
  world_size = function() return ds.comm.world_size() end,
  paused = function() return session().paused end,
  job = function() return job end,
}

-- An action for every rank, answered when it is done.
local function act(msg)
  if not current then error('this only works in code sent by `dslua attach`', 2) end
  require('dslua.live.reload').serialize(msg)      -- what cannot travel fails here, in the client's code
  last_msg = last_msg + 1
  msg.req = last_msg
  pending[last_msg] = current
  current.waiting = current.waiting + 1
  session():queue(msg)
end

-- A line of the reply (print in the client's code goes here too).
local function say(line)
  local out = current and current.out or M.printed
  out[#out + 1] = line
end

local HELP = [==[
values, read when used: loss, lr, step, step_time (s), memory, schedule, paused, rank, world_size, engine, job
status()                 one line: step, loss, lr, step time, memory
set_lr(x)                every group's lr, on every rank from the next step (set_lr(nil): the schedule again)
set_schedule{k = v}      change the schedule's params, on every rank
save([dir [, tag]])      every rank calls engine:save_checkpoint(dir or 'checkpoints', tag)
pause([seconds])         every rank waits at the step boundary (at most seconds); resume() goes on
all(code)                run code on every rank at the step boundary (compiled everywhere first)
versions()               the reloadable files running, with their SHA-256 and the step they came in
anything else runs on this rank only, at the step boundary; Ctrl-D detaches (the job goes on)]==]

local helpers = {
  help = function() say(HELP) end,
  status = function()
    local e, s = engine(), session()
    local m = memory()
    local l = e:get_lr()
    say(string.format('step %d | loss %s | lr %s | step time %s | memory %.1f MiB (peak %.1f MiB) | %s',
                        e.global_steps, e.last_loss and string.format('%.4f', e.last_loss) or '-',
                        table.concat(l, ', '), s.step_time and string.format('%.1f ms', s.step_time * 1000) or '-',
                        m.allocated_mib, m.peak_mib, s.paused and 'paused' or 'running'))
  end,
  set_lr = function(x) act { type = 'set_lr', lr = x } end,
  set_schedule = function(t)
    if type(t) ~= 'table' then error('set_schedule: expected a table of params, got ' .. type(t), 2) end
    act { type = 'set_schedule', params = t }
  end,
  save = function(dir, tag) act { type = 'save', dir = dir or 'checkpoints', tag = tag } end,
  pause = function(seconds) act { type = 'pause', seconds = seconds } end,
  resume = function() act { type = 'resume' } end,
  all = function(code)
    if type(code) ~= 'string' then error('all: expected the code as a string, got ' .. type(code), 2) end
    act { type = 'run', code = code }
  end,
  versions = function() return require('dslua.live.reload').versions() end,
}

-- The environment of a client's code: its own globals first, then the live
-- values and helpers, then the job's globals. print writes to the reply.
local function environment(with_helpers)
  local env = {}
  env.print = function(...)
    local parts = {}
    for i = 1, select('#', ...) do parts[i] = tostring((select(i, ...))) end
    say(table.concat(parts, '\t'))
  end
  return setmetatable(env, { __index = function(_, k)
    if live[k] then return live[k]() end
    if with_helpers and helpers[k] then return helpers[k] end
    return _G[k]
  end })
end

-- A value as the REPL shows it, plain tables nested two levels deep.
local function show(v, depth)
  depth = depth or 0
  if type(v) ~= 'table' or getmetatable(v) or depth >= 2 then return repl.show(v) end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  local n = #v
  local list = n > 0 and next(v, n) == nil
  table.sort(keys, function(a, b)
    if type(a) == type(b) and (type(a) == 'number' or type(a) == 'string') then return a < b end
    return type(a) < type(b)
  end)
  local parts = {}
  for i, k in ipairs(keys) do
    if i > 40 then parts[#parts + 1] = '...' break end
    local x = show(v[k], depth + 1)
    if list then
      parts[#parts + 1] = x
    else
      parts[#parts + 1] = (type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or '[' .. repl.show(k) .. ']')
                          .. ' = ' .. x
    end
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end

-- Runs code in env under guard's time budget (a C traceback handler: the
-- budget's hook runs in Lua code only): the lines it printed and its
-- results shown, and whether it ran without error.
local function run(fn, env, out)
  setfenv(fn, env)
  local res = { n = 0 }
  local function collect(_, ok, ...)
    res.n = select('#', ...)
    for i = 1, res.n do res[i] = (select(i, ...)) end
    return ok
  end
  local ok = collect(guard.pcall('code from `dslua attach`', xpcall, fn, debug.traceback))
  if not ok then
    out[#out + 1] = (tostring(res[1]):gsub('\n%s*%[C%]: in function \'xpcall\'.*$', ''))
    if tostring(res[1]):find('ran past its time budget', 1, true) then
      io.stderr:write(string.format('[rank %d] attach: code stopped: %s\n', ds.comm.rank(),
                                    tostring(res[1]):match('^[^\n]*')))
    end
    return false
  end
  for i = 1, res.n do out[#out + 1] = show(res[i]) end
  return true
end

---------------------------------------------------------------- requests

local function send(client, status, id, text)
  server:reply(client, status .. ' ' .. id .. '\n' .. text)
end

local function finish(req)
  send(req.client, req.ok and 'ok' or 'error', req.id, table.concat(req.out, '\n'))
end

local function banner(s)
  local e = s and s.engine
  return string.format('%s rank %d of %d, step %s%s', job, ds.comm.rank(), ds.comm.world_size(),
                       e and tostring(e.global_steps) or '-', s and s.paused and ', paused' or '')
end

local function handle(client, text)
  if client == 0 then                    -- the server's notice: a refused peer
    io.stderr:write(string.format('[rank %d] %s\n', ds.comm.rank(), text))
    return
  end
  if text == nil then                    -- the client detached
    envs[client] = nil
    return
  end
  local verb, id, body = text:match('^(%a+) (%d+)\n(.*)$')
  if verb == 'hello' then return send(client, 'ok', id, banner(session_of)) end
  if verb ~= 'eval' then return send(client, 'error', id or '0', 'attach: malformed request') end
  local fn, err = guard.load('return ' .. body, '=attach')
  if not fn then fn, err = guard.load(body, '=attach') end
  if not fn then return send(client, 'error', id, err) end
  envs[client] = envs[client] or environment(true)
  local req = { client = client, id = id, out = {}, waiting = 0, ok = true }
  current = req
  req.ok = run(fn, envs[client], req.out)
  current = nil
  if req.waiting == 0 then finish(req) end
end

-- serve(session): the session's requests come from this process's socket
-- (started on the first call: every rank calls it in ds.initialize).
function M.serve(s)
  session_of = s
  if server or failed then
    s.server = server ~= nil
    return
  end
  local pid = A.pid()
  if s.world_size > 1 then pid = ds.comm.broadcast(ds.tensor({ pid }, 'f64'), 0, { log_name = 'reload' }):item() end
  local script = (type(arg) == 'table' and type(arg[0]) == 'string' and arg[0] or 'dslua'):match('([^/]*)$')
  script = script:gsub('%.lua$', ''):gsub('[^%w_.-]', '_'):sub(1, 40)
  job = string.format('%s-%d', script ~= '' and script or 'dslua', pid)
  local dir = M.dir()
  local ok, err = A.check_dir(dir, true)
  if ok then
    -- the sockets of jobs killed before they could remove them, <job>-<pid of rank 0>.r<rank>.sock:
    -- that pid gone here (rank 0 may run on another host: and nothing listening)
    for _, path in ipairs(glob(dir .. '/*.r*.sock')) do
      local pid = tonumber(path:match('%-(%d+)%.r%d+%.sock$'))
      if pid and pid > 0 and not A.alive(pid) then M.serving(path) end
    end
    socket = M.socket_path(dir, job, s.rank)
    ok, err = pcall(A.listen, socket)
    if ok then server = err end
  end
  if not ok then
    failed = err
    io.stderr:write(string.format('[rank %d] %s: not serving `dslua attach`\n', s.rank, tostring(err)))
    return
  end
  s.server = true
  -- on stderr: a notice, not training output (piped logs stay as they were)
  if s.rank == 0 then io.stderr:write(string.format('attach: dslua attach %s  (%s)\n', job, socket)) end
end

-- take(): every request queued now.
function M.take()
  while true do
    local client, text = server:next(0)
    if not client then return end
    handle(client, text)
  end
end

-- wait(seconds): the next request, waiting up to seconds (paused).
function M.wait(seconds)
  local client, text = server:next(seconds)
  if client then handle(client, text) end
end

-- done(id, text, ok): a message of this rank's request is done.
function M.done(id, text, ok)
  local req = pending[id]
  if not req then return end
  pending[id] = nil
  if text ~= '' then req.out[#req.out + 1] = text end
  if not ok then req.ok = false end
  req.waiting = req.waiting - 1
  if req.waiting == 0 then finish(req) end
end

-- run_everywhere(fn): all(code) on this rank: its output.
function M.run_everywhere(fn)
  local out = {}
  M.printed = out
  local ok = run(fn, environment(false), out)
  M.printed = nil
  local text = table.concat(out, '\n')
  if not ok then return 'error: ' .. text end
  return text ~= '' and text or '(done)'
end

function M.forget(s)
  if session_of == s then session_of = nil end
end

return M
