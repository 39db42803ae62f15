-- The bench drivers' behaviour that needs no measurement: bench/gpu.sh
-- without a GPU, and bench/shards.sh's and bench/resume.sh's quick runs
-- (their files deleted on exit). Each runs the binary under test from a bare build folder (a link
-- to it), which the drivers use as it is.
local H = require 'helpers'
local ds = H.ds

local tmpdir, remove_tmpdirs = H.tmpdirs()
local function bare_build()
  local d = tmpdir()
  assert(os.execute('ln -s ' .. H.bin() .. ' ' .. d .. '/dslua') == 0)
  return d
end

describe('bench drivers', function()
  after_each(remove_tmpdirs)
  teardown(H.mpi_cleanup)

  it('bench/gpu.sh on a machine without a GPU stops at once with an error and exit status 1', function()
    local _, listed = H.run("nvidia-smi -L 2>/dev/null | grep -q '^GPU '")
    if listed == 0 then return pending('nvidia-smi lists a GPU here') end
    local out, status = H.run('bash bench/gpu.sh -b ' .. bare_build())
    assert.are.equal(1, status, out)
    H.has(out, 'bench/gpu.sh: no GPU on this machine (nvidia-smi lists none)')
    assert.is_nil(out:find('row ', 1, true), out)          -- no table
  end)

  it('bench/gpu.sh stops when nvidia-smi lists a GPU the binary does not see', function()
    if ds.cuda ~= nil and ds.cuda.is_available() then return pending('this binary sees a GPU') end
    local bin = tmpdir()
    local f = assert(io.open(bin .. '/nvidia-smi', 'w'))
    f:write('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    f:close()
    os.execute('chmod +x ' .. bin .. '/nvidia-smi')
    local build = bare_build()
    local out, status = H.run('PATH=' .. bin .. ':$PATH bash bench/gpu.sh -b ' .. build)
    assert.are.equal(1, status, out)
    H.has(out, 'bench/gpu.sh: ' .. build .. '/dslua sees no GPU')
    assert.is_nil(out:find('row ', 1, true), out)
  end)

  it('bench/shards.sh -q trains on 2 ranks, reports each rank\'s memory and deletes its corpus', function()
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local parent = tmpdir()
    local out, status = H.run('timeout 300 bash bench/shards.sh -q -b ' .. bare_build() .. ' -d ' .. parent)
    assert.are.equal(0, status, out)
    H.has(out, 'corpus: 2 shards, 0.00 billion tokens')
    assert.matches('20 steps after the first: loss [%d.]+ %-> [%d.]+, %d+ tokens/s', out)
    for r = 0, 1 do assert.matches('rank ' .. r .. ' | peak resident %d+ MB | anonymous %d+ MB', out) end
    assert.are.equal('', (H.run('ls -A ' .. parent)))
  end)

  it('bench/resume.sh -q saves on 2 ranks, loads on 3, reports the state and memory and deletes its files', function()
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local parent = tmpdir()
    local out, status = H.run('timeout 300 bash bench/resume.sh -q -b ' .. bare_build() .. ' -d ' .. parent)
    assert.are.equal(0, status, out)
    H.has(out, 'corpus: 2 shards, 249998 windows of 8 tokens; the uneven policy; saved after 3 steps on 2 ranks')
    H.has(out, 'saved on 2 ranks, loaded on 3: epoch 1 goes on with the 249974 of its 249998 samples')
    for r = 0, 1 do assert.matches('rank ' .. r .. ' | sampler and loader state %d+ bytes', out) end
    for r = 0, 2 do assert.matches('rank ' .. r .. ' | load_checkpoint: anonymous memory [+-]%d+ KB', out) end
    assert.are.equal('', (H.run('ls -A ' .. parent)))
  end)
end)
