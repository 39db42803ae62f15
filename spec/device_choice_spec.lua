-- Which device a rank trains on (core/cuda/ds_rank_device.h): ds.device()
-- and ds.initialize follow --device, then DSLUA_DEVICE, then this rank's
-- GPU if there is one; each process says once on stderr what it uses; bad
-- values are errors naming the flag or the variable; and more ranks on a
-- host than GPUs share them in blocks (ds.cuda.shared), their device
-- tensors then going over MPI (spec/comm_staged_spec.lua). Here the GPU
-- count is simulated with DSLUA_TEST_GPU_COUNT (a test hook read only by
-- the sharing). Each case
-- runs in a child process with a clean environment.
local H = require 'helpers'
local ds = H.ds

local CLEAN = 'env -u DSLUA_DEVICE -u DSLUA_TEST_GPU_COUNT -u LOCAL_RANK -u LOCAL_SIZE -u RANK '
              .. '-u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_LOCAL_SIZE '
local PRINT = [[ -e "local ds = require 'dslua'; print('device=' .. ds.device())"]]

-- output and exit status of `env... dslua <args>`
local function dslua(env, args)
  return H.run(CLEAN .. (env or '') .. ' ' .. H.bin() .. ' ' .. args)
end

local function device_of(env, args)
  local out, status = dslua(env, args or PRINT)
  assert.are.equal(0, status, out)
  return assert(out:match('device=(%S+)'), out), out
end

local function fails(env, args, piece)
  local out, status = dslua(env, args or PRINT)
  assert.are_not.equal(0, status, out)
  H.has(out, piece)
  return out
end

describe('device choice', function()
  local gpu = H.has_cuda()

  it('DSLUA_DEVICE=cpu puts the rank on the CPU and says so once', function()
    local dev, out = device_of('DSLUA_DEVICE=cpu',
                               [[ -e "local ds = require 'dslua'; ds.device(); print('device=' .. ds.device())"]])
    assert.are.equal('cpu', dev)
    local _, said = out:gsub('dslua: rank 0 uses the CPU %(DSLUA_DEVICE=cpu%)', '')
    assert.are.equal(1, said, out)
  end)

  it('an empty DSLUA_DEVICE is the default', function()
    local dev = device_of('DSLUA_DEVICE=')
    assert.are.equal(gpu and 'cuda:0' or 'cpu', dev)
  end)

  it('bad values are errors naming DSLUA_DEVICE', function()
    for _, v in ipairs({ 'gpu', 'cuda:x', 'cuda:-1', 'CPU', 'cuda:' }) do
      fails("DSLUA_DEVICE='" .. v .. "'", nil,
            'DSLUA_DEVICE=' .. v .. ": not a device (expected cpu, cuda for this rank's GPU, or cuda:N)")
    end
  end)

  it('a GPU asked for where there is none is an error naming DSLUA_DEVICE and why', function()
    if gpu then return pending('skipped: this machine has a GPU') end
    local why = ds.cuda.unavailable_reason()
    fails('DSLUA_DEVICE=cuda', nil, 'DSLUA_DEVICE=cuda: no CUDA device available (' .. why .. '); unset it or ask for cpu')
    fails('DSLUA_DEVICE=cuda:1', nil, 'DSLUA_DEVICE=cuda:1: no CUDA device available (' .. why .. ')')
  end)

  it('a GPU number past the visible ones is an error naming them', function()
    if not gpu then return pending('skipped: no CUDA device') end
    local n = ds.cuda.device_count()
    fails('DSLUA_DEVICE=cuda:' .. n, nil, 'DSLUA_DEVICE=cuda:' .. n .. ': this process sees ' .. n .. ' GPU')
  end)

  it('--device wins over DSLUA_DEVICE, leaves ds.args.rest, and a bad one names the flag', function()
    local dir = H.tmpdir()
    local script = H.write(dir .. '/s.lua', "local ds = require 'dslua'\n"
                           .. "print('device=' .. ds.device() .. ' flag=' .. tostring(ds.args.device) "
                           .. ".. ' rest=' .. table.concat(ds.args.rest, ','))\n")
    local out, status = dslua('DSLUA_DEVICE=gpu', script .. ' a --device cpu b')
    assert.are.equal(0, status, out)
    H.has(out, 'device=cpu flag=cpu rest=a,b')
    H.has(out, 'dslua: rank 0 uses the CPU (--device cpu)')
    out, status = dslua(nil, script .. ' --device=cpu')
    assert.are.equal(0, status, out)
    H.has(out, 'device=cpu flag=cpu rest=')
    fails(nil, script .. ' --device tpu', "--device tpu: not a device (expected cpu, cuda for this rank's GPU, or cuda:N)")
    fails(nil, script .. ' --device', '--device: expected a device (cpu, cuda or cuda:N)')
    fails(nil, script .. ' --device=', '--device: expected a device (cpu, cuda or cuda:N)')
    os.execute('rm -rf ' .. dir)
  end)

  it('ds.initialize takes the rank device and says why it cannot at the script line', function()
    local dir = H.tmpdir()
    local script = H.write(dir .. '/t.lua', [[
local ds = require 'dslua'
local engine = ds.initialize { model = ds.nn.Linear(2, 1), config = { train_batch_size = 1,
  optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
print('device=' .. engine.device .. ' weight=' .. engine.module.weight:device())
]])
    local dev, out = device_of('DSLUA_DEVICE=cpu', script)
    assert.are.equal('cpu', dev)
    H.has(out, 'weight=cpu')
    fails('DSLUA_DEVICE=gpu', script, dir .. '/t.lua:2: initialize: DSLUA_DEVICE=gpu: not a device')
    os.execute('rm -rf ' .. dir)
  end)
end)

describe('ranks against GPUs', function()
  local SHARED = [[ -e "local ds = require 'dslua'; local s = ds.cuda.shared(); ]]
                 .. [[print(s and string.format('shared=cuda:%d,%d-%d', s.gpu, s.first, s.last) or 'shared=no')"]]
  local function shared(env)
    local out, status = dslua(env, SHARED)
    assert.are.equal(0, status, out)
    return assert(out:match('shared=(%S+)'), out)
  end

  it('more ranks on this host than GPUs share them in blocks of neighbours, numbered in the world', function()
    assert.are.equal('cuda:0,0-3', shared('LOCAL_SIZE=4 LOCAL_RANK=1 RANK=1 DSLUA_TEST_GPU_COUNT=1'))
    assert.are.equal('cuda:1,6-7', shared('LOCAL_SIZE=4 LOCAL_RANK=3 RANK=7 DSLUA_TEST_GPU_COUNT=2'))
    assert.are.equal('cuda:0,0-1', shared('LOCAL_SIZE=3 LOCAL_RANK=0 DSLUA_TEST_GPU_COUNT=2'))
    assert.are.equal('cuda:1,2-2', shared('LOCAL_SIZE=3 LOCAL_RANK=2 DSLUA_TEST_GPU_COUNT=2'))
    assert.are.equal('no', shared('LOCAL_SIZE=2 LOCAL_RANK=1 DSLUA_TEST_GPU_COUNT=2'))
    assert.are.equal('no', shared('LOCAL_SIZE=4 LOCAL_RANK=1'))
    if H.has_cuda() and ds.cuda.device_count() == 1 then
      -- the real count: rank 1 of 2 takes cuda:0 with rank 0 and says so, where it stopped before
      local dev, out = device_of('LOCAL_SIZE=2 LOCAL_RANK=1 RANK=1')
      assert.are.equal('cuda:0', dev)
      H.has(out, '(LOCAL_RANK 1; ranks 0-1 share it)')
      assert.are.equal('cuda:0', (device_of('LOCAL_SIZE=2 LOCAL_RANK=1 RANK=1 DSLUA_DEVICE=cuda')))
    end
  end)

  it('CPU ranks stay on the CPU whatever the GPUs', function()
    assert.are.equal('cpu', (device_of('LOCAL_SIZE=2 LOCAL_RANK=1 DSLUA_TEST_GPU_COUNT=1 DSLUA_DEVICE=cpu')))
    local dir = H.tmpdir()
    local script = H.write(dir .. '/s.lua', "print('device=' .. require('dslua').device())\n")
    assert.are.equal('cpu', (device_of('LOCAL_SIZE=4 DSLUA_TEST_GPU_COUNT=1', script .. ' --device cpu')))
    os.execute('rm -rf ' .. dir)
    if not H.has_cuda() then
      assert.are.equal('cpu', (device_of('LOCAL_SIZE=2 LOCAL_RANK=1 DSLUA_TEST_GPU_COUNT=1')))
    end
  end)

  it('the GPU check, ds.comm and ds.args read one local rank: LOCAL_RANK, else Open MPI\'s', function()
    local P = [[ -e "local ds = require 'dslua'; print('local=' .. ds.comm.local_rank() .. ',' ]]
              .. [[.. ds.args.local_rank .. ',' .. ds.comm.local_size())"]]
    local function locals(env)
      local out, status = dslua(env, P)
      assert.are.equal(0, status, out)
      return assert(out:match('local=(%S+)'), out)
    end
    assert.are.equal('2,2,3',
                     locals('LOCAL_RANK=2 OMPI_COMM_WORLD_LOCAL_RANK=5 LOCAL_SIZE=3 OMPI_COMM_WORLD_LOCAL_SIZE=6'))
    assert.are.equal('3,3,4', locals('OMPI_COMM_WORLD_LOCAL_RANK=3 OMPI_COMM_WORLD_LOCAL_SIZE=4'))
    assert.are.equal('0,0,1', locals(nil))
    assert.are.equal('cuda:1,2-3', shared('OMPI_COMM_WORLD_LOCAL_RANK=3 OMPI_COMM_WORLD_LOCAL_SIZE=4 '
                                          .. 'OMPI_COMM_WORLD_RANK=3 DSLUA_TEST_GPU_COUNT=2'))
  end)

  describe('under mpirun', function()
    if H.skip_without_mpirun() then return end
    local dir = H.tmpdir()
    local script = H.write(dir .. '/train.lua', [[
local ds = require 'dslua'
local engine = ds.initialize { model = ds.nn.Linear(2, 1), config = { train_batch_size = 2,
  optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
local x = ds.ones(1, 2):to(engine.device)
engine:backward(engine(x):sum())
engine:step()
print(string.format('rank %d stepped on %s', engine.rank, engine.device))
]])
    local MPI = H.mpirun(2, { 'DSLUA_TEST_GPU_COUNT', 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT' }) .. ' '

    it('one rank and 1 GPU train', function()
      local out, status = dslua('DSLUA_TEST_GPU_COUNT=1 DSLUA_NUM_THREADS=1', script)
      assert.are.equal(0, status, out)
      H.has(out, 'rank 0 stepped on ' .. (H.has_cuda() and 'cuda:0' or 'cpu'))
    end)

    it('2 ranks and 1 GPU train, where they stopped before: on the GPU over MPI, said once', function()
      local out, status = H.run(CLEAN .. 'DSLUA_TEST_GPU_COUNT=1 DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. MPI
                                .. H.bin() .. ' ' .. script)
      assert.are.equal(0, status, out)
      local where = H.has_cuda() and 'cuda:0' or 'cpu'
      for r = 0, 1 do H.has(out, 'rank ' .. r .. ' stepped on ' .. where) end
      local _, lines = out:gsub('share cuda:0', '')
      assert.are.equal(H.has_cuda() and 1 or 0, lines, out)
      assert.is_nil(out:find('invalid usage', 1, true), out)
    end)

    it('the same ranks with DSLUA_DEVICE=cpu train on the CPU', function()
      local out, status = H.run(CLEAN .. 'DSLUA_DEVICE=cpu DSLUA_TEST_GPU_COUNT=1 DSLUA_NUM_THREADS=1 '
                                .. 'DSLUA_COMM_TIMEOUT=60 ' .. MPI .. '-x DSLUA_DEVICE ' .. H.bin() .. ' ' .. script)
      assert.are.equal(0, status, out)
      for r = 0, 1 do
        H.has(out, 'rank ' .. r .. ' stepped on cpu')
        H.has(out, 'dslua: rank ' .. r .. ' uses the CPU (DSLUA_DEVICE=cpu)')
      end
    end)

    teardown(function() os.execute('rm -rf ' .. dir) end)
  end)
end)
