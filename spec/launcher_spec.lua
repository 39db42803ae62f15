-- dslua.parallel.launcher: hostfile and --include/--exclude parsing (DeepSpeed's rules
-- and its unit tests' cases), the mpirun command it builds, and end to end:
-- `dslua -n N`, a hostfile (one local host, and two hosts faked with an ssh
-- stand-in that runs everything here), plain mpirun, and a failing rank.
-- Every rank runs spec/launcher/env.lua, which writes its environment and
-- arguments to a file per rank.
local H = require 'helpers'
local L = require 'dslua.parallel.launcher'

local fails = H.fails_plain

-- hosts as DeepSpeed's dict: { ['worker-0'] = {0, 1, 2, 3} } in list order
local function as_map(hosts)
  local m, order = {}, {}
  for _, h in ipairs(hosts) do m[h.host] = h.slots; order[#order + 1] = h.host end
  return m, order
end

describe('hostfile parsing', function()
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)
  local function hostfile(name, text)
    H.write(dir .. '/' .. name, text)
    return dir .. '/' .. name
  end

  it('reads DeepSpeed hostfiles: comments, blank lines, text after slots', function()
    local path = hostfile('good', '# the cluster\n\nworker-0 slots=4\n  worker-1   slots=2 max_slots=8\r\n'
                                  .. '# worker-2 slots=9\n10.0.0.3 slots=16\n')
    local pool = L.parse_hostfile(path)
    assert.are.same({ { host = 'worker-0', slots = 4, line = 3 }, { host = 'worker-1', slots = 2, line = 4 },
                      { host = '10.0.0.3', slots = 16, line = 6 } }, pool)
  end)

  it('names the file and line of a duplicate host', function()
    local path = hostfile('dup', 'worker-0 slots=4\n# x\nworker-1 slots=4\nworker-0 slots=2\n')
    fails(path .. ':4: Hostfile contains multiple entries for worker-0 (the first on line 1), unable to proceed',
          L.parse_hostfile, path)
  end)

  it('names the file and line of a malformed line', function()
    for _, bad in ipairs({ 'worker-1 slot=4', 'worker-1', 'worker-1 slots=four', 'slots=4' }) do
      local path = hostfile('bad', 'worker-0 slots=4\n\n' .. bad .. '\n')
      fails(path .. ':3: Hostfile contains a bad entry: ' .. bad .. ', unable to proceed with launching',
            L.parse_hostfile, path)
    end
  end)

  it('rejects an empty hostfile and a missing one', function()
    local path = hostfile('empty', '# nothing\n\n')
    fails(path .. ': Hostfile is empty or not formatted correctly', L.parse_hostfile, path)
    fails('cannot read hostfile: ' .. dir .. '/absent: No such file or directory', L.parse_hostfile, dir .. '/absent')
  end)
end)

describe('--include / --exclude', function()
  local function host_info()
    return { { host = 'worker-0', slots = { 0, 1, 2, 3 } }, { host = 'worker-1', slots = { 0, 1, 2, 3 } } }
  end
  local filter = L.parse_resource_filter

  it('keeps everything without a filter', function()
    assert.are.same(host_info(), filter(host_info()))
    assert.are.same(host_info(), filter(host_info(), '', ''))
  end)

  it('includes and excludes slots and hosts as DeepSpeed does', function()
    assert.are.same({ 1, 2, 3 }, as_map(filter(host_info(), '', 'worker-1:0'))['worker-1'])
    assert.are.same({ 0, 1 }, as_map(filter(host_info(), 'worker-1:0,1'))['worker-1'])
    local m, order = as_map(filter(host_info(), 'worker-1'))
    assert.are.same({ 0, 1, 2, 3 }, m['worker-1'])
    assert.are.same({ 'worker-1' }, order)
    assert.are.same({ 0, 3 }, as_map(filter(host_info(), 'worker-1:0,3'))['worker-1'])
    m, order = as_map(filter(host_info(), '', 'worker-1'))
    assert.are.same({ 0, 1, 2, 3 }, m['worker-0'])
    assert.are.same({ 'worker-0' }, order)
    m = as_map(filter(host_info(), '', 'worker-0:0,1@worker-1:3'))
    assert.are.same({ 2, 3 }, m['worker-0'])
    assert.are.same({ 0, 1, 2 }, m['worker-1'])
  end)

  it('keeps the hostfile order and drops duplicate slots', function()
    local hosts = filter(host_info(), 'worker-1:2,2,0@worker-0')
    assert.are.same({ { host = 'worker-0', slots = { 0, 1, 2, 3 } }, { host = 'worker-1', slots = { 2, 0 } } }, hosts)
  end)

  it('builds slot lists from a pool', function()
    local hosts = L.parse_inclusion_exclusion({ { host = 'a', slots = 2 }, { host = 'b', slots = 3 } }, 'b:1,2@a', nil)
    assert.are.same({ { host = 'a', slots = { 0, 1 } }, { host = 'b', slots = { 1, 2 } } }, hosts)
  end)

  it('names what is wrong', function()
    fails('--include and --exclude are mutually exclusive', filter, host_info(), 'A', 'B')
    fails("--include: Hostname 'jeff' not found in hostfile", filter, host_info(), 'jeff')
    fails("--exclude: Hostname 'jeff' not found in hostfile", filter, host_info(), '', 'jeff')
    fails("--include: No slot '4' specified on host 'worker-1'", filter, host_info(), 'worker-1:4')
    fails("--exclude: No slot '4' specified on host 'worker-1'", filter, host_info(), '', 'worker-1:4')
    fails("--exclude: Hostname '5' not found in hostfile", filter, host_info(), '', 'worker-1@worker-0:1@5')
    fails("--include: slot 'x' on host 'worker-0' is not an integer", filter, host_info(), 'worker-0:1,x')
    fails("--include: slot '' on host 'worker-0' is not an integer", filter, host_info(), 'worker-0:')
    fails("--include: bad node spec 'worker-0:1:2'", filter, host_info(), 'worker-0:1:2')
    fails("--include: Hostname '' not found in hostfile", filter, host_info(), 'worker-0@')
  end)
end)

describe('the launcher command line', function()
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)
  local two = dir .. '/two'
  H.write(two, 'worker-0 slots=2\nworker-1 slots=4\n')
  local one = dir .. '/one'
  H.write(one, 'localhost slots=3\n')
  local function machine(over)
    local m = { exe = '/opt/dslua', mpirun = '/usr/bin/mpirun', uid = 1000, cores = 2, hostname = 'here',
                env = { DSLUA_COMM_TIMEOUT = '9', NCCL_DEBUG = 'INFO', HOME = '/root' }, deepspeed_env = { 'A=b c' } }
    for k, v in pairs(over or {}) do m[k] = v end
    return m
  end
  local function cmd(argv, m)
    local opts, at = L.parse_args(argv)
    local c, plan = L.command(opts, { unpack(argv, at) }, machine(m))
    return L.quote(c), plan
  end

  it('parses options as --x v and --x=v, and stops at the script', function()
    local opts, at = L.parse_args({ '-n', '2', '--master_port=1234', '--master_addr', 'h0', '--include=', 'train.lua',
                                    '-n', '5' })
    assert.are.same({ num_gpus = 2, master_port = 1234, master_addr = 'h0' }, opts)
    assert.are.equal(7, at)
    assert.are.same({ num_gpus = 3 }, (L.parse_args({ '--nproc_per_node', '3', 's.lua' })))
    assert.are.same({ num_gpus = 4 }, (L.parse_args({ '--num_gpus=4', 's.lua' })))
    assert.are.equal(4, select(2, L.parse_args({ '-n', '1', '--', '-odd-name.lua' })))
  end)

  it('rejects bad options', function()
    fails("-n: expected a positive integer, got 'x'", L.parse_args, { '-n', 'x', 's.lua' })
    fails("--num_nodes: expected a positive integer, got '0'", L.parse_args, { '--num_nodes', '0', 's.lua' })
    fails("--master_port: expected a port number (1-65535), got '70000'", L.parse_args, { '--master_port=70000', 's.lua' })
    fails("'--hostfile' needs an argument", L.parse_args, { '--hostfile' })
    fails("unknown launcher option '-e'", L.parse_args, { '-n', '2', '-e', 'x', 's.lua' })
    fails('the launcher needs a script to run', L.parse_args, { '-n', '2' })
  end)

  it('runs -n N here over shared memory, oversubscribed past the cores', function()
    local line, plan = cmd({ '-n', '2', 'train.lua', '--config', 'my ds.json' })
    assert.are.equal('/usr/bin/mpirun --bind-to none --mca btl self,vader --mca oob_tcp_if_include lo -np 2 '
                     .. "-x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 /opt/dslua train.lua --config 'my ds.json'", line)
    assert.are.equal(2, plan.ranks)
    assert.is_true(plan.all_local)
    line = cmd({ '-n', '3', '--master_port', '4000', 'train.lua' }, { uid = 0, scratch = '/dev/shm/dslua.x' })
    assert.are.equal('/usr/bin/mpirun --allow-run-as-root --bind-to none --mca btl self,vader --oversubscribe '
                     .. '--mca oob_tcp_if_include lo --mca orte_tmpdir_base /dev/shm/dslua.x --mca '
                     .. 'btl_vader_backing_directory /dev/shm/dslua.x -np 3 -x MASTER_ADDR=127.0.0.1 '
                     .. '-x MASTER_PORT=4000 /opt/dslua train.lua', line)
    assert.are.equal(1, cmd({ '--master_addr', 'x', 's.lua' }):match('%-np (%d+)') + 0)
  end)

  it('runs a one-host hostfile with its slots', function()
    local line = cmd({ '--hostfile', one, 's.lua' })
    assert.are.equal('/usr/bin/mpirun --bind-to none --mca btl self,vader --mca oob_tcp_if_include lo -np 3 '
                     .. '--host localhost:3 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 /opt/dslua s.lua', line)
    line = cmd({ '--hostfile', one, '--include', 'localhost:1,2', 's.lua' })
    assert.truthy(line:find('-np 2 --host localhost:2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 '
                            .. '-x CUDA_VISIBLE_DEVICES=1,2 /opt/dslua s.lua', 1, true), line)
  end)

  it('runs one app context per host of a hostfile, forwarding the environment', function()
    local line, plan = cmd({ '--hostfile', two, 'train.lua', 'x' })
    local ctx = '-x MASTER_ADDR=worker-0 -x MASTER_PORT=29500 -x DSLUA_COMM_TIMEOUT -x NCCL_DEBUG '
                .. "-x 'A=b c' /opt/dslua train.lua x"
    assert.are.equal('/usr/bin/mpirun --bind-to none -np 2 --host worker-0:2 ' .. ctx
                     .. ' : -np 4 --host worker-1:4 ' .. ctx, line)
    assert.are.equal(6, plan.ranks)
    line, plan = cmd({ '--hostfile', two, '--num_nodes', '1', '--master_addr', '10.1.1.1', 's.lua' })
    assert.are.same({ { host = 'worker-0', slots = { 0, 1 } } }, plan.hosts)
    assert.are.equal('10.1.1.1', plan.master_addr)
    assert.truthy(line:find('--mca btl self,vader -np 2 --host worker-0:2', 1, true), line)
    plan = select(2, cmd({ '--hostfile', two, '-n', '1', 's.lua' }))
    assert.are.same({ { host = 'worker-0', slots = { 0 } }, { host = 'worker-1', slots = { 0 } } }, plan.hosts)
    line, plan = cmd({ '--hostfile', two, '--exclude', 'worker-0@worker-1:0,2', 's.lua' })
    assert.are.same({ { host = 'worker-1', slots = { 1, 3 } } }, plan.hosts)
    assert.truthy(line:find('-x CUDA_VISIBLE_DEVICES=1,3 /opt/dslua s.lua', 1, true), line)
  end)

  it('refuses what DeepSpeed refuses', function()
    fails('Cannot specify num_nodes/gpus with include/exclude', cmd, { '-n', '2', '--include', 'localhost:0', 's.lua' })
    fails('Cannot specify num_nodes/gpus with include/exclude', cmd, { '--hostfile', two, '--num_nodes', '1',
                                                                      '--exclude', 'worker-0', 's.lua' })
    fails('Num nodes is >1 but no extra nodes available via hostfile', cmd, { '--num_nodes', '2', 's.lua' })
    fails('--num_nodes 3: only 2 hosts to run on in ' .. two, cmd, { '--hostfile', two, '--num_nodes', '3', 's.lua' })
    fails("--include: No slot '1' specified on host 'localhost'", cmd, { '--include', 'localhost:1', 's.lua' })
    fails('no host with slots left to run on', cmd, { '--exclude', 'localhost', 's.lua' })
    fails('no host with slots left to run on in ' .. two, cmd, { '--hostfile', two, '--exclude', 'worker-0@worker-1', 's.lua' })
  end)

  it('quotes the command for the shell', function()
    assert.are.equal("a 'b c' 'it'\\''s' '' x=1,2@h:3", L.quote({ 'a', 'b c', "it's", '', 'x=1,2@h:3' }))
  end)
end)

-- name=value lines of every rank's file, by rank
local function ranks(dir, n)
  local out = {}
  for r = 0, n - 1 do
    local f = io.open(dir .. '/rank.' .. r)
    assert.truthy(f, 'rank ' .. r .. ' wrote nothing')
    local t = {}
    for line in f:lines() do
      local k, v = line:match('^([^=]+)=(.*)$')
      t[k] = v
    end
    f:close()
    out[r] = t
  end
  return out
end

local SCRIPT = 'spec/launcher/env.lua'
-- the rank environment left to what the launcher and dslua set
local CLEAN = 'env -u DSLUA_NUM_THREADS -u OMP_NUM_THREADS -u MASTER_ADDR -u MASTER_PORT -u RANK -u CROSS_RANK '
              .. '-u CUDA_VISIBLE_DEVICES '

describe('launching ranks', function()
  if H.skip_without_mpirun() then return end
  local bin = H.bin()
  local cpus = tonumber((H.run('nproc')))

  for _, n in ipairs({ 2, 3 }) do
    it('runs -n ' .. n .. ' with every rank variable and --local_rank', function()
      local dir = H.tmpdir()
      local out, status = H.run(CLEAN .. bin .. ' -n ' .. n .. ' ' .. SCRIPT .. ' --out=' .. dir .. " 'two words' -- tail")
      assert.are.equal(0, status, out)
      assert.truthy(out:find('[launcher] cmd = ', 1, true), out)
      assert.truthy(out:find('-np ' .. n .. ' -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 ' .. bin .. ' ' .. SCRIPT,
                             1, true), out)
      local got = ranks(dir, n)
      for r = 0, n - 1 do
        assert.are.same({
          RANK = tostring(r), LOCAL_RANK = tostring(r), WORLD_SIZE = tostring(n), LOCAL_SIZE = tostring(n),
          CROSS_RANK = '0', CROSS_SIZE = '1', MASTER_ADDR = '127.0.0.1', MASTER_PORT = '29500',
          DSLUA_NUM_THREADS = tostring(math.max(1, math.floor(cpus / n))), CUDA_VISIBLE_DEVICES = '(unset)',
          DSLUA_SPEC_FORWARD = '(unset)',
          arg0 = SCRIPT, arg1 = '--out=' .. dir, arg2 = 'two words', arg3 = '--local_rank=' .. r, arg4 = '--', arg5 = 'tail',
        }, got[r])
      end
      os.execute('rm -rf ' .. dir)
    end)
  end

  it('passes --master_addr, --master_port and a thread count given', function()
    local dir = H.tmpdir()
    local out, status = H.run(CLEAN .. 'DSLUA_NUM_THREADS=3 ' .. bin .. ' --nproc_per_node=2 --master_addr 10.9.8.7 '
                              .. '--master_port=4321 ' .. SCRIPT .. ' --out=' .. dir)
    assert.are.equal(0, status, out)
    local got = ranks(dir, 2)
    for r = 0, 1 do
      assert.are.equal('10.9.8.7', got[r].MASTER_ADDR)
      assert.are.equal('4321', got[r].MASTER_PORT)
      assert.are.equal('3', got[r].DSLUA_NUM_THREADS)
    end
    os.execute('rm -rf ' .. dir)
  end)

  it('exits non-zero at once when a rank fails, naming it', function()
    local dir = H.tmpdir()
    local t0 = os.time()
    local out, status = H.run(CLEAN .. bin .. ' -n 3 ' .. SCRIPT .. ' --out=' .. dir .. ' --fail=1')
    assert.are_not.equal(0, status, out)
    assert.truthy(out:find('[rank 1] error: ' .. SCRIPT .. ':18: rank 1 fails on purpose', 1, true), out)
    assert.is_true(os.time() - t0 < 15, 'the job took ' .. (os.time() - t0) .. ' s')
    -- Open MPI's own account after the rank's line is left out
    assert.is_nil(out:find('mpirun detected that one or more processes exited', 1, true), out)
    assert.is_nil(out:find('Primary job', 1, true), out)
    assert.is_nil(out:find(string.rep('-', 20), 1, true), out)
    os.execute('rm -rf ' .. dir)
  end)

  it("keeps Open MPI's account of a rank killed by a signal, which dslua cannot tell", function()
    local dir = H.tmpdir()
    local out, status = H.run(CLEAN .. bin .. ' -n 2 ' .. SCRIPT .. ' --out=' .. dir .. ' --kill=1')
    assert.are_not.equal(0, status, out)
    H.has(out, 'mpirun noticed that process rank 1 with PID')
    H.has(out, 'exited on signal 9 (Killed)')
    os.execute('rm -rf ' .. dir)
  end)

  it('keeps a job on this machine off the network: mpirun listens on loopback only', function()
    local dir = H.tmpdir()
    local out, status = H.run(CLEAN .. bin .. ' -n 2 spec/launcher/job_files.lua --out=' .. dir)
    assert.are.equal(0, status, out)
    local got = ranks(dir, 2)
    assert.truthy(got[0].listening:find('%x'), 'no listening socket of mpirun found: ' .. got[0].listening)
    for addr in got[0].listening:gmatch('[^,]+') do
      -- 0100007F: 127.0.0.1; 00000000000000000000000001000000: ::1 (as /proc/net/tcp{,6} write them)
      assert.truthy(addr == '0100007F' or addr == '00000000000000000000000001000000',
                    'mpirun listens on ' .. addr .. ' (of ' .. got[0].listening .. ')')
    end
    os.execute('rm -rf ' .. dir)
  end)

  it("removes Open MPI's session directory and shared-memory segments however the job ends", function()
    for _, how in ipairs({ 'exit', 'group SIGTERM', 'launcher SIGTERM' }) do
      local dir = H.tmpdir()
      local hold = how ~= 'exit' and ' --hold' or ''
      -- its own session (setsid), so that a group signal reaches the launcher, mpirun and the ranks alone
      local line = 'setsid sh -c \'echo $$ > ' .. dir .. '/pid; exec ' .. CLEAN .. bin .. ' -n 2 '
                   .. 'spec/launcher/job_files.lua --out=' .. dir .. hold .. '\' > ' .. dir .. '/log 2>&1'
      if hold == '' then
        assert.are.equal(0, os.execute(line), how)
      else
        os.execute(line .. ' &')
        -- wait (a deadline, not a measurement) for both ranks to have written their files
        for _ = 1, 600 do
          if io.open(dir .. '/rank.0') and io.open(dir .. '/rank.1') then break end
          os.execute('sleep 0.1')
        end
        local pid = H.run('cat ' .. dir .. '/pid'):match('%d+')
        finally(function() os.execute('kill -KILL -' .. pid .. ' 2>/dev/null') end)
        os.execute('kill -TERM ' .. (how == 'group SIGTERM' and '-' or '') .. pid)
        for _ = 1, 600 do
          if os.execute('kill -0 ' .. pid .. ' 2>/dev/null') ~= 0 then break end
          os.execute('sleep 0.1')
        end
        assert.are_not.equal(0, os.execute('kill -0 ' .. pid .. ' 2>/dev/null'), how .. ': the launcher still runs')
      end
      local got = ranks(dir, 2)
      local scratch = got[0].scratch
      assert.truthy(scratch:match('^/dev/shm/dslua%.') or scratch:match('/dslua%.'), how .. ': ' .. scratch)
      assert.are.equal(scratch, got[0].session:sub(1, #scratch), how)
      assert.are.equal('2', got[0].segments, how)        -- each rank's segment, in the job's folder
      assert.is_nil(io.open(scratch), how .. ': ' .. scratch .. ' is left behind')
      os.execute('rm -rf ' .. dir)
    end
  end)

  -- mpirun sends SIGKILL a second after SIGTERM: on a loaded machine a rank
  -- may not have run its handler by then, so one rank's line is asked for,
  -- and a socket left is the next job's to remove
  it('stops the ranks with a line saying why when the launcher or mpirun is killed; no attach socket stays', function()
    local glob = require('dslua.core').data_core.glob
    local orphan            -- the scratch folder of the killed launcher: the next launcher removes it
    for _, how in ipairs({ 'launcher SIGKILL', 'mpirun SIGTERM', 'mpirun SIGKILL' }) do
      local dir = H.tmpdir()
      local sockets = dir .. '/sockets'
      -- its own session (setsid): every process of the job can be found, and killed at the end
      os.execute('setsid sh -c \'echo $$ > ' .. dir .. '/pid; exec ' .. CLEAN .. 'DSLUA_DEVICE=cpu DSLUA_ATTACH_DIR='
                 .. sockets .. ' ' .. bin .. ' -n 2 spec/launcher/hold_attach.lua --out=' .. dir .. '\' > ' .. dir
                 .. '/log 2>&1 &')
      -- wait (a deadline, not a measurement) for both ranks to serve attach
      for _ = 1, 600 do
        if io.open(dir .. '/ready.0') and io.open(dir .. '/ready.1') then break end
        os.execute('sleep 0.1')
      end
      local pid = H.run('cat ' .. dir .. '/pid'):match('%d+')
      finally(function() os.execute('pkill -KILL -s ' .. pid .. ' 2>/dev/null') end)
      assert.are.equal(2, #glob(sockets .. '/*.sock'), how)
      if orphan then
        assert.is_nil(io.open(orphan), orphan .. ' is left behind')
        orphan = nil
      end
      local mpirun = H.run('pgrep -x mpirun -P ' .. pid):match('%d+')   -- not the stderr filter
      os.execute(how == 'launcher SIGKILL' and 'kill -KILL ' .. pid or 'kill -' .. how:match('SIG(%u+)') .. ' ' .. mpirun)
      local left
      for _ = 1, 300 do
        left = H.run('pgrep -s ' .. pid)
        if left == '' then break end
        os.execute('sleep 0.1')
      end
      local log = H.run('cat ' .. dir .. '/log')
      assert.are.equal('', left, how .. ': processes of the job still run\n' .. log)
      if how == 'launcher SIGKILL' then
        assert.matches('%[rank %d%] stopped by SIGTERM from pid %d+ %(mpirun%): the launcher that started the job has '
                       .. 'ended', log)
        orphan = log:match('orte_tmpdir_base (%S+)')
        assert.truthy(orphan and orphan:match('/dslua%.' .. pid .. '%.'), log)
      elseif how == 'mpirun SIGTERM' then
        assert.matches('%[rank %d%] stopped by SIGTERM from pid ' .. mpirun .. ' %(mpirun%)\n', log)
      else
        H.has(log, 'dslua: mpirun was killed by signal 9 (Killed): the job ended there')
      end
      -- the next job to serve in that folder removes what a killed one left (a socket
      -- planted by a process that exits without removing it, too), and its own socket
      -- at a SIGTERM
      os.execute(bin .. [[ -e "local A = require('dslua.core')._attach; A.listen(']] .. sockets
                 .. [[/planted-' .. A.pid() .. '.r0.sock'); os.exit(0)"]])
      assert.are_not.same({}, glob(sockets .. '/planted-*.sock'), how)
      os.remove(dir .. '/ready.0')
      os.execute(CLEAN .. 'DSLUA_DEVICE=cpu DSLUA_ATTACH_DIR=' .. sockets .. ' timeout 60 ' .. bin
                 .. ' spec/launcher/hold_attach.lua --out=' .. dir .. ' >/dev/null 2>&1 & while [ ! -e ' .. dir
                 .. '/ready.0 ]; do sleep 0.1; done; kill %1; wait')
      assert.are.same({}, glob(sockets .. '/*.sock'), how)
      os.execute('rm -rf ' .. dir)
    end
  end)

  it('runs a hostfile naming this machine only', function()
    local dir = H.tmpdir()
    H.write(dir .. '/hosts', '# here\nlocalhost slots=3\n')
    local out, status = H.run(CLEAN .. bin .. ' --hostfile ' .. dir .. '/hosts --include localhost:0,2 '
                              .. SCRIPT .. ' --out=' .. dir)
    assert.are.equal(0, status, out)
    assert.truthy(out:find('--host localhost:2', 1, true), out)
    local got = ranks(dir, 2)
    for r = 0, 1 do
      assert.are.equal('2', got[r].WORLD_SIZE)
      assert.are.equal('0,2', got[r].CUDA_VISIBLE_DEVICES)
      assert.are.equal('--local_rank=' .. r, got[r].arg2)
    end
    os.execute('rm -rf ' .. dir)
  end)

  it('runs two hosts of a hostfile, each rank knowing its node', function()
    -- an ssh stand-in: mpirun starts its daemon for "nodeA" and "nodeB" here
    local dir = H.tmpdir()
    H.write(dir .. '/ssh', '#!/bin/sh\nwhile [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done\n'
                           .. 'shift\nexec sh -c "$*"\n')
    os.execute('chmod +x ' .. dir .. '/ssh')
    H.write(dir .. '/hosts', 'nodeA slots=2\nnodeB slots=4\n')
    -- two Open MPI daemons on one machine race writing hwloc's shared
    -- topology and orted itself can crash there (a segfault in
    -- hwloc_shmem_topology_write, before any rank starts): that stand-in
    -- artefact is retried; any other failure fails the spec. Their
    -- session directory is this spec file's own (H.mpi_env): under the
    -- shared temporary folder another job's could hold the same name
    local out, status
    for _ = 1, 3 do
      out, status = H.run(CLEAN .. H.mpi_env() .. 'OMPI_MCA_plm_rsh_agent=' .. dir .. '/ssh DSLUA_SPEC_FORWARD=yes ' .. bin
                          .. ' --hostfile ' .. dir .. '/hosts --include nodeA@nodeB:1 ' .. SCRIPT .. ' --out=' .. dir)
      if status == 0 or not out:find('hwloc_shmem_topology_write', 1, true) then break end
    end
    assert.are.equal(0, status, out)
    assert.truthy(out:find(' : -np 1 --host nodeB:1 ', 1, true), out)
    local got = ranks(dir, 3)
    local want = { { '0', '2', '0' }, { '1', '2', '0' }, { '0', '1', '1' } }     -- local rank, local size, node
    for r = 0, 2 do
      local w = want[r + 1]
      assert.are.same({ tostring(r), w[1], '3', w[2], w[3], '2', 'nodeA', '29500', '--local_rank=' .. w[1], 'yes' },
                      { got[r].RANK, got[r].LOCAL_RANK, got[r].WORLD_SIZE, got[r].LOCAL_SIZE, got[r].CROSS_RANK,
                        got[r].CROSS_SIZE, got[r].MASTER_ADDR, got[r].MASTER_PORT, got[r].arg2,
                        got[r].DSLUA_SPEC_FORWARD })
    end
    assert.are.equal('(unset)', got[0].CUDA_VISIBLE_DEVICES)
    assert.are.equal('1', got[2].CUDA_VISIBLE_DEVICES)
    os.execute('rm -rf ' .. dir)
  end)

  it('gives plain mpirun ranks the same environment and --local_rank', function()
    local dir = H.tmpdir()
    local out, status = H.run(CLEAN .. H.mpirun(2) .. ' ' .. bin .. ' ' .. SCRIPT .. ' --out=' .. dir)
    assert.are.equal(0, status, out)
    local got = ranks(dir, 2)
    for r = 0, 1 do
      assert.are.same({ tostring(r), tostring(r), '2', '2', '0', '1', '127.0.0.1', '29500', '--local_rank=' .. r },
                      { got[r].RANK, got[r].LOCAL_RANK, got[r].WORLD_SIZE, got[r].LOCAL_SIZE, got[r].CROSS_RANK,
                        got[r].CROSS_SIZE, got[r].MASTER_ADDR, got[r].MASTER_PORT, got[r].arg2 })
    end
    -- a --local_rank given is kept, not doubled
    out, status = H.run(CLEAN .. H.mpirun(1) .. ' ' .. bin .. ' ' .. SCRIPT .. ' --local_rank=7 --out=' .. dir)
    assert.are.equal(0, status, out)
    local one = ranks(dir, 1)[0]
    assert.are.equal('--local_rank=7', one.arg1)
    assert.is_nil(one.arg3)
    os.execute('rm -rf ' .. dir)
  end)

  it('reports usage errors in one line and exits 1', function()
    local dir = H.tmpdir()
    H.write(dir .. '/hosts', 'nodeA slots=2\nnodeA slots=2\n')
    for cmdline, msg in pairs({
      [' -n 2'] = 'dslua: the launcher needs a script to run',
      [' --hostfile ' .. dir .. '/hosts s.lua'] = 'dslua: ' .. dir .. '/hosts:2: Hostfile contains multiple entries for nodeA',
      [' -n 2 --exclude localhost s.lua'] = 'dslua: Cannot specify num_nodes/gpus with include/exclude',
      [" -e 'x = 1' -n 2 s.lua"] = "dslua: '-n' launches a script on ranks; it goes with no -e, -l, -i or --check-config",
    }) do
      local out, status = H.run(bin .. cmdline)
      assert.are.equal(1, status, out)
      assert.truthy(out:find(msg, 1, true), out)
      assert.is_nil(out:find('traceback', 1, true), out)
    end
    local out, status = H.run('PATH=/nonexistent ' .. bin .. ' -n 2 s.lua')
    assert.are.equal(1, status, out)
    assert.truthy(out:find('dslua: mpirun not found on PATH', 1, true), out)
    out, status = H.run('mpirun --allow-run-as-root -np 1 ' .. bin .. ' -n 2 ' .. SCRIPT)
    assert.are_not.equal(0, status, out)
    assert.truthy(out:find('launcher options given to rank 0 of 1, already started by mpirun', 1, true), out)
    out = H.run(bin .. ' --help')
    assert.truthy(out:find('--hostfile F', 1, true), out)
    os.execute('rm -rf ' .. dir)
  end)
end)
