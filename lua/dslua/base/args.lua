-- ds.args: the script's command line as DeepSpeed reads it. --config and
-- --deepspeed_config (deepspeed.add_config_arguments) name the config file,
-- --local_rank (or --local-rank) comes from a launcher, --deepspeed is the
-- flag DeepSpeed scripts are run with; dslua adds --device (cpu, cuda,
-- cuda:N: the device ds.device() gives, over DSLUA_DEVICE); each as
-- `--x v` or `--x=v`. Everything else stays in ds.args.rest, in order (all
-- of it after `--`).
--
-- ds.args.config, .local_rank, .deepspeed, .device and .rest parse the global `arg`
-- on first use, so a bad command line raises where the script reads it.
-- ds.args.parse(list) parses any list of strings the same way.
local comm = require('dslua.core')._comm

local M = {}

local VALUED = { ['--config'] = 'config', ['--deepspeed_config'] = 'config',
                 ['--local_rank'] = 'local_rank', ['--local-rank'] = 'local_rank', ['--device'] = 'device' }
local EXPECTED = { config = 'a config file name', local_rank = 'a value', device = 'a device (cpu, cuda or cuda:N)' }

-- An option's value cannot look like another option (argparse's rule);
-- negative numbers are values.
local function is_option(s)
  return s:sub(1, 1) == '-' and #s > 1 and not tonumber(s)
end

-- parse({...}) -> {config =, local_rank =, deepspeed =, device =, rest = {...}}
-- local_rank falls back to ds.comm.local_rank() (core/tensor/ds_env.h: $LOCAL_RANK,
-- then Open MPI's local rank, then 0).
function M.parse(argv)
  local out = { rest = {}, deepspeed = false }
  local i, n = 1, #argv
  while i <= n do
    local a = argv[i]
    local name, inline = a:match('^(%-%-[%w_%-]+)=(.*)$')
    name = name or a
    local key = VALUED[name]
    if a == '--' then
      for k = i, n do out.rest[#out.rest + 1] = argv[k] end
      break
    elseif key then
      local v = inline
      if not v then
        v = argv[i + 1]
        if v == nil or is_option(v) then
          error(string.format('%s: expected %s', name, EXPECTED[key]), 0)
        end
        i = i + 1
      end
      if key == 'local_rank' then
        local r = tonumber(v)
        if not r or r ~= math.floor(r) or r < -1 then
          error(string.format("%s: expected an integer, got '%s'", name, v), 0)
        end
        v = r
      elseif v == '' then
        error(string.format('%s: expected %s', name, EXPECTED[key]), 0)
      end
      out[key] = v
    elseif a == '--deepspeed' then
      out.deepspeed = true
    else
      out.rest[#out.rest + 1] = a
    end
    i = i + 1
  end
  out.local_rank = out.local_rank or comm.local_rank()
  return out
end

local parsed
return setmetatable(M, { __index = function(_, k)
  if not parsed then
    local argv = {}
    for i = 1, #(arg or {}) do argv[i] = arg[i] end
    parsed = M.parse(argv)
  end
  return parsed[k]
end })
