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
    local total = 0
    for q = 0, 1 do
      local f = assert(io.open(dir .. '/1/rank.' .. q .. '/stdout'))
      local text = f:read('*a')
      f:close()
      assert.is_nil(text:find('FAIL', 1, true), text)
      local _, passes = text:gsub('PASS ', '')
      assert.is_true(passes > 100, text)
      total = total + passes
    end
    local f = assert(io.open(dir .. '/1/rank.0/stdout'))
    local text = f:read('*a')
    f:close()
    H.has(text, 'DONE checks=' .. total .. ' failures=0')
  end)
end)
