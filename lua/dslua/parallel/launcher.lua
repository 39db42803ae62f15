-- dslua.parallel.launcher: `dslua [launcher options] script [args]` runs the script on
-- many ranks through Open MPI's mpirun, as the `deepspeed` launcher does.
--
--   dslua -n 2 train.lua --config ds.json          2 ranks on this machine
--   dslua --hostfile hosts train.lua ...           the hosts of a DeepSpeed hostfile
--
-- Options, each `--x v` or `--x=v`, with DeepSpeed's meanings:
--   -n, --num_gpus, --num_accelerators, --nproc_per_node N   ranks per host
--   --hostfile F       `host slots=N` lines, `#` comments, blank lines
--   --include S, --exclude S   NODE_SPEC[@NODE_SPEC ...], NODE_SPEC = host[:slot[,slot ...]]
--   --num_nodes N      the first N hosts
--   --master_addr A    (127.0.0.1 on this machine, else the first host)
--   --master_port P    (29500)
--
-- core/lua_main.c hands the arguments from the first launcher option on to
-- main(), and execs the command it returns: the launcher becomes mpirun, so
-- its exit status is mpirun's. Each rank's RANK, LOCAL_RANK, ... and its
-- --local_rank argument come from core/ds_rankenv.c and core/lua_main.c.
local file = require 'dslua.base.file'
local read = file.read

local M = {}

M.MASTER_PORT = 29500

local OPTIONS = {
  ['-n'] = 'num_gpus', ['--num_gpus'] = 'num_gpus', ['--num_accelerators'] = 'num_gpus',
  ['--nproc_per_node'] = 'num_gpus', ['--hostfile'] = 'hostfile', ['--include'] = 'include',
  ['--exclude'] = 'exclude', ['--num_nodes'] = 'num_nodes', ['--master_addr'] = 'master_addr',
  ['--master_port'] = 'master_port',
}

-- Variables the ranks on other hosts get from the launcher's environment
-- (local ranks inherit all of it), as DeepSpeed forwards NCCL*, UCX*, ...
local FORWARD = { 'DSLUA_', 'NCCL_', 'UCX_', 'OMP_', 'LUA_PATH', 'LUA_CPATH' }

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

-- every piece of s between separators, empty ones included (Python's split)
local function split(s, sep)
  local out, at = {}, 1
  while true do
    local k = s:find(sep, at, true)
    if not k then out[#out + 1] = s:sub(at); return out end
    out[#out + 1] = s:sub(at, k - 1)
    at = k + 1
  end
end

local function range(n)
  local out = {}
  for i = 1, n do out[i] = i - 1 end
  return out
end

local function contains(list, v)
  for _, x in ipairs(list) do if x == v then return true end end
  return false
end

---------------------------------------------------------------- hostfile

-- parse_hostfile(path) -> pool: { {host =, slots = N, line = n}, ... } in
-- file order. DeepSpeed's rules: a line is `host slots=N` (anything after
-- is ignored), `#` starts a comment line; a duplicate host, a malformed
-- line or no host at all is an error naming the file and line.
function M.parse_hostfile(path)
  local text, why = file.text(path)
  if not text then fail('cannot read hostfile: %s: %s', path, why) end
  return M.parse_hostfile_text(text, path)
end

function M.parse_hostfile_text(text, name)
  local pool, seen, n = {}, {}, 0
  for line in (text:gsub('\n$', '') .. '\n'):gmatch('([^\n]*)\n') do
    n = n + 1
    local s = line:match('^%s*(.-)%s*$')
    if s ~= '' and s:sub(1, 1) ~= '#' then
      local host, slots = s:match('^(%S+)%s+slots=(%d+)')
      if not host then
        fail('%s:%d: Hostfile contains a bad entry: %s, unable to proceed with launching (expected `host slots=N`)', name, n, s)
      end
      if seen[host] then
        fail('%s:%d: Hostfile contains multiple entries for %s (the first on line %d), unable to proceed with launching',
             name, n, host, seen[host])
      end
      seen[host] = n
      pool[#pool + 1] = { host = host, slots = tonumber(slots), line = n }
    end
  end
  if #pool == 0 then fail('%s: Hostfile is empty or not formatted correctly, unable to proceed with launching.', name) end
  return pool
end

---------------------------------------------------------------- include / exclude

-- parse_resource_filter(hosts, include, exclude) -> hosts, DeepSpeed's
-- function: hosts is { {host =, slots = {0, 1, ...}}, ... }; include keeps
-- only the named hosts (all their slots, or the listed ones), exclude drops
-- named hosts or slots. Duplicate slots and emptied hosts go; the order is
-- the hostfile's.
function M.parse_resource_filter(host_info, include_str, exclude_str)
  include_str, exclude_str = include_str or '', exclude_str or ''
  if include_str ~= '' and exclude_str ~= '' then fail('--include and --exclude are mutually exclusive') end
  if include_str == '' and exclude_str == '' then return host_info end
  local including = include_str ~= ''
  local flag = including and '--include' or '--exclude'
  local index, filtered = {}, {}
  for _, h in ipairs(host_info) do
    index[h.host] = h
    if not including then filtered[h.host] = { unpack(h.slots) } end
  end
  for _, node in ipairs(split(including and include_str or exclude_str, '@')) do
    local hostname, slot_str = node:match('^([^:]*):(.*)$')
    if hostname then
      if slot_str:find(':', 1, true) then fail("%s: bad node spec '%s' (expected host:slot,slot,...)", flag, node) end
      local slots = {}
      for _, s in ipairs(split(slot_str, ',')) do
        local v = tonumber(s:match('^%s*(%-?%d+)%s*$'))
        if not v then fail("%s: slot '%s' on host '%s' is not an integer", flag, s, hostname) end
        slots[#slots + 1] = v
      end
      if not index[hostname] then fail("%s: Hostname '%s' not found in hostfile", flag, hostname) end
      for _, slot in ipairs(slots) do
        if not contains(index[hostname].slots, slot) then
          fail("%s: No slot '%d' specified on host '%s'", flag, slot, hostname)
        end
      end
      if including then
        filtered[hostname] = slots
      else
        local keep = {}
        for _, s in ipairs(filtered[hostname]) do
          if not contains(slots, s) then keep[#keep + 1] = s end
        end
        filtered[hostname] = keep
      end
    else
      if not index[node] then fail("%s: Hostname '%s' not found in hostfile", flag, node) end
      filtered[node] = including and { unpack(index[node].slots) } or {}
    end
  end
  local out = {}
  for _, h in ipairs(host_info) do
    local slots = filtered[h.host]
    if slots then
      local unique = {}
      for _, s in ipairs(slots) do
        if not contains(unique, s) then unique[#unique + 1] = s end
      end
      if #unique > 0 then out[#out + 1] = { host = h.host, slots = unique } end
    end
  end
  return out
end

-- parse_inclusion_exclusion(pool, include, exclude) -> hosts with slot lists
function M.parse_inclusion_exclusion(pool, include, exclude)
  local hosts = {}
  for i, h in ipairs(pool) do hosts[i] = { host = h.host, slots = range(h.slots) } end
  return M.parse_resource_filter(hosts, include, exclude)
end

---------------------------------------------------------------- command line

local function positive(name, v)
  local n = tonumber(v)
  if not n or n ~= math.floor(n) or n < 1 then fail("%s: expected a positive integer, got '%s'", name, v) end
  return n
end

-- parse_args(list) -> opts, index of the script in list. Options come
-- before the script (as the deepspeed launcher takes them); `--` ends them.
-- Empty --include/--exclude/--master_addr mean unset, as DeepSpeed's "".
function M.parse_args(argv)
  local opts, i = {}, 1
  while i <= #argv do
    local a = argv[i]
    if a == '--' then i = i + 1; break end
    if a:sub(1, 1) ~= '-' or a == '-' then break end
    local name, v = a:match('^(%-%-?[%w_]+)=(.*)$')
    name = name or a
    local key = OPTIONS[name]
    if not key then
      fail("unknown launcher option '%s' (the launcher takes -n, --num_gpus, --nproc_per_node, --hostfile, "
           .. '--include, --exclude, --num_nodes, --master_addr, --master_port before the script)', a)
    end
    if v == nil then
      v = argv[i + 1]
      if v == nil then fail("'%s' needs an argument", name) end
      i = i + 1
    end
    if key == 'num_gpus' or key == 'num_nodes' then
      opts[key] = positive(name, v)
    elseif key == 'master_port' then
      local p = tonumber(v)
      if not p or p ~= math.floor(p) or p < 1 or p > 65535 then
        fail("%s: expected a port number (1-65535), got '%s'", name, v)
      end
      opts[key] = p
    elseif key == 'hostfile' then
      opts[key] = v
    else
      opts[key] = v ~= '' and v or nil
    end
    i = i + 1
  end
  if i > #argv then fail('the launcher needs a script to run, as in: dslua -n 2 train.lua --config ds.json') end
  return opts, i
end

-- This machine as the command needs it: the dslua binary, mpirun's path,
-- uid, physical cores this process may use (mpirun's slots), hostname,
-- environment, and the KEY=VALUE lines of ~/.deepspeed_env and ./.deepspeed_env.
function M.machine(exe)
  local m = { exe = exe, env = {}, deepspeed_env = {} }
  local status = read('/proc/self/status') or ''
  m.uid = tonumber(status:match('\nUid:%s*(%d+)'))
  local cores, cpus = {}, 0
  for piece in (status:match('\nCpus_allowed_list:%s*([%d,%-]+)') or ''):gmatch('[^,]+') do
    local lo, hi = piece:match('^(%d+)%-?(%d*)$')
    for c = tonumber(lo), tonumber(hi ~= '' and hi or lo) do
      cpus = cpus + 1
      local dir = '/sys/devices/system/cpu/cpu' .. c .. '/topology/'
      local core, pkg = read(dir .. 'core_id'), read(dir .. 'physical_package_id')
      cores[(pkg or '?') .. ':' .. (core or c)] = true
    end
  end
  local n = 0
  for _ in pairs(cores) do n = n + 1 end
  m.cores = math.max(1, n > 0 and n or cpus)
  m.hostname = (read('/proc/sys/kernel/hostname') or ''):match('^%s*(.-)%s*$')
  -- the names come from the environment this process started with, the
  -- values from the one it has now: dslua takes out again what it added
  -- for itself before its second start (core/tensor/ds_threads.c)
  for entry in (read('/proc/self/environ') or ''):gmatch('([^%z]+)') do
    local k = entry:match('^([^=]+)=')
    if k and os.getenv(k) then m.env[k] = os.getenv(k) end
  end
  local at = {}
  for _, path in ipairs({ (os.getenv('HOME') or '.') .. '/.deepspeed_env', './.deepspeed_env' }) do
    for line in (read(path) or ''):gmatch('[^\n]+') do
      local k, v = line:match('^%s*([^#=%s][^=]-)%s*=%s*(.-)%s*$')
      if k then
        at[k] = at[k] or #m.deepspeed_env + 1
        m.deepspeed_env[at[k]] = k .. '=' .. v
      end
    end
  end
  for dir in (os.getenv('PATH') or ''):gmatch('[^:]+') do
    if require('dslua.core').ckpt.exists(dir .. '/mpirun') then m.mpirun = dir .. '/mpirun'; break end
  end
  return m
end

local function is_local(host, m)
  return host == 'localhost' or host == '127.0.0.1' or host == '::1' or host == m.hostname
end

-- command(opts, script, machine) -> argv, plan. script: the script and its
-- arguments. plan: {ranks =, hosts = {{host =, slots = {...}}}, master_addr =,
-- master_port =}. One host: `mpirun -np N` (plus `--host h:N` from a
-- hostfile) over shared memory; several: one app context per host
-- (`-np 2 --host a:2 ... : -np 2 --host b:2 ...`), so each host gets its
-- own slot list and every rank can tell its node.
function M.command(opts, script, m)
  local pool = opts.hostfile and M.parse_hostfile(opts.hostfile) or { { host = 'localhost', slots = 1 } }
  if (opts.num_nodes or opts.num_gpus) and (opts.include or opts.exclude) then
    fail('Cannot specify num_nodes/gpus with include/exclude')
  end
  if not opts.hostfile and opts.num_nodes and opts.num_nodes > 1 then
    fail('Num nodes is >1 but no extra nodes available via hostfile')
  end
  local hosts = {}
  for _, h in ipairs(M.parse_inclusion_exclusion(pool, opts.include, opts.exclude)) do
    if #h.slots > 0 then hosts[#hosts + 1] = h end
  end
  if #hosts == 0 then fail('no host with slots left to run on%s', opts.hostfile and ' in ' .. opts.hostfile or '') end
  if opts.num_nodes then
    if opts.num_nodes > #hosts then
      fail('--num_nodes %d: only %d host%s to run on in %s', opts.num_nodes, #hosts, #hosts == 1 and '' or 's',
           opts.hostfile)
    end
    for k = #hosts, opts.num_nodes + 1, -1 do hosts[k] = nil end
  end
  local ranks, all_local = 0, true
  for _, h in ipairs(hosts) do
    if opts.num_gpus then h.slots = range(opts.num_gpus) end
    ranks = ranks + #h.slots
    all_local = all_local and is_local(h.host, m)
  end
  local plan = { ranks = ranks, hosts = hosts, master_port = opts.master_port or M.MASTER_PORT,
                 master_addr = opts.master_addr or (all_local and '127.0.0.1' or hosts[1].host), all_local = all_local }

  local cmd = { m.mpirun or 'mpirun' }
  local function add(...) for _, a in ipairs({ ... }) do cmd[#cmd + 1] = tostring(a) end end
  if m.uid == 0 then add('--allow-run-as-root') end
  -- mpirun binds each rank to one core by default: a rank's OpenMP threads
  -- (its share of the cores, core/comm/ds_rankenv.c) would all crowd onto
  -- it. Unbound, the kernel spreads them; `--map-by slot:PE=k` would pin
  -- k cores a rank but fails when ranks outnumber cores.
  add('--bind-to', 'none')
  if #hosts == 1 then add('--mca', 'btl', 'self,vader') end
  if not opts.hostfile and ranks > m.cores then add('--oversubscribe') end
  if all_local then
    -- nothing leaves this machine: the runtime's control traffic on
    -- loopback (the listener itself is moved there by the preloaded
    -- libdslua_loopback.so, core/cli/ds_loopback.c), and the session
    -- directory and shared-memory segments in the job's own scratch
    -- folder, which the launcher removes however the job ends
    add('--mca', 'oob_tcp_if_include', 'lo')
    if m.scratch then
      add('--mca', 'orte_tmpdir_base', m.scratch, '--mca', 'btl_vader_backing_directory', m.scratch)
    end
  end
  local exports = { 'MASTER_ADDR=' .. plan.master_addr, 'MASTER_PORT=' .. plan.master_port }
  if not all_local then
    local names = {}
    for k in pairs(m.env) do
      for _, prefix in ipairs(FORWARD) do
        if k:sub(1, #prefix) == prefix then names[#names + 1] = k; break end
      end
    end
    table.sort(names)
    for _, k in ipairs(names) do exports[#exports + 1] = k end
    for _, kv in ipairs(m.deepspeed_env) do exports[#exports + 1] = kv end
  end
  for k, h in ipairs(hosts) do
    if k > 1 then add(':') end
    add('-np', #h.slots)
    if opts.hostfile then add('--host', h.host .. ':' .. #h.slots) end
    for _, e in ipairs(exports) do add('-x', e) end
    -- a chosen subset of the slots (--include host:1,3): those devices only
    for i, s in ipairs(h.slots) do
      if s ~= i - 1 then add('-x', 'CUDA_VISIBLE_DEVICES=' .. table.concat(h.slots, ',')); break end
    end
    add(m.exe, unpack(script))
  end
  return cmd, plan
end

-- The command as a shell line (for the [launcher] line).
function M.quote(argv)
  local out = {}
  for i, a in ipairs(argv) do
    if a == '' or a:find("[^%w%-_./:=@,+%%]") then a = "'" .. a:gsub("'", "'\\''") .. "'" end
    out[i] = a
  end
  return table.concat(out, ' ')
end

-- main(argv, exe, scratch, loopback) -> the mpirun argv for
-- core/cli/lua_launch.c to run, and whether the job stays on this machine
-- (then mpirun runs with libdslua_loopback.so preloaded). argv: the dslua
-- arguments from the first launcher option on; exe: this binary; scratch:
-- a new folder for the job's Open MPI files (nil: none could be made);
-- loopback: whether libdslua_loopback.so is next to the binary.
function M.main(argv, exe, scratch, loopback)
  local size = os.getenv('OMPI_COMM_WORLD_SIZE')
  if size then
    fail('launcher options given to rank %s of %s, already started by mpirun: run `dslua -n N script` '
         .. 'or `mpirun -np N dslua script`, not both', os.getenv('OMPI_COMM_WORLD_RANK') or '?', size)
  end
  local opts, at = M.parse_args(argv)
  local m = M.machine(exe)
  if not m.mpirun then
    fail("mpirun not found on PATH: the launcher runs ranks with Open MPI's mpirun (Debian: openmpi-bin)")
  end
  m.scratch = scratch
  local cmd, plan = M.command(opts, { unpack(argv, at) }, m)
  io.stderr:write('[launcher] cmd = ', M.quote(cmd), '\n')
  if plan.all_local and not loopback then
    io.stderr:write("[launcher] warning: no libdslua_loopback.so next to the dslua binary: mpirun's control port "
                    .. 'listens on every interface\n')
  end
  io.stderr:flush()
  return cmd, plan.all_local
end

return M
