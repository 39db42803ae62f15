-- The lr a step takes: finite, >= 0 and within fp32 wherever it comes from
-- (the config, a schedule, a reload, set_lr), and the same on every rank
-- (the resolved config agreed at initialize by hash, the lr at each step
-- boundary); a difference is named by key or value, rank and step.
-- Multi-rank cases run spec/agree/run.lua on 2 ranks.
local H = require 'helpers'
local ds = H.ds

local MUST = 'must be >= 0 and finite in fp32 (at most 3.4e38), got '

describe('an lr that would end the weights', function()
  local dir
  before_each(function() dir = H.tmpdir() end)
  after_each(function() os.execute('rm -rf ' .. dir) end)

  local function put(path, text)             -- write and rename, as editors save
    H.write(path .. '.tmp', text)
    assert(os.rename(path .. '.tmp', path))
    return path
  end
  local function engine_with(sched)
    ds.manual_seed(1)
    local engine = ds.initialize { model = ds.nn.Linear(3, 2), config = {
      train_batch_size = 2, steps_per_print = 1e9, reload = { attach = false },
      optimizer = { type = 'SGD', params = { lr = 0.1 } },
      scheduler = sched and { type = 'lua', params = { path = sched } } or nil } }
    local x = ds.randn(2, 3)
    return engine, function()
      engine:backward(engine(x):sum())
      engine:step()
    end
  end

  it('is refused from a schedule, naming the file, the step and the value', function()
    for _, v in ipairs({ '1/0', '-1/0', '1e300', '-0.5' }) do
      local sched = put(dir .. '/s.lua', 'return function(step) return ' .. v .. ' end\n')
      H.has(H.err(engine_with, sched), 'scheduler lua (' .. sched .. '): the lr at step 0 ' .. MUST)
    end
    local sched = put(dir .. '/s.lua', 'return function(step) return step < 2 and 0.1 or 1e300 end\n')
    local engine, step = engine_with(sched)
    step()
    H.has(H.err(step), 'scheduler lua (' .. sched .. '): the lr at step 2 ' .. MUST .. '1e+300')
    engine:destroy()
  end)

  it('is refused from a built-in schedule and by the optimizer, whoever set it', function()
    local p = { ds.zeros(1):requires_grad_() }
    H.has(H.err(ds.lr.WarmupLR, ds.optim.SGD(p, { lr = 0.1 }), { warmup_min_lr = 1e300 }),
          'WarmupLR: the lr at step 0 ' .. MUST .. '1e+300')
    H.has(H.err(ds.optim.SGD, p, { lr = 1 / 0 }), 'optim.SGD: group 1: lr ' .. MUST .. 'inf')
    local opt = ds.optim.SGD(p, { lr = 0.1 })
    opt.param_groups[1].lr = 1e300
    p[1].grad = ds.ones(1)
    H.has(H.err(opt.step, opt), 'optim.SGD: group 1: lr ' .. MUST .. '1e+300')
    assert.are.equal(0, p[1]:item())
  end)

  it('from a reloaded schedule is rejected, the running one kept', function()
    local sched = put(dir .. '/s.lua', 'return function(step) return 0.1 end\n')
    local engine, step = engine_with(sched)
    step()
    for _, v in ipairs({ '1/0', '-0.25', '1e300' }) do
      put(sched, 'return function(step) return ' .. v .. ' end -- ' .. v .. '\n')
      step()
      local last = ds.reload.history()[#ds.reload.history()]
      assert.are.equal('rejected', last.status, v)
      H.has(last.error, 'the lr at step ' .. engine.global_steps .. ' ' .. MUST)
      assert.are.same({ 0.1 }, engine:get_lr())
    end
    engine:destroy()
  end)

  it('from set_lr is rejected, the lr kept', function()
    local engine, step = engine_with(nil)
    for _, v in ipairs({ 1 / 0, -1, 1e300, 0 / 0 }) do
      engine.reload:queue { type = 'set_lr', lr = v }
      step()
      assert.are.same({ 0.1 }, engine:get_lr(), tostring(v))
    end
    engine.reload:queue { type = 'set_lr', lr = 0.5 }
    step()
    assert.are.same({ 0.5 }, engine:get_lr())
    engine:destroy()
  end)
end)

describe('ranks that differ', function()
  local dir
  before_each(function() dir = H.tmpdir() end)
  after_each(function() os.execute('rm -rf ' .. dir) end)

  -- every rank's line: 'refused: <error>' or 'trained'
  local function run(mode)
    if not H.have_mpirun() then return pending('mpirun is not installed') end
    local out, status = H.run(H.ranks_cmd(2) .. ' spec/agree/run.lua ' .. mode .. ' ' .. dir)
    assert.are.equal(0, status, out)
    local lines = {}
    for r, line in out:gmatch('%[rank (%d)%] ([^\n]*)') do lines[tonumber(r) + 1] = line end
    assert.are.equal(lines[1], lines[2], out)
    return lines[1]
  end

  it('train when their configs and lrs agree', function()
    assert.are.equal('trained', run('same'))
  end)

  it('are refused at initialize by the first key of the config that differs', function()
    local differs = 'refused: initialize: the resolved config differs across ranks (every rank must run the same '
                    .. 'one): '
    assert.are.equal(differs .. 'optimizer.params.lr is 0.02 on rank 1, 0.01 on rank 0', run('lr'))
    assert.are.equal(differs .. 'gradient_clipping is 1 on rank 1, 0 on rank 0', run('clip'))
    assert.are.equal(differs .. '(the first lr of param group 1) is 0.02 on rank 1, 0.01 on rank 0', run('schedule'))
  end)

  it('are refused at the step boundary before the step whose lr differs, naming the schedule', function()
    for _, mode in ipairs({ 'late', 'reload' }) do
      assert.are.equal('refused: the lr differs across ranks from step 4 (set by scheduler lua (' .. dir .. '/'
                       .. mode .. '.lua)): rank 0 steps with 0.01, rank 1 0.02; every rank must step with the '
                       .. 'same lr', run(mode))
    end
  end)
end)
