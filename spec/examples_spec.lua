-- The examples, each run for a few steps in a child process on the CPU
-- (DSLUA_DEVICE=cpu, as on a GPU machine too; spec/gpu/examples_spec.lua
-- runs them on the GPU): the exit status, the device it said it used, the
-- engine's progress line and the example's final metric line. The data sets
-- come from ../shared/data (or $DSLUA_DATA); without them those examples
-- skip with a line saying so.
local H = require 'helpers'
local ds = H.ds

local bin = 'DSLUA_DEVICE=cpu ' .. H.bin()

-- said: the line naming the device (default DSLUA_DEVICE's; false: none,
-- for a run that skips before it picks one)
local function run(cmd, said)
  local out, status = H.run(bin .. ' ' .. cmd)
  assert(status == 0, string.format('`dslua %s` exited with %s:\n%s', cmd, tostring(status), out))
  if said ~= false then H.has(out, said or 'dslua: rank 0 uses the CPU (DSLUA_DEVICE=cpu)') end
  return out
end

describe('examples', function()
  teardown(H.mpi_cleanup)
  it('quickstart: trains 20 steps on its embedded corpus and samples', function()
    local cfg = H.edited_config('examples/quickstart/ds.json', function(c) c.steps_per_print = 10 end)
    local out = run('examples/quickstart/train.lua --config ' .. cfg .. ' --steps 20')
    os.remove(cfg)
    assert.matches('%[Rank 0%] step=10, skipped=0, lr=%[', out)
    assert.matches('%[Rank 0%] step=20, skipped=0', out)
    assert.matches('final loss %d+%.%d+ after 20 steps %(320 samples%)', out)
    assert.matches('sample:\nlocal function ', out)
    H.has(out, 'model: 239040 parameters; on cpu, ')
  end)

  it('spiral: trains 200 steps with plain autograd on ds.device() and evaluates', function()
    local out = run('examples/spiral/train.lua --steps 200')
    H.has(out, 'MLP 2-128-3, on cpu, ')
    local loss, train, test = out:match('loss ([%d.]+), train accuracy ([%d.]+)%%, test accuracy ([%d.]+)%%')
    assert(loss, 'no final line in:\n' .. out)
    assert(tonumber(loss) < 0.3 and tonumber(test) > 85,
           string.format('loss %s, train %s%%, test %s%% after 200 steps', loss, train, test))
  end)

  it('spiral: --device picks the device over DSLUA_DEVICE, and a bad one is an error naming the flag', function()
    local out, status = H.run('DSLUA_DEVICE=cuda ' .. H.bin() .. ' examples/spiral/train.lua --steps 5 --device cpu')
    assert.are.equal(0, status, out)
    H.has(out, 'dslua: rank 0 uses the CPU (--device cpu)')
    H.has(out, 'MLP 2-128-3, on cpu, ')
    out, status = H.run(H.bin() .. ' examples/spiral/train.lua --steps 5 --device gpu')
    assert.are_not.equal(0, status, out)
    H.has(out, '--device gpu: not a device (expected cpu, cuda for this rank\'s GPU, or cuda:N)')
  end)

  it('live_reload: trains 20 steps with its Lua schedule and names the version it ran', function()
    local out = run('examples/live_reload/train.lua --steps 20')
    assert.matches('%[Rank 0%] step=20, skipped=0, lr=%[0%.0021%]', out)
    assert.matches('final loss %d+%.%d+ after 20 steps', out)
    local f = assert(io.open('examples/live_reload/schedule.lua', 'rb'))
    local hash = ds.reload.sha256(f:read('*a'))
    f:close()
    assert.matches('examples/live_reload/schedule%.lua: sha256 ' .. hash:sub(1, 12) .. ', loaded at step 0', out)
  end)

  it('mnist: trains 25 steps of the MLP and reports the test accuracy', function()
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    local out = run('examples/mnist/train.lua --config examples/mnist/ds.json --data ' .. dir .. '/mnist --steps 25')
    assert.matches('8000 training images, 2000 test images', out)
    assert.matches('%[Rank 0%] step=25, skipped=0, lr=%[[%d.e-]+%], mom=%[0%.9%]', out)
    assert.matches('%[Rank 0%] epoch=1/micro_step=25/global_step=25, RunningAvgSamplesPerSec=', out)
    local acc = tonumber(out:match('final test accuracy ([%d.]+)%% on the last 2000 images after 25 steps'))
    assert(acc, 'no final accuracy line in:\n' .. out)
    assert(acc > 50, string.format('accuracy %.2f%% after 25 steps', acc))
    H.has(out, 'epochs of 125 steps; on cpu, ')
  end)

  it('mnist: the CNN with --device cpu trains 40 steps and reports the test accuracy', function()
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    local out = run('examples/mnist/train.lua --model cnn --device cpu --data ' .. dir .. '/mnist --steps 40',
                    'dslua: rank 0 uses the CPU (--device cpu)')
    H.has(out, 'cnn with ')
    local acc = tonumber(out:match('final test accuracy ([%d.]+)%% on the last 2000 images after 40 steps'))
    assert(acc and acc > 30, 'accuracy after 40 steps in:\n' .. out)
  end)

  it('uneven: one rank with its comparison config trains 20 steps and reports the test accuracy', function()
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    local out = run('examples/uneven/train.lua --config examples/uneven/ds_1rank.json --data ' .. dir
                    .. '/mnist --steps 20')
    H.has(out, '1 ranks, train_batch_size 64')
    H.has(out, 'rank 0 on cpu, ')
    local acc = tonumber(out:match('final test accuracy ([%d.]+)%% on the last 2000 images after 20 steps'))
    assert(acc and acc > 40, 'accuracy after 20 steps in:\n' .. out)
  end)

  for _, name in ipairs { 'mnist', 'pipeline' } do
    it(name .. ': without the data folder, names the missing files and exits 0', function()
      local out = run('examples/' .. name .. '/train.lua --data /nonexistent/mnist', false)
      assert.matches('skipping: no MNIST t10k files in /nonexistent/mnist', out)
    end)
  end

  it('pipeline: 2 stages x 2 data ranks train 20 steps with train_batch() and report the test accuracy', function()
    local dir, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not dir then return pending(absent) end
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local cmd = H.ranks_cmd(4) .. ' examples/pipeline/train.lua --config examples/pipeline/ds.json --data ' .. dir
                .. '/mnist --steps 20'
    local out, status = H.run(cmd .. ' 2>&1')
    assert(status == 0, string.format('`%s` exited with %s:\n%s', cmd, tostring(status), out))
    H.has(out, '4 ranks: 2 stages x 2 data parallel; 2 micro batches of 16 a step; 20 steps')
    H.has(out, 'stage 0: layers 0..2, 401920 parameters')
    H.has(out, 'stage 1: layers 3..5, 133898 parameters')
    local acc = tonumber(out:match('accuracy ([%d.]+)%% %(%d+/2000%) after 20 steps'))
    assert(acc and acc > 50, 'accuracy after 20 steps in:\n' .. out)
  end)

  it('3d: pipe 2 x tensor 2 x data 2 on 8 ranks trains as one rank does', function()
    if not H.have_mpirun() then return pending('mpirun is not on PATH') end
    local args = ' examples/3d/train.lua --config examples/3d/ds.json --steps 20 2>&1'
    local out, status = H.run(H.ranks_cmd(8) .. args)
    assert(status == 0, out)
    H.has(out, '[rank 7] pipe 2 x data 2 x tensor 2: stage 1, data index 1, tensor rank 1, layers 2..3')
    local one = run('examples/3d/train.lua --config examples/3d/ds.json --steps 20')
    local a = tonumber(one:match('done: 20 steps, loss ([%d.]+)'))
    local b = tonumber(out:match('done: 20 steps, loss ([%d.]+)'))
    assert(a and b, out .. one)
    -- within 1e-5 in f32, and the printed six decimals' rounding
    assert(math.abs(a - b) <= 1e-5 * a + 1e-6, string.format('8 ranks %.6f, one rank %.6f', b, a))
  end)

  it('shakespeare: trains 6 steps, the val loss falls, and it samples from "ROMEO:"', function()
    local dir, absent = H.shared_data('tinyshakespeare/input.txt')
    if not dir then return pending(absent) end
    local cfg = H.edited_config('examples/shakespeare/ds.json', function(c)
      c.steps_per_print = 3
      c.scheduler.params.warmup_num_steps = 2
    end)
    local out = run('examples/shakespeare/train.lua --config ' .. cfg .. ' --data ' .. dir
                    .. '/tinyshakespeare/input.txt --steps 6 --eval-batches 1 --sample-chars 20')
    os.remove(cfg)
    assert.matches('vocabulary 65, 1003854 train / 111540 val', out)
    assert.matches('%[Rank 0%] step=6, skipped=0, lr=%[[^]]+%], mom=%[%(0%.9, 0%.99%)', out)
    local before = tonumber(out:match('step 0: val loss ([%d.]+)'))
    local after = tonumber(out:match('step 6: train loss [%d.]+ %(first step [%d.]+%), val loss ([%d.]+)'))
    assert(before and after, 'no val loss lines in:\n' .. out)
    assert(after < before, string.format('val loss %.4f after 6 steps, %.4f before', after, before))
    local sample = out:match('sample:\n(.*)\n$')
    assert.matches('^ROMEO:', sample)
    assert.are.equal(6 + 20, #sample)
    H.has(out, 'x 128 tokens; on cpu, ')
  end)

  describe('shards', function()
    local out_dir
    after_each(function()
      if out_dir then os.execute('rm -rf ' .. out_dir) end
      out_dir = nil
    end)

    it('writes byte-level shards of tiny Shakespeare with Python and trains 6 steps on them, the val loss falls', function()
      local dir, absent = H.shared_data('tinyshakespeare/input.txt')
      if not dir then return pending(absent) end
      local _, status = H.run('python3 -c pass')
      if status ~= 0 then return pending('python3 is not on PATH') end
      out_dir = H.tmpdir()
      local w, ws = H.run('python3 examples/shards/write_shards.py ' .. dir .. '/tinyshakespeare/input.txt ' .. out_dir
                          .. ' --shard-tokens 300000 --encoding bytes')
      assert.are.equal(0, ws, w)
      H.has(w, '1115394 tokens (bytes, vocabulary 256): 4 train shards, 111539 val tokens')
      local out = run('examples/shards/train.lua --data ' .. out_dir .. ' --vocab 256 --steps 6 --eval-batches 2')
      H.has(out, '4 train shards (1003855 tokens, 7840 windows of 128), 871 val windows; vocabulary 256')
      local before = tonumber(out:match('step 0: val loss ([%d.]+)'))
      local after = tonumber(out:match('step 6: train loss [%d.]+ %(first step [%d.]+%), val loss ([%d.]+)'))
      assert(before and after, 'no val loss lines in:\n' .. out)
      assert(after < before, string.format('val loss %.4f after 6 steps, %.4f before', after, before))
    end)
  end)

  it('shakespeare: without the text, names the missing file and exits 0', function()
    local out = run('examples/shakespeare/train.lua --data /nonexistent/input.txt', false)
    assert.matches('skipping: /nonexistent/input.txt is absent', out)
  end)
end)
