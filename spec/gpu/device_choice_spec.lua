-- The device choice on a GPU machine (spec/device_choice_spec.lua runs the
-- same choices with a simulated count): the default is this rank's GPU
-- and says so with the GPU's name; DSLUA_DEVICE=cpu keeps a rank on the
-- CPU; CUDA_VISIBLE_DEVICES decides what the process sees; more ranks than
-- GPUs share them and train over MPI; and two ranks forced onto one GPU
-- with NCCL asked for stop before NCCL with a message naming them, never
-- NCCL's "invalid usage". Skips without a GPU.
local H = require 'helpers'
local ds = H.ds

local CLEAN = 'env -u DSLUA_DEVICE -u DSLUA_TEST_GPU_COUNT -u DSLUA_COMM_BACKEND -u LOCAL_RANK -u LOCAL_SIZE -u RANK '
local PRINT = [[ -e "local ds = require 'dslua'; print('device=' .. ds.device() .. ' count=' .. ds.cuda.device_count())"]]

describe('#gpu device choice on a GPU machine', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end
  local n = ds.cuda.device_count()
  local dir = H.tmpdir()
  local script = H.write(dir .. '/train.lua', [[
local ds = require 'dslua'
local engine = ds.initialize { model = ds.nn.Linear(2, 1), config = { train_batch_size = 2 * ds.comm.world_size(),
  train_micro_batch_size_per_gpu = 2, steps_per_print = 1, optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
local x = ds.ones(2, 2):to(engine.device)
engine:backward(engine(x):sum())
engine:step()
print(string.format('rank %d stepped on %s, weight on %s', engine.rank, engine.device,
                    engine.module.weight:device()))
]])
  local function MPI(np, more)
    return H.mpirun(np, { 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT', more }) .. ' '
  end

  it('puts a rank on its GPU by default and names it', function()
    local out, status = H.run(CLEAN .. H.bin() .. PRINT)
    assert.are.equal(0, status, out)
    H.has(out, 'device=cuda:0 count=' .. n)
    assert.matches('dslua: rank 0 uses cuda:0, [^\n]+ %(LOCAL_RANK 0%)', out)
    out, status = H.run(CLEAN .. H.bin() .. ' ' .. script)
    assert.are.equal(0, status, out)
    H.has(out, 'rank 0 stepped on cuda:0, weight on cuda:0')
  end)

  it('keeps a rank on the CPU with DSLUA_DEVICE=cpu', function()
    local out, status = H.run(CLEAN .. 'DSLUA_DEVICE=cpu ' .. H.bin() .. ' ' .. script)
    assert.are.equal(0, status, out)
    H.has(out, 'rank 0 stepped on cpu, weight on cpu')
    H.has(out, 'dslua: rank 0 uses the CPU (DSLUA_DEVICE=cpu)')
  end)

  it('sees the GPUs CUDA_VISIBLE_DEVICES lets it see', function()
    local out, status = H.run(CLEAN .. 'CUDA_VISIBLE_DEVICES=0 ' .. H.bin() .. PRINT)
    assert.are.equal(0, status, out)
    H.has(out, 'device=cuda:0 count=1')
    out, status = H.run(CLEAN .. "CUDA_VISIBLE_DEVICES='' " .. H.bin() .. PRINT)
    assert.are.equal(0, status, out)
    H.has(out, 'device=cpu count=0')
    H.has(out, "with CUDA_VISIBLE_DEVICES='')")
    out, status = H.run(CLEAN .. "CUDA_VISIBLE_DEVICES='' DSLUA_DEVICE=cuda " .. H.bin() .. PRINT)
    assert.are_not.equal(0, status, out)
    H.has(out, "DSLUA_DEVICE=cuda: no CUDA device available (")
  end)

  describe('under mpirun', function()
    if H.skip_without_mpirun() then return end

    it('more ranks than GPUs share them and train, their device tensors over MPI, said once per GPU', function()
      local np = n + 1
      local out, status = H.run(CLEAN .. 'DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. MPI(np)
                                .. H.bin() .. ' ' .. script)
      assert.are.equal(0, status, out)
      for r = 0, n do H.has(out, 'rank ' .. r .. ' stepped on cuda:') end
      H.has(out, ': collectives of device tensors over MPI (NCCL needs a GPU per rank)')
      -- each rank on the shared GPU logs its own memory at the print boundary
      -- (n + 1 ranks on n GPUs: ranks 0 and 1 share cuda:0)
      H.has(out, '[Rank 1] cuda:0 shared by ranks 0-1: this rank MemAllocated=')
      H.has(out, 'dslua: ranks 0-1 share cuda:0: collectives of device tensors over MPI')
      assert.is_nil(out:find('invalid usage', 1, true), out)
    end)

    it('the same ranks on the CPU train', function()
      local out, status = H.run(CLEAN .. 'DSLUA_DEVICE=cpu DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. MPI(n + 1, 'DSLUA_DEVICE')
                                .. H.bin() .. ' ' .. script)
      assert.are.equal(0, status, out)
      for r = 0, n do H.has(out, 'rank ' .. r .. ' stepped on cpu') end
    end)

    it('two ranks forced onto one GPU with NCCL asked for stop before NCCL, naming them', function()
      local out, status = H.run(CLEAN .. 'DSLUA_DEVICE=cuda:0 DSLUA_COMM_BACKEND=nccl DSLUA_NUM_THREADS=1 '
                                .. 'DSLUA_COMM_TIMEOUT=60 ' .. MPI(2, 'DSLUA_DEVICE') .. '-x DSLUA_COMM_BACKEND '
                                .. H.bin() .. ' ' .. script)
      assert.are_not.equal(0, status, out)
      H.has(out, 'ranks 0 and 1 both use the GPU at PCI ')
      H.has(out, 'NCCL needs a GPU of its own for each rank')
      H.has(out, 'DSLUA_COMM_BACKEND=mpi')
      assert.is_nil(out:find('invalid usage', 1, true), out)
    end)

    if n >= 2 then
      it('2 ranks on 2 GPUs each take the GPU of their local rank and train', function()
        local out, status = H.run(CLEAN .. 'DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 ' .. MPI(2) .. H.bin()
                                  .. ' ' .. script)
        assert.are.equal(0, status, out)
        H.has(out, 'rank 0 stepped on cuda:0')
        H.has(out, 'rank 1 stepped on cuda:1')
      end)
    end
  end)

  teardown(function() os.execute('rm -rf ' .. dir) end)
end)
