-- Live reload (dslua/live/reload.lua) and `dslua attach` (dslua/live/attach.lua,
-- core/io/ds_attach.c). Multi-rank cases run spec/reload/job.lua under
-- mpirun on 2 ranks: rank 0 of the job rewrites a watched file after a
-- given step itself, and the attach case pauses itself at a given step
-- before this spec talks to it, so every change lands at a known step.
local H = require 'helpers'
local ds = H.ds
local A = require('dslua.core')._attach

local bin = H.bin()

-- the job command on np ranks, the attach directory exported to the ranks
local function ranks_cmd(np, dir)
  return 'DSLUA_ATTACH_DIR=' .. dir .. ' '
    .. H.ranks_cmd(np):gsub(' %-np ', ' -x DSLUA_ATTACH_DIR -np ')
end

-- a fresh folder only this user may open, as attach wants its socket folder
local function private_dir()
  local dir = H.tmpdir()
  os.execute('chmod 700 ' .. dir)
  return dir
end

local function write_json(path, t)
  H.write(path, ds.json.encode(t))
  return path
end

local function read_json(path)
  local f = assert(io.open(path))
  local t = ds.json.decode(f:read('*a'))
  f:close()
  return t
end

local function mode_of(path)
  local p = io.popen('stat -c %a ' .. path)
  local m = p:read('*l')
  p:close()
  return m
end

-- Runs the job: each rank's JSON and the output.
local function job(dir, cfg, steps, edits)
  local cfg_path = write_json(dir .. '/ds.json', cfg)
  local lines = {}
  for _, e in ipairs(edits or {}) do lines[#lines + 1] = string.format('%d %s %s', e[1], e[2], e[3]) end
  local edits_path = H.write(dir .. '/edits.txt', table.concat(lines, '\n') .. '\n')
  local cmd = string.format('%s spec/reload/job.lua %s %s/out %d %s', ranks_cmd(2, dir), cfg_path, dir, steps,
                            edits_path)
  local out, status = H.run(cmd)
  assert(status == 0, string.format('exit status %s:\n%s', tostring(status), out))
  return { read_json(dir .. '/out.0.json'), read_json(dir .. '/out.1.json') }, out
end

local function events(history, path)
  local out = {}
  for _, ev in ipairs(history) do
    if ev.path == path then out[#out + 1] = ev end
  end
  return out
end

describe('live reload across ranks', function()
  if H.skip_without_mpirun() then return end

  it('swaps an edited schedule at the same step on both ranks, rejecting bad edits everywhere', function()
    local dir = H.tmpdir()
    local sched = dir .. '/schedule.lua'
    local v1 = 'local M = { state = { peak = 0.1 } }\nfunction M.get_lr(step) return M.state.peak end\nreturn M\n'
    H.write(sched, v1)
    local versions = {
      syntax = 'local M = { state = { peak = 0.1 } }\nfunction M.get_lr(step) return M.state.peak +\nreturn M\n',
      rank1 = "if require('dslua').comm.rank() == 1 then error('fails only on rank 1') end\n"
              .. 'return function() return 7 end\n',
      check = 'local M = { state = { peak = 3 } }\nfunction M.get_lr(step) return 9 end\n'
              .. "function M.check_reload() if require('dslua').comm.rank() == 1 then error('no, says rank 1') end end\n"
              .. 'return M\n',
      -- the running state is carried over: peak stays 0.1
      v2 = 'local M = { state = { peak = 999 } }\nfunction M.get_lr(step) return 2 * M.state.peak end\nreturn M\n',
      param = "local ds = require 'dslua'\nlocal M = { state = { w = ds.zeros(2):requires_grad_() } }\n"
              .. 'function M.get_lr(step) return 1 end\nreturn M\n',
      v3 = 'local M = {}\nfunction M.migrate_state(old) return { peak = old.peak * 5 } end\n'
           .. 'function M.get_lr(step) return M.state.peak end\nreturn M\n',
    }
    for name, text in pairs(versions) do H.write(dir .. '/' .. name .. '.lua', text) end
    local edits = { { 1, dir .. '/syntax.lua', sched }, { 3, dir .. '/rank1.lua', sched },
                    { 5, dir .. '/check.lua', sched }, { 6, dir .. '/v2.lua', sched },
                    { 8, dir .. '/param.lua', sched }, { 9, dir .. '/v3.lua', sched } }
    local ranks, out = job(dir, {
      train_micro_batch_size_per_gpu = 2, steps_per_print = 100,
      optimizer = { type = 'SGD', params = { lr = 1 } },
      scheduler = { type = 'lua', params = { path = sched } },
      reload = { attach = false },
    }, 12, edits)

    -- the optimizer's lr at each step, the same on both ranks
    local expect = { 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.5, 0.5 }
    for r = 1, 2 do H.assert_close(ranks[r].lrs, expect, { rtol = 1e-12, atol = 0 }, 'rank ' .. (r - 1) .. ' lrs') end

    -- every rank recorded the same events at the same steps
    for r = 1, 2 do
      local ev = events(ranks[r].history, sched)
      local got = {}
      for i, e in ipairs(ev) do got[i] = { e.status, e.step, e.rank } end
      assert.are.same({ { 'loaded', 0 }, { 'rejected', 2, 0 }, { 'rejected', 4, 1 }, { 'rejected', 6, 1 },
                        { 'swapped', 7 }, { 'rejected', 9, 0 }, { 'swapped', 10 } }, got)
      assert.are.equal(ds.reload.sha256(v1), ev[1].hash)
      assert.are.equal(ds.reload.sha256(versions.v2), ev[5].hash)
      assert.are.equal(ds.reload.sha256(versions.v3), ev[7].hash)
      H.has(ev[2].error, sched .. ':3:')
      H.has(ev[3].error, 'fails only on rank 1')
      H.has(ev[4].error, 'no, says rank 1')
      H.has(ev[6].error, 'holds a parameter (a tensor with requires_grad)')
      assert.are.same({ { path = sched, kind = 'schedule', hash = ev[7].hash, step = 10, status = 'swapped' } },
                      ranks[r].versions)
    end
    -- rank 0 says why, naming the rank that failed
    H.has(out, 'reload: ' .. sched .. ' rejected on rank 0: ' .. sched .. ':3:')
    H.has(out, 'reload: ' .. sched .. ' rejected on rank 1: ' .. sched .. ':1: fails only on rank 1')
    H.has(out, 'reload: ' .. sched .. ' rejected on rank 1: ' .. sched .. ':3: no, says rank 1')
    H.has(out, 'reload: ' .. sched .. ' swapped at step 7 (sha256 ' .. ds.reload.sha256(versions.v2):sub(1, 12))
    H.has(out, 'a module that owns parameters or optimizer state is not swapped')
    os.execute('rm -rf ' .. dir)
  end)

  it('stops schedule code that loops, blocks, raises or exits, and rolls back to the last good version everywhere',
     function()
    local dir = H.tmpdir()
    local sched = dir .. '/schedule.lua'
    H.write(sched, 'return function(step) return 0.1 end\n')
    local versions = {
      loop_load = 'while true do end\nreturn function() return 9 end\n',
      exec_load = "os.execute('sleep 100')\nreturn function() return 9 end\n",
      v2 = 'return function(step) return 0.2 end\n',
      raises = "return function(step)\n  if step >= 8 and require('dslua').comm.rank() == 1 then error('no lr past 7') end\n"
               .. '  return 0.3\nend\n',
      loops = 'return function(step)\n  while step >= 11 do end\n  return 0.4\nend\n',
      exits = 'return function(step)\n  if step >= 15 then os.exit(3) end\n  return 0.5\nend\n',
    }
    for name, text in pairs(versions) do H.write(dir .. '/' .. name .. '.lua', text) end
    local edits = { { 1, 'loop_load' }, { 3, 'exec_load' }, { 5, 'v2' }, { 6, 'raises' }, { 9, 'loops' },
                    { 12, 'exits' } }
    local lines = {}
    for i, e in ipairs(edits) do lines[i] = string.format('%d %s/%s.lua %s', e[1], dir, e[2], sched) end
    H.write(dir .. '/edits.txt', table.concat(lines, '\n') .. '\n')
    write_json(dir .. '/ds.json', {
      train_micro_batch_size_per_gpu = 2, steps_per_print = 100,
      optimizer = { type = 'SGD', params = { lr = 1 } },
      scheduler = { type = 'lua', params = { path = sched } },
      reload = { attach = false, every = 2, budget = 1 },
    })
    -- a schedule that hangs every rank must fail this spec, not hang it
    local out, status = H.run(string.format('timeout 120 env %s spec/reload/job.lua %s/ds.json %s/out 16 %s/edits.txt',
                                            ranks_cmd(2, dir), dir, dir, dir))
    assert.are.equal(0, status, out)
    -- the lr of each step: v1, v2 from step 7, each failing version's lrs
    -- until the step it failed at, then v2's again, the same on both ranks
    -- (a round every 2 steps, and at every step while a rollback may come)
    local expect = { 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.2, 0.2, 0.4, 0.2, 0.2, 0.2, 0.5, 0.2 }
    for r = 0, 1 do
      local res = read_json(dir .. '/out.' .. r .. '.json')
      H.assert_close(res.lrs, expect, { rtol = 1e-12, atol = 0 }, 'rank ' .. r .. ' lrs')
      local got = {}
      for i, e in ipairs(events(res.history, sched)) do got[i] = { e.status, e.step, e.rank } end
      assert.are.same({ { 'loaded', 0 }, { 'rejected', 2, 0 }, { 'rejected', 4, 0 }, { 'swapped', 6 }, { 'swapped', 7 },
                        { 'rolled back', 8, 1 }, { 'swapped', 10 }, { 'rolled back', 11, 0 }, { 'swapped', 14 },
                        { 'rolled back', 15, 0 } }, got)
      assert.are.same({ { path = sched, kind = 'schedule', hash = ds.reload.sha256(versions.v2), step = 15,
                          status = 'rolled back' } }, res.versions)
    end
    H.has(out, 'reload: ' .. sched .. ' rejected on rank 0: ran past its time budget of 1 s (reload.budget), stopped at '
               .. sched .. ':1')
    H.has(out, 'reload: ' .. sched .. ' rejected on rank 0: ' .. sched .. ':1: os.execute is not allowed in ' .. sched)
    H.has(out, 'reload: ' .. sched .. ' failed on rank 1: scheduler lua (' .. sched .. '): get_lr at step 8: '
               .. sched .. ':2: no lr past 7; rolled back to sha256 ' .. ds.reload.sha256(versions.v2):sub(1, 12))
    H.has(out, 'get_lr at step 11: ran past its time budget of 1 s (reload.budget), stopped at ' .. sched .. ':2')
    H.has(out, 'get_lr at step 15: ' .. sched .. ':2: os.exit is not allowed in scheduler lua')
    os.execute('rm -rf ' .. dir)
  end)

  it('swaps a sampler policy mid-epoch: the epoch goes on where it was, the state carries over', function()
    local dir = H.tmpdir()
    local policy = dir .. '/policy.lua'
    -- v1: rank r takes r, r + 2, ... in batches of 4 (5 steps of 20 samples)
    H.write(policy, 'local P = { state = { plans = 0 } }\nfunction P.plan(ctx)\n  P.state.plans = P.state.plans + 1\n'
                    .. '  local idx = {}\n  for i = ctx.rank, ctx.dataset_len - 1, ctx.world_size do idx[#idx + 1] = i end\n'
                    .. '  return { indices = idx, micro_batch = 4 }\nend\nreturn P\n')
    -- v2: the same samples backwards, in batches of 5; its own state (-100) is replaced by v1's
    H.write(dir .. '/v2.lua', 'local P = { state = { plans = -100 } }\nfunction P.plan(ctx)\n'
                              .. '  P.state.plans = P.state.plans + 1\n  local idx = {}\n'
                              .. '  for i = ctx.dataset_len - 2 + ctx.rank, 0, -ctx.world_size do idx[#idx + 1] = i end\n'
                              .. '  return { indices = idx, micro_batch = 5 }\nend\nreturn P\n')
    local ranks, out = job(dir, {
      steps_per_print = 100, optimizer = { type = 'SGD', params = { lr = 0.1 } },
      sampler = { policy = policy, micro_batch_per_rank = { 4, 4 } },
      reload = { attach = false },
    }, 9, { { 2, dir .. '/v2.lua', policy } })
    for r = 1, 2 do
      local rank, res = r - 1, ranks[r]
      local want = {}
      for i = rank, 39, 2 do want[#want + 1] = i end               -- epoch 0: v1's plan, to its end
      local back = {}
      for i = 38 + rank, 0, -2 do back[#back + 1] = i end           -- epoch 1: v2's plan
      local got0, got1 = {}, {}
      for _, s in ipairs(res.steps) do
        for _, i in ipairs(s.indices) do
          local list = s.epoch == 0 and got0 or got1
          list[#list + 1] = i
        end
      end
      assert.are.same(want, got0)
      assert.are.same(back, got1)
      assert.are.equal(9, #res.steps)                                -- 5 steps of 4, then 4 of 5
      assert.are.equal(5, #res.steps[6].indices)
      assert.are.same({ plans = 2 }, res.policy_state)              -- v1 planned epoch 0, v2 epoch 1
      local ev = events(res.history, policy)
      assert.are.same({ 'loaded', 'swapped' }, { ev[1].status, ev[2].status })
      assert.are.equal(3, ev[2].step)
    end
    H.has(out, 'reload: ' .. policy .. ' swapped at step 3')
    os.execute('rm -rf ' .. dir)
  end)

  it('attach: reads a paused job, changes the lr, requests a save and runs code on every rank', function()
    local dir = H.tmpdir()
    local sockets = dir .. '/sockets'
    H.write(dir .. '/schedule.lua', 'return function(step) return 0.1 end\n')
    H.write(dir .. '/hooks.lua', [[
local H = { state = { steps = {}, logs = {}, saves = {}, evals = 0 } }
function H.on_step(engine, info)
  H.state.steps[#H.state.steps + 1] = info.step
  if info.step == 3 then engine.reload:pause(120) end
end
function H.on_log(engine, info) H.state.logs[#H.state.logs + 1] = info.step end
function H.on_save(engine, dir, tag) H.state.saves[#H.state.saves + 1] = { dir = dir, tag = tag, step = engine.global_steps } end
function H.on_eval(engine) H.state.evals = H.state.evals + 1 end
return H
]])
    local cfg = write_json(dir .. '/ds.json', {
      train_micro_batch_size_per_gpu = 2, steps_per_print = 2,
      optimizer = { type = 'SGD', params = { lr = 1 } },
      scheduler = { type = 'lua', params = { path = dir .. '/schedule.lua' } },
      hooks = dir .. '/hooks.lua', reload = { budget = 1 },
    })
    local env = 'DSLUA_ATTACH_DIR=' .. sockets .. ' '
    local function attach(args) return H.run(env .. bin .. ' attach ' .. args) end
    local no_edits = H.write(dir .. '/edits.txt', '')
    local run = io.popen(string.format('%s spec/reload/job.lua %s %s/out 6 %s 2>&1', ranks_cmd(2, sockets), cfg, dir,
                                       no_edits))
    local ok, err = pcall(function()
      -- until the job has paused itself after step 3 (a request is answered at each step)
      local reply, status
      for _ = 1, 300 do
        reply, status = attach("-e 'return paused, step'")
        if status == 0 and reply == 'true\n3\n' then break end
        os.execute('sleep 0.1')
      end
      assert.are.equal('true\n3\n', reply)

      -- only the job's user: the directory 0700, the sockets 0600
      assert.are.equal('700', mode_of(sockets))
      local socks = require('dslua.core').data_core.glob(sockets .. '/*.sock')
      assert.are.equal(2, #socks)
      for _, s in ipairs(socks) do assert.are.equal('600', mode_of(s)) end
      local name = socks[1]:match('([^/]+)%.r0%.sock$')
      assert.matches('^job%-%d+$', name)

      -- another user's client refuses the job's directory (tests/test_attach.c
      -- checks that the kernel refuses a raw connect at the directory and the socket)
      local text, st
      if A.uid() == 0 and H.run('command -v setpriv') ~= '' then
        text, st = H.run('setpriv --reuid=65534 --regid=65534 --clear-groups env ' .. env .. bin .. ' attach '
                         .. socks[1] .. " -e 'return 1'")
        assert.are_not.equal(0, st)
        H.has(text, 'belongs to uid 0, not to this user (uid 65534)')
      end

      -- rank 1's own socket; the job by its name and by its pid
      assert.are.equal('1\n3\ntrue\n', (attach("--rank 1 -e 'return rank, step, paused'")))
      assert.are.equal('3\n', (attach(name .. " -e 'return step'")))
      assert.are.equal('3\n', (attach(name:match('(%d+)$') .. " -e 'return step'")))

      -- code that loops or blocks is stopped, named, and the job goes on
      text, st = attach("-e 'while true do end'")
      assert.are.equal(1, st)
      H.has(text, 'ran past its time budget of 1 s (reload.budget), stopped at attach:1')
      text, st = attach([[-e 'all("if rank == 1 then os.execute([=[sleep 100]=]) end")']])
      assert.are.equal(0, st, text)
      H.has(text, '[rank 1] error: all:1: os.execute is not allowed in code from `dslua attach`')
      assert.are.equal('3\n', (attach("-e 'return step'")))

      -- code on every rank: compiled everywhere first
      text, st = attach([[-e 'all("return rank * 10")']])
      assert.are.equal(0, st, text)
      assert.are.equal('[rank 0] 0\n[rank 1] 10\n', text)
      text, st = attach([[-e 'all("return +")']])
      assert.are.equal(1, st)
      H.has(text, 'run: rejected on rank 0: all:1:')

      -- the lr from the next step on, a save request, and on
      local ck = dir .. '/ck'
      text, st = attach([[-e 'set_lr(0.5); save("]] .. ck .. [[", "tag1"); resume()']])
      assert.are.equal(0, st, text)
      H.has(text, 'set_lr: lr 0.5 on every rank from step 4')
      H.has(text, 'save: save_checkpoint("' .. ck .. '", "tag1") requested at step 3')
      H.has(text, 'resume: every rank goes on from step 4')
    end)
    if not ok then attach("-e 'resume()'") end        -- let the job end before failing
    local out = run:read('*a')
    run:close()
    assert(ok, tostring(err) .. '\njob output:\n' .. out)
    H.has(out, 'reload: paused at step 3 for at most 120 s')
    H.has(out, 'reload: lr set to 0.5 at step 3 by attach')
    H.has(out, 'reload: resumed at step 3')
    H.has(out, '[rank 0] attach: code stopped: ran past its time budget of 1 s')
    for r = 0, 1 do
      local res = read_json(dir .. '/out.' .. r .. '.json')
      H.assert_close(res.lrs, { 0.1, 0.1, 0.1, 0.5, 0.5, 0.5 }, { rtol = 1e-12, atol = 0 }, 'rank ' .. r)
      assert.are.same({ { dir = dir .. '/ck', tag = 'tag1', step = 3 } }, res.hooks.saves)
      assert.are.same({ 1, 2, 3, 4, 5, 6 }, res.hooks.steps)
      assert.are.same({ 2, 4, 6 }, res.hooks.logs)
      assert.are.equal(1, res.hooks.evals)
    end
    assert.are.same({}, require('dslua.core').data_core.glob(sockets .. '/*.sock'))    -- removed at exit
    os.execute('rm -rf ' .. dir)
  end)
end)

describe('the attach socket', function()
  local dir
  before_each(function() dir = private_dir() end)
  after_each(function() os.execute('rm -rf ' .. dir) end)

  it('refuses a peer of another uid (SO_PEERCRED), telling both sides', function()
    local server = A.listen(dir .. '/s.sock', { uid = A.uid() + 4242 })     -- a job of another user, for the test
    local c = A.dial(dir .. '/s.sock')
    local reply = c:recv(5)
    assert.are.equal(string.format('error: attach: refused: the job runs as uid %d, this client as uid %d',
                                   A.uid() + 4242, A.uid()), reply)
    local client, notice = server:next(5)
    assert.are.equal(0, client)
    assert.matches('attach: refused a connection from uid %d+ %(pid %d+%): the job runs as uid %d+', notice)
    c:close()
    server:close()
  end)

  it('serves and dials only a directory of this user with no group or other bits, and a 0600 socket', function()
    local server = A.listen(dir .. '/s.sock')
    assert.are.equal('600', mode_of(dir .. '/s.sock'))
    os.execute('chmod 666 ' .. dir .. '/s.sock')
    H.has(H.err(A.dial, dir .. '/s.sock'), 's.sock has mode 0666: group or others may open it')
    server:close()
    os.execute('chmod 750 ' .. dir)
    H.has(H.err(A.listen, dir .. '/t.sock'), 'has mode 0750: group or others may open it (chmod 700 ')
    local ok, why = A.check_dir(dir)
    assert.is_nil(ok)
    H.has(why, 'mode 0750')
    os.execute('chmod 700 ' .. dir .. ' && chown 65534 ' .. dir)
    H.has(H.err(A.listen, dir .. '/t.sock'), 'belongs to uid 65534, not to this user')
    os.execute('chown 0 ' .. dir)
    assert.is_true(A.check_dir(dir .. '/new', true))
    assert.are.equal('700', mode_of(dir .. '/new'))
  end)

  it('queues requests from a thread and drops replies to clients that left', function()
    local server = A.listen(dir .. '/s.sock')
    local a, b = A.dial(dir .. '/s.sock'), A.dial(dir .. '/s.sock')
    a:send('one')
    b:send(string.rep('x', 200000))
    local got = {}
    for _ = 1, 2 do
      local client, text = server:next(5)
      got[text == 'one' and 'a' or 'b'] = client
    end
    assert.is_true(server:reply(got.b, 'to b'))
    assert.are.equal('to b', b:recv(5))
    a:close()
    local client, text = server:next(5)          -- a hung up
    assert.are.equal(got.a, client)
    assert.is_nil(text)
    assert.is_false(server:reply(got.a, 'too late'))
    assert.is_nil(b:recv(0.05))                   -- nothing more for b
    b:close()
    server:close()
  end)

  it('gives a new client the place of the one idle longest when 16 are attached', function()
    local server = A.listen(dir .. '/s.sock')
    local idle = {}
    for i = 1, 16 do
      idle[i] = A.dial(dir .. '/s.sock')
      os.execute('sleep 0.01')                   -- accepted in this order
    end
    idle[16]:send('busy 1')                      -- waits for its reply: not idle
    assert.are.equal('busy 1', select(2, server:next(5)))
    local owner = A.dial(dir .. '/s.sock')
    owner:send('hello 1')
    local client, text = server:next(5)          -- the oldest idle one was let go
    assert.is_nil(text)
    client, text = server:next(5)
    assert.are.equal('hello 1', text)
    assert.is_true(server:reply(client, 'ok 1'))
    assert.are.equal('ok 1', owner:recv(5))
    H.has(idle[1]:recv(5), 'error: attach: disconnected: a new client came and the job serves 16 at most; this one '
                           .. 'was idle longest')
    H.has(H.err(idle[1].recv, idle[1], 5), 'the job closed the connection')
    for _, c in ipairs(idle) do c:close() end
    owner:close()
    server:close()
  end)

  it('disconnects a client that leaves more than 16 MiB of replies unread, saying so', function()
    local server = A.listen(dir .. '/s.sock')
    local c = A.dial(dir .. '/s.sock')
    c:send('eval 1')
    local client = server:next(5)
    local mib, sent = string.rep('x', 2^20), 0
    while sent < 64 and server:reply(client, mib) do sent = sent + 1 end
    -- 15 frames of 1 MiB + 4 fill the 16 MiB when the job's thread has sent
    -- none yet (a loaded machine); what the socket took adds to that
    assert.is_true(sent >= 15 and sent < 64, 'replies queued: ' .. sent)
    local who, notice = server:next(5)
    assert.are.equal(0, who)
    H.has(notice, string.format('attach: client %d disconnected: ', client))
    H.has(notice, 'bytes of replies it has not read (at most 16777216)')
    assert.are.equal(client, (server:next(5)))   -- and the job forgets it
    c:close()
    server:close()
  end)
end)

describe('dslua attach', function()
  local dir
  local glob = require('dslua.core').data_core.glob
  before_each(function() dir = private_dir() end)
  after_each(function() os.execute('rm -rf ' .. dir) end)

  it('says what is wrong, lists the jobs, and clears the sockets of jobs that died', function()
    local cmd = 'DSLUA_ATTACH_DIR=' .. dir .. ' ' .. bin .. ' attach '
    local out, st = H.run(cmd .. "-e 'return 1'")
    assert.are.equal(1, st)
    H.has(out, 'dslua attach: no running job serves rank 0 under ' .. dir)
    out, st = H.run(cmd .. '--rank x')
    assert.are.equal(1, st)
    H.has(out, 'dslua attach: --rank needs a rank (an integer >= 0), got x')
    out = H.run(cmd .. 'a b')
    H.has(out, "dslua attach: unexpected 'b'")
    -- a job killed before it could remove its socket
    H.run(bin .. " -e \"require('dslua.core')._attach.listen('" .. dir .. "/dead-1.r0.sock'); os.exit(0)\"")
    assert.are.equal(1, #glob(dir .. '/*.sock'))
    local server = A.listen(dir .. '/live-7.r0.sock')
    out, st = H.run(cmd .. '--list')
    assert.are.equal(0, st)
    assert.are.equal('live-7  ' .. dir .. '/live-7.r0.sock\n', out)
    assert.are.same({ dir .. '/live-7.r0.sock' }, glob(dir .. '/*.sock'))
    out, st = H.run(cmd .. "nosuch -e 'return 1'")
    assert.are.equal(1, st)
    H.has(out, "no running job 'nosuch' serves rank 0 under " .. dir .. ' (running: live-7)')
    server:close()
  end)
end)

-- One rank in this process: the engine's boundary swaps files edited in place.
describe('live reload in one process', function()
  local dir
  local function put(path, text)             -- write and rename, as editors save
    H.write(path .. '.tmp', text)
    assert(os.rename(path .. '.tmp', path))
  end
  local function engine_with(cfg)
    ds.manual_seed(1)
    local model = require('models.mlp') { input_size = 4, hidden = { 8 }, num_classes = 2 }
    cfg.train_micro_batch_size_per_gpu = 2
    cfg.steps_per_print = cfg.steps_per_print or 1000
    cfg.optimizer = cfg.optimizer or { type = 'SGD', params = { lr = 0.1 } }
    cfg.reload = cfg.reload or { attach = false }
    local engine = ds.initialize { model = model, config = cfg }
    local x, y = ds.randn(2, 4), ds.tensor({ 0, 1 }, 'i64')
    return engine, function(n)
      for _ = 1, n or 1 do
        engine:backward(engine { x = x, y = y })
        engine:step()
      end
    end
  end
  before_each(function() dir = H.tmpdir() end)
  after_each(function() os.execute('rm -rf ' .. dir) end)

  it('reloads a module of ds.reload.require in place, its state carried', function()
    package.path = dir .. '/?.lua;' .. package.path
    put(dir .. '/reload_tbl.lua', 'local M = { state = { n = 1 } }\nfunction M.f() return "v1", M.state.n end\nreturn M\n')
    put(dir .. '/reload_fn.lua', 'return function() return "f1" end\n')
    local tbl, fn = ds.reload.require 'reload_tbl', ds.reload.require 'reload_fn'
    assert.are.equal(tbl, ds.reload.require 'reload_tbl')
    assert.are.equal(tbl, package.loaded.reload_tbl)
    tbl.state.n = 5
    local engine, step = engine_with {}
    put(dir .. '/reload_tbl.lua', 'local M = { state = { n = 0 } }\nfunction M.f() return "v2", M.state.n end\n'
                                  .. 'function M.g() return "new" end\nreturn M\n')
    put(dir .. '/reload_fn.lua', 'return function() return "f2!" end\n')
    step()
    assert.are.same({ 'v2', 5 }, { tbl.f() })
    assert.are.equal('new', tbl.g())
    assert.are.equal('f2!', fn())
    -- a new version that returns another kind of value is refused
    put(dir .. '/reload_fn.lua', 'return { }\n')
    step()
    assert.are.equal('f2!', fn())
    local last = ds.reload.history()[#ds.reload.history()]
    assert.are.equal('rejected', last.status)
    H.has(last.error, 'returned a table, the running version a function')
    engine:destroy()
    ds.reload.unwatch('reload_tbl')
    ds.reload.unwatch('reload_fn')
  end)

  -- in a process of its own, under `timeout`: a budget that stops nothing fails the spec, not hangs it
  it('stops a module or sampler policy whose new version loops while it loads, in a function of its own too', function()
    local child = H.write(dir .. '/child.lua', [=[
local ds = require 'dslua'
local dir = arg[1]
local function put(path, text)
  local f = assert(io.open(path .. '.tmp', 'w'))
  f:write(text)
  f:close()
  assert(os.rename(path .. '.tmp', path))
end
package.path = dir .. '/?.lua;' .. package.path
local spin = 'local function spin(n) while n > 0 do n = n + 1 end end\nspin(1)\n'
local policy = 'local P = {}\nfunction P.plan(ctx)\n  local idx = {}\n'
               .. '  for i = 0, ctx.dataset_len - 1 do idx[#idx + 1] = i end\n'
               .. '  return { indices = idx, micro_batch = 2 }\nend\nreturn P\n'
put(dir .. '/reload_spin.lua', 'return { v = 1 }\n')
put(dir .. '/policy.lua', policy)
local mod = ds.reload.require 'reload_spin'
local model = require('models.mlp') { input_size = 4, hidden = { 8 }, num_classes = 2 }
local engine, _, loader = ds.initialize {
  model = model, training_data = ds.data.tensors { x = ds.randn(8, 4), y = ds.zeros(8, 'i64') },
  config = { steps_per_print = 1000, optimizer = { type = 'SGD', params = { lr = 0.1 } },
             sampler = { policy = dir .. '/policy.lua', micro_batch_per_rank = { 2 } },
             reload = { attach = false, budget = 0.5 } } }
put(dir .. '/reload_spin.lua', spin .. 'return { v = 2 }\n')
put(dir .. '/policy.lua', spin .. policy)
for _, batch in loader:epoch(0) do
  engine:backward(engine(batch))
  engine:step()
  break
end
print('module v' .. mod.v)
for _, ev in ipairs(ds.reload.history()) do
  if ev.status == 'rejected' then print('rejected ' .. ev.path .. ': ' .. ev.error) end
end
]=])
    local out, status = H.run('timeout 60 ' .. bin .. ' ' .. child .. ' ' .. dir)
    assert.are.equal(0, status, out)
    H.has(out, 'module v1\n')
    for _, path in ipairs({ dir .. '/reload_spin.lua', dir .. '/policy.lua' }) do
      H.has(out, 'rejected ' .. path .. ': ran past its time budget of 0.5 s (reload.budget), stopped at ' .. path
                 .. ':1\n')
    end
  end)

  it('refuses modules that own parameters or optimizers', function()
    package.path = dir .. '/?.lua;' .. package.path
    put(dir .. '/reload_model.lua', "local ds = require 'dslua'\nlocal M = { net = ds.nn.Linear(2, 2) }\nreturn M\n")
    H.has(H.err(ds.reload.require, 'reload_model'), 'reload_model.lua.net holds a ds.nn module: a module that owns '
                                                    .. 'parameters or optimizer state is not swapped')
    put(dir .. '/reload_opt.lua', "local ds = require 'dslua'\nlocal w = ds.zeros(2):requires_grad_()\n"
                                  .. 'local opt = ds.optim.SGD({ w }, { lr = 1 })\nreturn function() return opt end\n')
    H.has(H.err(ds.reload.require, 'reload_opt'), 'holds an optimizer')
  end)

  it('reloads the hooks file and rejects unknown hook names', function()
    local hooks = dir .. '/hooks.lua'
    put(hooks, 'local H = { state = { n = 0 } }\nfunction H.on_step(e, info) H.state.n = H.state.n + 1 end\nreturn H\n')
    local engine, step = engine_with { hooks = hooks }
    step(2)
    put(hooks, 'local H = {}\nfunction H.on_stpe(e, info) end\nreturn H\n')
    step()
    local last = ds.reload.history()[#ds.reload.history()]
    assert.are.equal('rejected', last.status)
    H.has(last.error, "unknown hook 'on_stpe', did you mean 'on_step'?")
    put(hooks, 'local H = {}\nfunction H.on_step(e, info) H.state.n = H.state.n + 10 end\nreturn H\n')
    step(2)
    -- v1 ran at steps 1-4 (at a boundary the hooks run before the swap), v2 at step 5: the count carried
    assert.are.equal(4 + 10, engine.reload.hooks.state.n)
    engine:destroy()
  end)

  it('looks every `every` steps, and not at all when disabled', function()
    local sched = dir .. '/s.lua'
    put(sched, 'return function() return 0.1 end\n')
    local engine, step = engine_with { scheduler = { type = 'lua', params = { path = sched } },
                                       reload = { every = 3, attach = false } }
    step()
    put(sched, 'return function() return 0.25 end\n')
    step()
    assert.are.equal(0.1, engine:get_lr()[1])
    step()                                                   -- step 3: looked
    assert.are.equal(0.25, engine:get_lr()[1])
    engine:destroy()
    put(sched, 'return function() return 0.1 end\n')
    engine, step = engine_with { scheduler = { type = 'lua', params = { path = sched } },
                                 reload = { enabled = false, attach = false } }
    put(sched, 'return function() return 0.3 end\n')
    step(2)
    assert.are.equal(0.1, engine:get_lr()[1])
    engine:destroy()
  end)

  it('records versions for checkpoints and runs the recorded ones on resume, saying which changed', function()
    local sched = dir .. '/s.lua'
    local v1, v2 = 'return function() return 0.1 end\n', 'return function() return 0.2 end\n'
    put(sched, v1)
    local engine, step = engine_with { scheduler = { type = 'lua', params = { path = sched } } }
    put(sched, v2)
    step()
    local sd = engine.reload:state_dict()
    assert.are.same({ kind = 'schedule', hash = ds.reload.sha256(v2), step = 1, source = v2 }, sd.files[sched])
    engine:destroy()
    -- a resume with the file edited since: the checkpoint's version runs
    put(sched, 'return function() return 0.7 end\n')
    engine, step = engine_with { scheduler = { type = 'lua', params = { path = sched } } }
    assert.are.equal(0.7, engine:get_lr()[1])
    assert.are.same({ sched }, engine.reload:restore(sd))
    assert.are.equal(0.2, engine:get_lr()[1])
    step()
    assert.are.equal(0.2, engine:get_lr()[1])              -- the file on disk waits for its next edit
    put(sched, 'return function() return 0.9 end\n')
    step()
    assert.are.equal(0.9, engine:get_lr()[1])
    engine:destroy()
  end)

  it('attach in this process: set_lr pins the lr over the schedule, set_schedule changes its params', function()
    local engine, step = engine_with {
      scheduler = { type = 'WarmupLR', params = { warmup_min_lr = 0, warmup_max_lr = 0.1, warmup_num_steps = 1000,
                                                  warmup_type = 'linear' } },
      reload = { attach = true },
    }
    local _, socket = require('dslua.live.attach').job()
    local c = A.dial(socket)
    -- the server's thread queues the request when it reads it: steps until
    -- a boundary has taken it; the reply and the step it was taken at
    local function ask(code)
      c:send('eval 1\n' .. code)
      for _ = 1, 500 do
        step()
        local reply = c:recv(0.01)
        if reply then return reply, engine.global_steps end
      end
      error('no reply to ' .. code)
    end
    local function ramp(max, n) return { max * (n - 1) / 1000 } end    -- after n steps: iteration n - 1
    local reply, k = ask('return step')
    assert.are.equal('ok 1\n' .. k, reply)
    reply, k = ask('set_schedule{warmup_max_lr = 0.2}')
    assert.are.equal('ok 1\nset_schedule: warmup_max_lr = 0.2 on every rank from step ' .. (k + 1), reply)
    H.assert_close(engine:get_lr(), ramp(0.2, k), { rtol = 1e-12, atol = 0 })
    reply, k = ask('set_lr(0.5)')
    H.has(reply, 'set_lr: lr 0.5 on every rank from step ' .. (k + 1))
    step(2)
    assert.are.equal(0.5, engine:get_lr()[1])
    reply, k = ask('set_lr(nil)')
    H.has(reply, 'the schedule sets the lr again from step ' .. (k + 1))
    H.assert_close(engine:get_lr(), ramp(0.2, k), { rtol = 1e-12, atol = 0 })
    H.has((ask('set_schedule{warmup_type = "sideways"}')), "set_schedule: rejected on rank 0: ")
    reply = ask('local t = nil; return t.x')
    assert.are.equal("error 1\nattach:1: attempt to index local 't' (a nil value)",
                    (reply:gsub('\nstack traceback:.*', '')))
    c:close()
    engine:destroy()
  end)
end)

describe('the reload and hooks config blocks', function()
  it('fills the reload block and checks its keys, and the hooks file or table', function()
    local cfg = ds.config.load { train_batch_size = 8 }
    assert.are.same({ enabled = true, every = 1, attach = true, budget = 5 }, cfg.reload)
    local _, problems = ds.config.check { train_batch_size = 8, reload = { every = 0, watch = { 'a.lua' }, budget = 0 },
                                          hooks = { on_stpe = function() end } }
    local text = table.concat(problems, '\n')
    H.has(text, 'reload.every: must be a positive integer, got 0')
    H.has(text, "reload.watch: unknown key")
    H.has(text, 'reload.budget: must be a number of seconds > 0 and <= 86400, got 0')
    H.has(text, "hooks.on_stpe: unknown hook \"on_stpe\", did you mean 'on_step'?")
    _, problems = ds.config.check { train_batch_size = 8, hooks = 'no/such/hooks.lua' }
    H.has(table.concat(problems, '\n'), 'hooks: cannot read the hooks file "no/such/hooks.lua"')
  end)
end)
