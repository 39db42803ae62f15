-- The fused optimizers against float64 references (spec/fixtures/gen_optim.py):
-- torch.optim's SGD, Adam, AdamW and Adagrad, DeepSpeed's FusedLamb and
-- lion-pytorch's Lion, over 100 steps of a fixed gradient sequence on three
-- parameters of different shapes; then the flat layout, state_dict,
-- DeepSpeed's config block, and the errors.
local H = require 'helpers'
local ds = H.ds

local F = H.fixture('optim')
local P = F.problem

-- The trajectories run in f32 against float64 references. Over 100 steps
-- the largest error measured is 3.5e-6 on parameters of size up to 9 (at
-- most a fifth of this tolerance, in lamb_clipped; the others a tenth).
local TRAJ_TOL = { rtol = 1e-5, atol = 1e-5 }

local GRADS = H.tensor(P.grads):to('f32') / P.scale     -- exact: k / 256

local function fresh_params()
  local ps = {}
  for i, rec in ipairs(P.init) do ps[i] = (H.tensor(rec):to('f32') / P.scale):requires_grad_() end
  return ps
end

-- Writes step t's gradients into the parameters' .grad (the flat views).
local function set_grads(ps, t)
  local row, off = GRADS:narrow(1, t, 1):view(-1), 0
  for _, p in ipairs(ps) do
    local n = p:numel()
    p.grad:copy_(row:narrow(1, off + 1, n):view(p:size()))
    off = off + n
  end
end

local function values(ps)
  local out = {}
  for _, p in ipairs(ps) do
    for _, v in ipairs(p:view(-1):totable()) do out[#out + 1] = v end
  end
  return out
end

local function schedule(t, base_lr)
  return base_lr * (1 - 0.5 * (t - 1) / 100), 0.8 + 0.15 * ((t - 1) % 10) / 10
end

local function build(case, ps, ctor)
  ctor = ctor or ds.optim[case.optimizer]
  if case.groups then
    local groups = {}
    for gi, g in ipairs(case.groups) do
      local sel = {}
      for _, i in ipairs(g.idx) do sel[#sel + 1] = ps[i] end
      groups[gi] = { params = sel }
      for k, v in pairs(g.opts) do groups[gi][k] = v end
    end
    return ctor(groups, case.opts)
  end
  return ctor(ps, case.opts)
end

-- Steps t0..t1 of a case; calls on_snapshot(t, ps) at the fixture's snapshots.
local function run_steps(case, opt, ps, t0, t1, on_snapshot)
  local snap = {}
  for _, s in ipairs(P.snapshots) do snap[s] = true end
  for t = t0, t1 do
    if case.schedule then
      local lr, mom = schedule(t, case.opts.lr)
      for _, g in ipairs(opt.param_groups) do
        g.lr = lr
        if g.betas then g.betas = { mom, g.betas[2] } else g.momentum = mom end
      end
    end
    set_grads(ps, t)
    opt:step()
    if snap[t] and on_snapshot then on_snapshot(t, ps) end
  end
end

local function snapshot_index(t)
  for i, s in ipairs(P.snapshots) do if s == t then return i end end
end

local function check_trajectory(name, ctor)
  local case = F[name]
  local ps = fresh_params()
  local opt = build(case, ps, ctor)
  local worst = 0
  run_steps(case, opt, ps, 1, P.steps, function(t, params)
    local expected = H.tensor(case.traj):narrow(1, snapshot_index(t), 1):view(-1):totable()
    local got = values(params)
    H.assert_close(got, expected, TRAJ_TOL, name .. ' after step ' .. t)
    for i = 1, #got do
      worst = math.max(worst, math.abs(got[i] - expected[i]) / (TRAJ_TOL.atol + TRAJ_TOL.rtol * math.abs(expected[i])))
    end
  end)
  return opt, ps, worst
end

describe('optim trajectories (100 steps, f32 vs float64 reference)', function()
  local cases = { 'sgd', 'sgd_momentum', 'sgd_nesterov', 'sgd_schedule', 'adam', 'adam_betas', 'adamw',
                  'adamw_schedule', 'adamw_groups', 'adagrad', 'lamb', 'lamb_clipped', 'lion', 'lion_betas' }
  for _, name in ipairs(cases) do
    it(name .. ' (' .. F[name].optimizer .. ') matches its reference', function()
      check_trajectory(name)
    end)
  end

  it('Lamb trust ratios match DeepSpeed FusedLamb', function()
    for _, name in ipairs({ 'lamb', 'lamb_clipped' }) do
      local case = F[name]
      local ps = fresh_params()
      local opt = build(case, ps)
      run_steps(case, opt, ps, 1, P.steps, function(t)
        local expected = H.tensor(case.coeffs):narrow(1, snapshot_index(t), 1):view(-1):totable()
        H.assert_close(opt:get_lamb_coeffs(), expected, { rtol = 1e-5, atol = 0 }, name .. ' coeffs at ' .. t)
      end)
    end
  end)

  it('a replaced or dropped .grad is taken in at step (copied, or zero)', function()
    local case = F.adamw
    local a, b = fresh_params(), fresh_params()
    local oa, ob = build(case, a), build(case, b)
    for t = 1, 5 do
      set_grads(a, t)
      oa:step()
      set_grads(b, t)
      for _, p in ipairs(b) do p.grad = p.grad:clone() end     -- replaced by a tensor of its shape
      ob:step()
      assert.are.same(values(a), values(b))
    end
    b[2].grad = nil                                          -- dropped: counts as zero
    ob:step()
    set_grads(a, 5)
    a[2].grad:zero_()
    oa:step()
    assert.are.same(values(a), values(b))
    -- the views are back: writing the flat buffer shows in .grad
    ob:flat_grads():fill_(3)
    assert.are.same({ 3, 3, 3, 3, 3 }, b[2].grad:totable())
  end)

  it('the parallel paths (buffers over 32768 elements) agree with a float64 formula', function()
    ds.manual_seed(7)
    local w = ds.randn(300, 400):requires_grad_()
    local small = ds.randn(10):requires_grad_()
    local g = ds.randn(300, 400)
    local gs = ds.randn(10)
    -- one AdamW step from zero moments: p (1 - lr wd) - lr g / (|g| + eps)
    local w0 = w:detach():to('f64')
    local opt = ds.optim.AdamW({ w, small }, { lr = 0.01, weight_decay = 0.1 })
    w.grad:copy_(g)
    small.grad:copy_(gs)
    opt:step()
    local g64 = g:to('f64')
    local expect = w0 * (1 - 0.01 * 0.1) - g64 / (g64:abs() + 1e-8) * 0.01
    H.assert_close(w:to('f64'), expect, { rtol = 1e-5, atol = 1e-6 }, 'adamw big')
    -- Lamb: its norms reduce over threads
    local w2 = ds.randn(300, 400):requires_grad_()
    local p0 = w2:detach():to('f64')
    local lamb = ds.optim.Lamb({ w2, ds.randn(10):requires_grad_() }, { lr = 0.01, weight_decay = 0.01 })
    w2.grad:copy_(g)
    lamb:step()
    local m, v = g64 * 0.1, g64 * g64 * 0.001
    local u = m / (v:sqrt() + 1e-8) + p0 * 0.01
    local coeff = math.min(math.max(p0:norm():item() / u:norm():item(), 0.01), 10)
    H.assert_close(lamb:get_lamb_coeffs()[1], coeff, { rtol = 1e-5, atol = 0 }, 'lamb coeff')
    local step_size = 0.01 * math.sqrt(1 - 0.999) / (1 - 0.9)
    H.assert_close(w2:to('f64'), p0 - u * (step_size * coeff), { rtol = 1e-5, atol = 1e-6 }, 'lamb big')
  end)
end)

-- The CPU loops are compiled per instruction set and picked by the CPU; every
-- one rounds each step as the scalar math does, so each set's trajectories
-- are the same bits as SSE2's (which every x86-64 runs), and within the
-- references' tolerance.
describe('optim CPU instruction sets', function()
  local best = ds.cpu_optim_isa()
  after_each(function() ds.cpu_optim_isa(best) end)

  local function trajectories(isa)
    ds.cpu_optim_isa(isa)
    local out = {}
    for _, name in ipairs({ 'adam', 'adam_betas', 'adamw', 'adamw_schedule', 'adamw_groups', 'sgd_nesterov',
                            'adagrad', 'lion' }) do
      local _, ps = check_trajectory(name)
      out[name] = values(ps)
    end
    -- the threaded path with a short last block, a gradient factor and a bf16 copy
    ds.manual_seed(3)
    local w = ds.randn(40007):requires_grad_()
    local opt = ds.optim.AdamW({ w }, { lr = 0.01, weight_decay = 0.1 })
    for t = 1, 3 do
      ds.manual_seed(10 + t)
      w.grad:copy_(ds.randn(40007))
      opt:step()
    end
    out.big = w:totable()
    return out
  end

  for _, isa in ipairs({ 'avx512', 'avx2' }) do
    it(isa .. ' writes the same bits as sse2 and matches the references', function()
      if not pcall(ds.cpu_optim_isa, isa) then return pending('this CPU has no ' .. isa) end
      local want, got = trajectories('sse2'), trajectories(isa)
      for name, v in pairs(want) do assert.are.same(v, got[name], name) end
    end)
  end

  it('refuses an instruction set by name', function()
    H.has(H.err(ds.cpu_optim_isa, 'neon'),
          'cpu_optim_isa: cpu optimizer: unknown instruction set "neon" (avx512, avx2 or sse2)')
    assert.are.equal(best, ds.cpu_optim_isa())
  end)
end)

describe('optim flat buffers', function()
  it('re-seats parameters as views of one flat buffer per group, with flat grads', function()
    local ps = fresh_params()
    local before = values(ps)
    require('dslua.engine').settle_garbage()     -- earlier garbage must not be freed inside the window
    local stats0 = ds.memory_stats().current
    local opt = ds.optim.Adam(ps)
    local stats1 = ds.memory_stats().current
    assert.are.same(before, values(ps))
    local flat = opt:flat_params()
    assert.are.same({ 29 }, flat:size())
    assert.are.same(before, flat:totable())
    for _, p in ipairs(ps) do assert.is_true(p:is_contiguous()) end
    flat:narrow(1, 13, 5):fill_(2)                 -- parameter 2 lives at elements 13..17
    assert.are.same({ 2, 2, 2, 2, 2 }, ps[2]:totable())
    assert.are.same({ 29 }, opt:flat_grads():size())
    assert.are.same({ 29 }, opt:flat_state(1, 'exp_avg_sq'):size())
    assert.are.same({ 'exp_avg', 'exp_avg_sq' }, opt:state_names())
    assert.are.equal(2 * 29 * 4, stats1.optimizer_state - stats0.optimizer_state)
    assert.is_true(stats1.gradients - stats0.gradients >= 29 * 4)
  end)

  it('backward adds into the flat grads; zero_grad zeroes them and keeps the views', function()
    local w = ds.tensor({ { 1, 2 }, { 3, 4 } }):requires_grad_()
    local b = ds.tensor({ 0.5, -0.5 }):requires_grad_()
    local opt = ds.optim.SGD({ w, b }, { lr = 0.1 })
    local x = ds.tensor({ { 1, 1 } })
    local function loss() return (x:matmul(w) + b):sum() end
    loss():backward()
    loss():backward()                               -- accumulates
    assert.are.same({ 2, 2, 2, 2, 2, 2 }, opt:flat_grads():totable())
    opt:step()
    H.assert_close(w, ds.tensor({ { 0.8, 1.8 }, { 2.8, 3.8 } }))
    opt:zero_grad()
    assert.are.same({ 0, 0, 0, 0, 0, 0 }, opt:flat_grads():totable())
    loss():backward()
    assert.are.same({ 1, 1, 1, 1, 1, 1 }, opt:flat_grads():totable())
    assert.are.same({ { 1, 1 }, { 1, 1 } }, w.grad:totable())
  end)

  it('keeps a gradient the parameters already had', function()
    local w = ds.ones(3):requires_grad_()
    ;(w * 2):sum():backward()
    local opt = ds.optim.SGD({ w })
    assert.are.same({ 2, 2, 2 }, opt:flat_grads():totable())
  end)

  it('trains through autograd as torch.optim.AdamW does', function()
    local A = F.autograd
    local x, y = H.tensor(A.x):to('f32'), H.tensor(A.y):to('f32')
    local w = H.tensor(A.w0):to('f32'):requires_grad_()
    local b = ds.zeros(2):requires_grad_()
    local opt = ds.optim.AdamW({ w, b }, { lr = 0.05, weight_decay = 0.01 })
    local losses = {}
    for i = 1, 30 do
      opt:zero_grad()
      local d = x:matmul(w) + b - y
      local loss = (d * d):mean()
      loss:backward()
      opt:step()
      losses[i] = loss:item()
    end
    -- f32 forward and backward feed the steps here, hence the wider tolerance
    local tol = { rtol = 1e-4, atol = 1e-5 }
    H.assert_close(losses, H.tensor(A.losses):totable(), tol, 'losses')
    H.assert_close(w, H.tensor(A.w):to('f32'), tol, 'w')
    H.assert_close(b, H.tensor(A.b):to('f32'), tol, 'b')
  end)

  it('adds param groups, empty ones included, each with its own buffers', function()
    local ps = fresh_params()
    local opt = ds.optim.SGD({ { params = { ps[1] } }, { params = {} } }, { lr = 0.1 })
    opt:add_param_group({ params = { ps[2], ps[3] }, lr = 0.5, momentum = 0.9 })
    assert.are.equal(3, #opt.param_groups)
    assert.are.equal(0.5, opt.param_groups[3].lr)
    assert.are.equal(0, opt.param_groups[1].momentum)
    assert.are.same({ 0 }, opt:flat_params(2):size())
    assert.are.same({ 17 }, opt:flat_params(3):size())
    set_grads(ps, 1)
    local p2 = ps[2]:clone()
    opt:step()
    H.assert_close(ps[2], p2 - ps[2].grad * 0.5)
    assert.is_nil(opt:flat_state(1, 'momentum_buffer'))
    assert.is_not_nil(opt:flat_state(3, 'momentum_buffer'))
  end)

  it('turns momentum on later as torch does (buffer starts as the gradient)', function()
    local case = F.sgd_momentum
    local ps = fresh_params()
    local opt = ds.optim.SGD(ps, { lr = case.opts.lr, dampening = case.opts.dampening,
                                   weight_decay = case.opts.weight_decay })
    assert.is_nil(opt:flat_state(1, 'momentum_buffer'))
    opt.param_groups[1].momentum = case.opts.momentum
    run_steps(case, opt, ps, 1, P.steps)
    H.assert_close(values(ps), H.tensor(case.traj):narrow(1, #P.snapshots, 1):view(-1):totable(), TRAJ_TOL)
  end)
end)

describe('optim state_dict', function()
  for _, name in ipairs({ 'sgd_momentum', 'adam', 'adamw_groups', 'adagrad', 'lamb', 'lion', 'adamw_schedule' }) do
    it(name .. ': a loaded state continues exactly as the original', function()
      local case = F[name]
      local a = fresh_params()
      local oa = build(case, a)
      run_steps(case, oa, a, 1, 50)
      local sd = oa:state_dict()
      -- a new model with the same weights and a new optimizer
      local b = {}
      for i, p in ipairs(a) do b[i] = p:detach():clone():requires_grad_() end
      local ob = build(case, b)
      ob:load_state_dict(sd)
      run_steps(case, oa, a, 51, P.steps)
      run_steps(case, ob, b, 51, P.steps)
      assert.are.same(values(a), values(b))
      H.assert_close(values(b), H.tensor(case.traj):narrow(1, #P.snapshots, 1):view(-1):totable(), TRAJ_TOL)
    end)
  end

  it("has PyTorch's layout, copies of the state and the hyperparameters", function()
    local ps = fresh_params()
    local opt = ds.optim.AdamW({ { params = { ps[1], ps[3] } }, { params = { ps[2] }, lr = 0.5 } }, { lr = 0.01 })
    assert.are.same({}, opt:state_dict().state)       -- nothing before the first step
    set_grads(ps, 1)
    opt:step()
    local sd = opt:state_dict()
    assert.are.same({ 1, 2 }, sd.param_groups[1].params)
    assert.are.same({ 3 }, sd.param_groups[2].params)
    assert.are.equal(0.5, sd.param_groups[2].lr)
    assert.are.same({ 0.9, 0.999 }, sd.param_groups[1].betas)
    assert.are.equal(1, sd.state[3].step)
    assert.are.same(ps[2]:size(), sd.state[3].exp_avg:size())
    H.assert_close(sd.state[3].exp_avg, ps[2].grad * 0.1)
    local copy = sd.state[1].exp_avg:clone()
    opt:step()
    assert.are.same(copy:totable(), sd.state[1].exp_avg:totable())
    -- hyperparameters come back with the state
    sd.param_groups[2].lr = 0.25
    opt:load_state_dict(sd)
    assert.are.equal(0.25, opt.param_groups[2].lr)
    assert.are.equal(1, opt:state_dict().state[1].step)
  end)

  it('refuses a state of another shape', function()
    local ps = fresh_params()
    local opt = ds.optim.Adam(ps)
    set_grads(ps, 1)
    opt:step()
    local sd = opt:state_dict()
    local other = ds.optim.Adam({ ps[1], ps[2] })
    assert.has_error(function() other:load_state_dict(sd) end)
    H.fails_plain("group 1 has 3 parameters, the optimizer's has 2",
                  other.load_state_dict, other, { param_groups = { { params = { 1, 2, 3 } } }, state = {} })
    local q = fresh_params()
    local o3 = ds.optim.Adam(q)
    sd.state[1].exp_avg = ds.zeros(4, 3)
    H.fails_plain('exp_avg of parameter 1 of group 1 is f32 [4,3], the parameter is [3,4]', o3.load_state_dict, o3, sd)
    sd = opt:state_dict()
    sd.state[2].step = 7
    H.fails_plain('different steps', o3.load_state_dict, o3, sd)
    H.fails_plain('the state has 0 param groups, the optimizer 1',
                  o3.load_state_dict, o3, { param_groups = {}, state = {} })
  end)
end)

describe('optim.from_config (DeepSpeed optimizer block)', function()
  local function same_run(block, name)
    local ps = fresh_params()
    local opt = ds.optim.from_config(ps, block)
    local case = F[name]
    run_steps(case, opt, ps, 1, P.steps)
    H.assert_close(values(ps), H.tensor(case.traj):narrow(1, #P.snapshots, 1):view(-1):totable(), TRAJ_TOL,
                   block.type)
    return opt
  end

  it('"Adam" is AdamW (adam_w_mode defaults to true) with weight_decay 0 by default', function()
    local opt = same_run({ type = 'Adam', params = { lr = 0.01, weight_decay = 0.1 } }, 'adamw')
    assert.are.equal('AdamW', opt.name)
    local ps = fresh_params()
    opt = ds.optim.from_config(ps, { type = 'adam', params = { lr = 0.01 } })
    assert.are.equal('AdamW', opt.name)
    assert.are.equal(0, opt.param_groups[1].weight_decay)
    assert.are.same({ 0.9, 0.999 }, opt.param_groups[1].betas)
  end)

  it('"Adam" with adam_w_mode false is Adam with L2 decay; "AdamW" stays decoupled', function()
    local opt = same_run({ type = 'Adam', params = { lr = 0.01, weight_decay = 0.01, adam_w_mode = false } }, 'adam')
    assert.are.equal('Adam', opt.name)
    opt = ds.optim.from_config(fresh_params(), { type = 'AdamW', params = { adam_w_mode = false } })
    assert.are.equal('AdamW', opt.name)
    assert.are.equal(0, opt.param_groups[1].weight_decay)
    opt = ds.optim.from_config(fresh_params(), { type = 'AdamW', params = { torch_adam = true } })
    assert.are.equal(0.01, opt.param_groups[1].weight_decay)      -- torch.optim.AdamW's default
  end)

  it('SGD, Adagrad, Lamb and Lion take DeepSpeed / torch parameter names', function()
    same_run({ type = 'SGD', params = { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.001 } },
             'sgd_nesterov')
    same_run({ type = 'Adagrad', params = { lr = 0.1, lr_decay = 0.01, weight_decay = 0.01,
                                            initial_accumulator_value = 0.1 } }, 'adagrad')
    same_run({ type = 'Lamb', params = { lr = 0.01, bias_correction = false, eps_inside_sqrt = true,
                                         max_coeff = 0.5, min_coeff = 0.3 } }, 'lamb_clipped')
    same_run({ type = 'lion', params = { lr = 3e-3, betas = { 0.95, 0.98 } } }, 'lion_betas')
    local opt = ds.optim.from_config(fresh_params(), { type = 'Lion' })
    assert.are.equal(1e-3, opt.param_groups[1].lr)                 -- FusedLion's defaults
    assert.are.same({ 0.9, 0.999 }, opt.param_groups[1].betas)
    assert.are.same({ 0.9, 0.99 }, ds.optim.Lion(fresh_params()).param_groups[1].betas)
  end)

  it('refuses max_grad_norm, unknown parameters and unknown types, naming the key', function()
    local ps = fresh_params()
    local err = H.fails_plain("optimizer.params.max_grad_norm: 'max_grad_norm' is not supported",
                              ds.optim.from_config, ps, { type = 'Adam', params = { max_grad_norm = 1 } })
    assert.matches('gradient_clipping', err, 1, true)
    H.fails_plain('optimizer.params.betas: unknown parameter for SGD',
                  ds.optim.from_config, ps, { type = 'SGD', params = { betas = { 0.9, 0.9 } } })
    H.fails_plain("optimizer.type: 'RMSprop' is not supported",
                  ds.optim.from_config, ps, { type = 'RMSprop', params = {} })
  end)
end)

describe('optim errors', function()
  local fails = H.fails_plain

  it('refuses parameters that cannot be optimized', function()
    fails('optim.SGD: parameter 1 of group 1 is i64 [3]; only floating point', ds.optim.SGD, { ds.zeros(3, 'i64') })
    fails('optim.Adam: parameter 2 of group 1 is f64 [2,2]; the fused optimizers keep f32',
          ds.optim.Adam, { ds.zeros(3):requires_grad_(), ds.zeros(2, 2, 'f64'):requires_grad_() })
    local w = ds.zeros(3):requires_grad_()
    fails('optim.SGD: parameter 1 of group 1 ([3]) is not a leaf (made by mul)', ds.optim.SGD, { w * 2 })
    fails('optim.SGD: parameter 1 of group 1 ([3]) does not require grad', ds.optim.SGD, { ds.zeros(3) })
    fails('optim.SGD: parameter 2 of group 1 is the same tensor as parameter 1', ds.optim.SGD, { w, w })
    fails('optim.SGD: parameter 1 of group 2 is the same tensor as parameter 1 of group 1', ds.optim.SGD,
          { { params = { w } }, { params = { w } } })
    fails('optim.Adam: empty parameter list', ds.optim.Adam, {})
    fails('optim.Adam: empty parameter list', ds.optim.Adam, { { params = {} } })
    fails('optim.Adam: params[2] is a number, not a tensor', ds.optim.Adam, { w, 3 })
  end)

  it('refuses parameters on different devices', function()
    local ok, other = pcall(ds.zeros, { 3 }, 'f32', 'cuda')
    if not ok then
      pending('no second device in this build: ' .. tostring(other))
      return
    end
    fails('optim.SGD: parameter 2 of group 1 is on cuda', ds.optim.SGD,
          { ds.zeros(3):requires_grad_(), other:requires_grad_() })
  end)

  it('refuses bad hyperparameters, naming the group and the value', function()
    local function ps() return { ds.zeros(3):requires_grad_() } end
    fails('optim.SGD: group 1: lr must be >= 0 and finite in fp32 (at most 3.4e38), got -1', ds.optim.SGD, ps(),
          { lr = -1 })
    fails('optim.Adam: group 1: betas[1] must be in [0, 1), got 1', ds.optim.Adam, ps(), { betas = { 1, 0.999 } })
    fails('optim.AdamW: group 1: betas[2] must be in [0, 1), got -0.1', ds.optim.AdamW, ps(),
          { betas = { 0.9, -0.1 } })
    fails('optim.Lion: group 1: betas[1] must be in [0, 1), got 1.5', ds.optim.Lion, ps(), { betas = { 1.5, 0.9 } })
    fails('optim.Adam: group 1: eps must be >= 0, got -1', ds.optim.Adam, ps(), { eps = -1 })
    fails('optim.SGD: group 1: weight_decay must be >= 0, got -0.1', ds.optim.SGD, ps(), { weight_decay = -0.1 })
    fails('optim.SGD: group 1: momentum must be >= 0, got -0.5', ds.optim.SGD, ps(), { momentum = -0.5 })
    fails('optim.SGD: group 1: nesterov needs momentum > 0 and dampening 0', ds.optim.SGD, ps(), { nesterov = true })
    fails('optim.Adagrad: group 1: lr_decay must be >= 0, got -1', ds.optim.Adagrad, ps(), { lr_decay = -1 })
    fails('optim.Lamb: group 1: max_coeff must be >= min_coeff, got 0.1', ds.optim.Lamb, ps(),
          { max_coeff = 0.1, min_coeff = 0.2 })
    fails('optim.Adam: group 1: lr must be a number, got string', ds.optim.Adam, ps(), { lr = 'big' })
    fails('optim.Adam: group 1: betas must be a table of two numbers', ds.optim.Adam, ps(), { betas = { 0.9 } })
    fails('optim.SGD: group 2: lr must be >= 0 and finite in fp32 (at most 3.4e38), got -1', ds.optim.SGD,
          { { params = ps() }, { params = ps(), lr = -1 } })
    fails("optim.SGD: unknown option 'betas' (options: dampening, lr, maximize, momentum, nesterov, weight_decay)",
          ds.optim.SGD, ps(), { betas = { 0.9, 0.9 } })
    fails('optim.Adam: amsgrad = true is not supported', ds.optim.Adam, ps(), { amsgrad = true })
  end)

  it('checks values a scheduler sets before changing anything', function()
    local ps = fresh_params()
    local opt = ds.optim.AdamW({ { params = { ps[1] } }, { params = { ps[2], ps[3] } } })
    set_grads(ps, 1)
    local before = values(ps)
    opt.param_groups[2].lr = -0.5
    fails('optim.AdamW: group 2: lr must be >= 0 and finite in fp32 (at most 3.4e38), got -0.5', opt.step, opt)
    assert.are.same(before, values(ps))
    opt.param_groups[2].lr = 0.01
    opt.param_groups[1].betas = { 0.9, 1 }
    fails('optim.AdamW: group 1: betas[2] must be in [0, 1), got 1', opt.step, opt)
    opt.param_groups[1].betas = { 0.9, 0.999 }
    opt:step()
    assert.are_not.same(before, values(ps))
  end)

  it('refuses a grad replaced by a tensor of the wrong shape', function()
    local ps = fresh_params()
    local opt = ds.optim.SGD(ps)
    fails('grad: assigned f32 [4,3] to a tensor of f32 [3,4]', function() ps[1].grad = ds.zeros(4, 3) end)
    fails('grad: assigned f64 [5] to a tensor of f32 [5]', function() ps[2].grad = ds.zeros(5, 'f64') end)
    opt:step()          -- the grads kept their views
    assert.are.equal(29, opt:flat_grads():numel())
  end)

  it('notices parameters taken over by another optimizer or a changed params list', function()
    local ps = fresh_params()
    local first = ds.optim.SGD(ps)
    local second = ds.optim.SGD(ps)
    second:step()
    fails("optim.SGD: parameter 1 of group 1 ([3,4]) no longer lives in this optimizer's flat buffer", first.step, first)
    local extra = ds.zeros(2):requires_grad_()
    table.insert(second.param_groups[1].params, extra)
    fails('optim.SGD: group 1: params differ from the 3 the group was built with', second.step, second)
  end)

  -- the engine's binding takes the optimizer table where the handle's
  -- methods take the handle (dsL_checkoptim, dsL_optim_hparams)
  it('takes an optimizer or its handle, and checks the param_groups list', function()
    local ps = fresh_params()
    local opt = ds.optim.Lamb(ps)
    set_grads(ps, 1)
    opt._h.step(opt, opt.param_groups)
    assert.are.equal(1, opt._h.steps(opt, 1))
    assert.are.same(opt:get_lamb_coeffs(), opt._h.lamb_coeffs(opt, 1))
    fails('optim: expected an optimizer (ds.optim) or its handle, got number', opt._h.steps, 5, 1)
    fails('optim: expected an optimizer (ds.optim) or its handle, got table', opt._h.steps, {}, 1)
    fails('optim.Lamb: param_groups must be a table, got nil', opt._h.step, opt._h)
    fails('optim.Lamb: 0 param_groups, the optimizer has 1', opt._h.step, opt._h, {})
    fails('optim.Lamb: group 1 is not a table', opt._h.step, opt._h, { 3 })
  end)
end)
