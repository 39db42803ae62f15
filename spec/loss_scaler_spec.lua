-- fp16 loss scaling against DeepSpeed's DynamicLossScaler / LossScaler
-- (deepspeed/runtime/fp16/loss_scaler.py): step tables worked out by hand,
-- and random overflow sequences against a second transcription of
-- update_scale written here as a pure function.
local H = require 'helpers'
local ds = H.ds
local S = require 'dslua.engine.loss_scaler'

local INF, NAN = math.huge, 0 / 0

local function fp16(over)
  local c = { enabled = true, auto_cast = false, loss_scale = 0, initial_scale_power = 4,
              loss_scale_window = 2, hysteresis = 1, consecutive_hysteresis = false, min_loss_scale = 1 }
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

local fails = H.fails_plain

-- rows: { overflow, scale after, hysteresis after, kind of message }
-- kind: 'reduce', 'hyst', 'restore' or false
local function run_table(scaler, rows)
  for i, r in ipairs(rows) do
    scaler:update_scale(r[1])
    local what = string.format('step %d (%s)', i, r[1] and 'overflow' or 'clean')
    assert.are.equal(r[2], scaler.cur_scale, what .. ': scale')
    assert.are.equal(r[3], scaler.cur_hysteresis, what .. ': hysteresis')
    local m, kind = scaler.message, false
    if m and m:find('reducing to', 1, true) then kind = 'reduce'
    elseif m and m:find('but hysteresis', 1, true) then kind = 'hyst'
    elseif m and m:find('^Consecutive') then kind = 'restore'
    elseif m then kind = m end
    assert.are.equal(r[4], kind, what .. ': message ' .. tostring(m))
    assert.are.equal(i, scaler.cur_iter, what .. ': cur_iter')
  end
end

-- The reference: update_scale as a function of a state table, returning a new
-- state, or nil and 'min' where DeepSpeed raises.
local function ref_step(st, overflow)
  local n = {}
  for k, v in pairs(st) do n[k] = v end
  if overflow then
    local drop = st.delayed_shift == 1 or st.cur_hysteresis == 1
    if drop and st.raise and st.cur_scale == st.min_scale then return nil, 'min' end
    if drop then
      n.cur_scale = st.cur_scale / 2
      if n.cur_scale < st.min_scale then n.cur_scale = st.min_scale end
    else
      n.cur_hysteresis = st.cur_hysteresis - 1
    end
    n.last_overflow_iter = st.cur_iter
  else
    if st.consecutive then n.cur_hysteresis = st.delayed_shift end
    local since = st.cur_iter - st.last_overflow_iter - 1
    if since > 0 and since % st.window == 0 then
      n.cur_scale = st.cur_scale * 2
      if not st.consecutive then n.cur_hysteresis = st.delayed_shift end
    end
  end
  n.cur_iter = st.cur_iter + 1
  return n
end

describe('loss_scaler: dynamic scale, step by step', function()
  it('hysteresis 1: halves on each overflow, doubles on the (window+1)-th clean step', function()
    local s = S.from_config(fp16 { initial_scale_power = 4, loss_scale_window = 2, hysteresis = 1 })
    assert.is_true(s.dynamic)
    assert.are.equal(16, s.cur_scale)
    run_table(s, {
      { true, 8, 1, 'reduce' },
      { false, 8, 1, false },    -- stable interval 0
      { false, 8, 1, false },    -- 1
      { false, 16, 1, false },   -- 2: a full window
      { false, 16, 1, false },
      { false, 32, 1, false },
      { true, 16, 1, 'reduce' },
      { true, 8, 1, 'reduce' },
    })
    assert.are.equal(7, s.last_overflow_iter)
  end)

  it('grows from the start after window+1 clean steps (last_overflow_iter starts at -1)', function()
    local s = S.from_config(fp16 { initial_scale_power = 0, loss_scale_window = 3 })
    assert.are.equal(-1, s.last_overflow_iter)
    local scales = {}
    for i = 1, 7 do s:update_scale(false); scales[i] = s.cur_scale end
    assert.are.same({ 1, 1, 1, 2, 2, 2, 4 }, scales)
  end)

  it('hysteresis 2 without consecutive_hysteresis: refilled only when the scale grows', function()
    local s = S.from_config(fp16 { hysteresis = 2 })
    run_table(s, {
      { true, 16, 1, 'hyst' },
      { false, 16, 1, false },
      { true, 8, 1, 'reduce' },   -- a clean step did not refill it
      { true, 4, 1, 'reduce' },
      { false, 4, 1, false },
      { false, 4, 1, false },
      { false, 8, 2, false },     -- growth refills
      { true, 8, 1, 'hyst' },
      { true, 4, 1, 'reduce' },
    })
  end)

  it('hysteresis 2 with consecutive_hysteresis: every clean step refills', function()
    local s = S.from_config(fp16 { hysteresis = 2, consecutive_hysteresis = true })
    run_table(s, {
      { true, 16, 1, 'hyst' },
      { false, 16, 2, 'restore' },
      { true, 16, 1, 'hyst' },
      { true, 8, 1, 'reduce' },
      { false, 8, 2, 'restore' },
      { false, 8, 2, 'restore' },
      { false, 16, 2, 'restore' },
      { true, 16, 1, 'hyst' },
    })
  end)

  it('hysteresis 3 needs three overflows in a row before the first halving', function()
    local s = S.from_config(fp16 { hysteresis = 3 })
    run_table(s, {
      { true, 16, 2, 'hyst' },
      { true, 16, 1, 'hyst' },
      { true, 8, 1, 'reduce' },
      { true, 4, 1, 'reduce' },
    })
  end)

  it('window 1 doubles on every clean step after the first one', function()
    local s = S.from_config(fp16 { loss_scale_window = 1 })
    run_table(s, {
      { false, 16, 1, false },
      { false, 32, 1, false },
      { false, 64, 1, false },
      { true, 32, 1, 'reduce' },
      { false, 32, 1, false },
      { false, 64, 1, false },
    })
  end)
end)

describe('loss_scaler: the minimum scale', function()
  it('raises naming fp16.min_loss_scale when an overflow would lower the minimum', function()
    local s = S.from_config(fp16 { initial_scale_power = 2, min_loss_scale = 1 })
    s:update_scale(true); s:update_scale(true)
    assert.are.equal(1, s.cur_scale)
    local err = fails('Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.',
                      s.update_scale, s, true)
    assert.is_truthy(err:find('fp16.min_loss_scale', 1, true))
    -- nothing moved: DeepSpeed raises before touching the counters
    assert.are.equal(1, s.cur_scale)
    assert.are.equal(2, s.cur_iter)
    assert.are.equal(1, s.last_overflow_iter)
  end)

  it('floors at a minimum that is not a power of two, then raises', function()
    local s = S.from_config(fp16 { initial_scale_power = 4, min_loss_scale = 5 })
    run_table(s, { { true, 8, 1, 'reduce' }, { true, 5, 1, 'reduce' } })
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 8, reducing to 5', s.message)
    fails('fp16.min_loss_scale', s.update_scale, s, true)
  end)

  it('hysteresis still absorbs overflows at the minimum before it raises', function()
    local s = S.from_config(fp16 { initial_scale_power = 0, hysteresis = 2 })
    run_table(s, { { true, 1, 1, 'hyst' } })
    fails('fp16.min_loss_scale', s.update_scale, s, true)
  end)

  it('with raise_error_at_min_scale = false it stays at the minimum (stage-0 FP16_Optimizer)', function()
    local s = S.from_config(fp16 { initial_scale_power = 1 }, { raise_error_at_min_scale = false })
    run_table(s, { { true, 1, 1, 'reduce' }, { true, 1, 1, 'reduce' }, { false, 1, 1, false } })
    s:update_scale(true)
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1', s.message)
  end)
end)

describe('loss_scaler: log lines', function()
  it('are DeepSpeed\'s text', function()
    local s = S.from_config(fp16 { initial_scale_power = 16, hysteresis = 2 })
    s:update_scale(true)
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, '
                     .. 'but hysteresis is 2. Reducing hysteresis to 1', s.message)
    s:update_scale(true)
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768',
                     s.message)
    s:update_scale(false)
    assert.is_nil(s.message)
    local c = S.from_config(fp16 { hysteresis = 3, consecutive_hysteresis = true })
    c:update_scale(false)
    assert.are.equal('Consecutive hysteresis is enabled. Restoring hysteresis to 3', c.message)
  end)

  it('overflow_line prints scales as Python int() does', function()
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4294967296, '
                     .. 'reducing to 2147483648', S.overflow_line { scale = 2 ^ 32, next_scale = 2 ^ 31 })
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1180591620717411303424, '
                     .. 'reducing to 590295810358705651712', S.overflow_line { scale = 2 ^ 70, next_scale = 2 ^ 69 })
    assert.are.equal('[deepspeed] OVERFLOW! Rank 3 Skipping step. Attempted loss scale: 0, reducing to 0',
                     S.overflow_line { rank = 3, scale = 0.5, next_scale = 0.25 })
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 8, '
                     .. 'but hysteresis is 4. Reducing hysteresis to 3', S.overflow_line { scale = 8, hysteresis = 4 })
    assert.are.equal('[deepspeed] OVERFLOW! Rank 0 Skipping step.', S.overflow_line {})
  end)
end)

describe('loss_scaler: random sequences against the reference', function()
  it('agree step for step over many settings', function()
    local seed = 12345
    local function rand()   -- LCG, the same sequence on every run
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed / 2147483648
    end
    local checked = 0
    for _, hyst in ipairs { 1, 2, 3 } do
      for _, consecutive in ipairs { false, true } do
        for _, window in ipairs { 1, 2, 5 } do
          for _, minimum in ipairs { 1, 8 } do
            for _, p in ipairs { 0.1, 0.4 } do
              local cfg = fp16 { initial_scale_power = 6, loss_scale_window = window, hysteresis = hyst,
                                 consecutive_hysteresis = consecutive, min_loss_scale = minimum }
              local s = S.from_config(cfg)
              local st = { cur_scale = 64, cur_iter = 0, last_overflow_iter = -1, cur_hysteresis = hyst,
                           delayed_shift = hyst, consecutive = consecutive, window = window, min_scale = minimum,
                           raise = true }
              for step = 1, 60 do
                local o = rand() < p
                local nxt, why = ref_step(st, o)
                local ok = pcall(s.update_scale, s, o)
                local what = string.format('hyst %d cons %s window %d min %d step %d', hyst, tostring(consecutive),
                                           window, minimum, step)
                if why == 'min' then
                  assert.is_false(ok, what .. ': should raise at the minimum')
                  break
                end
                assert.is_true(ok, what)
                for _, k in ipairs { 'cur_scale', 'cur_iter', 'last_overflow_iter', 'cur_hysteresis' } do
                  assert.are.equal(nxt[k], s[k], what .. ': ' .. k)
                end
                st = nxt
                checked = checked + 1
              end
            end
          end
        end
      end
    end
    assert.is_true(checked > 1000)
  end)
end)

describe('loss_scaler: static scale and construction', function()
  it('a static loss_scale never changes', function()
    local s = S.from_config(fp16 { loss_scale = 128 })
    assert.is_false(s.dynamic)
    for _, o in ipairs { true, true, false, true, false } do
      s:update_scale(o)
      assert.are.equal(128, s.cur_scale)
      assert.is_nil(s.message)
    end
    assert.are.equal(256, s:scale_loss(2))
  end)

  it('fp16 off (bf16 or fp32) gives a static scale of 1', function()
    local s = S.from_config(fp16 { enabled = false, loss_scale = 0 })
    assert.is_false(s.dynamic)
    assert.are.equal(1, s.cur_scale)
  end)

  it('takes DeepSpeed\'s defaults as dslua.config fills them in', function()
    local cfg = ds.config.load({ train_batch_size = 1, fp16 = { enabled = true } }, { world_size = 1 })
    local s = S.from_config(cfg.fp16)
    assert.is_true(s.dynamic)
    assert.are.equal(65536, s.cur_scale)
    assert.are.equal(1000, s.scale_window)
    assert.are.equal(2, s.delayed_shift)
    assert.are.equal(2, s.cur_hysteresis)
    assert.are.equal(1, s.min_scale)
    assert.is_false(s.consecutive_hysteresis)
    assert.is_true(s.raise_error_at_min_scale)
    assert.are.equal(2, s.scale_factor)
  end)

  it('scale_loss multiplies a tensor loss', function()
    local s = S.from_config(fp16 {})
    H.assert_close(s:scale_loss(ds.tensor({ 0.5 })), ds.tensor({ 8 }))
  end)

  it('rejects settings DeepSpeed rejects, naming the key', function()
    fails('fp16.min_loss_scale', S.from_config, fp16 { min_loss_scale = 0 })
    fails('initial_scale_power', S.from_config, fp16 { initial_scale_power = 2000 })
    fails('fp16.loss_scale_window', S.from_config, fp16 { loss_scale_window = 0 })
    fails('fp16.hysteresis', S.from_config, fp16 { hysteresis = 1.5 })
    fails('fp16.loss_scale', S.from_config, fp16 { loss_scale = -1 })
    fails('fp16.loss_scale', S.from_config, fp16 { loss_scale = INF })
    fails('resolved fp16 config block', S.from_config, nil)
  end)
end)

describe('loss_scaler: state', function()
  it('round-trips mid-run and continues identically', function()
    local seq = { true, false, true, true, false, false, false, false, true, false, false, false }
    local a = S.from_config(fp16 { hysteresis = 2, loss_scale_window = 3, initial_scale_power = 10 })
    for i = 1, 5 do a:update_scale(seq[i]) end
    local sd = a:state_dict()
    for _, v in pairs(sd) do assert.is_true(type(v) == 'number' or type(v) == 'boolean') end
    -- a scaler configured otherwise takes everything from the state, as DeepSpeed's checkpoint load
    local b = S.from_config(fp16 { hysteresis = 1, loss_scale_window = 100, initial_scale_power = 1 })
    b:load_state_dict(sd)
    assert.are.same(sd, b:state_dict())
    for i = 6, #seq do
      a:update_scale(seq[i]); b:update_scale(seq[i])
      assert.are.same(a:state_dict(), b:state_dict())
    end
  end)

  it('a saved static scaler replaces a dynamic one and the other way round', function()
    local st = S.from_config(fp16 { loss_scale = 512 })
    local dy = S.from_config(fp16 {})
    local dsd = dy:state_dict()
    dy:load_state_dict(st:state_dict())
    assert.is_false(dy.dynamic)
    dy:update_scale(true)
    assert.are.equal(512, dy.cur_scale)
    st:load_state_dict(dsd)
    assert.is_true(st.dynamic)
    st:update_scale(true)
    assert.are.equal(8, st.cur_scale)
  end)

  it('rejects a state that is not one', function()
    local s = S.from_config(fp16 {})
    fails('expected a table from state_dict()', s.load_state_dict, s, 'x')
    fails("the state has no 'cur_hysteresis'", s.load_state_dict, s, { dynamic = true, cur_scale = 1, cur_iter = 0,
                                                                       last_overflow_iter = -1 })
  end)
end)

describe('loss_scaler: has_overflow', function()
  for _, dt in ipairs { 'f32', 'f64', 'f16', 'bf16' } do
    it('finds inf, -inf and nan in ' .. dt, function()
      assert.is_false(S.has_overflow(ds.tensor({ 1, -2, 3 }, dt)))
      assert.is_true(S.has_overflow(ds.tensor({ 1, INF, 3 }, dt)))
      assert.is_true(S.has_overflow(ds.tensor({ 1, -INF, 3 }, dt)))
      assert.is_true(S.has_overflow(ds.tensor({ 1, NAN, 3 }, dt)))
      assert.is_true(S.has_overflow(ds.tensor({ INF, -INF }, dt)))     -- the sum is nan
    end)
  end

  it('is not fooled by sums of huge finite values that overflow', function()
    assert.is_false(S.has_overflow(ds.tensor({ 3e38, 3e38, 3e38 }, 'f32')))
    assert.is_false(S.has_overflow(ds.tensor({ 3e38, 3e38, -3e38, -3e38, -3e38 }, 'f32')))
    assert.is_false(S.has_overflow(ds.tensor({ 1e308, 1e308, -1e308, -1e308 }, 'f64')))   -- f64 sum: nan
    assert.is_false(S.has_overflow(ds.tensor({ 60000, 60000 }, 'f16')))
    assert.is_false(S.has_overflow(ds.tensor({ 3e38, 3e38 }, 'bf16')))
    assert.is_true(S.has_overflow(ds.tensor({ 3e38, 3e38, NAN }, 'f32')))
    assert.is_true(S.has_overflow(ds.tensor({ 1e308, 1e308, -INF }, 'f64')))
  end)

  it('checks large tensors in all their parts', function()
    local n = 2 * 1048576 + 37        -- row sums plus a remainder
    local t = ds.zeros({ n })
    assert.is_false(S.has_overflow(t))
    t:narrow(1, n, 1):fill_(INF)      -- in the remainder
    assert.is_true(S.has_overflow(t))
    t:narrow(1, n, 1):fill_(0)
    t:narrow(1, 1000000, 1):fill_(NAN)
    assert.is_true(S.has_overflow(t))
    t:fill_(3e38)
    assert.is_false(S.has_overflow(t))
    t:narrow(1, 5, 1):fill_(-INF)
    assert.is_true(S.has_overflow(t:to('f16')))
  end)

  it('takes lists (nil entries skipped), views and any shape; ints, bools and empties never overflow', function()
    local m = ds.tensor({ { 1, 2, 3 }, { 4, INF, 6 } })
    assert.is_true(S.has_overflow(m:transpose(1, 2)))
    assert.is_true(S.has_overflow(m:narrow(2, 2, 1)))
    assert.is_false(S.has_overflow(m:narrow(2, 1, 1)))
    assert.is_true(S.has_overflow { ds.tensor({ 1 }), nil, ds.tensor({ NAN }, 'bf16') })
    assert.is_false(S.has_overflow { ds.tensor({ 1 }), ds.tensor({ 2 }, 'f16') })
    assert.is_false(S.has_overflow {})
    assert.is_false(S.has_overflow(ds.tensor({ 1, 2 }, 'i64')))
    assert.is_false(S.has_overflow(ds.zeros({ 0 })))
    assert.is_false(S.has_overflow(ds.tensor(5.0)))
  end)

  it('works on tensors that require grad without recording', function()
    local w = ds.tensor({ 1, INF })
    w.requires_grad = true
    assert.is_true(S.has_overflow(w))
  end)

  it('names itself on bad input', function()
    fails('loss_scaler.has_overflow: expected a tensor or a list of tensors', S.has_overflow, 'x')
    fails('loss_scaler.has_overflow: item 2 is a string, not a tensor', S.has_overflow, { ds.zeros({ 1 }), 'x' })
  end)
end)
