-- dslua.base.guard: the user code that live reload and `dslua attach` run (a
-- reloaded file's chunk and checks, a Lua schedule's get_lr, attach input)
-- gets a time budget and no calls that block the job.
--
-- A loop is stopped by a count hook that compares the clock with a
-- deadline (core._reload.pcall_budget); hooks do not run inside
-- JIT-compiled traces, so guard.load compiles user code with the JIT off
-- for it (its own functions only: the library it calls keeps the JIT).
-- Calls that wait on the outside world (os.execute, io.popen, os.exit,
-- reading standard input) raise instead while user code runs. The budget
-- is the config's reload.budget (seconds, default 5).
local K = require('dslua.core')._reload

local M = { budget = 5 }

-- load(text, name) -> the chunk, with the JIT off for it and every
-- function it defines, or nil and the error (loadstring's).
function M.load(text, name)
  local fn, err = loadstring(text, name)
  if fn then jit.off(fn, true) end
  return fn, err
end

-- release(chunk): the JIT back for a loaded chunk's functions, once it has
-- run under the budget, when they run outside it (a module's, a policy's).
function M.release(chunk) jit.on(chunk, true) end

local whats = {}        -- what runs now, innermost last

local function refuse(name)
  return function()
    error(string.format('%s is not allowed in %s: code that live reload or `dslua attach` runs must not wait on '
                        .. 'the outside world (it would stop every rank)', name, whats[#whats]), 2)
  end
end

local stubs = {
  { os, 'execute', refuse('os.execute') }, { os, 'exit', refuse('os.exit') }, { io, 'popen', refuse('io.popen') },
  { io, 'read', refuse('io.read (standard input)') },
}
local io_lines = io.lines
stubs[#stubs + 1] = { io, 'lines', function(name, ...)
  if name == nil then refuse('io.lines() (standard input)')() end
  return io_lines(name, ...)
end }

local function swap(on)
  for _, s in ipairs(stubs) do
    local t, k, f = s[1], s[2], s[3]
    if on then s.saved, t[k] = t[k], f else t[k] = s.saved end
  end
end

local function leave(...)
  whats[#whats] = nil
  if #whats == 0 then swap(false) end
  return ...
end

-- pcall(what, fn, ...) -> pcall(fn, ...) under the budget; what names the
-- code in the errors of refused calls ('the schedule file s.lua').
function M.pcall(what, fn, ...)
  if #whats == 0 then swap(true) end
  whats[#whats + 1] = what
  return leave(K.pcall_budget(M.budget, fn, ...))
end

return M
