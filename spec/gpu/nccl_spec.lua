-- NCCL: every primitive on CUDA tensors under mpirun with 2 ranks, one GPU
-- each (spec/comm/primitives.lua cuda does the checking). Skips without a GPU,
-- with one GPU (NCCL takes one GPU per rank), or without mpirun.
local H = require 'helpers'
local ds = H.ds

describe('#gpu NCCL collectives on CUDA tensors', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end
  if ds.cuda.device_count() < 2 then pending('skipped: NCCL needs 2 GPUs, this machine has 1') return end
  if H.skip_without_mpirun() then return end

  it('checks every primitive on 2 ranks', function()
    local dir = H.tmpdir()
    local cmd = 'DSLUA_COMM_TIMEOUT=120 ' .. H.mpirun(2, { 'DSLUA_COMM_TIMEOUT' }) .. ' --output-filename ' .. dir
                .. ' ' .. H.bin() .. ' spec/comm/primitives.lua cuda'
    local out, status = H.run(cmd)
    assert.are.equal(0, status, out)
    H.primitives_passed(dir, 2, 101)
  end)
end)
