local H = require 'helpers'
local ds = H.ds

-- A small regression problem: fixed data, a fixed initial MLP.
local function problem(n)
  ds.manual_seed(7)
  local x = ds.randn(n, 6)
  local y = ds.randn(n, 2)
  return x, y
end

local Reg = H.two_layer('Reg')

local function model_with(state)
  ds.manual_seed(3)
  local m = Reg()
  if state then m:load_state_dict(state) end
  return m
end

local function weights(m)
  local out = {}
  for _, p in ipairs(m:named_parameters()) do out[p[1]] = p[2]:clone() end
  return out
end

local function config(extra)
  local c = {
    train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 1, steps_per_print = 1000,
    optimizer = { type = 'SGD', params = { lr = 0.1 } },
  }
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end

describe('ds.initialize', function()
  it('returns engine, optimizer, loader and scheduler, as DeepSpeed does', function()
    local x, y = problem(16)
    local engine, opt, loader, sched = ds.initialize {
      model = model_with(), config = config { scheduler = { type = 'WarmupLR', params = { warmup_num_steps = 10 } } },
      training_data = ds.data.tensors { x = x, y = y },
    }
    assert.is_table(engine)
    assert.is_function(opt.step)
    assert.are.equal(4, #loader)
    assert.is_function(sched.step)
    assert.are.equal(4, engine:train_batch_size())
  end)

  it('names what is wrong in its options', function()
    local ok, err = pcall(ds.initialize, { model = model_with(), config = config(), bogus = 1 })
    assert.is_false(ok)
    assert.matches("unknown option 'bogus'", err)
    ok, err = pcall(ds.initialize, { model = model_with(), config = { train_batch_size = 4 } })
    assert.is_false(ok)
    assert.matches('no optimizer', err)
    ok, err = pcall(ds.initialize, { model = {}, config = config() })
    assert.is_false(ok)
    assert.matches('model must be a ds.nn module', err)
    ok, err = pcall(ds.initialize, { model = model_with(), config = { train_batch_sizee = 4 } })
    assert.is_false(ok)
    assert.matches("did you mean 'train_batch_size'", err)
  end)
end)

describe('engine steps', function()
  it('accumulates micro batches into one step equal to the whole batch', function()
    local x, y = problem(8)
    local init = weights(model_with())
    -- one micro batch of 8
    local big = model_with(init)
    local e1 = ds.initialize { model = big, config = config { train_micro_batch_size_per_gpu = 8 } }
    e1:backward(e1:forward { x = x, y = y })
    e1:step()
    -- two micro batches of 4, gradient_accumulation_steps 2
    local small = model_with(init)
    local e2 = ds.initialize { model = small, config = config { gradient_accumulation_steps = 2 } }
    local seen = {}
    for k = 0, 1 do
      local b = { x = x:narrow(1, 1 + 4 * k, 4), y = y:narrow(1, 1 + 4 * k, 4) }
      seen[#seen + 1] = e2:is_gradient_accumulation_boundary()
      e2:backward(e2(b))
      e2:step()
    end
    assert.are.same({ false, true }, seen)
    assert.are.equal(1, e2.global_steps)
    assert.are.equal(8, e2.global_samples)
    assert.are.equal(2, e2.micro_steps)
    local w1, w2 = weights(big), weights(small)
    for name, t in pairs(w1) do H.assert_close(w2[name], t, { rtol = 1e-5, atol = 1e-6 }, name) end
  end)

  it('keeps each micro step\'s loss in last_loss, asked before or after the step, and refuses a loss of many values',
     function()
    local x, y = problem(8)
    local e = ds.initialize { model = model_with(), config = config() }
    local losses = {}
    for k = 0, 1 do
      local loss = e(({ x = x:narrow(1, 1 + 4 * k, 4), y = y:narrow(1, 1 + 4 * k, 4) }))
      losses[k + 1] = loss:item()
      e:backward(loss)
      if k == 0 then assert.are.equal(losses[1], e.last_loss) end
      e:step()
    end
    assert.are_not.equal(losses[1], losses[2])
    assert.are.equal(losses[2], e.last_loss)
    local ok, err = pcall(e.backward, e, ds.ones(3):requires_grad_())
    assert.is_false(ok)
    assert.matches('backward: the loss must hold one value, got 3', err, 1, true)
    assert.are.equal(losses[2], e.last_loss)
  end)

  it('clips by the global gradient norm with DeepSpeed\'s formula', function()
    local x, y = problem(4)
    local init = weights(model_with())
    local clip = 1e-3
    local m = model_with(init)
    local e = ds.initialize { model = m, config = config { gradient_clipping = clip } }
    -- the reference: gradients by plain autograd, scaled by clip / (norm + 1e-6)
    local ref = model_with(init)
    ref:forward({ x = x, y = y }):backward()
    local sq = 0
    for _, p in ipairs(ref:parameters()) do sq = sq + p.grad:norm():item() ^ 2 end
    local coef = clip / (math.sqrt(sq) + 1e-6)
    assert.is_true(coef < 1)
    e:backward(e:forward { x = x, y = y })
    e:step()
    H.assert_close(e.grad_norm, math.sqrt(sq), { rtol = 1e-5, atol = 0 })
    local got = weights(m)
    for _, np in ipairs(ref:named_parameters()) do
      local want = init[np[1]] - np[2].grad * (0.1 * coef)
      H.assert_close(got[np[1]], want, { rtol = 1e-5, atol = 1e-7 }, np[1])
    end
  end)

  it('steps the scheduler after the optimizer and takes a Lua schedule function', function()
    local x, y = problem(4)
    local e, opt = ds.initialize {
      model = model_with(), config = config(),
      lr_scheduler = function(step) return 0.5 / (step + 1) end,
    }
    local used = {}
    for _ = 1, 3 do
      used[#used + 1] = opt.param_groups[1].lr
      e:backward(e:forward { x = x, y = y })
      e:step()
    end
    assert.are.same({ 0.5, 0.25, 0.5 / 3 }, used)
    assert.are.same({ 0.125 }, e:get_lr())
  end)

  it('takes a scheduler given to initialize over the config\'s, as DeepSpeed, and says so', function()
    local x, y = problem(4)
    local said, stdout = {}, io.stdout
    io.stdout = { write = function(self, ...) said[#said + 1] = table.concat({ ... }) return self end,
                  flush = function() end }
    local ok, e = pcall(ds.initialize, {
      model = model_with(), config = config { scheduler = { type = 'WarmupLR', params = { warmup_num_steps = 10 } } },
      lr_scheduler = function(step) return 0.5 / (step + 1) end,
    })
    io.stdout = stdout
    assert(ok, e)
    H.has(table.concat(said), "using the client LR scheduler passed to initialize, not the config's scheduler WarmupLR")
    e:backward(e:forward { x = x, y = y })
    e:step()
    assert.are.same({ 0.25 }, e:get_lr())
  end)

  it('reads a config file\'s Lua schedule next to it, a table config\'s from the working directory', function()
    local dir = H.tmpdir()
    H.write(dir .. '/sched.lua', 'return function(step) return 0.5 / (step + 1) end')
    H.write(dir .. '/ds.json', ds.json.encode(config { scheduler = { type = 'lua', params = { path = 'sched.lua' } } }))
    local e = ds.initialize { model = model_with(), config = dir .. '/ds.json' }
    assert.are.same({ 0.5 }, e:get_lr())
    assert.are.equal(dir .. '/sched.lua', e.config.scheduler.params.path)
    local out, status = H.run(H.bin() .. ' --check-config ' .. dir .. '/ds.json')
    assert.are.equal(0, status, out)
    local params = { path = 'spec/fixtures/lr_schedule.lua', warmup = 5, peak = 0.01, decay = 0.9 }
    e = ds.initialize { model = model_with(), config = config { scheduler = { type = 'lua', params = params } } }
    assert.are.equal('spec/fixtures/lr_schedule.lua', e.config.scheduler.params.path)
  end)

  it('erases a progress bar\'s unfinished line before its log lines, not leaving it drawn above them', function()
    local x, y = problem(4)
    local e = ds.initialize { model = model_with(), config = config { steps_per_print = 1 } }
    local said, stdout = {}, io.stdout
    local out = { write = function(self, ...) said[#said + 1] = table.concat({ ... }) return self end,
                  flush = function() end }
    e.bar = require('dslua.io.progress').new { total = 5, label = 'epoch 1', tty = true, out = out }
    e.bar_first_step, e.bar_first_samples = 0, 0
    io.stdout = out
    local ok, err = pcall(function()
      e:backward(e:forward { x = x, y = y })
      e:step()
    end)
    io.stdout = stdout
    assert(ok, err)
    local text = table.concat(said)
    local bar, clear, line = text:find('epoch 1 [', 1, true), text:find('\r\27[K', 1, true), text:find('[Rank 0] step=1', 1, true)
    assert.is_truthy(bar and clear and line, text)
    assert.is_true(bar < clear and clear < line, text)
    assert.is_nil(text:find('\27[K\n', 1, true), text)      -- the bar's line not ended where it stood
  end)

  it('takes an optimizer built in Lua in place of the config block', function()
    local m = model_with()
    local opt = ds.optim.AdamW(m:parameters(), { lr = 1e-3 })
    local e, o = ds.initialize { model = m, optimizer = opt, config = { train_batch_size = 2 } }
    assert.are.equal(opt, o)
    assert.are.same({ { 0.9, 0.999 } }, e:get_mom())
  end)

  it('changes the batch size through gradient accumulation', function()
    local e = ds.initialize { model = model_with(), config = config() }
    e:set_train_batch_size(12)
    assert.are.equal(3, e:gradient_accumulation_steps())
    assert.are.equal(12, e:train_batch_size())
    local ok, err = pcall(e.set_train_batch_size, e, 10)
    assert.is_false(ok)
    assert.matches('Train batch size must be divisible by micro%-batch data parallelism', err)
  end)

  it('skips a bf16 step whose gradients are not finite under bf16.check_grad_overflow, at every stage', function()
    local x, y = problem(4)
    for stage = 0, 3 do
      local e = ds.initialize { model = model_with(), config = config {
        bf16 = { enabled = true, check_grad_overflow = true }, zero_optimization = { stage = stage } } }
      local before = e.module.fc2.weight:to('f32')
      e:backward(e { x = x, y = y } * (0 / 0))
      e:step()
      assert.are.equal(1, e.skipped_steps, 'stage ' .. stage)
      assert.are.equal(1, e.global_steps, 'stage ' .. stage)
      H.assert_same(e.module.fc2.weight:to('f32'), before, 'stage ' .. stage .. ' weights')
      e:backward(e { x = x, y = y })
      e:step()
      assert.are.equal(1, e.skipped_steps, 'stage ' .. stage .. ': a finite step goes on')
      assert.is_true((e.module.fc2.weight:to('f32') - before):abs():amax():item() > 0, 'stage ' .. stage)
      e:destroy()
    end
  end)

  it('refuses a batch size the config would refuse, keeping the one it has', function()
    local e = ds.initialize { model = model_with(), config = config() }
    for _, n in ipairs({ 1e308, 2 ^ 40, 1 / 0, 0 / 0, 2.5, 0, -4 }) do
      local err = H.err(e.set_train_batch_size, e, n)
      assert.is_nil(err:find('divisible', 1, true), tostring(n) .. ': ' .. err)
    end
    assert.matches('set_train_batch_size: train_batch_size: must be an integer between %-2%^63 and 2%^63 %- 1, '
                   .. 'got 1e%+308', H.err(e.set_train_batch_size, e, 1e308))
    assert.matches('set_train_batch_size: train_batch_size: must be <= 2147483647', H.err(e.set_train_batch_size, e, 2 ^ 40))
    assert.are.equal(4, e:train_batch_size())
    assert.are.equal(1, e:gradient_accumulation_steps())
  end)

  it('switches the model between train and eval', function()
    local m = model_with()
    local e = ds.initialize { model = m, config = config() }
    assert.is_true(m.training)
    e:eval()
    assert.is_false(m.training)
    e:train()
    assert.is_true(m.training)
  end)
end)

describe('engine counters', function()
  it('reads the step counters as a table and restores them, rescaling micro_steps to this accumulation',
     function()
    local x, y = problem(8)
    local e = ds.initialize { model = model_with(), config = config { gradient_accumulation_steps = 2 } }
    for k = 0, 1 do
      e:backward(e { x = x:narrow(1, 1 + 4 * k, 4), y = y:narrow(1, 1 + 4 * k, 4) })
      e:step()
    end
    assert.are.same({ global_steps = 1, global_samples = 8, micro_steps = 2, skipped_steps = 0 }, e:counters())
    -- saved with 4 micro steps a window: 12 of them are 3 windows, 6 micro steps here
    e:restore_counters({ global_steps = 3, global_samples = 48, micro_steps = 12, skipped_steps = 1, epoch = 2 }, 4)
    assert.are.same({ global_steps = 3, global_samples = 48, micro_steps = 6, skipped_steps = 1, epoch = 2 },
                    e:counters())
    assert.are.equal(3, e.global_steps)
    assert.is_false(e:is_gradient_accumulation_boundary())
  end)

  it('refuses counters that are not non-negative integers, naming the counter, and keeps its own', function()
    local e = ds.initialize { model = model_with(), config = config() }
    local good = { global_steps = 1, global_samples = 4, micro_steps = 1, skipped_steps = 0 }
    for key, bad in pairs({ global_steps = -1, global_samples = 1.5, micro_steps = 'x', skipped_steps = false,
                            epoch = -2 }) do
      local t = {}
      for k, v in pairs(good) do t[k] = v end
      t[key] = bad
      local ok, err = pcall(e.restore_counters, e, t)
      assert.is_false(ok)
      assert.matches('restore_counters: ' .. key .. ' must be a non%-negative integer', err)
    end
    local ok, err = pcall(e.restore_counters, e, { global_steps = 1 })
    assert.is_false(ok)
    assert.matches('global_samples must be a non%-negative integer, got nil', err)
    ok, err = pcall(e.restore_counters, e, good, 0)
    assert.is_false(ok)
    assert.matches('gradient_accumulation_steps must be a positive integer, got 0', err)
    assert.are.same({ global_steps = 0, global_samples = 0, micro_steps = 0, skipped_steps = 0 }, e:counters())
  end)
end)

describe('engine logs', function()
  it('prints DeepSpeed\'s progress, throughput and timer lines', function()
    local dir = os.tmpname()
    os.remove(dir)
    os.execute('mkdir -p ' .. dir)
    local f = assert(io.open(dir .. '/run.lua', 'w'))
    f:write([[
      local ds = require 'dslua'
      ds.manual_seed(0)
      local model = require('models.mlp'){ input_size = 4, hidden = 8, num_classes = 3 }
      local labels = {}
      for i = 1, 32 do labels[i] = i % 3 end
      local data = ds.data.tensors{ x = ds.randn(32, 4), y = ds.tensor(labels, 'i64') }
      local engine, _, loader = ds.initialize{ model = model, training_data = data, config = {
        train_batch_size = 8, train_micro_batch_size_per_gpu = 4, steps_per_print = 2,
        wall_clock_breakdown = true,
        optimizer = { type = 'Adam', params = { lr = 0.01 } } } }
      for _, batch in loader:epoch(1) do
        engine:backward(engine:forward(batch))
        engine:step()
      end
      print('done', engine.global_steps, engine.global_samples)
    ]])
    f:close()
    local out, status = H.run(H.bin() .. ' ' .. dir .. '/run.lua')
    assert.are.equal(0, status, out)
    assert.matches('%[Rank 0%] step=2, skipped=0, lr=%[0%.01%], mom=%[%(0%.9, 0%.999%)%]', out)
    assert.matches('%[Rank 0%] step=4, skipped=0', out)
    assert.matches('%[Rank 0%] epoch=1/micro_step=4/global_step=2, RunningAvgSamplesPerSec=[%d.]+, '
                   .. 'CurrSamplesPerSec=[%d.]+, MemAllocated=[%d.]+GB, MaxMemAllocated=[%d.]+GB', out)
    assert.matches('%[Rank 0%] time %(ms%) | forward: [%d.]+ | backward: [%d.]+ | step: [%d.]+', out)
    assert.matches('done\t4\t32', out)
  end)
end)

describe('the step', function()
  -- a model of n parameter tensors of 3 elements
  local function model_of(n)
    local Many = ds.nn.Module:extend('Many')
    function Many:init()
      for i = 1, n do self['p' .. i] = ds.randn(3):requires_grad_() end
    end
    function Many:forward(x)
      local s
      for i = 1, n do
        local t = (self['p' .. i] * x):sum()
        s = s and s + t or t
      end
      return s
    end
    return Many()
  end

  -- Lua-C crossings of engine:backward and of engine:step, the third step
  local function crossings(n, extra)
    local cfg = { train_batch_size = 1, gradient_clipping = 1.0, steps_per_print = 1000,
                  optimizer = { type = 'AdamW', params = { lr = 1e-3 } } }
    for k, v in pairs(extra) do cfg[k] = v end
    local e = ds.initialize { model = model_of(n), config = cfg }
    local backward, step
    for _ = 1, 3 do
      local loss = e(ds.randn(3))
      backward = ds.crossings(function() e:backward(loss) end)
      step = ds.crossings(function() e:step() end)
    end
    e:destroy()
    return { backward = backward, step = step }
  end

  -- Each count holds ds.crossings' own 3 (pcall, the call of fn, sethook).
  -- backward: ds.is_tensor; loss:numel and loss:detach, each a lookup
  -- through the tensor's C __index and a call; ds.wall_time; the step
  -- engine's backward; under bf16 or ZeRO also loss:to('f32') (2).
  -- step: the step engine's step; ds.wall_time for the busy time; the live
  -- session's boundary (dslua/live/reload.lua): ds.wall_time twice, its
  -- round's require, attach's server poll, three ipairs loops over the
  -- watched files and one over the pending schedules (ipairs and the
  -- iterator's last call, 2 each), and the lr span of the one param group
  -- (ipairs, its iterator twice, math.min, math.max).
  it('crosses between Lua and C a fixed number of times, as often for 1,000 parameters as for 10', function()
    for _, c in ipairs({ { {}, 3 + 7, 3 + 19 },
                         { { bf16 = { enabled = true } }, 3 + 9, 3 + 19 },
                         { { zero_optimization = { stage = 2 } }, 3 + 9, 3 + 19 },
                         { { zero_optimization = { stage = 3 } }, 3 + 9, 3 + 19 } }) do
      local name = ds.json.encode(c[1])
      local few, many = crossings(10, c[1]), crossings(1000, c[1])
      assert.are.same({ backward = c[2], step = c[3] }, few, name)
      assert.are.same(few, many, name)
    end
  end)

  it('counts crossings, callbacks from C included', function()
    local function calls(k) return ds.crossings(function() for _ = 1, k do ds.zeros(1) end end) end
    assert.is_true(calls(1) > calls(0))
    assert.are.equal(calls(10) - calls(5), calls(5) - calls(0))
    -- a Lua function that C calls (the comparator) counts too
    local with = ds.crossings(function() table.sort({ 3, 1, 2 }, function(x, y) return x < y end) end)
    local without = ds.crossings(function() table.sort({ 3, 1, 2 }) end)
    assert.is_true(with > without)
  end)
end)
