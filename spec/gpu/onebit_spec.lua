-- The 1-bit optimizers' CUDA kernels (sign packing with error feedback and
-- the pointwise steps) on one GPU: spec/onebit/run.lua trains its MLP with
-- OneBitAdam and with AdamW without bias correction; the warm-up follows
-- AdamW, the compressed phase keeps the loss falling, and the GPU run
-- follows the same run on the CPU. Skips without a GPU.
local H = require 'helpers'

local function run(device, args)
  local out = os.tmpname()
  local t = H.run_json('DSLUA_DEVICE=' .. device .. ' DSLUA_NUM_THREADS=1 ' .. H.bin() .. ' spec/onebit/run.lua '
                       .. out .. ' ' .. args, out)
  os.remove(out)
  return t
end

describe('#gpu 1-bit optimizers on one GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  it('OneBitAdam follows AdamW in warm-up, keeps learning compressed, and matches the CPU', function()
    local onebit = run('cuda', 'OneBitAdam 120 freeze_step=40')
    local adam = run('cuda', 'AdamW 120 bias_correction=false')
    local cpu = run('cpu', 'OneBitAdam 120 freeze_step=40')
    for i = 1, 40 do
      local d = math.abs(onebit.steps[i].loss - adam.steps[i].loss) / adam.steps[i].loss
      assert(d < 1e-4, string.format('warm-up step %d: %.7g vs AdamW %.7g', i, onebit.steps[i].loss, adam.steps[i].loss))
    end
    assert.is_true(onebit.steps[120].compressed, 'compressed after freeze_step')
    local function mean(t, a, b)
      local s = 0
      for i = a, b do s = s + t.steps[i].loss end
      return s / (b - a + 1)
    end
    assert(mean(onebit, 101, 120) < mean(onebit, 41, 60), 'the loss falls after the freeze')
    -- signs of near-zero momenta may differ between the devices after the
    -- freeze; error feedback carries the difference along
    for i = 1, 120 do
      local d = math.abs(onebit.steps[i].loss - cpu.steps[i].loss) / cpu.steps[i].loss
      assert(d < (i <= 40 and 1e-4 or 2e-2),
             string.format('step %d: GPU %.7g vs CPU %.7g', i, onebit.steps[i].loss, cpu.steps[i].loss))
    end
  end)
end)
