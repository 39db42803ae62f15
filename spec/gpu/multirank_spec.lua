-- The multi-rank specs with device tensors: spec/ddp, zero, uneven, pipe,
-- onebit, checkpoint, reload and tp run again in a child busted with their
-- ranks on the GPU (DSLUA_SPEC_DEVICE=cuda, read by H.ranks_cmd), 2 to 4
-- ranks sharing it: once over MPI through page-locked host memory
-- (DSLUA_COMM_BACKEND=mpi), once through NCCL's backend with the NCCL
-- test double preloaded (DSLUA_COMM_BACKEND=nccl, build/libnccl_double.so,
-- tests/nccl_double/README.md). Each spec's own checks decide: N ranks
-- equal one rank, as on the CPU. Then the staged path's primitives with
-- device tensors (spec/comm/primitives.lua cuda) on 2, 3 and 4 ranks, in
-- chunks and whole. Skips without a GPU.
local H = require 'helpers'

local SPECS = { 'ddp', 'zero', 'uneven', 'pipe', 'onebit', 'checkpoint', 'reload', 'tp' }
local BUSTED = os.getenv('BUSTED') or '/usr/bin/busted'

local function double_path()
  local dir = H.bin():match('^(.*)/[^/]+$') or '.'
  local f = io.open(dir .. '/libnccl_double.so', 'rb')
  if not f then return nil end
  f:close()
  return dir .. '/libnccl_double.so'
end

describe('#gpu multi-rank specs on device tensors', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end
  if H.skip_without_mpirun() then return end

  for _, path in ipairs({ 'mpi', 'nccl' }) do
    for _, name in ipairs(SPECS) do
      it(string.format('%s_spec over %s', name, path == 'mpi' and 'MPI (staged)' or 'NCCL (the test double)'),
         function()
        local env = 'DSLUA_SPEC_DEVICE=cuda DSLUA_COMM_BACKEND=' .. path
        if path == 'nccl' then
          local lib = double_path()
          if not lib then pending('no libnccl_double.so next to the binary') return end
          env = env .. ' DSLUA_SPEC_PRELOAD=' .. lib
        end
        local out, status = H.run(env .. ' ' .. H.bin() .. ' ' .. BUSTED .. ' spec/' .. name .. '_spec.lua 2>&1')
        assert.are.equal(0, status, out)
        assert.truthy(out:find(' 0 failures / 0 errors', 1, true), out)
        assert.is_true(tonumber(out:match('(%d+) successes') or 0) > 0, out)
      end)
    end
  end

  for _, case in ipairs({ { 2, 4096 }, { 3, 4194304 }, { 4, 64 } }) do
    local np, chunk = case[1], case[2]
    it(string.format('checks every primitive on %d ranks sharing a GPU over MPI, in chunks of %d bytes', np, chunk),
       function()
      local dir = H.tmpdir()
      local out, status = H.run('DSLUA_COMM_BACKEND=mpi DSLUA_COMM_CHUNK=' .. chunk .. ' DSLUA_NUM_THREADS=1 '
                                .. 'DSLUA_COMM_TIMEOUT=120 ' .. H.mpirun(np, { 'DSLUA_COMM_BACKEND', 'DSLUA_COMM_CHUNK',
                                'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT' }) .. ' --output-filename ' .. dir .. ' '
                                .. H.bin() .. ' spec/comm/primitives.lua cuda')
      assert.are.equal(0, status, out)
      H.primitives_passed(dir, np, 149)
      os.execute('rm -rf ' .. dir)
    end)
  end

  it('checks every primitive on 2 ranks sharing a GPU through NCCL\'s backend and the test double', function()
    local lib = double_path()
    if not lib then pending('no libnccl_double.so next to the binary') return end
    local dir = H.tmpdir()
    local out, status = H.run('DSLUA_COMM_BACKEND=nccl DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=120 '
                              .. H.mpirun(2, { 'DSLUA_COMM_BACKEND', 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT',
                              'LD_PRELOAD=' .. lib }) .. ' --output-filename ' .. dir .. ' ' .. H.bin()
                              .. ' spec/comm/primitives.lua cuda')
    assert.are.equal(0, status, out)
    H.primitives_passed(dir, 2, 149)
    os.execute('rm -rf ' .. dir)
  end)
end)
