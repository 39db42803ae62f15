-- Collectives of device tensors over MPI (core/comm/ds_comm_staged.c) on
-- CPU ranks: DSLUA_TEST_STAGE_CPU=1 puts CPU tensors through the staged
-- backend with memcpy for its copies (its fences pass at their second
-- look), so its pieces, its chunks and the order of its MPI calls run
-- without a GPU; spec/gpu/multirank_spec.lua runs it with device tensors.
-- Then which backend device tensors get: NCCL or MPI, chosen by
-- dist_backend, DSLUA_COMM_BACKEND or ranks sharing a GPU (counted with
-- the DSLUA_TEST_GPU_COUNT hook), the line that says so, and the errors.
local H = require 'helpers'

local CLEAN = 'env -u DSLUA_DEVICE -u DSLUA_TEST_GPU_COUNT -u DSLUA_COMM_BACKEND -u LOCAL_RANK -u LOCAL_SIZE -u RANK '
local BACKEND = [[ -e "local ds = require 'dslua'; print('backend=' .. ds.comm.backend())"]]

local function mpirun(np, env, script, outdir)
  local vars = { 'DSLUA_TEST_STAGE_CPU', 'DSLUA_COMM_CHUNK', 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT',
                 'DSLUA_TEST_GPU_COUNT' }
  return H.run(CLEAN .. 'DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. env .. ' ' .. H.mpirun(np, vars)
               .. (outdir and ' --output-filename ' .. outdir or '') .. ' ' .. H.bin() .. ' ' .. script)
end

describe('collectives staged through host memory', function()
  if H.skip_without_mpirun() then return end

  -- chunks of 8 bytes: every all_reduce, broadcast and reduce of more than
  -- two f32 (one f64) goes in several MPI calls; 4 MiB: in one
  for _, case in ipairs({ { 2, 8 }, { 3, 8 }, { 4, 8 }, { 2, 4194304 } }) do
    local np, chunk = case[1], case[2]
    it(string.format('checks every primitive on %d ranks in chunks of %d bytes', np, chunk), function()
      local dir = H.tmpdir()
      local out, status = mpirun(np, 'DSLUA_TEST_STAGE_CPU=1 DSLUA_COMM_CHUNK=' .. chunk, 'spec/comm/primitives.lua',
                                 dir)
      assert.are.equal(0, status, out)
      H.primitives_passed(dir, np, 149)
      os.execute('rm -rf ' .. dir)
    end)
  end

  it('starts a staged send while its rank waits for another collective', function()
    -- rank 0's send is queued until its copy arrives; rank 0 then waits in
    -- the barrier's agreement, which rank 1 reaches only once the send has come
    local dir = H.tmpdir()
    local script = H.write(dir .. '/order.lua', [[
local ds = require 'dslua'
local c = ds.comm
local x = ds.ones(4) * (c.rank() + 1)
if c.rank() == 0 then
  local w = c.isend(x, 1)
  c.barrier()
  w:wait()
else
  c.recv(x, 0)
  c.barrier()
end
c.print('got ' .. x:sum():item())
]])
    local out, status = mpirun(2, 'DSLUA_TEST_STAGE_CPU=1 DSLUA_COMM_TIMEOUT=10', script)
    assert.are.equal(0, status, out)
    H.has(out, '[rank 1] got 4')
    os.execute('rm -rf ' .. dir)
  end)

  it('refuses a recv larger than its send and names a rank that never arrives, as the direct path does', function()
    local out = mpirun(2, 'DSLUA_TEST_STAGE_CPU=1', 'spec/comm/failures.lua recv_size')
    H.has(out, 'refused: recv: rank 1 sent 4 elements, the receiving tensor holds 10: a recv takes exactly what its '
          .. 'send sends')
    out = mpirun(2, 'DSLUA_TEST_STAGE_CPU=1 DSLUA_COMM_TIMEOUT=2', 'spec/comm/failures.lua timeout')
    H.has(out, '[rank 0] error: all_reduce(f32, 10 elements) #2 timed out on rank 0 of 2 after 2.0 s')
    H.has(out, 'rank 1 did not arrive')
  end)
end)

describe('the backend of device tensors', function()
  local function backend(env, script)
    local out, status = H.run(CLEAN .. (env or '') .. ' ' .. H.bin() .. ' ' .. (script or BACKEND))
    return out, status
  end
  local function chosen(env, script)
    local out, status = backend(env, script)
    assert.are.equal(0, status, out)
    return assert(('\n' .. out):match('\nbackend=(%S+)'), out), out
  end
  local SHARE = 'collectives of device tensors over MPI (NCCL needs a GPU per rank)'

  it('is NCCL where every rank of the host has a GPU, MPI where they share, said once by the first sharer',
     function()
    local b, out = chosen('LOCAL_SIZE=4 LOCAL_RANK=0 RANK=0 DSLUA_TEST_GPU_COUNT=4')
    assert.are.equal('nccl', b)
    assert.is_nil(out:find('share', 1, true), out)
    b, out = chosen('LOCAL_SIZE=4 LOCAL_RANK=0 RANK=0 DSLUA_TEST_GPU_COUNT=1')
    assert.are.equal('mpi', b)
    H.has(out, 'dslua: ranks 0-3 share cuda:0: ' .. SHARE)
    b, out = chosen('LOCAL_SIZE=4 LOCAL_RANK=3 RANK=3 DSLUA_TEST_GPU_COUNT=1')
    assert.are.equal('mpi', b)
    assert.is_nil(out:find('share', 1, true), out)
    -- blocks of neighbours, numbered in the world from this host's first rank
    b, out = chosen('LOCAL_SIZE=4 LOCAL_RANK=2 RANK=6 DSLUA_TEST_GPU_COUNT=2')
    assert.are.equal('mpi', b)
    H.has(out, 'dslua: ranks 6-7 share cuda:1: ' .. SHARE)
    -- 3 ranks on 2 GPUs: rank 2 has cuda:1 alone, and still goes over MPI with the others
    b, out = chosen('LOCAL_SIZE=3 LOCAL_RANK=2 RANK=2 DSLUA_TEST_GPU_COUNT=2')
    assert.are.equal('mpi', b)
    assert.is_nil(out:find('share', 1, true), out)
  end)

  it('takes DSLUA_COMM_BACKEND, set_backend and init_distributed with DeepSpeed\'s names', function()
    assert.are.equal('nccl', (chosen('LOCAL_SIZE=4 RANK=0 DSLUA_TEST_GPU_COUNT=1 DSLUA_COMM_BACKEND=nccl')))
    local _, out = chosen('LOCAL_SIZE=4 RANK=0 DSLUA_TEST_GPU_COUNT=1 DSLUA_COMM_BACKEND=nccl')
    H.has(out, 'dslua: ranks 0-3 share cuda:0: collectives of device tensors over NCCL (DSLUA_COMM_BACKEND=nccl)')
    assert.are.equal('mpi', (chosen('DSLUA_COMM_BACKEND=mpi')))
    assert.are.equal('mpi', (chosen('DSLUA_COMM_BACKEND=gloo')))
    assert.are.equal('nccl', (chosen("DSLUA_COMM_BACKEND='cpu:gloo,cuda:nccl'")))
    assert.are.equal('mpi', (chosen('DSLUA_COMM_BACKEND=auto LOCAL_SIZE=2 DSLUA_TEST_GPU_COUNT=1')))
    local set = [[ -e "local ds = require 'dslua'; ds.comm.set_backend('gloo'); print('backend=' .. ds.comm.backend())"]]
    assert.are.equal('mpi', (chosen('DSLUA_COMM_BACKEND=nccl', set)))
    local init = [[ -e "local ds = require 'dslua'; ds.comm.init_distributed { dist_backend = 'nccl' }; ]]
                 .. [[print('backend=' .. ds.comm.backend())"]]
    assert.are.equal('nccl', (chosen('LOCAL_SIZE=2 DSLUA_TEST_GPU_COUNT=1', init)))
  end)

  it('refuses another name, naming the setting', function()
    local out, status = backend('DSLUA_COMM_BACKEND=hccl')
    assert.are_not.equal(0, status)
    H.has(out, 'DSLUA_COMM_BACKEND=hccl: not a backend for device tensors (expected nccl, mpi, gloo (MPI through host '
          .. 'memory, as mpi) or auto)')
    out, status = backend(nil, [[ -e "require('dslua').comm.set_backend('ccl', 'dist_backend')"]])
    assert.are_not.equal(0, status)
    H.has(out, 'dist_backend=ccl: not a backend for device tensors')
  end)

  it('is the config\'s dist_backend, checked with the file and key', function()
    local dir = H.tmpdir()
    local script = H.write(dir .. '/t.lua', [[
local ds = require 'dslua'
ds.initialize { model = ds.nn.Linear(2, 1), config = { train_batch_size = 2, dist_backend = arg[1],
  optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
print('backend=' .. ds.comm.backend())
]])
    assert.are.equal('mpi', (chosen('DSLUA_DEVICE=cpu DSLUA_COMM_BACKEND=nccl', script .. ' gloo')))
    assert.are.equal('nccl', (chosen('DSLUA_DEVICE=cpu LOCAL_SIZE=2 DSLUA_TEST_GPU_COUNT=1', script .. ' nccl')))
    local out, status = backend('DSLUA_DEVICE=cpu', script .. ' hccl')
    assert.are_not.equal(0, status)
    H.has(out, 'dist_backend')
    H.has(out, 'hccl')
    os.execute('rm -rf ' .. dir)
  end)

  describe('under mpirun', function()
    if H.skip_without_mpirun() then return end

    it('4 ranks on 1 GPU: one line, every rank on MPI; on 2 GPUs: a line per GPU', function()
      local out, status = mpirun(4, 'DSLUA_TEST_GPU_COUNT=1', BACKEND)
      assert.are.equal(0, status, out)
      assert.are.equal(4, H.count(out, 'backend=mpi'), out)
      assert.are.equal(1, H.count(out, 'share cuda'), out)
      H.has(out, 'dslua: ranks 0-3 share cuda:0: ' .. SHARE)
      out, status = mpirun(4, 'DSLUA_TEST_GPU_COUNT=2', BACKEND)
      assert.are.equal(0, status, out)
      assert.are.equal(2, H.count(out, 'share cuda'), out)
      H.has(out, 'dslua: ranks 0-1 share cuda:0: ' .. SHARE)
      H.has(out, 'dslua: ranks 2-3 share cuda:1: ' .. SHARE)
    end)
  end)
end)
