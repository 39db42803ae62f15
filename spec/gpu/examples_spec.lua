-- Every example on the GPU, a few steps each in a child process, as a user
-- runs it (no DSLUA_DEVICE: the default is this rank's GPU; one run each
-- with DSLUA_DEVICE=cuda and --device cuda:0): it says it uses cuda:0, the
-- loss falls and the evaluation (accuracy, validation loss, a sample)
-- runs on the model's device. examples/uneven runs on 2 ranks: a GPU
-- each, or with one GPU both on it, their collectives over MPI. The data
-- sets come from ../shared/data (or $DSLUA_DATA); without them those
-- examples skip with a line saying so. Skips without a GPU.
local H = require 'helpers'
local ds = H.ds

-- Runs `dslua <cmd>` with env; it must succeed and say it uses cuda:0 for `why`.
local function run(cmd, env, why)
  local out, status = H.run('env -u DSLUA_DEVICE ' .. (env or '') .. ' ' .. H.bin() .. ' ' .. cmd)
  assert(status == 0, string.format('`dslua %s` exited with %s:\n%s', cmd, tostring(status), out))
  H.has(out, 'dslua: rank 0 uses cuda:0, ')
  H.has(out, '(' .. (why or 'LOCAL_RANK 0') .. ')')
  return out
end

local function number(out, pattern)
  local v = tonumber(out:match(pattern))
  assert(v, string.format('no match for %q in:\n%s', pattern, out))
  return v
end

describe('#gpu examples on the GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end

  it('quickstart: 60 steps, the loss falls, and it samples', function()
    local cfg = H.edited_config('examples/quickstart/ds.json', function(c)
      c.steps_per_print = 20
      c.scheduler.params.total_num_steps = 60
      c.scheduler.params.warmup_num_steps = 10
    end)
    local out = run('examples/quickstart/train.lua --config ' .. cfg .. ' --steps 60')
    os.remove(cfg)
    H.has(out, 'parameters; on cuda:0, ')
    assert.matches('%[Rank 0%] step=60, skipped=0', out)
    local final = number(out, 'final loss ([%d.]+) after 60 steps %(960 samples%)')
    local first = number(out, 'first step ([%d.]+)')
    assert(final < first - 1, string.format('loss %.4f after 60 steps, %.4f at the first', final, first))
    assert.matches('sample:\nlocal function ', out)
  end)

  it('shakespeare: 20 steps with DSLUA_DEVICE=cuda, the val loss falls, and it samples', function()
    local dir, absent = H.shared_data('tinyshakespeare/input.txt')
    if not dir then return pending(absent) end
    local cfg = H.edited_config('examples/shakespeare/ds.json', function(c)
      c.steps_per_print = 10
      c.scheduler.params.warmup_num_steps = 5
    end)
    local out = run('examples/shakespeare/train.lua --config ' .. cfg .. ' --data ' .. dir
                    .. '/tinyshakespeare/input.txt --steps 20 --eval-batches 4 --sample-chars 40',
                    'DSLUA_DEVICE=cuda', 'DSLUA_DEVICE=cuda')
    os.remove(cfg)
    H.has(out, 'x 128 tokens; on cuda:0, ')
    local before = number(out, 'step 0: val loss ([%d.]+)')
    local first = number(out, 'step 20: train loss [%d.]+ %(first step ([%d.]+)%)')
    local last = number(out, 'step 20: train loss ([%d.]+)')
    local after = number(out, 'step 20: train loss [%d.]+ %(first step [%d.]+%), val loss ([%d.]+)')
    assert(last < first and after < before,
           string.format('train loss %.4f -> %.4f, val loss %.4f -> %.4f', first, last, before, after))
    local sample = out:match('sample:\n(.*)\n$')
    assert.matches('^ROMEO:', sample)
    assert.are.equal(6 + 40, #sample)
  end)

  for _, model in ipairs({ 'mlp', 'cnn' }) do
    it('mnist: the ' .. model .. ' trains 60 steps and the test accuracy is far above chance', function()
      local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
      if not dir then return pending(absent) end
      local flag = model == 'cnn' and ' --device cuda:0' or ''
      local out = run('examples/mnist/train.lua --model ' .. model .. ' --data ' .. dir .. '/mnist --steps 60' .. flag,
                      nil, model == 'cnn' and '--device cuda:0' or nil)
      H.has(out, 'epochs of 125 steps; on cuda:0, ')
      local loss = number(out, 'epoch 1: train loss ([%d.]+)')
      local acc = number(out, 'final test accuracy ([%d.]+)%% on the last 2000 images after 60 steps')
      assert(loss < math.log(10) and acc > 60, string.format('train loss %.4f, accuracy %.2f%%', loss, acc))
    end)
  end

  it('uneven: one rank with the comparison config trains 40 steps', function()
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    local out = run('examples/uneven/train.lua --config examples/uneven/ds_1rank.json --data ' .. dir
                    .. '/mnist --steps 40')
    H.has(out, 'rank 0 on cuda:0, ')
    local loss = number(out, 'epoch 0: rank 0 train loss ([%d.]+)')
    local acc = number(out, 'final test accuracy ([%d.]+)%% on the last 2000 images after 40 steps')
    assert(loss < math.log(10) and acc > 50, string.format('train loss %.4f, accuracy %.2f%%', loss, acc))
  end)

  it('uneven: 2 ranks (48 and 16) train 20 steps, on a GPU each or sharing one over MPI', function()
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    local out, status = H.run('env -u DSLUA_DEVICE DSLUA_NUM_THREADS=1 ' .. H.bin() .. ' -n 2 examples/uneven/train.lua '
                              .. '--config examples/uneven/ds.json --data ' .. dir .. '/mnist --steps 20')
    assert.are.equal(0, status, out)
    local shared = ds.cuda.device_count() < 2
    H.has(out, 'dslua: rank 0 uses cuda:0, ')
    H.has(out, 'dslua: rank 1 uses cuda:' .. (shared and 0 or 1) .. ', ')
    if shared then H.has(out, 'dslua: ranks 0-1 share cuda:0: collectives of device tensors over MPI') end
    H.has(out, '2 ranks, train_batch_size 64')
    local acc = number(out, 'final test accuracy ([%d.]+)%% on the last 2000 images after 20 steps, 1280 samples')
    assert(acc > 40, string.format('accuracy %.2f%% after 20 steps', acc))
  end)

  it('spiral: 300 steps of plain autograd on ds.device(), the loss falls, the test accuracy is high', function()
    local out = run('examples/spiral/train.lua --steps 300')
    H.has(out, 'MLP 2-128-3, on cuda:0, ')
    local loss = number(out, 'done in [%d.]+s: loss ([%d.]+)')
    local acc = number(out, 'test accuracy ([%d.]+)%%')
    assert(loss < 0.3 and acc > 85, string.format('loss %.4f (ln 3 = 1.0986 at the start), test accuracy %.1f%%',
                                                  loss, acc))
  end)
end)
