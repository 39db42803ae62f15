-- Mixed precision and ZeRO (lua/dslua/engine/zero.lua): spec/zero/equiv.lua trains
-- a tiny GPT-2 for 50 steps with stages 0-3 in fp32 and bf16, with nvme
-- offload and with accumulation + clipping, on 1 rank and under mpirun on
-- 2 and 4; spec/zero/overflow.lua forces fp16 overflows; spec/zero/fold.lua
-- trains one rank, whose gradients go straight into the master gradients,
-- against two ranks of the same batches; spec/zero/kernels.lua counts the
-- step engine's kernels. Partitioned parameters are also checked in this
-- process.
local H = require 'helpers'
local ds = H.ds

-- Tolerances. fp32: the stages sum the same gradients in the same order,
-- so at one world size they agree to the last bit we can see (1e-6 leaves
-- room); against 1 rank a sum of N partial gradients rounds differently,
-- a few 2^-24 each step. equiv.lua's learning rate keeps AdamW below its
-- stability edge, where such differences shrink from step to step instead
-- of doubling (at 1e-2 they grew from 1e-7 to 1e-2 within 30 steps, eps
-- 1e-8 or 1e-4 alike), so the losses stay that close through 50 steps,
-- with accumulation and clipping too (measured at data seeds 0-9: 1.2e-7
-- at most; 1e-5 is about 170 units of 2^-24).
-- bf16: every rounding is 2^-8, 50 steps apart the runs are different
-- samples of one training (measured: losses within 1.7e-3 of one rank).
local SAME_RTOL = 1e-6         -- stage k vs stage 0, same world size, same dtype: losses and weights
local LOSS_RTOL = 1e-5         -- fp32, N ranks vs 1 rank, every step, with accumulation + clipping too
local LOSS_RTOL_BF16 = 5e-2    -- bf16, N ranks vs 1 rank, every step

local function rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

local function weight_err(w, ref)
  local worst = 0
  for name, v in pairs(w) do
    local r = assert(ref[name], name)
    assert.are.equal(#r, #v)
    local d, s = 0, 0
    for i = 1, #v do d = d + (v[i] - r[i]) ^ 2; s = s + r[i] ^ 2 end
    worst = math.max(worst, math.sqrt(d / s))
  end
  return worst
end

describe('partitioned parameters', function()
  local Z0 = require('dslua.core')._zero

  it('release their data, keep shape and dtype, and come back through the fetch function', function()
    local p = ds.randn(3, 4):requires_grad_()
    local keep = p:clone()
    Z0.release_data(p)
    assert.is_true(Z0.is_released(p))
    assert.are.same({ 3, 4 }, p:size())
    assert.are.equal('f32', p:dtype())
    H.err('has no data: a partitioned parameter', function() return p + 1 end)
    local fetched = 0
    Z0.set_fetch(function(t)
      fetched = fetched + 1
      Z0.set_data(t, keep:clone())
    end)
    assert.are.equal(keep:sum():item(), (p * 1):sum():item())
    assert.are.equal(1, fetched)
    Z0.set_fetch(nil)
  end)

  it('are fetched again by backward when released after forward', function()
    local w = ds.randn(4, 3):requires_grad_()
    local x = ds.randn(2, 4)
    local want = ds.matmul(x, w):sum()
    want:backward()
    local g = w.grad:clone()
    w.grad = nil
    local keep = w:clone()
    local y = ds.matmul(x, w):sum()
    Z0.release_data(w)
    H.err('no data', function() y:backward() end)
    y = (function() Z0.set_data(w, keep:clone()); return ds.matmul(x, w):sum() end)()
    Z0.release_data(w)
    local fetched = 0
    Z0.set_fetch(function(t) fetched = fetched + 1; Z0.set_data(t, keep:clone()) end)
    y:backward()
    Z0.set_fetch(nil)
    assert.are.equal(1, fetched)
    H.assert_close(g, w.grad)
  end)

  it('refuse data of another shape or dtype', function()
    local p = ds.randn(3, 4):requires_grad_()
    H.err('set_data: f32 [3,4] needs a contiguous f32 tensor', function() Z0.set_data(p, ds.randn(5)) end)
    H.err('set_data', function() Z0.set_data(p, ds.randn(12):to('bf16')) end)
    H.err('only a leaf', function() Z0.release_data(p * 2) end)
  end)
end)

describe('ZeRO and mixed precision', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  local run = H.runs_by_np(dir, function(np, json)
    return H.ranks_cmd(np) .. ' spec/zero/equiv.lua ' .. json .. ' ' .. dir .. '/nvme' .. np
  end)

  local function same(case, ref, tol, what)
    assert.are.equal(50, #case.losses)
    for i, l in ipairs(ref.losses) do
      assert.is_true(rel(case.losses[i], l) <= tol, string.format('%s: step %d loss %.9g vs %.9g', what, i,
                                                                 case.losses[i], l))
    end
  end

  for _, np in ipairs({ 2, 4 }) do
    it('stages 1, 2, 3 and nvme offload train as stage 0 on ' .. np .. ' ranks (fp32 and bf16)', function()
      local r = run(np)
      for _, suffix in ipairs({ '', '_bf16' }) do
        local base = r['z0' .. suffix]
        for stage = 1, 3 do
          local c = r['z' .. stage .. suffix]
          same(c, base, SAME_RTOL, 'stage ' .. stage .. suffix)
          local e = weight_err(c.weights, base.weights)
          assert.is_true(e <= SAME_RTOL, string.format('stage %d%s weights differ by %.3g', stage, suffix, e))
        end
      end
      same(r.z2_nvme, r.z2, SAME_RTOL, 'nvme')
      assert.is_true(weight_err(r.z2_nvme.weights, r.z2.weights) <= SAME_RTOL)
      -- offload_param: the shards in host memory or a file, fetched for each module
      for _, name in ipairs({ 'z3_param_cpu', 'z3_param_nvme' }) do
        same(r[name], r.z3, SAME_RTOL, name)
        assert.is_true(weight_err(r[name].weights, r.z3.weights) <= SAME_RTOL, name)
        assert.is_truthy(r[name].zero_lines[1]:find('parameter offload ' .. name:match('_(%a+)$'), 1, true))
      end
      for _, name in ipairs({ 'z0', 'z1', 'z2', 'z0_bf16', 'z1_bf16', 'z2_bf16', 'z1_gas2_clip', 'z2_nvme' }) do
        assert.are.equal(0, r[name].rank_diff, name .. ': every rank holds rank 0\'s weights')
      end
    end)

    it('matches one rank on ' .. np .. ' ranks within the stated tolerances', function()
      local one, many = run(1), run(np)
      for stage = 0, 3 do
        same(many['z' .. stage], one.z0, LOSS_RTOL, 'fp32 stage ' .. stage)
        same(many['z' .. stage .. '_bf16'], one.z0_bf16, LOSS_RTOL_BF16, 'bf16 stage ' .. stage)
      end
      for _, name in ipairs({ 'z1_gas2_clip', 'z3_gas2_clip' }) do
        same(many[name], one.z0_gas2_clip, LOSS_RTOL, name)
      end
      -- bf16 learns as fp32 does: the last 10 steps' mean loss within 2%
      local function tail(c)
        local s = 0
        for i = 41, 50 do s = s + c.losses[i] end
        return s / 10
      end
      assert.is_true(rel(tail(many.z3_bf16), tail(one.z0)) < 0.02)
      -- Lamb's trust ratios come from whole parameters whatever the shards
      same(many.z1_lamb, one.z0_lamb, LOSS_RTOL, 'Lamb stage 1')
      same(many.z3_lamb, one.z0_lamb, LOSS_RTOL, 'Lamb stage 3')
      assert.is_true(rel(tail(many.z2_lamb_bf16), tail(one.z0_lamb)) < 0.02, 'Lamb bf16 stage 2')
    end)

    it('divides optimizer state, gradients and parameters by ' .. np .. ' (allocator counters)', function()
      local r = run(np)
      local base = r.z0.memory
      -- every parameter's shards are padded to np equal pieces: at most
      -- np - 1 elements of 4 bytes per parameter tensor (14 here)
      local pad = 14 * (np - 1) * 4
      local function near(got, whole, what)
        local want = whole / np
        assert.is_true(math.abs(got - want) <= 0.02 * want + pad,
                       string.format('%s: %d bytes, 1/%d of %d is %d', what, got, np, whole, want))
      end
      for rank = 1, np do
        local b = base[rank]
        assert.are.equal(0, b.master_weights)
        for stage = 1, 3 do
          local m = r['z' .. stage].memory[rank]
          near(m.optimizer_state, b.optimizer_state, 'stage ' .. stage .. ' optimizer state')
          near(m.master_weights, b.parameters, 'stage ' .. stage .. ' master weights')
          if stage >= 2 then near(m.gradients, b.gradients, 'stage ' .. stage .. ' gradients') end
          if stage == 3 then near(m.parameters, b.parameters, 'stage 3 parameters') end
        end
        near(r.z3_bf16.memory[rank].parameters, b.parameters / 2, 'stage 3 bf16 parameters')
        -- nvme: the state lives in files; memory holds the piece buffers
        assert.is_true(r.z2_nvme.memory[rank].optimizer_state < b.optimizer_state)
        assert.are.equal(0, r.z2_nvme.memory[rank].master_weights)
        -- offload_param nvme: no shard stays in memory between steps
        assert.are.equal(0, r.z3_param_nvme.memory[rank].parameters)
        assert.are.equal(r.z3.memory[rank].parameters, r.z3_param_cpu.memory[rank].parameters)
      end
    end)
  end

  it('reduces a short last shard\'s padding as zeros, and rows the gradients fill need none', function()
    local json = dir .. '/padding.json'
    local r = H.run_json(H.ranks_cmd(2) .. ' spec/zero/padding.lua ' .. json, json)
    for _, name in ipairs({ 'odd', 'even' }) do
      local base = r[name .. 0]
      for stage = 1, 3 do
        local c = r[name .. stage]
        for step = 1, 3 do
          assert.is_true(rel(c[step], base[step]) <= SAME_RTOL, string.format('%s stage %d step %d: norm %.9g vs %.9g',
                                                                              name, stage, step, c[step], base[step]))
        end
      end
    end
  end)

  it('prints what each rank holds, on rank 0', function()
    local r, out = run(2)
    assert.truthy(out:find('ZeRO stage 1 | rank 1 | optimizer holds 3,432 of 6,864 parameters', 1, true), out)
    assert.truthy(out:find('ZeRO stage 3 | rank 0 | optimizer holds 3,432 of 6,864 parameters | gradients hold '
                           .. '3,432 | parameters hold 3,432', 1, true))
    assert.truthy(out:find('ZeRO stage 0 | rank 1 | optimizer holds 6,864 of 6,864 parameters | bf16 compute, '
                           .. 'fp32 master', 1, true))
    assert.are.same(r.z1.zero_lines[2], 'ZeRO stage 1 | rank 1 | optimizer holds 3,432 of 6,864 parameters')
  end)

  -- DeepSpeed's DynamicLossScaler.update_scale (stable_interval form), transcribed on its own
  local function expected_scales(bad, n, init, window, hysteresis, consecutive)
    local scale, hyst, iter, last, out = init, hysteresis, 0, -1, {}
    for s = 1, n do
      if bad[s] then
        if hysteresis == 1 or hyst == 1 then scale = math.max(scale / 2, 1) else hyst = hyst - 1 end
        last = iter
      else
        if consecutive then hyst = hysteresis end
        local stable = iter - last - 1
        if stable > 0 and stable % window == 0 then
          if not consecutive then hyst = hysteresis end
          scale = scale * 2
        end
      end
      iter = iter + 1
      out[s] = scale
    end
    return out
  end

  local function overflow_run(np, steps, stage, hysteresis, consecutive, min_scale)
    local json = dir .. '/overflow.json'
    local out, status = H.run(H.ranks_cmd(np) .. ' spec/zero/overflow.lua ' .. json .. ' "' .. steps
                              .. '" ' .. stage .. ' ' .. hysteresis .. ' ' .. tostring(consecutive) .. ' '
                              .. (min_scale or 1))
    if status ~= 0 then return nil, out end
    local f = assert(io.open(json))
    local r = ds.json.decode(f:read('*a'))
    f:close()
    os.remove(json)
    return r.steps, out
  end

  for _, c in ipairs({ { np = 1, stage = 0, hyst = 2, cons = false }, { np = 2, stage = 2, hyst = 2, cons = true },
                       { np = 2, stage = 3, hyst = 1, cons = false } }) do
    it(string.format('fp16 skips overflowing steps, halves the scale after hysteresis %d, holds the scheduler '
                     .. '(%d rank(s), stage %d, consecutive_hysteresis %s)', c.hyst, c.np, c.stage,
                     tostring(c.cons)), function()
      local forced = '1 2 3 5 9 10 11'
      local bad = {}
      for s in forced:gmatch('%d+') do bad[tonumber(s)] = true end
      local steps, out = overflow_run(c.np, forced, c.stage, c.hyst, c.cons)
      assert.truthy(steps, out)
      assert.are.equal(16, #steps)
      local want = expected_scales(bad, 16, 256, 3, c.hyst, c.cons)
      local skipped, stepped = 0, 0
      for s, st in ipairs(steps) do
        assert.are.equal(bad[s] == true, st.overflow, 'step ' .. s)
        if bad[s] then skipped = skipped + 1 else stepped = stepped + 1 end
        assert.are.equal(skipped, st.skipped, 'skipped after step ' .. s)
        assert.are.equal(want[s], st.scale_after, 'scale after step ' .. s)
        -- WarmupLR (linear, 100 steps to 1e-3) moved once per step taken
        assert.is_true(math.abs(st.lr - 1e-5 * math.max(stepped - 1, 0)) < 1e-12, 'lr after step ' .. s)
      end
      local _, lines = out:gsub('%[deepspeed%] OVERFLOW! Rank 0 Skipping step%. Attempted loss scale: ', '')
      assert.are.equal(skipped, lines, out)
    end)
  end

  it('fp16 stops with a clear error at the minimum loss scale', function()
    local steps, out = overflow_run(1, '1 2 3 4 5 6', 0, 1, false, 64)
    assert.is_nil(steps)
    assert.truthy(out:find('Current loss scale already at minimum', 1, true), out)
    assert.truthy(out:find('min_loss_scale', 1, true), out)
  end)
end)

-- The step folds the clip factor into the optimizer's pass and writes the
-- bf16 parameters in it; here the unfused step is done by hand beside it
-- (the gradients scaled by the clip factor, ds.optim.apply, the cast to
-- bf16), and the two must agree to the bit.
describe('the step, against the same step done by hand', function()
  local Reg = H.two_layer('ZeroReg', 6, 40, 3, 'tanh')

  local OPTIMIZERS = {
    { type = 'AdamW', params = { lr = 1e-2, weight_decay = 0.1 } },
    { type = 'SGD', params = { lr = 0.05, momentum = 0.9, weight_decay = 1e-3 } },
    { type = 'Adagrad', params = { lr = 0.05 } },
    { type = 'Lion', params = { lr = 1e-3, weight_decay = 0.1 } },
  }


  local function engine(extra)
    ds.manual_seed(11)
    local cfg = { train_batch_size = 8, steps_per_print = 1e9 }
    for k, v in pairs(extra) do cfg[k] = v end
    return ds.initialize { model = Reg(), config = cfg }
  end

  -- Three steps of e, each checked against apply on copies taken before
  -- it: params() and grads() give the flat f32 parameters and gradients.
  -- The master gradients are complete once the reductions in flight have
  -- landed, which scale_grads waits for (by 2 and back: exact).
  local function check_steps(e, clip, params, grads, after)
    local names = e.optimizer:state_names()
    for t = 1, 3 do
      e:backward(e { x = ds.randn(8, 6), y = ds.randn(8, 3) })
      if e.zero then
        e.zero.engine:scale_grads(2)
        e.zero.engine:scale_grads(0.5)
      end
      local want, g, state = params():clone(), grads():clone(), {}
      for s, name in ipairs(names) do state[s] = e.optimizer:flat_state(1, name):clone() end
      e:step()
      local c = clip > 0 and (e.grad_norm + 1e-6) / clip or 0
      ds.optim.apply(e.optimizer.name, e.optimizer.param_groups[1], t, want, g:mul_(c > 1 and 1 / c or 1), state)
      local what = 'step ' .. t
      H.assert_same(params(), want, what .. ' parameters')
      for s, name in ipairs(names) do H.assert_same(e.optimizer:flat_state(1, name), state[s], what .. ' ' .. name) end
      if after then after(want, what) end
    end
  end

  -- the model's bf16 parameters, back to back, are the masters cast
  local function cast_of(e)
    return function(master, what)
      local at = 0
      for _, p in ipairs(e.module:parameters()) do
        local n = p:numel()
        assert.are.equal('bf16', p:dtype())
        H.assert_same(p:view(-1), master:narrow(1, at + 1, n):to('bf16'), what .. ' bf16 parameters')
        at = at + n
      end
      assert.are.equal(master:numel(), at)
    end
  end

  for _, o in ipairs(OPTIMIZERS) do
    for _, clip in ipairs({ 0.01, 0 }) do
      for stage = 0, 2 do
        it(string.format('bf16 masters, stage %d, %s, clipping %g', stage, o.type, clip), function()
          local e = engine { bf16 = { enabled = true }, gradient_clipping = clip, optimizer = o,
                             zero_optimization = { stage = stage } }
          local z = e.zero.engine
          check_steps(e, clip, function() return z:master(1) end, function() return z:master_grad(1) end, cast_of(e))
          e:destroy()
        end)
      end
      it(string.format('fp32 without masters, %s, clipping %g', o.type, clip), function()
        local e = engine { gradient_clipping = clip, optimizer = o }
        check_steps(e, clip, function() return e.optimizer:flat_params(1) end,
                    function() return e.optimizer:flat_grads(1) end)
        e:destroy()
      end)
    end
  end

  it('a parameter with no elements steps at stages 0-3 (its shard of 0 divided by nothing)', function()
    local Empty = ds.nn.Module:extend('ZeroEmpty')
    function Empty:init()
      self.fc = ds.nn.Linear(4, 2)
      self:register_parameter('none', ds.zeros({ 0 }))
    end
    function Empty:forward(b) return ds.mse_loss(self.fc(b.x), b.y) + self.none:sum() end
    for stage = 0, 3 do
      ds.manual_seed(3)
      local e = ds.initialize { model = Empty(), config = { train_batch_size = 2, steps_per_print = 1e9,
        bf16 = { enabled = true }, optimizer = OPTIMIZERS[1], zero_optimization = { stage = stage } } }
      local before = e.module.fc.weight:to('f32')
      e:backward(e { x = ds.randn(2, 4), y = ds.randn(2, 2) })
      e:step()
      assert.are.equal(1, e.global_steps)
      local moved = (e.module.fc.weight:to('f32') - before):abs():amax():item()
      assert.is_true(moved > 0, 'stage ' .. stage .. ' stepped')
      e:destroy()
    end
  end)

  it('a graph from before the step fails its backward: the step changed the weights it saved', function()
    local e = engine { bf16 = { enabled = true }, optimizer = OPTIMIZERS[1] }
    local batch = { x = ds.randn(8, 6), y = ds.randn(8, 3) }
    local stale = e(batch)
    e:backward(e(batch))
    e:step()
    local ok, err = pcall(function() e:backward(stale) end)
    assert.is_false(ok)
    assert.matches("modified in place by the optimizer's step", err)
    e:destroy()
  end)

  it('Lamb (gradients scaled apart) leaves the bf16 parameters the masters cast', function()
    local e = engine { bf16 = { enabled = true }, gradient_clipping = 0.01,
                       optimizer = { type = 'Lamb', params = { lr = 1e-2 } } }
    for t = 1, 3 do
      e:backward(e { x = ds.randn(8, 6), y = ds.randn(8, 3) })
      e:step()
      cast_of(e)(e.zero.engine:master(1), 'step ' .. t)
    end
    e:destroy()
  end)
end)

-- Stage 2 and 3 reduce every micro step; a step engine holds each bucket
-- in flight at most once, however many micro steps a step takes.
describe('gradient accumulation past two micro steps', function()
  local Net = H.two_layer('ZeroAccum', 5, 7, 3, 'relu')

  -- weights after two steps of ga micro steps each, as flat f32 values
  local function train(stage, ga, dtype, bucket)
    ds.manual_seed(5)
    local cfg = { train_micro_batch_size_per_gpu = 2, gradient_accumulation_steps = ga, steps_per_print = 1e9,
                  optimizer = { type = 'AdamW', params = { lr = 1e-2 } },
                  zero_optimization = { stage = stage, reduce_bucket_size = bucket } }
    if dtype == 'bf16' then cfg.bf16 = { enabled = true } end
    local e = ds.initialize { model = Net(), config = cfg }
    ds.manual_seed(6)
    for _ = 1, 2 * ga do
      e:backward(e { x = ds.randn(2, 5), y = ds.randn(2, 3) })
      e:step()
    end
    assert.are.equal(2, e.global_steps)
    local w = {}
    for _, p in ipairs(e.module:parameters()) do
      ds.no_grad(function() w[#w + 1] = p:to('f32'):view(-1):clone() end)
    end
    e:destroy()
    return w
  end

  for _, dtype in ipairs({ 'f32', 'bf16' }) do
    for _, ga in ipairs({ 5, 33 }) do
      for _, bucket in ipairs({ 1, 5e8 }) do
        it(string.format('stages 2 and 3 in %s, %d micro steps, bucket size %g: stage 0\'s weights', dtype, ga,
                         bucket), function()
          -- f32: the same sums in the same order; bf16: stage 0 accumulates
          -- the micro steps in the bf16 gradients, stage 2-3 in the f32 masters
          local tol = dtype == 'f32' and { rtol = SAME_RTOL, atol = 1e-7 } or H.tol.bf16
          local want = train(0, ga, dtype, bucket)
          for stage = 2, 3 do
            local got = train(stage, ga, dtype, bucket)
            for i = 1, #want do
              H.assert_close(got[i], want[i], tol,
                             string.format('stage %d parameter %d', stage, i))
            end
          end
        end)
      end
    end
  end

  it('two stage-3 engines in one process: the first collected, the second still gathers', function()
    local function stage3()
      ds.manual_seed(7)
      return ds.initialize { model = Net(), config = { train_batch_size = 2, steps_per_print = 1e9,
        optimizer = { type = 'AdamW', params = { lr = 1e-2 } },
        zero_optimization = { stage = 3, stage3_param_persistence_threshold = 0 } } }
    end
    local first, second = stage3(), stage3()
    first:destroy()
    first = nil
    collectgarbage()
    collectgarbage()
    for _ = 1, 3 do
      second:backward(second { x = ds.randn(2, 5), y = ds.randn(2, 3) })
      second:step()
    end
    assert.are.equal(3, second.global_steps)
    second:destroy()
  end)
end)

-- The optimizer is built over the engine's fp32 masters and adopts them
-- and their gradients: initialize never holds two of either. One rank, so
-- each master is its group's parameters whole.
describe('the optimizer over the masters', function()
  local Net = H.two_layer('ZeroAttach')

  local dir
  setup(function() dir = H.tmpdir() end)
  teardown(function() os.execute('rm -rf ' .. dir) end)

  local CASES = {
    { name = 'stage 0 bf16', stage = 0, bf16 = true },
    { name = 'stage 1', stage = 1 },
    { name = 'stage 2', stage = 2 },
    { name = 'stage 3', stage = 3 },
    { name = 'stage 2 offload cpu', stage = 2, offload = 'cpu' },
    { name = 'stage 2 offload nvme', stage = 2, offload = 'nvme' },
  }
  for _, case in ipairs(CASES) do
    it(case.name .. ': initialize peaks at one copy of the masters and one of their gradients', function()
      local zc = { stage = case.stage }
      if case.offload then zc.offload_optimizer = { device = case.offload, nvme_path = dir } end
      local cfg = { train_batch_size = 2, steps_per_print = 1e9, zero_optimization = zc,
                    optimizer = { type = 'AdamW', params = { lr = 1e-3 } } }
      if case.bf16 then cfg.bf16 = { enabled = true } end
      local model = Net()
      local bytes = 0
      for _, p in ipairs(model:parameters()) do bytes = bytes + 4 * p:numel() end
      collectgarbage()
      local before = ds.memory_stats().current
      ds.reset_peak_memory()
      local e = ds.initialize { model = model, config = cfg }
      local peak = ds.memory_stats().peak
      assert.are.equal(bytes, peak.master_weights - before.master_weights)
      assert.are.equal(bytes, peak.gradients - before.gradients)
      e:destroy()
    end)
  end
end)

-- ZeRO-Offload's pipeline on 2 CPU ranks (spec/zero/offload.lua): the test
-- hook DSLUA_TEST_OFFLOAD_CPU runs it as from a GPU, in chunks of 1000
-- elements, its copies made on the host only when waited for, so a read
-- before its copy's wait would read stale bytes. Each rank steps its own
-- partition; the same sums in the same order make the same bits. With
-- offload_param cpu at stage 3 the prefetched shards go up through it.
describe('the step engine\'s kernels', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)
  local run = H.runs_by_np(dir, function(np, json) return H.ranks_cmd(np) .. ' spec/zero/kernels.lua ' .. json end)

  -- backward + step over n parameters in k buckets: a + b k, as many at
  -- 8 parameters as at 64 (none per parameter)
  local function per_bucket(counts, what)
    local function total(n, k) local c = counts[n .. ' ' .. k]; return c[1] + c[2] end
    for _, k in ipairs({ 1, 2, 4 }) do
      assert.are.equal(total(8, k), total(64, k), string.format('%s, %d buckets: 8 parameters vs 64', what, k))
    end
    local b = total(8, 2) - total(8, 1)
    assert.are.equal(total(8, 1) + 3 * b, total(8, 4), what .. ': linear in the buckets')
    return b
  end

  it('go by bucket, not by parameter, on 1 and 2 ranks', function()
    local one, two = run(1), run(2)
    for name, counts in pairs(one) do
      -- one rank: each bucket's gradients added into the master gradients
      -- in one kernel (backward); flat takes them all in one. The step, 5
      -- in either layout below stage 3: the sums of squares (their
      -- accumulator zeroed, the pass, the read to the host), the optimizer
      -- (for masters writing the bf16 parameters in its own pass), the
      -- gradients zeroed.
      for key, c in pairs(counts) do
        local k = tonumber(key:match(' (%d+)'))
        assert.are.equal(name == 'f32 flat' and 1 or k, c[1], name .. ' ' .. key .. ': backward')
        if name ~= 'bf16 stage 3' then assert.are.equal(5, c[2], name .. ' ' .. key .. ': step') end
      end
      per_bucket(counts, name .. ' on 1 rank')
      per_bucket(two[name], name .. ' on 2 ranks')
    end
  end)
end)

describe('gradients where nothing is communicated', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  -- One rank adds each bucket's gradients straight into the master (or
  -- flat) gradients; two ranks with the same batches send them as rows
  -- and sum them: 2g, exact, the mean's 1/2 exact again, so the two runs
  -- are one training if the fold adds as a landed row does.
  it('train bit for bit as two ranks of the same batches that reduce them: stages 0-3, fp32, bf16 and fp16, '
     .. 'clipping, 1 and 3 micro steps', function()
    local run = H.runs_by_np(dir, function(np, json) return H.ranks_cmd(np) .. ' spec/zero/fold.lua ' .. json end)
    local one, two = run(1), run(2)
    local n = 0
    for name, a in pairs(one) do
      local b = assert(two[name], name)
      assert.are.equal(3, a.steps, name)
      assert.are.equal(a.losses, b.losses, name .. ': losses')
      assert.are.equal(#a.weights, #b.weights, name)
      for i, w in ipairs(a.weights) do assert.are.equal(w, b.weights[i], name .. ': parameter ' .. i) end
      n = n + 1
    end
    assert.are.equal(16, n)
  end)
end)

describe('ZeRO-Offload\'s pipeline on data-parallel ranks', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  it('trains stages 1-3, fp32 and bf16, 1 and 3 micro steps, offload_param at 3, bit for bit as without', function()
    if H.rank_device() ~= 'cpu' then
      -- device ranks offload for real, their optimizer on the CPU against one on the device without
      pending('the hook is for CPU ranks; tests/test_zero.c checks offload on a GPU against the CPU')
      return
    end
    local json = dir .. '/offload.json'
    local r = H.run_json(H.ranks_cmd(2, { 'DSLUA_TEST_OFFLOAD_CPU=1000' }) .. ' spec/zero/offload.lua ' .. json, json)
    assert.are.equal(14, #r)
    for _, c in ipairs(r) do
      local what = string.format('stage %d %s gas %d%s', c.stage, c.bf16 and 'bf16' or 'fp32', c.gas,
                                 c.param and ' offload_param' or '')
      assert.are.equal(8, c.steps, what)
      assert.are.equal(0, c.difference, what .. ': losses and weights differ')
      -- every step took the pipeline (at least one chunk per group) and its rows came through it
      assert.is_true(c.chunks >= c.steps and c.rows >= c.steps, string.format('%s: %d chunks, %d rows', what,
                                                                            c.chunks, c.rows))
      assert.are.equal(0, c.none_chunks, what .. ': the run without offload has no pipeline')
      -- offload_param: each step's forward prefetched shards through the copies (none loaded without it)
      if c.param then
        assert.is_true(c.shards >= c.steps, string.format('%s: %d shards loaded', what, c.shards))
      else
        assert.are.equal(0, c.shards, what)
      end
    end
  end)
end)
