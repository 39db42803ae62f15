-- The configuration matrix (spec/matrix/): ZeRO stage x gradient
-- accumulation x dtype x ranks x buckets x clipping x offload (cpu through
-- its chunked pipeline) x the uneven sampler x 1-bit optimizers x pipeline
-- stages x tensor parallelism x fp8 x a checkpoint resumed on other ranks,
-- over a model of awkward shapes, each cell against one fp32 rank (in fp8
-- too for an fp8 cell) over the same global batch (spec/matrix/judge.lua
-- says how close, and why). Here the pairwise subset
-- (spec/matrix/pairwise.lua): every pair of settings in some cell, a pair
-- only refused cells hold in one that must raise DeepSpeed's (or dslua's)
-- error, and the cells that once found a bug. scripts/matrix.lua runs the
-- full product or a slice.
local H = require 'helpers'
local P = require 'matrix.pairwise'
local R = require 'matrix.runner'
local S = require 'matrix.settings'

describe('the configuration matrix, pairwise', function()
  local cells = P.cells()

  it('covers every pair of settings, and each refusal alone', function()
    assert.are.same({}, P.uncovered(cells))
    for _, rule in ipairs(S.REFUSALS) do
      local alone = false
      for _, c in ipairs(cells) do alone = alone or (rule[1](c) and P.refusals(c) == 1) end
      assert.is_true(alone, rule[2])
    end
  end)

  if not H.have_mpirun() then
    pending('mpirun is not on PATH: the matrix needs 2 and 3 ranks')
    return
  end

  local dir = H.tmpdir()
  local rows
  teardown(function() os.execute('rm -rf ' .. dir) end)

  for i, c in ipairs(cells) do
    local what = S.refusal(c) and 'refuses' or 'trains as one fp32 rank'
    it(string.format('%s: %s', S.name(c), what), function()
      rows = rows or R.run(cells, { dir = dir, timeout = 60 })
      local row = rows[i]
      assert(row.verdict ~= 'FAIL', row.why)
      assert.are.equal(S.refusal(c) and 'refused' or 'pass', row.verdict)
    end)
  end
end)
