-- `dslua attach [JOB] [--rank R] [-e CODE] [--list]`: the client of a
-- running job's attach socket (dslua/live/attach.lua is the job's side).
--
-- JOB is a job's name (train-12345: the script and rank 0's pid), its pid,
-- the start of its name, or a socket's path; without it, the one job
-- running. Inputs run in the job at its next step boundary; the REPL reads
-- until Ctrl-D, which detaches and leaves the job running.
local A = require('dslua.core')._attach
local glob = require('dslua.core').data_core.glob
local server_side = require 'dslua.live.attach'

local M = {}

local conn, last_id = nil, 0
local USAGE = 'usage: dslua attach [JOB] [--rank R] [-e CODE] [--list]'

-- The jobs with a socket for rank in dir: {name, path}, by name. Sockets
-- of jobs that ended without removing them (killed) are removed.
function M.jobs(dir, rank)
  local out = {}
  for _, path in ipairs(glob(dir .. '/*.r' .. rank .. '.sock')) do
    if server_side.serving(path) then out[#out + 1] = { name = path:match('([^/]+)%.r%d+%.sock$'), path = path } end
  end
  return out
end

local function names(jobs)
  local n = {}
  for i, j in ipairs(jobs) do n[i] = j.name end
  return table.concat(n, ', ')
end

-- The socket of spec (nil: the only job) for rank, or nil and why.
local function resolve(spec, rank)
  if spec and (spec:find('/', 1, true) or spec:match('%.sock$')) then return spec end
  local dir = server_side.dir()
  local jobs = M.jobs(dir, rank)
  if spec == nil then
    if #jobs == 1 then return jobs[1].path end
    if #jobs == 0 then return nil, string.format('no running job serves rank %d under %s', rank, dir) end
    return nil, 'several jobs are running (' .. names(jobs) .. '): name one'
  end
  local found = {}
  for _, j in ipairs(jobs) do
    if j.name == spec then return j.path end
    if j.name:match('%-(%d+)$') == spec or j.name:sub(1, #spec) == spec then found[#found + 1] = j end
  end
  if #found == 1 then return found[1].path end
  if #found == 0 then
    return nil, string.format("no running job '%s' serves rank %d under %s%s", spec, rank, dir,
                              #jobs > 0 and ' (running: ' .. names(jobs) .. ')' or '')
  end
  return nil, string.format("'%s' matches several jobs (%s)", spec, names(found))
end

-- One request and its reply: ok (boolean) and the text. Replies to
-- requests given up on (Ctrl-C) are skipped.
local function request(verb, body)
  last_id = last_id + 1
  conn:send(verb .. ' ' .. last_id .. '\n' .. body)
  while true do
    local reply = conn:recv(0.25)
    if reply then
      local status, id, text = reply:match('^(%a+) (%d+)\n(.*)$')
      if not status then return false, (reply:gsub('^error: ', '')) end     -- a refusal from the server
      if tonumber(id) == last_id then return status == 'ok', text end
    end
  end
end

local function show(ok, text)
  if text == '' then return end
  local out = ok and io.stdout or io.stderr
  out:write(text, '\n')
  out:flush()
end

-- main(args) -> exit status, or the prompt of the REPL to start.
function M.main(args)
  local spec, rank, code, list = nil, 0, nil, false
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '--rank' or a == '-e' then
      if not args[i + 1] then
        io.stderr:write('dslua attach: ', a, ' needs an argument\n', USAGE, '\n')
        return 1
      end
      if a == '-e' then
        code = args[i + 1]
      else
        rank = tonumber(args[i + 1])
        if not rank or rank < 0 or rank ~= math.floor(rank) then
          io.stderr:write('dslua attach: --rank needs a rank (an integer >= 0), got ', args[i + 1], '\n')
          return 1
        end
      end
      i = i + 1
    elseif a == '--list' then
      list = true
    elseif a == '-h' or a == '--help' then
      io.stdout:write(USAGE, '\n')
      return 0
    elseif a:sub(1, 1) == '-' or spec then
      io.stderr:write("dslua attach: unexpected '", a, "'\n", USAGE, '\n')
      return 1
    else
      spec = a
    end
    i = i + 1
  end
  if list then
    for _, j in ipairs(M.jobs(server_side.dir(), rank)) do io.stdout:write(j.name, '  ', j.path, '\n') end
    return 0
  end
  local path, why = resolve(spec, rank)
  if not path then
    io.stderr:write('dslua attach: ', why, '\n')
    return 1
  end
  local ok, c = pcall(A.dial, path)
  if not ok then
    io.stderr:write('dslua attach: ', tostring(c), '\n')
    return 1
  end
  conn = c
  local hello_ok, banner = request('hello', '')
  if not hello_ok then
    io.stderr:write('dslua attach: ', banner, '\n')
    return 1
  end
  local interactive = code == nil and require('dslua').isatty(0)
  if not interactive then
    if code == nil then code = io.stdin:read('*a') end
    local done, text = request('eval', code)
    show(done, text)
    conn:close()
    return done and 0 or 1
  end
  io.stdout:write('attached to ', banner, '; help() lists what you can do; Ctrl-D detaches, the job goes on\n')
  local name, r = banner:match('^(%S+) rank (%d+)')
  return string.format('%s[%s]> ', name, r)
end

-- The REPL's steps (core/cli/lua_repl.c): true when the input is incomplete.
function M.step(src)
  local fn, err = loadstring('return ' .. src)
  if not fn then fn, err = loadstring(src) end
  if not fn and err:match("<eof>'?$") then return true end
  show(request('eval', src))
  return false
end

local NAMES = { 'all', 'engine', 'help', 'job', 'loss', 'lr', 'memory', 'pause', 'paused', 'rank', 'resume', 'save',
                'schedule', 'set_lr', 'set_schedule', 'status', 'step', 'step_time', 'versions', 'world_size' }

function M.complete(text)
  local out = {}
  for _, n in ipairs(NAMES) do
    if n:sub(1, #text) == text then out[#out + 1] = n end
  end
  return out
end

function M.detach()
  if conn then conn:close() end
  conn = nil
  io.stdout:write('detached; the job goes on\n')
end

return M
