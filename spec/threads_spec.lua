-- CPU threads: how many a process and each rank of `dslua -n N` use, and
-- that idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, in force before
-- libgomp loads) unless the user chose otherwise. Every case runs
-- spec/threads/probe.lua in a child with the thread variables cleared.
local H = require 'helpers'

local bin = H.bin()
local PROBE = 'spec/threads/probe.lua'
local CLEAN = 'env -u DSLUA_NUM_THREADS -u OMP_NUM_THREADS -u OMP_WAIT_POLICY -u OPENBLAS_NUM_THREADS '
              .. '-u GOMP_SPINCOUNT -u DSLUA_THREADS_ADDED '
local cpus = tonumber((H.run(CLEAN .. 'nproc')))

-- the probe lines of a command's output, by rank ('-' alone)
local function probe(cmd)
  local out, status = H.run(CLEAN .. cmd)
  assert.are.equal(0, status, out)
  local got = {}
  for line in out:gmatch('probe ([^\n]*)') do
    local t = {}
    for k, v in line:gmatch('([%w_]+)=(%S+)') do t[k] = tonumber(v) or v end
    got[t.rank] = t
  end
  assert.truthy(next(got), 'no probe line in:\n' .. out)
  return got, out
end

describe('CPU threads', function()
  it('a process alone takes every core', function()
    assert.are.equal(cpus, probe(bin .. ' ' .. PROBE)['-'].threads)
  end)

  it('DSLUA_NUM_THREADS, else OMP_NUM_THREADS, sets them', function()
    assert.are.equal(3, probe('DSLUA_NUM_THREADS=3 ' .. bin .. ' ' .. PROBE)['-'].threads)
    assert.are.equal(3, probe('OMP_NUM_THREADS=3 ' .. bin .. ' ' .. PROBE)['-'].threads)
    assert.are.equal(1, probe('DSLUA_NUM_THREADS=1 OMP_NUM_THREADS=3 ' .. bin .. ' ' .. PROBE)['-'].threads)
  end)

  it('idle OpenMP threads sleep by default, and scripts see the environment as it was', function()
    local p = probe('DSLUA_NUM_THREADS=2 ' .. bin .. ' ' .. PROBE .. ' --sleeps')['-']
    -- what libgomp and OpenBLAS read when they loaded
    assert.are.equal('PASSIVE', p.wait_env)
    assert.are.equal(1, p.blas_env)
    -- taken out again after the second start
    assert.are.same({ '(unset)', '(unset)', '(unset)' }, { p.wait_now, p.blas_now, p.added_now })
    -- a worker goes to sleep after (nearly) every one of the 50 ops
    assert.is_true(type(p.sleeps) == 'number' and p.sleeps >= 25, 'sleeps=' .. tostring(p.sleeps))
    H.has(H.run(CLEAN .. bin .. ' --report'), 'wait policy PASSIVE (dslua\'s default)')
  end)

  it("keeps the user's OMP_WAIT_POLICY and OPENBLAS_NUM_THREADS", function()
    local p = probe('OMP_WAIT_POLICY=ACTIVE DSLUA_NUM_THREADS=2 ' .. bin .. ' ' .. PROBE .. ' --sleeps')['-']
    assert.are.same({ 'ACTIVE', 'ACTIVE', 1, '(unset)' }, { p.wait_env, p.wait_now, p.blas_env, p.blas_now })
    -- spinning workers never sleep; with fewer cores than threads libgomp
    -- spins only briefly whatever the policy
    if cpus >= 2 then assert.are.equal(0, p.sleeps) end
    H.has(H.run(CLEAN .. 'OMP_WAIT_POLICY=ACTIVE ' .. bin .. ' --report'), 'wait policy ACTIVE (OMP_WAIT_POLICY)')
    -- GOMP_SPINCOUNT overrides the policy in libgomp: a choice of policy too
    p = probe('GOMP_SPINCOUNT=infinity DSLUA_NUM_THREADS=2 ' .. bin .. ' ' .. PROBE .. ' --sleeps')['-']
    assert.are.equal('(unset)', p.wait_env)
    if cpus >= 2 then assert.are.equal(0, p.sleeps) end
    p = probe('OPENBLAS_NUM_THREADS=4 ' .. bin .. ' ' .. PROBE)['-']
    assert.are.same({ 'PASSIVE', '(unset)', 4, 4 }, { p.wait_env, p.wait_now, p.blas_env, p.blas_now })
  end)

  it("the launcher forwards the user's variables, not dslua's own", function()
    local out = H.run(CLEAN .. 'OMP_SCHEDULE=static ' .. bin .. ' -e "local m = require(\'dslua.parallel.launcher\').machine(\'x\'); '
                      .. 'print(\'env\', m.env.OMP_SCHEDULE, m.env.OMP_WAIT_POLICY, m.env.DSLUA_THREADS_ADDED)"')
    H.has(out, 'env\tstatic\tnil\tnil')
  end)

  describe('under dslua -n 2', function()
    if H.skip_without_mpirun() then return end

    it('each rank takes its share of the cores and sleeps when idle', function()
      local got, out = probe(bin .. ' -n 2 ' .. PROBE)
      for r = 0, 1 do
        assert.truthy(got[r], 'no probe line from rank ' .. r .. ' in:\n' .. out)
        assert.are.equal(math.max(1, math.floor(cpus / 2)), got[r].threads)
        assert.are.equal('PASSIVE', got[r].wait_env)
      end
    end)

    it("the user's DSLUA_NUM_THREADS wins", function()
      local got = probe('DSLUA_NUM_THREADS=3 ' .. bin .. ' -n 2 ' .. PROBE)
      assert.are.same({ 3, 3 }, { got[0].threads, got[1].threads })
    end)
  end)
end)
