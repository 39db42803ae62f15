-- The reload and hooks blocks' checkers (dslua's own blocks; live/reload.lua
-- runs them): live reload of Lua code and the `dslua attach` socket.
local json = require 'dslua.base.json'
local S = require 'dslua.base.schema'
local describe, join, unknown, problem = S.describe, S.join, S.unknown, S.problem
local bool, int, num, block, is_object = S.bool, S.int, S.num, S.block, S.is_object
local sorted_keys, lua_file = S.sorted_keys, S.lua_file

local M = {}

--   "reload": {
--     enabled   true: the files the config names (a "lua" scheduler's
--               path, a sampler policy file, the hooks file) and modules
--               loaded with ds.reload.require reload when they change
--     every     1: rank 0 looks at them (and attach requests are taken)
--               every this many global steps
--     attach    true: the job serves `dslua attach` on a Unix socket
--     budget    5: seconds a reloaded file's loading and checks, a Lua
--               schedule's get_lr and attach input may run (dslua/base/guard.lua)
--   }
--   "hooks": the path of a Lua file returning {on_step =, on_log =,
--            on_eval =, on_save =} (tried as given, then next to the config
--            file; it reloads), or, in a Lua config, that table itself

M.hook_names = { 'on_step', 'on_log', 'on_eval', 'on_save' }

M.reload = block({ fields = { enabled = bool(true), every = int(1, 1), attach = bool(true),
                              budget = num(5, nil, { above = 0, max = 86400,
                                                     range_msg = 'must be a number of seconds > 0 and <= 86400' }) } })

local function check_hooks(ctx, path, v)
  if v == json.null then return nil end
  if type(v) == 'string' then
    return lua_file(ctx, path, v, 'hooks')
  end
  if not is_object(v) then
    return problem(ctx, path, 'must be the path of a Lua file or a table of hook functions, got ' .. describe(v))
  end
  local known, ok = {}, true
  for _, n in ipairs(M.hook_names) do known[n] = true end
  for _, k in ipairs(sorted_keys(v)) do
    if not known[k] then
      problem(ctx, join(path, tostring(k)), unknown(k, M.hook_names, 'hook'))
      ok = false
    elseif type(v[k]) ~= 'function' then
      problem(ctx, join(path, k), 'must be a function, got ' .. describe(v[k]))
      ok = false
    end
  end
  return ok and v or nil
end

M.check_hooks = check_hooks

return M
