-- LR schedulers against DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py),
-- written again here in Lua, independently of the C ones, and DeepSpeed's
-- stepping: the constructor sets the lr of iteration -1, step() advances.
local H = require 'helpers'
local ds = H.ds

local TOL = { rtol = 1e-12, atol = 1e-15 }

local fails = H.fails

local function adam(...)
  local groups = {}
  for i, lr in ipairs { ... } do groups[i] = { lr = lr, betas = { 0.9, 0.999 } } end
  return { param_groups = groups }
end

local function sgd(lr) return { param_groups = { { lr = lr, momentum = 0.9 } } } end

local function lrs_of(opt)
  local out = {}
  for i, g in ipairs(opt.param_groups) do out[i] = g.lr end
  return out
end

-- DeepSpeed's formulas, per group, at last_batch_iteration `it`.
local ref = {}

function ref.range_test(it, min_lr, p)
  local interval = (it + 1) / (p.lr_range_test_step_size or 2000)
  if p.lr_range_test_staircase then interval = math.floor(interval) end
  return min_lr * (1 + (p.lr_range_test_step_rate or 1.0) * interval)
end

-- lr, first beta
function ref.one_cycle(it, p)
  local min_lr, max_lr = p.cycle_min_lr, p.cycle_max_lr
  local min_mom, max_mom = p.cycle_min_mom or 0.8, p.cycle_max_mom or 0.9
  local first = p.cycle_first_step_size or 2000
  local second = p.cycle_second_step_size or first
  local first_stairs = p.cycle_first_stair_count or 0
  local second_stairs = p.cycle_second_stair_count or first_stairs
  local decay_size = p.decay_step_size or 0
  local lr_rate, mom_rate = p.decay_lr_rate or 0, p.decay_mom_rate or 0
  local total = first + second
  if it < total then
    local b = it + 1
    local cycle = math.floor(1 + b / total)
    local x = 1 + b / total - cycle
    local ratio = first / total
    local scale, stairs
    if x <= ratio then scale, stairs = x / ratio, first_stairs
    else scale, stairs = (x - 1) / (ratio - 1), second_stairs end
    if stairs > 0 then
      local at = b % total
      local pos = at <= first and at * stairs / first or (total - at) * stairs / second
      scale = math.floor(pos) / stairs
    end
    return min_lr + (max_lr - min_lr) * scale, max_mom - (max_mom - min_mom) * scale
  end
  local k = it - total + 1
  local lr, mom = min_lr, max_mom
  if decay_size ~= 0 and lr_rate ~= 0 then lr = min_lr / (1 + lr_rate * k / decay_size) end
  if decay_size ~= 0 and mom_rate ~= 0 then mom = max_mom * (1 + mom_rate * k / decay_size) end
  return lr, mom
end

local function warm_fraction(it, p)
  local w = math.max(2, p.warmup_num_steps or 1000)
  if (p.warmup_type or 'log') == 'log' then return math.log(it + 1) / math.log(w) end
  return it / w
end

function ref.warmup(it, min_lr, max_lr, p)
  if it < 0 then return min_lr end
  local w = math.max(2, p.warmup_num_steps or 1000)
  local gamma = it < w and warm_fraction(it, p) or 1
  return min_lr + (max_lr - min_lr) * gamma
end

function ref.warmup_decay(it, min_lr, max_lr, p)
  if it < 0 then return min_lr end
  local w, total = math.max(2, p.warmup_num_steps or 1000), p.total_num_steps
  local gamma
  if it < w then gamma = warm_fraction(it, p)
  else gamma = math.max(0, (total - it) / math.max(1, total - w)) end
  return min_lr + (max_lr - min_lr) * gamma
end

function ref.cosine(it, base_lr, p)
  if it < 0 then return 0 end
  local w, total = math.max(2, p.warmup_num_steps or 1000), p.total_num_steps
  local wmin, cmin = p.warmup_min_ratio or 0, p.cos_min_ratio or 0.0001
  if it < w then return base_lr * (wmin + warm_fraction(it, p) * (1 - wmin)) end
  local progress = math.min(1, (it - w + 1) / math.max(1, total - w))
  return base_lr * math.max(0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)
end

-- Steps a scheduler from construction to iteration last, checking every
-- group's lr (and betas) against expect(it) -> lrs [, betas].
local function walk(sched, opt, last, expect, what)
  for it = 0, last do
    sched:step()
    assert.are.equal(it, sched.last_batch_iteration)
    local lrs, betas = expect(it)
    H.assert_close(lrs_of(opt), lrs, TOL, string.format('%s lr at iteration %d', what, it))
    H.assert_close(sched:get_last_lr(), lrs, TOL, string.format('%s get_last_lr at %d', what, it))
    H.assert_close(sched:get_lr(), lrs, TOL, string.format('%s get_lr at %d', what, it))
    if betas then
      for i, g in ipairs(opt.param_groups) do
        H.assert_close(g.betas, betas[i], TOL, string.format('%s betas of group %d at %d', what, i, it))
      end
    end
  end
end

describe('LRRangeTest', function()
  for _, staircase in ipairs { false, true } do
    it('matches the formula over 60 iterations, staircase=' .. tostring(staircase), function()
      local p = { lr_range_test_min_lr = 0.002, lr_range_test_step_size = 7, lr_range_test_step_rate = 0.5,
                  lr_range_test_staircase = staircase }
      local opt = adam(0.1)
      local s = ds.lr.from_config(opt, { type = 'LRRangeTest', params = p })
      assert.are.equal(-1, s.last_batch_iteration)
      assert.are.same({ 0.002 }, lrs_of(opt))            -- the constructor sets min_lr
      assert.are.same({ 0.002 }, s:get_last_lr())
      walk(s, opt, 60, function(i) return { ref.range_test(i, 0.002, p) } end, 'LRRangeTest')
    end)
  end

  it('takes a min_lr per group and DeepSpeed defaults', function()
    local opt = adam(0.1, 0.2)
    local s = ds.lr.LRRangeTest(opt, { lr_range_test_min_lr = { 0.001, 0.003 } })
    walk(s, opt, 10, function(i) return { ref.range_test(i, 0.001, {}), ref.range_test(i, 0.003, {}) } end, 'LRRT')
    s:step(3999)
    H.assert_close(lrs_of(opt), { 0.003, 0.009 }, TOL)    -- 1 + 1.0 * 4000 / 2000
  end)
end)

describe('OneCycle', function()
  local cases = {
    { name = 'symmetric, no decay', p = { cycle_min_lr = 0.001, cycle_max_lr = 0.01, cycle_first_step_size = 8 } },
    { name = 'asymmetric with lr and momentum decay',
      p = { cycle_min_lr = 0.002, cycle_max_lr = 0.02, cycle_first_step_size = 10, cycle_second_step_size = 6,
            decay_step_size = 3, decay_lr_rate = 0.25, decay_mom_rate = 0.05, cycle_min_mom = 0.85,
            cycle_max_mom = 0.95 } },
    { name = 'stairs', p = { cycle_min_lr = 0.001, cycle_max_lr = 0.005, cycle_first_step_size = 12,
                             cycle_second_step_size = 9, cycle_first_stair_count = 4,
                             cycle_second_stair_count = 3, decay_step_size = 5, decay_lr_rate = 0.5 } },
    { name = 'stairs, second count from the first', p = { cycle_min_lr = 0.0, cycle_max_lr = 0.1,
      cycle_first_step_size = 6, cycle_first_stair_count = 3 } },
  }
  for _, c in ipairs(cases) do
    it('matches the formula through the cycle and decay: ' .. c.name, function()
      local opt = adam(0.5, 0.7)
      local s = ds.lr.from_config(opt, { type = 'OneCycle', params = c.p })
      -- the constructor: lr at cycle_min_lr, betas at (cycle_min_mom, 0.99)
      assert.are.same({ c.p.cycle_min_lr, c.p.cycle_min_lr }, lrs_of(opt))
      assert.are.same({ c.p.cycle_min_mom or 0.8, 0.99 }, opt.param_groups[2].betas)
      fails('need to call step%(%) first', function() s:get_last_lr() end)
      walk(s, opt, 45, function(i)
        local lr, mom = ref.one_cycle(i, c.p)
        return { lr, lr }, { { mom, 0.99 }, { mom, 0.99 } }
      end, 'OneCycle ' .. c.name)
      local lr, mom = ref.one_cycle(45, c.p)
      H.assert_close(s:get_mom(), { { mom, 0.99 }, { mom, 0.99 } }, TOL)
      local flr, fmom = ds.lr.one_cycle(45, c.p)
      H.assert_close({ flr, fmom }, { lr, mom }, TOL, 'ds.lr.one_cycle')
    end)
  end

  it('reaches the peak and the bounds at the phase boundaries', function()
    local p = { cycle_min_lr = 0.001, cycle_max_lr = 0.011, cycle_first_step_size = 10, cycle_second_step_size = 5 }
    H.assert_close({ ds.lr.one_cycle(9, p) }, { 0.011, 0.8 }, TOL)   -- batch 10 of 15: the top
    H.assert_close({ ds.lr.one_cycle(-1, p) }, { 0.001, 0.9 }, TOL)
    H.assert_close({ ds.lr.one_cycle(14, p) }, { 0.001, 0.9 }, TOL)  -- first iteration of the decay phase
  end)

  it('takes lr and momentum bounds per group', function()
    local opt = adam(0.1, 0.1)
    local p = { cycle_min_lr = { 0.001, 0.002 }, cycle_max_lr = { 0.01, 0.03 }, cycle_min_mom = { 0.8, 0.7 },
                cycle_max_mom = 0.9, cycle_first_step_size = 5, cycle_second_step_size = 3, decay_step_size = 2,
                decay_lr_rate = 0.1, decay_mom_rate = 0.01 }
    local s = ds.lr.OneCycle(opt, p)
    assert.are.same({ 0.001, 0.002 }, lrs_of(opt))
    assert.are.same({ 0.7, 0.99 }, opt.param_groups[2].betas)
    local function group(i)
      local q = {}
      for k, v in pairs(p) do q[k] = type(v) == 'table' and v[i] or v end
      return q
    end
    walk(s, opt, 15, function(i)
      local lr1, mom1 = ref.one_cycle(i, group(1))
      local lr2, mom2 = ref.one_cycle(i, group(2))
      return { lr1, lr2 }, { { mom1, 0.99 }, { mom2, 0.99 } }
    end, 'OneCycle per group')
    fails('scheduler OneCycle: params.cycle_max_lr: expected 2 values %(one per param group%), got 3', function()
      ds.lr.from_config(adam(0.1, 0.1), { type = 'OneCycle', params = { cycle_min_lr = 0, cycle_max_lr = { 1, 2, 3 } } })
    end)
  end)

  it('leaves momentum alone without betas, and with cycle_momentum=false', function()
    local opt = sgd(0.1)
    local stderr, said = io.stderr, {}
    io.stderr = { write = function(_, ...) for _, x in ipairs { ... } do said[#said + 1] = x end end }
    local ok, s = pcall(ds.lr.OneCycle, opt, { cycle_min_lr = 0.01, cycle_max_lr = 0.1, cycle_first_step_size = 4 })
    io.stderr = stderr
    assert(ok, s)
    assert.matches('OneCycle: cycle_momentum is disabled because the optimizer has no betas', table.concat(said))
    s:step()
    assert.are.equal(0.9, opt.param_groups[1].momentum)
    assert.is_nil(opt.param_groups[1].betas)
    local opt2 = adam(0.1)
    s = ds.lr.OneCycle(opt2, { cycle_min_lr = 0.01, cycle_max_lr = 0.1, cycle_first_step_size = 4,
                               cycle_momentum = false })
    for _ = 1, 3 do s:step() end
    assert.are.same({ 0.9, 0.999 }, opt2.param_groups[1].betas)
    assert.is_nil(s:get_mom())
    assert.is_nil(select(2, ds.lr.one_cycle(3, { cycle_min_lr = 0, cycle_max_lr = 1, cycle_momentum = false })))
  end)
end)

describe('WarmupLR', function()
  for _, wtype in ipairs { 'log', 'linear' } do
    it('matches the formula across the warmup boundary, ' .. wtype, function()
      local p = { warmup_min_lr = 0.0005, warmup_max_lr = 0.004, warmup_num_steps = 12, warmup_type = wtype }
      local opt = adam(0.1)
      local s = ds.lr.from_config(opt, { type = 'WarmupLR', params = p })
      assert.are.same({ 0.0005 }, lrs_of(opt))            -- iteration -1 gives warmup_min_lr
      assert.are.same({ 0.0005 }, s:get_last_lr())
      walk(s, opt, 30, function(i) return { ref.warmup(i, 0.0005, 0.004, p) } end, 'WarmupLR ' .. wtype)
      assert.are.equal(0.004, lrs_of(opt)[1])
    end)
  end

  it('uses DeepSpeed defaults: log over 1000 steps from 0 to each group lr', function()
    local opt = adam(0.1, 0.3)
    local s = ds.lr.WarmupLR(opt)
    assert.are.same({ 0, 0 }, lrs_of(opt))
    for _, it in ipairs { 0, 1, 2, 500, 998, 999, 1000, 1001, 5000 } do
      s:step(it)
      H.assert_close(lrs_of(opt), { ref.warmup(it, 0, 0.1, {}), ref.warmup(it, 0, 0.3, {}) }, TOL, 'at ' .. it)
    end
    assert.are.same({ 0.1, 0.3 }, lrs_of(opt))
  end)

  it('warmup_num_steps 1 behaves as 2 (log of 1 is 0)', function()
    local p = { warmup_max_lr = 0.01, warmup_num_steps = 1 }
    local opt = adam(0.1)
    local s = ds.lr.WarmupLR(opt, p)
    walk(s, opt, 4, function(i) return { ref.warmup(i, 0, 0.01, { warmup_num_steps = 2 }) } end, 'W1')
    H.assert_close({ ds.lr.warmup_lr(0, p), ds.lr.warmup_lr(1, p) }, { 0, 0.01 }, TOL)
  end)

  it('takes min and max per group', function()
    local opt = adam(0.1, 0.1)
    local p = { warmup_min_lr = { 0, 0.001 }, warmup_max_lr = { 0.01, 0.002 }, warmup_num_steps = 5,
                warmup_type = 'linear' }
    local s = ds.lr.WarmupLR(opt, p)
    walk(s, opt, 8, function(i)
      return { ref.warmup(i, 0, 0.01, p), ref.warmup(i, 0.001, 0.002, p) }
    end, 'per group')
  end)
end)

describe('WarmupDecayLR', function()
  for _, wtype in ipairs { 'log', 'linear' } do
    it('warms up, decays linearly to warmup_min_lr at total_num_steps and stays, ' .. wtype, function()
      local p = { total_num_steps = 40, warmup_min_lr = 0.0001, warmup_max_lr = 0.003, warmup_num_steps = 10,
                  warmup_type = wtype }
      local opt = adam(0.1)
      local s = ds.lr.from_config(opt, { type = 'WarmupDecayLR', params = p })
      assert.are.same({ 0.0001 }, lrs_of(opt))
      walk(s, opt, 55, function(i) return { ref.warmup_decay(i, 0.0001, 0.003, p) } end, 'WarmupDecayLR ' .. wtype)
      assert.are.equal(0.0001, lrs_of(opt)[1])
    end)
  end

  it('defaults warmup_max_lr to 0.001 (not the group lr)', function()
    local opt = adam(0.1)
    local s = ds.lr.WarmupDecayLR(opt, { total_num_steps = 3000 })
    s:step(1000)
    H.assert_close(lrs_of(opt), { ref.warmup_decay(1000, 0, 0.001, { total_num_steps = 3000 }) }, TOL)
    H.assert_close(lrs_of(opt), { 0.001 }, TOL)
  end)
end)

describe('WarmupCosineLR', function()
  for _, wtype in ipairs { 'log', 'linear' } do
    it('ratios of each group lr through warmup, cosine and past the end, ' .. wtype, function()
      local p = { total_num_steps = 50, warmup_num_steps = 8, warmup_min_ratio = 0.1, cos_min_ratio = 0.05,
                  warmup_type = wtype }
      local opt = adam(0.01, 0.004)
      local s = ds.lr.from_config(opt, { type = 'WarmupCosineLR', params = p })
      assert.are.same({ 0, 0 }, lrs_of(opt))              -- iteration -1: ratio 0
      walk(s, opt, 70, function(i) return { ref.cosine(i, 0.01, p), ref.cosine(i, 0.004, p) } end,
           'WarmupCosineLR ' .. wtype)
      H.assert_close(lrs_of(opt), { 0.01 * 0.05, 0.004 * 0.05 }, TOL)
    end)
  end

  it('uses the defaults (log warmup over 1000, cos_min_ratio 1e-4)', function()
    local opt = adam(0.1)
    local s = ds.lr.WarmupCosineLR(opt, { total_num_steps = 1500 })
    for _, it in ipairs { 0, 1, 999, 1000, 1250, 1499, 1500, 1600 } do
      s:step(it)
      H.assert_close(lrs_of(opt), { ref.cosine(it, 0.1, { total_num_steps = 1500 }) }, TOL, 'at ' .. it)
    end
    H.assert_close(lrs_of(opt), { 0.1 * 1e-4 }, TOL)
    H.assert_close({ ds.lr.warmup_cosine_lr(1250, { total_num_steps = 1500 }) },
                   { ref.cosine(1250, 1, { total_num_steps = 1500 }) }, TOL, 'ratio without base_lr')
  end)
end)

describe('state_dict', function()
  local configs = {
    { type = 'LRRangeTest', params = { lr_range_test_step_size = 4, lr_range_test_staircase = true } },
    { type = 'OneCycle', params = { cycle_min_lr = 0.001, cycle_max_lr = 0.01, cycle_first_step_size = 6,
                                    decay_step_size = 2, decay_lr_rate = 0.3, decay_mom_rate = 0.1 } },
    { type = 'WarmupLR', params = { warmup_num_steps = 7, warmup_type = 'linear' } },
    { type = 'WarmupDecayLR', params = { total_num_steps = 20, warmup_num_steps = 5 } },
    { type = 'WarmupCosineLR', params = { total_num_steps = 20, warmup_num_steps = 5 } },
    { type = 'lua', params = { path = 'spec/fixtures/lr_schedule.lua', warmup = 5, peak = 0.01, decay = 0.9 } },
  }
  for _, cfg in ipairs(configs) do
    it('resumes ' .. cfg.type .. ' identically', function()
      local a_opt = adam(0.01, 0.02)
      local a = ds.lr.from_config(a_opt, cfg)
      local saved, saved_groups = nil, nil
      local trace = {}
      for i = 1, 30 do
        a:step()
        if i == 12 then
          saved = a:state_dict()
          saved_groups = {}
          for k, g in ipairs(a_opt.param_groups) do saved_groups[k] = { lr = g.lr, betas = g.betas } end
        end
        if i > 12 then trace[#trace + 1] = { lrs_of(a_opt), a_opt.param_groups[1].betas } end
      end
      assert.are.same({ last_batch_iteration = 11 }, saved)
      -- as a checkpoint loads: a fresh optimizer and scheduler, then the
      -- optimizer's groups (its own state_dict) and the scheduler's state
      local b_opt = adam(0.01, 0.02)
      local b = ds.lr.from_config(b_opt, cfg)
      for k, g in ipairs(b_opt.param_groups) do g.lr, g.betas = saved_groups[k].lr, saved_groups[k].betas end
      b:load_state_dict(saved)
      for j = 1, #trace do
        b:step()
        H.assert_close(lrs_of(b_opt), trace[j][1], TOL, cfg.type .. ' resumed step ' .. j)
        H.assert_close(b_opt.param_groups[1].betas, trace[j][2], TOL, cfg.type .. ' betas at ' .. j)
      end
    end)
  end

  it('rejects a state without last_batch_iteration', function()
    local s = ds.lr.WarmupLR(adam(0.1))
    fails('WarmupLR: load_state_dict: expected a table with an integer last_batch_iteration',
          function() s:load_state_dict({}) end)
  end)

  it('starts from params.last_batch_iteration without touching the lr', function()
    local opt = adam(0.1)
    local s = ds.lr.WarmupLR(opt, { warmup_num_steps = 10, last_batch_iteration = 4 })
    assert.are.same({ 0.1 }, lrs_of(opt))
    s:step()
    H.assert_close(lrs_of(opt), { ref.warmup(5, 0, 0.1, { warmup_num_steps = 10 }) }, TOL)
  end)
end)

describe('Lua schedules', function()
  local params = { warmup = 4, peak = 0.02, decay = 0.5 }
  local function expected(step)
    if step < 4 then return 0.02 * step / 4, 0.95 - 0.1 * step / 4 end
    return 0.02 * 0.5 ^ (step - 4), 0.85
  end

  it('a file returning a function, by relative path: lr and betas[1] from step = iteration + 1', function()
    local opt = adam(0.1, 0.1)
    local s = ds.lr.from_config(opt, { type = 'lua', params = { path = 'spec/fixtures/lr_schedule.lua',
                                                                warmup = 4, peak = 0.02, decay = 0.5 } })
    assert.are.same({ 0, 0 }, lrs_of(opt))                -- step 0 at construction
    H.assert_close(opt.param_groups[1].betas, { 0.95, 0.999 }, TOL)
    for step = 1, 12 do
      s:step()
      local lr, mom = expected(step)
      H.assert_close(lrs_of(opt), { lr, lr }, TOL, 'lr at ' .. step)
      H.assert_close(opt.param_groups[2].betas, { mom, 0.999 }, TOL, 'betas at ' .. step)
      H.assert_close(s:get_last_lr(), { lr, lr }, TOL)
    end
  end)

  it('a file returning a table with get_lr and state, by absolute path', function()
    local path = os.tmpname()
    local f = assert(io.open(path, 'w'))
    f:write([[
      local M = { calls = 0 }
      function M.get_lr(step, params)
        M.calls = M.calls + 1
        return params.base * (step + 1), { 0.5, 0.6 }
      end
      function M.state_dict() return { calls = M.calls } end
      function M.load_state_dict(sd) M.calls = sd.calls end
      return M
    ]])
    f:close()
    local opt = { param_groups = { { lr = 1, betas = { 0.9, 0.99 } }, { lr = 1, momentum = 0.9 } } }
    local s = ds.lr.from_config(opt, { type = 'lua', params = { path = path, base = 0.001 } })
    s:step(); s:step()
    H.assert_close(lrs_of(opt), { 0.003, 0.003 }, TOL)
    assert.are.same({ 0.5, 0.99 }, opt.param_groups[1].betas)
    assert.are.equal(0.6, opt.param_groups[2].momentum)
    assert.are.same({ last_batch_iteration = 1, schedule = { calls = 3 } }, s:state_dict())
    s:load_state_dict({ last_batch_iteration = 7, schedule = { calls = 100 } })
    assert.are.same({ last_batch_iteration = 7, schedule = { calls = 100 } }, s:state_dict())
    s:step()
    H.assert_close(lrs_of(opt), { 0.01, 0.01 }, TOL)   -- step 9
    os.remove(path)
  end)

  it('composes the C formulas: warmup_lr at step - 1 is WarmupLR', function()
    local p = { warmup_max_lr = 0.01, warmup_num_steps = 6 }
    local a_opt, b_opt = adam(0.1), adam(0.1)
    local a = ds.lr.WarmupLR(a_opt, p)
    local b = ds.lr.lambda(b_opt, function(step) return ds.lr.warmup_lr(step - 1, p) end)
    assert.are.same(lrs_of(a_opt), lrs_of(b_opt))
    for _ = 1, 10 do
      a:step(); b:step()
      assert.are.same(lrs_of(a_opt), lrs_of(b_opt))
    end
  end)

  -- in a process of its own, under `timeout`: a budget that stops nothing fails the spec, not hangs it
  it('stops a schedule file that loops or blocks, at load or at a step, naming the file, get_lr and the step', function()
    local path = os.tmpname()
    local child = H.write(path .. '.child.lua', [=[
local ds = require 'dslua'
require('dslua.base.guard').budget = 0.5
local path = arg[1]
local function load(text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
  return ds.lr.from_config({ param_groups = { { lr = 1 } } }, { type = 'lua', params = { path = path } })
end
print(select(2, pcall(load, 'local n = 0\nwhile true do n = n + 1 end')))
print(select(2, pcall(load, "io.popen('sleep 100')")))
local s = load('return function(step)\n  while step >= 2 do end\n  return 0.1\nend')
s:step()
print(select(2, pcall(s.step, s)))
]=])
    finally(function() os.remove(path); os.remove(child) end)
    local out, status = H.run('timeout 60 ' .. H.bin() .. ' ' .. child .. ' ' .. path)
    assert.are.equal(0, status, out)
    local P, lines = path:gsub('%p', '%%%0'), {}
    for line in out:gmatch('[^\n]+') do lines[#lines + 1] = line end
    assert.matches('schedule file ' .. P .. ' failed while loading: ran past its time budget of 0%.5 s '
                   .. '%(reload%.budget%), stopped at ' .. P .. ':2$', lines[1])
    assert.matches('schedule file ' .. P .. ' failed while loading: ' .. P .. ':1: io%.popen is not allowed in the '
                   .. 'schedule file ' .. P, lines[2])
    assert.matches('scheduler lua %(' .. P .. '%): get_lr at step 2: ran past its time budget of 0%.5 s '
                   .. '%(reload%.budget%), stopped at ' .. P .. ':2$', lines[3])
  end)

  it('errors name the file, the step and what was wrong', function()
    local opt = adam(0.1)
    fails("scheduler lua: cannot load schedule file no/such_lr%.lua: cannot open the directory 'no': No such file",
          ds.lr.from_config, opt, { type = 'lua', params = { path = 'no/such_lr.lua' } })
    fails('scheduler lua: params.path must be the path of a Lua file, got nil',
          ds.lr.from_config, opt, { type = 'lua', params = {} })
    local path = os.tmpname()
    local function write(text)
      local f = assert(io.open(path, 'w'))
      f:write(text)
      f:close()
    end
    write('return function(step) return 0.1 +')
    fails('scheduler lua: cannot load schedule file ' .. path:gsub('%p', '%%%0') .. ': ' .. path:gsub('%p', '%%%0'),
          ds.lr.from_config, opt, { type = 'lua', params = { path = path } })
    write('error("boom")')
    fails('schedule file .* failed while loading: .*boom', ds.lr.from_config, opt,
          { type = 'lua', params = { path = path } })
    write('return 42')
    fails('returned a number; expected function%(step, params%)', ds.lr.from_config, opt,
          { type = 'lua', params = { path = path } })
    write('return { state_dict = function() end }')
    fails('returned a table without get_lr', ds.lr.from_config, opt, { type = 'lua', params = { path = path } })
    write('return function(step) if step < 3 then return 0.1 end end')
    local s = ds.lr.from_config(opt, { type = 'lua', params = { path = path } })
    s:step(); s:step()
    fails('scheduler lua %(' .. path:gsub('%p', '%%%0') .. '%): lr at step 3 must be a number, got nil',
          function() s:step() end)
    os.remove(path)
    fails('lambda: the schedule returned a momentum, but param_groups%[1%] has neither betas nor momentum',
          ds.lr.lambda, { param_groups = { { lr = 0.1 } } }, function() return 0.1, 0.9 end)
    fails('lambda: lr at step 0: expected 2 values %(one per param group%), got 1',
          ds.lr.lambda, adam(0.1, 0.2), function() return { 0.1 } end)
  end)
end)

describe('Lua schedule files that are FIFOs or devices', function()
  -- in another process under `timeout`, so a read that blocks fails the spec
  local function run(dir, mode)
    local script = dir .. '/run.lua'
    H.write(script, [[
local ds = require 'dslua'
local dir, mode = arg[1], arg[2]
local sched = dir .. '/s.lua'
if mode == 'fifo' then os.execute('mkfifo ' .. sched)
elseif mode == 'device' then os.execute('ln -s /dev/zero ' .. sched)
else
  local f = io.open(sched, 'w')
  f:write('return function() return 0.1 end')
  f:close()
end
local model = require('models.mlp') { input_size = 4, hidden = { 8 }, num_classes = 2 }
local ok, engine = pcall(ds.initialize, { model = model, config = {
  train_micro_batch_size_per_gpu = 2, steps_per_print = 1000, optimizer = { type = 'SGD', params = { lr = 0.5 } },
  scheduler = { type = 'lua', params = { path = sched } }, reload = { every = 1, attach = false } } })
if not ok then print(engine) return end
os.execute('mkfifo ' .. dir .. '/f && mv ' .. dir .. '/f ' .. sched)
local x, y = ds.randn(2, 4), ds.tensor({ 0, 1 }, 'i64')
for _ = 1, 2 do engine:backward(engine { x = x, y = y }); engine:step() end
print('trained on at lr ' .. engine:get_lr()[1])
engine:destroy()
]])
    return H.run('timeout 60 ' .. H.bin() .. ' ' .. script .. ' ' .. dir .. ' ' .. mode)
  end

  it('are refused at initialize, and a reloaded one keeps the running version', function()
    local dir = H.tmpdir()
    for _, case in ipairs({ { 'fifo', 'is a FIFO' }, { 'device', 'is a device' } }) do
      os.remove(dir .. '/s.lua')
      local out, status = run(dir, case[1])
      assert.are.equal(0, status, out)
      H.has(out, 'cannot load schedule file ' .. dir .. '/s.lua: ' .. case[2] .. ', expected a regular file')
    end
    os.remove(dir .. '/s.lua')
    local out, status = run(dir, 'reload')
    assert.are.equal(0, status, out)
    H.has(out, "reload: '" .. dir .. "/s.lua' is a FIFO, expected a regular file; the loaded version keeps running")
    H.has(out, 'trained on at lr 0.1')
    os.execute('rm -rf ' .. dir)
  end)
end)

describe('bad params', function()
  local opt = adam(0.1)
  local function cfg(kind, params)
    return function() return ds.lr.from_config(opt, { type = kind, params = params }) end
  end

  it('unknown scheduler types and params suggest the nearest name', function()
    fails("scheduler.type: unknown scheduler 'WarmupDecay' %(did you mean 'WarmupDecayLR'%?%)", cfg('WarmupDecay', {}))
    fails("scheduler.type: unknown scheduler 'Cosine' %(valid: LRRangeTest, OneCycle", cfg('Cosine', {}))
    fails("scheduler WarmupLR: unknown param 'warmup_num_step' %(did you mean 'warmup_num_steps'%?%)",
          cfg('WarmupLR', { warmup_num_step = 10 }))
    fails("scheduler OneCycle: unknown param 'cycle_max_mon' %(did you mean 'cycle_max_mom'%?%)",
          cfg('OneCycle', { cycle_min_lr = 0, cycle_max_lr = 1, cycle_max_mon = 0.9 }))
    fails("scheduler WarmupCosineLR: unknown param 'last_batch_iter' %(did you mean 'last_batch_iteration'%?%)",
          cfg('WarmupCosineLR', { total_num_steps = 10, last_batch_iter = 0 }))
    fails("scheduler WarmupLR: unknown param 'total_num_steps'", cfg('WarmupLR', { total_num_steps = 10 }))
    fails("scheduler: unknown key 'parms' %(did you mean 'params'%?%)",
          function() return ds.lr.from_config(opt, { type = 'WarmupLR', parms = {} }) end)
    fails("scheduler WarmupLR: unknown param 'warmup_steps' %(did you mean 'warmup_num_steps'%?%)",
          cfg('WarmupLR', { warmup_steps = 3 }))
    fails("warmup_lr: unknown param 'warmup_steps' %(valid: warmup_min_lr, warmup_max_lr, warmup_num_steps, "
          .. "warmup_type%)",
          ds.lr.warmup_lr, 3, { warmup_steps = 3 })
  end)

  it('missing, mistyped and out-of-range values name the param', function()
    fails('scheduler WarmupDecayLR: params.total_num_steps is required', cfg('WarmupDecayLR', {}))
    fails('scheduler WarmupCosineLR: params.total_num_steps is required', cfg('WarmupCosineLR', {}))
    fails('scheduler OneCycle: params.cycle_min_lr is required', cfg('OneCycle', { cycle_max_lr = 1 }))
    fails('scheduler WarmupLR: params.warmup_num_steps must be a positive integer, got 0',
          cfg('WarmupLR', { warmup_num_steps = 0 }))
    fails('scheduler WarmupLR: params.warmup_num_steps must be a positive integer, got 2.5',
          cfg('WarmupLR', { warmup_num_steps = 2.5 }))
    fails("scheduler WarmupLR: params.warmup_type must be 'log' or 'linear', got 'cosine'",
          cfg('WarmupLR', { warmup_type = 'cosine' }))
    fails('scheduler WarmupLR: params.warmup_max_lr must be a number, got string',
          cfg('WarmupLR', { warmup_max_lr = '0.1' }))
    fails('scheduler WarmupLR: params.warmup_min_lr: expected 1 values %(one per param group%), got 2',
          cfg('WarmupLR', { warmup_min_lr = { 0, 0 } }))
    fails('scheduler WarmupLR: params.warmup_min_lr must be a finite number >= 0, got %-1',
          cfg('WarmupLR', { warmup_min_lr = -1 }))
    fails('scheduler LRRangeTest: params.lr_range_test_step_size must be a positive integer, got 0',
          cfg('LRRangeTest', { lr_range_test_step_size = 0 }))
    fails('scheduler LRRangeTest: params.lr_range_test_staircase must be a boolean, got number',
          cfg('LRRangeTest', { lr_range_test_staircase = 1 }))
    fails('scheduler OneCycle: params.cycle_first_stair_count must be a non%-negative integer, got 1.5',
          cfg('OneCycle', { cycle_min_lr = 0, cycle_max_lr = 1, cycle_first_stair_count = 1.5 }))
    fails('scheduler OneCycle: params.cycle_first_step_size must be a number > 0, got 0',
          cfg('OneCycle', { cycle_min_lr = 0, cycle_max_lr = 1, cycle_first_step_size = 0 }))
    fails('scheduler WarmupCosineLR: params.cos_min_ratio must be in %[0, 1%], got 2',
          cfg('WarmupCosineLR', { total_num_steps = 10, cos_min_ratio = 2 }))
    fails('scheduler WarmupLR: params.last_batch_iteration must be an integer >= %-1, got %-3',
          cfg('WarmupLR', { last_batch_iteration = -3 }))
    fails('scheduler.type: expected a scheduler name, got nil', function() return ds.lr.from_config(opt, {}) end)
    fails('warmup_lr: iteration must be an integer', ds.lr.warmup_lr, 1.5, {})
    fails('WarmupLR: step: batch_iteration must be an integer, got 0.5',
          function() ds.lr.WarmupLR(adam(1)):step(0.5) end)
  end)

  it('takes a JSON null as the default, as DeepSpeed takes None', function()
    local block = ds.json.decode('{"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,'
                                 .. ' "cycle_first_step_size": 4, "cycle_second_step_size": null}}')
    local o = adam(0.1)
    local s = ds.lr.from_config(o, block)
    s:step(5)
    H.assert_close(lrs_of(o), { (ref.one_cycle(5, { cycle_min_lr = 0.001, cycle_max_lr = 0.01,
                                                    cycle_first_step_size = 4 })) }, TOL)
  end)

  it('rejects optimizers without param_groups', function()
    fails('WarmupLR: optimizer must have param_groups', ds.lr.WarmupLR, {})
    fails('OneCycle: optimizer.param_groups%[1%] must be a table with a number lr', ds.lr.OneCycle,
          { param_groups = { { betas = { 0.9, 0.99 } } } }, { cycle_min_lr = 0, cycle_max_lr = 1 })
  end)
end)
