-- Sampler policies (samplers/policy.lua, uneven.lua, auto.lua) and the
-- config's sampler block: coverage of every epoch across ranks, equal
-- steps, determinism, custom policy files, state, auto's planning from
-- given observations, and the validation messages.
local H = require 'helpers'
local ds = H.ds
local json = require 'dslua.base.json'
local config = require 'dslua.config'
local P = require 'samplers.policy'
local U = require 'samplers.uneven'
local A = require 'samplers.auto'

local bin, tmpdir, write, err, has = H.bin(), H.tmpdir, H.write, H.err, H.has

local function list(v) return ds.is_tensor(v) and v:totable() or v end

-- Every rank's sampler for one epoch: indices, steps and step sizes.
local function plans(block, n, W, epoch)
  local out = {}
  for r = 0, W - 1 do
    local s = P.new(block, { dataset_len = n, rank = r, world_size = W })
    s:set_epoch(epoch or 0)
    local sizes = {}
    for j = 1, s:steps() do sizes[j] = s:batch_size(j) end
    out[r + 1] = { indices = list(s:indices()), steps = s:steps(), sizes = sizes, sampler = s,
                   micro_batch = s:micro_batch() }
  end
  return out
end

-- Every index used once (drop_last = false: at least once, fewer than W
-- repeated; true: at most once, fewer than one global batch left out),
-- every rank the same number of steps, every step between 1 and the cap.
local function check_cover(ps, n, drop_last, caps, what)
  local W = #ps
  local seen, total, global = {}, 0, 0
  for r, p in ipairs(ps) do
    assert.are.equal(ps[1].steps, p.steps, what .. ': rank ' .. (r - 1) .. ' steps')
    local sum = 0
    for j, b in ipairs(p.sizes) do
      assert(b >= 1 and (not caps or b <= caps[r]), string.format('%s: rank %d step %d has %d', what, r - 1, j, b))
      sum = sum + b
    end
    assert.are.equal(#p.indices, sum, what .. ': sizes sum to the rank\'s samples')
    for _, i in ipairs(p.indices) do
      assert(i >= 0 and i < n and i == math.floor(i), what .. ': index ' .. tostring(i))
      seen[i] = (seen[i] or 0) + 1
      total = total + 1
    end
    global = global + (caps and caps[r] or p.sizes[1] or 0)
  end
  if not drop_last then
    for i = 0, n - 1 do assert(seen[i], what .. ': index ' .. i .. ' unused') end
    assert(total - n >= 0 and total - n < W, what .. ': ' .. (total - n) .. ' repeated')
    if n >= W then
      for i, c in pairs(seen) do assert(c <= 2, what .. ': index ' .. i .. ' used ' .. c .. ' times') end
    end
  else
    for i, c in pairs(seen) do assert.are.equal(1, c, what .. ': index ' .. i .. ' used twice') end
    assert(n - total >= 0 and n - total < math.max(global, W), what .. ': ' .. (n - total) .. ' left out')
  end
  return total
end

local MICRO = { 48, 16, 32, 8 }
local TINY = { 1, 3, 2, 1 }
local SHARES = { { 1 }, { 0.3, 0.7 }, { 0.5, 0.2, 0.3 }, { 0.4, 0.3, 0.2, 0.1 } }
local SIZES = { 997, 1009, 13, 1 }

local function first(t, W)
  local out = {}
  for i = 1, W do out[i] = t[i] end
  return out
end

describe('uneven policy', function()
  it('uses every index once per epoch across 1 to 4 ranks, in equal steps', function()
    for W = 1, 4 do
      for _, n in ipairs(SIZES) do
        for _, drop_last in ipairs({ false, true }) do
          local blocks = {
            { micro_batch_per_rank = first(MICRO, W) },                               -- shares follow the batches
            { micro_batch_per_rank = first(MICRO, W), data_share = SHARES[W] },       -- shares of their own
            { micro_batch_per_rank = first(TINY, W), data_share = SHARES[W], shuffle = false },
          }
          for k, b in ipairs(blocks) do
            b.policy, b.drop_last = 'uneven', drop_last
            local what = string.format('W=%d n=%d drop_last=%s block %d', W, n, tostring(drop_last), k)
            check_cover(plans(b, n, W, 3), n, drop_last, b.micro_batch_per_rank, what)
          end
        end
      end
    end
  end)

  it('gives each rank its share in its micro batches: 75% in 48s and 25% in 16s, 157 steps each', function()
    local ps = plans({ micro_batch_per_rank = { 48, 16 }, data_share = { 0.75, 0.25 } }, 10000, 2)
    assert.are.equal(7500, #ps[1].indices)
    assert.are.equal(2500, #ps[2].indices)
    assert.are.equal(48, ps[1].micro_batch)
    assert.are.equal(16, ps[2].micro_batch)
    assert.are.equal(157, ps[1].steps)
    assert.are.equal('rank 1 | epoch 0 | micro batch 16 | samples 2500 | steps 157', ps[2].sampler:epoch_line())
    assert.are.equal('rank 0 | epoch 0 | micro batch 48 | samples 7500 | steps 157', ps[1].sampler:epoch_line())
    -- drop_last: the incomplete last step goes on both ranks
    ps = plans({ micro_batch_per_rank = { 48, 16 }, data_share = { 0.75, 0.25 }, drop_last = true }, 10000, 2)
    assert.are.equal(156 * 48, #ps[1].indices)
    assert.are.equal(156 * 16, #ps[2].indices)
  end)

  it('rounds the shares by largest remainder and bends them only as equal steps need', function()
    assert.are.same({ 748, 249 }, (U.apportion(997, { 0.75, 0.25 })))
    assert.are.same({ 4, 3, 3 }, (U.apportion(10, { 1, 1, 1 })))
    local L = U.layout(997, { 48, 16 }, { 0.75, 0.25 }, false)
    assert.are.same({ 748, 249 }, L.counts)
    assert.are.equal(16, L.steps)
    -- equal shares but micro batches 48 and 16: rank 0 takes its half in smaller batches
    L = U.layout(1000, { 48, 16 }, { 0.5, 0.5 }, false)
    assert.are.same({ 500, 500 }, L.counts)
    assert.are.equal(32, L.steps)
    assert.are.equal(16, U.micro_batch(L, 0))
    -- a share too thin for its micro batch: batches of b and b - 1, as a list
    L = U.layout(1009, { 5, 7, 3, 2 }, { 0.25, 0.25, 0.25, 0.25 }, false)
    assert.are.equal(126, L.steps)
    local mb = U.micro_batch(L, 0)
    assert.is_table(mb)
    assert.are.equal(126, #mb)
    -- too few samples for one per rank and step: padded by fewer than W
    L = U.layout(1, { 48, 16 }, { 0.5, 0.5 }, false)
    assert.are.same({ 1, 1 }, L.counts)
    assert.are.equal(1, L.pad)
    L = U.layout(0, { 48, 16 }, { 0.5, 0.5 }, false)
    assert.are.equal(0, L.steps)
  end)

  it('lays the ranks out step by step: the union of a step is the next run of the order', function()
    for _, shuffle in ipairs({ true, false }) do
      local ps = plans({ micro_batch_per_rank = { 48, 16, 8 }, shuffle = shuffle, seed = 5 }, 997, 3, 2)
      local order = shuffle and ds.data.permutation(997, 5 + 2):totable() or nil
      local pos = 0
      for j = 1, ps[1].steps do
        for _, p in ipairs(ps) do
          local start = 0
          for k = 1, j - 1 do start = start + p.sizes[k] end
          for k = 1, p.sizes[j] do
            local want = order and order[pos + 1] or pos
            assert.are.equal(want, p.indices[start + k])
            pos = pos + 1
          end
        end
      end
      assert.are.equal(997, pos)
      assert.are.same({ 72, 72 }, { U.global_sizes(ps[1].sampler.policy.layout)[1],
                                    U.global_sizes(ps[1].sampler.policy.layout)[2] })
    end
  end)

  it('is deterministic by seed and epoch', function()
    local b = { micro_batch_per_rank = { 8, 4 }, seed = 3 }
    assert.are.same(plans(b, 1009, 2, 1)[2].indices, plans(b, 1009, 2, 1)[2].indices)
    assert.are_not.same(plans(b, 1009, 2, 1)[2].indices, plans(b, 1009, 2, 2)[2].indices)
    assert.are_not.same(plans(b, 1009, 2, 1)[2].indices, plans({ micro_batch_per_rank = { 8, 4 }, seed = 4 },
                                                                1009, 2, 1)[2].indices)
  end)

  it('feeds a loader each step\'s batch and prints the rank\'s line per epoch', function()
    local d = ds.data.tensors { x = ds.arange(0, 1009):to('f32'), y = ds.arange(0, 1009) }
    for _, block in ipairs({ { micro_batch_per_rank = { 5, 7, 3, 2 }, data_share = { 0.25, 0.25, 0.25, 0.25 } },
                             { micro_batch_per_rank = { 5, 7, 3, 2 } } }) do
      local seen = {}
      for r = 0, 3 do
        local s = P.new(block, { dataset = d, rank = r, world_size = 4 })
        local lines = {}
        local l = P.loader(d, s, { print = function(line) lines[#lines + 1] = line end })
        local steps = 0
        for step, batch in l:epoch(4) do
          steps = step
          assert.are.equal(s:batch_size(step), batch.x:size(1))
          for _, v in ipairs(batch.x:totable()) do seen[#seen + 1] = v end
        end
        assert.are.equal(s:steps(), steps)
        assert.are.equal(s:epoch_line(), lines[#lines])
        has(lines[#lines], 'rank ' .. r .. ' | epoch 4 | micro batch ')
      end
      table.sort(seen)
      for i = 0, 1008 do assert.are.equal(i, seen[i + 1]) end
    end
  end)
end)

describe('distributed policy', function()
  it('is PyTorch\'s DistributedSampler with the micro batch of every rank', function()
    for W = 1, 4 do
      for _, n in ipairs(SIZES) do
        for _, drop_last in ipairs({ false, true }) do
          local b = { policy = 'distributed', micro_batch_per_rank = first({ 8, 8, 8, 8 }, W), drop_last = drop_last }
          local ps = plans(b, n, W, 1)
          check_cover(ps, n, drop_last, b.micro_batch_per_rank, string.format('W=%d n=%d', W, n))
          local ref = require('samplers.distributed').new(n, { num_replicas = W, rank = W - 1, drop_last = drop_last })
          assert.are.same(ref:indices(1), ps[W].indices)
        end
      end
    end
  end)
end)

describe('auto policy', function()
  it('allocates the global micro batch in proportion to speed within the caps', function()
    assert.are.same({ 48, 16 }, A.allocate(64, { 3, 1 }, { 64, 64 }))
    assert.are.same({ 40, 24 }, A.allocate(64, { 3, 1 }, { 40, 64 }))
    assert.are.same({ 10, 20 }, A.allocate(64, { 1, 1 }, { 10, 20 }))
    assert.are.same({ 8, 1, 1 }, A.allocate(10, { 1000, 1, 1 }, { 10, 10, 10 }))
    assert.are.same({ 4, 3, 3 }, A.allocate(10, { 1, 1, 1 }, { 10, 10, 10 }))
    assert.are.same({ 3, 3, 4 }, A.allocate(10, { 1, 1, 1.0001 }, { 10, 10, 10 }))
  end)

  local function observe(s, speeds, steps)
    for _ = 1, steps do
      for r, v in ipairs(speeds) do s:observe { rank = r - 1, samples = 16, seconds = 16 / v } end
    end
  end

  it('runs the configured plan while measuring, then plans by speed at the next epoch', function()
    local block = { policy = 'auto', micro_batch_per_rank = { 32, 32 }, measure_steps = 4, skip_steps = 1 }
    local s = P.new(block, { dataset_len = 1009, rank = 0, world_size = 2 })
    s:set_epoch(0)
    assert.are.equal(32, s:micro_batch())
    has(s:note(), 'auto plan | epoch 0 | measuring (0 of 4 steps) | micro batch 32, 32 | data share 0.5000, 0.5000')
    assert.is_true(s:observing())
    observe(s, { 300, 100 }, 4)          -- the first is skipped: 3 of 4
    assert.are.equal(32, s:micro_batch(), 'the plan changes at epoch boundaries only')
    s:set_epoch(1)
    assert.are.equal(32, s:micro_batch())
    has(s:note(), 'measuring (3 of 4 steps)')
    observe(s, { 300, 100 }, 1)
    s:set_epoch(2)
    assert.are.equal(48, s:micro_batch())
    assert.are.equal('auto plan | epoch 2 | samples/s 300.0, 100.0 | micro batch 48, 16 | data share 0.7500, 0.2500'
                     .. ' | global batch 64', s:note())
    -- caps bound it
    block.max_micro_batch_per_rank = { 40, 64 }
    s = P.new(block, { dataset_len = 1009, rank = 1, world_size = 2 })
    observe(s, { 300, 100 }, 5)
    s:set_epoch(0)
    assert.are.equal(24, s:micro_batch())
  end)

  it('uses every index once per epoch after re-planning, on 1 to 4 ranks', function()
    for W = 1, 4 do
      for _, n in ipairs(SIZES) do
        for _, drop_last in ipairs({ false, true }) do
          local block = { policy = 'auto', micro_batch_per_rank = first({ 16, 16, 16, 16 }, W), measure_steps = 2,
                          max_micro_batch_per_rank = 40, drop_last = drop_last }
          local ps = {}
          for r = 0, W - 1 do
            local s = P.new(block, { dataset_len = n, rank = r, world_size = W })
            observe(s, first({ 400, 100, 250, 50 }, W), 3)
            s:set_epoch(1)
            local sizes = {}
            for j = 1, s:steps() do sizes[j] = s:batch_size(j) end
            ps[r + 1] = { indices = list(s:indices()), steps = s:steps(), sizes = sizes }
          end
          check_cover(ps, n, drop_last, first({ 40, 40, 40, 40 }, W), string.format('auto W=%d n=%d', W, n))
        end
      end
    end
  end)

  it('keeps its measurements through state_dict, a JSON round trip and load_state_dict', function()
    local block = { policy = 'auto', micro_batch_per_rank = { 32, 32 }, measure_steps = 3 }
    local a = P.new(block, { dataset_len = 997, rank = 1, world_size = 2 })
    a:set_epoch(0)
    observe(a, { 100, 300 }, 4)
    local sd = json.decode(json.encode(a:state_dict()))
    assert.are.equal('auto', sd.policy)
    assert.are.equal(0, sd.epoch)
    local b = P.new(block, { dataset_len = 997, rank = 1, world_size = 2 })
    b:load_state_dict(sd)
    assert.are.same(list(a:set_epoch(1).indices), list(b:set_epoch(1).indices))
    assert.are.equal(48, b:micro_batch())
  end)

  it('all-gathers observations through exchange (one rank: its own)', function()
    local s = P.new({ policy = 'auto', micro_batch_per_rank = { 8 }, measure_steps = 1, skip_steps = 0 },
                    { dataset_len = 100, rank = 0, world_size = 1 })
    s:exchange(8, 0.5)
    s:set_epoch(0)
    has(s:note(), 'samples/s 16.0')
  end)
end)

describe('custom policies', function()
  local dir = tmpdir()
  -- every world_size-th index from the rank on, params.size per step
  local strided = write(dir .. '/strided.lua', [[
local P = {}
function P.plan(ctx)
  local out = {}
  for i = ctx.rank, ctx.dataset_len - 1, ctx.world_size do out[#out + 1] = i end
  P.last = ctx
  return { indices = out, micro_batch = ctx.params.size }
end
return P
]])
  -- method style, with state that counts plans
  local counting = write(dir .. '/counting.lua', [[
local P = { plans = 0, version = 1 }
function P:plan(ctx)
  self.plans = self.plans + 1
  local out = {}
  for i = 0, ctx.dataset_len - 1 do out[#out + 1] = i end
  return { indices = out, micro_batch = { ctx.dataset_len }, note = 'plans ' .. self.plans }
end
function P:state_dict() return { plans = self.plans } end
function P:load_state_dict(s) self.plans = s.plans end
return P
]])

  it('loads a policy file and hands it the context', function()
    local s = P.new({ policy = strided, params = { size = 7 } },
                    { dataset_len = 1009, rank = 1, world_size = 3, micro_batch = 7 })
    s:set_epoch(2)
    assert.are.equal(7, s:micro_batch())
    assert.are.equal(336, s:len())
    assert.are.equal(48, s:steps())
    local ctx = s.policy.last
    assert.are.same({ 1, 3, 2, 0, 1009 }, { ctx.rank, ctx.world_size, ctx.epoch, ctx.seed, ctx.dataset_len })
    assert.are.equal(7, ctx.params.size)
    assert.are.same({ 1 / 3, 1 / 3, 1 / 3 }, ctx.params.data_share)
    assert.are.equal(P.hash(io.open(strided):read('*a')), s:state_dict().hash)
    assert.are.equal(8, #s:state_dict().hash)
    -- each sampler runs the file afresh
    local t = P.new({ policy = strided, params = { size = 7 } },
                    { dataset_len = 10, rank = 0, world_size = 3, micro_batch = 7 })
    assert.are_not.equal(s.policy, t.policy)
  end)

  it('takes a policy table, self-style functions and new()', function()
    local made = write(dir .. '/made.lua', [[
return { new = function() return { plan = function(ctx) return { indices = { 0, 1 }, micro_batch = 1 } end } end }
]])
    local s = P.new({ policy = made }, { dataset_len = 5, rank = 0, world_size = 1, micro_batch = 2 })
    assert.are.equal(2, s:steps())
    local tbl = { plan = function(ctx) return { indices = ds.tensor({ ctx.rank, 4 }, 'i64'), micro_batch = 2 } end }
    s = P.new({ policy = tbl }, { dataset_len = 5, rank = 0, world_size = 1, micro_batch = 2 })
    assert.are.same({ 0, 4 }, s:indices():totable())
    s = P.new({ policy = counting }, { dataset_len = 5, rank = 0, world_size = 1, micro_batch = 2 })
    s:set_epoch(0)
    assert.are.equal('plans 1', s:note())
  end)

  it('names the file in every error', function()
    local function fails(block, piece)
      local s = P.new(block, { dataset_len = 10, rank = 0, world_size = 1, micro_batch = 2 })
      has(err(s.set_epoch, s, 0), piece)
    end
    local function policy(name, text) return write(dir .. '/' .. name, text) end
    local syntax = policy('syntax.lua', 'return { plan = function(ctx) return { end }')
    has(err(P.new, { policy = syntax }, { dataset_len = 10, rank = 0, world_size = 1, micro_batch = 2 }),
        'sampler.policy: the policy file does not compile: ' .. syntax .. ':1:')
    has(err(P.load, syntax), 'sampler policy ' .. syntax .. ': ' .. syntax .. ':1:')
    has(err(P.new, { policy = dir .. '/none.lua' }, { dataset_len = 10, rank = 0, world_size = 1, micro_batch = 2 }),
        'cannot read the policy file "' .. dir .. '/none.lua"')
    local boom = policy('boom.lua', 'return { plan = function(ctx) error("no plan today") end }')
    fails({ policy = boom }, 'sampler policy ' .. boom .. ': plan() failed: ' .. boom .. ':1: no plan today')
    local notable = policy('notable.lua', 'return 42')
    has(err(P.load, notable), notable .. ': the file must return a table with a plan(ctx) function, it returned a number')
    local range = policy('range.lua', 'return { plan = function(ctx) return { indices = { 0, 10 }, micro_batch = 1 } end }')
    fails({ policy = range }, range .. ': plan() indices[2] = 10 is not an index of the dataset [0, 10)')
    local sum = policy('sum.lua', 'return { plan = function(ctx) return { indices = { 0, 1, 2 }, micro_batch = { 2 } } end }')
    fails({ policy = sum }, sum .. ': plan() micro_batch sizes sum to 2, indices has 3')
    local zero = policy('zero.lua', 'return { plan = function(ctx) return { indices = { 0 }, micro_batch = 0 } end }')
    fails({ policy = zero }, zero .. ': plan() micro_batch must be a positive integer or a list of them, got 0')
    local typo = policy('typo.lua', 'return { plan = function(ctx) return { indices = {}, microbatch = 1 } end }')
    fails({ policy = typo }, typo .. ": plan() returned an unknown field 'microbatch' (indices, micro_batch, note)")
    local dtype = policy('dtype.lua', [[
local ds = require 'dslua'
return { plan = function(ctx) return { indices = ds.tensor({ 0.5 }), micro_batch = 1 } end }]])
    fails({ policy = dtype }, dtype .. ': plan() indices must be an i64 or i32 tensor, got f32')
  end)

  it('keeps state through state_dict / load_state_dict and a swap to new code', function()
    local opts = { dataset_len = 6, rank = 0, world_size = 1, micro_batch = 2 }
    local a = P.new({ policy = counting }, opts)
    a:set_epoch(0)
    a:set_epoch(1)
    local sd = json.decode(json.encode(a:state_dict()))
    assert.are.same({ plans = 2 }, sd.state)
    assert.are.equal(1, sd.epoch)
    local b = P.new({ policy = counting }, opts)
    b:load_state_dict(sd)
    assert.are.equal(1, b.epoch)
    b:set_epoch(2)
    assert.are.equal('plans 3', b:note())
    local v2 = write(dir .. '/counting2.lua', (io.open(counting):read('*a'):gsub("'plans '", "'v2 plans '")))
    b:swap(v2)
    assert.are.equal('plans 3', b:note(), 'the current epoch keeps its plan')
    b:set_epoch(3)
    assert.are.equal('v2 plans 4', b:note())
    assert.are.equal(v2, b:state_dict().policy)
    assert.are_not.equal(sd.hash, b:state_dict().hash)
  end)

  it('is kept for a checkpoint as its order and runs of sizes, a list plan as tensors, and read back', function()
    local opts = { dataset_len = 40, rank = 0, world_size = 1, micro_batch = 3 }
    local lazy = { plan = function(ctx)
      return { indices = ds.data.order(ctx.dataset_len, { seed = ctx.epoch, runs = { { 2, 3, 2, 6 } } }),
               micro_batch = { 3, 3, 3, 1, 1, 1 } }
    end }
    local s = P.new({ policy = lazy }, opts)
    s:set_epoch(2)
    local rec, tensors = s:saved_plan()
    rec = json.decode(json.encode(rec))
    assert.are.same({}, tensors)
    assert.are.same({ { 3, 3 }, { 1, 3 } }, rec.micro_batch_runs)
    local back = P.saved_plan_of(rec, function(name) error('read ' .. name) end)
    assert.are.equal(s:order(), back.indices)
    assert.are.same({ 3, 3, 3, 1, 1, 1 }, back.micro_batch)
    s:restore_plan(back)
    assert.are.equal(6, s:steps())
    -- a list plan keeps its indices, 8 bytes each
    local l = P.new({ policy = { plan = function() return { indices = { 5, 1, 4 }, micro_batch = 2 } end } }, opts)
    l:set_epoch(0)
    rec, tensors = l:saved_plan()
    assert.are.equal('sampler/indices', tensors[1][1])
    assert.are.same({ 5, 1, 4 }, P.saved_plan_of(rec, function() return tensors[1][2] end).indices:totable())
    -- runs of sizes that do not fill the indices are refused before they are written out
    rec = json.decode(json.encode((s:saved_plan())))
    rec.micro_batch_runs[2][2] = 1e15
    has(err(P.saved_plan_of, rec), 'micro_batch_runs hold 1000000000000009 samples, the indices 12')
    rec.micro_batch_runs[2] = { 0, 3 }
    has(err(P.saved_plan_of, rec), 'micro_batch_runs[2] is not {size >= 1, count >= 0}')
  end)

  it('finds a policy file next to the config file', function()
    local cdir = tmpdir()
    write(cdir .. '/mine.lua', 'return { plan = function(ctx) return { indices = {}, micro_batch = 1 } end }')
    local path = write(cdir .. '/ds.json', '{"train_micro_batch_size_per_gpu": 4, '
                                           .. '"sampler": {"policy": "mine.lua", "params": {"k": 1}}}')
    local cfg = config.load(path, { world_size = 2 })
    assert.are.equal(cdir .. '/mine.lua', cfg.sampler.policy)
    assert.are.same({ k = 1 }, cfg.sampler.params)
    assert.are.same({ 4, 4 }, cfg.sampler.micro_batch_per_rank)
    local s = P.new(cfg.sampler, { dataset_len = 3, rank = 1, world_size = 2, source = path })
    assert.are.equal(0, s:len())
  end)
end)

describe('the sampler block of the config', function()
  local function problems(t, ws)
    local cfg, lines = config.check(t, { world_size = ws or 2 })
    assert.is_nil(cfg, 'expected problems')
    return table.concat(lines, '\n')
  end

  it('resolves train_batch_size from the per-rank micro batches', function()
    local cfg, notes = config.load({ sampler = { micro_batch_per_rank = { 48, 16 }, data_share = { 0.75, 0.25 } } },
                                   { world_size = 2 })
    assert.are.same({ 64, 48, 1 }, { cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                     cfg.gradient_accumulation_steps })
    has(table.concat(notes, '\n'), 'config: train_batch_size: 64 = sum(sampler.micro_batch_per_rank) '
                                   .. '* gradient_accumulation_steps = (48 + 16) * 1')
    assert.are.same({ policy = 'uneven', micro_batch_per_rank = { 48, 16 }, data_share = { 0.75, 0.25 },
                      shuffle = true, seed = 0, drop_last = false }, cfg.sampler)
    cfg = config.load({ train_batch_size = 192, sampler = { micro_batch_per_rank = { 48, 16 } } }, { world_size = 2 })
    assert.are.same({ 192, 3 }, { cfg.train_batch_size, cfg.gradient_accumulation_steps })
    assert.are.same({ 0.75, 0.25 }, cfg.sampler.data_share)
    cfg = config.load({ gradient_accumulation_steps = 2, sampler = { micro_batch_per_rank = { 5, 7, 3 } } },
                      { world_size = 3 })
    assert.are.equal(30, cfg.train_batch_size)
    -- without micro_batch_per_rank the DeepSpeed triple sets one for every rank
    cfg = config.load({ train_batch_size = 32, sampler = { policy = 'distributed' } }, { world_size = 4 })
    assert.are.same({ 8, 8, 8, 8 }, cfg.sampler.micro_batch_per_rank)
    assert.are.same(cfg, config.load(json.decode(json.encode(cfg)), { world_size = 4 }))
    cfg = config.load({ train_micro_batch_size_per_gpu = 8, sampler = { policy = 'auto', max_micro_batch_per_rank = 16 } },
                      { world_size = 2 })
    assert.are.same({ 16, 16 }, cfg.sampler.max_micro_batch_per_rank)
    assert.are.same({ 10, 1 }, { cfg.sampler.measure_steps, cfg.sampler.skip_steps })
    assert.are.same(cfg, config.load(json.decode(json.encode(cfg)), { world_size = 2 }))
  end)

  it('reports each problem with its key path', function()
    local out = problems({ sampler = { micro_batch_per_rank = { 48, 16, 0 }, data_share = { 0.5, 0.6 },
                                       shufle = true, measure_steps = 3, params = {} } })
    has(out, 'config: sampler.shufle: unknown key, did you mean \'shuffle\'?')
    has(out, 'config: sampler.measure_steps: only the \'auto\' policy reads it')
    has(out, 'config: sampler.params: only a policy loaded from a Lua file reads it')
    has(out, 'config: sampler.micro_batch_per_rank: has 3 entries, the world size is 2 (one per rank)')
    has(out, 'config: sampler.micro_batch_per_rank[2]: must be a positive integer, got 0')
    has(out, 'config: sampler.data_share: the shares sum to 1.1, they must sum to 1 (within 1e-6)')
    out = problems({ sampler = { micro_batch_per_rank = { -4, 2.5 }, data_share = { 0, 1 } } })
    has(out, 'sampler.micro_batch_per_rank[0]: must be a positive integer, got -4')
    has(out, 'sampler.micro_batch_per_rank[1]: must be a positive integer, got 2.5')
    has(out, 'sampler.data_share[0]: must be a number > 0 (every rank takes a share), got 0')
    has(problems({ sampler = { micro_batch_per_rank = { 8, 8 }, data_share = { 0.5, 0.51 } } }),
        'sampler.data_share: the shares sum to 1.01, they must sum to 1 (within 1e-6)')
    assert.is_table(config.load({ sampler = { micro_batch_per_rank = { 8, 8, 8 },
                                              data_share = { 1 / 3, 1 / 3, 0.3333334 } } }, { world_size = 3 }))
    has(problems({ sampler = { micro_batch_per_rank = { 48 } } }), 'sampler.micro_batch_per_rank: has 1 entry, the world size is 2')
    -- one per data-parallel rank: with tensor parallelism, the world over its degree
    local tp = { tensor_parallel = { autotp_size = 2 }, sampler = { micro_batch_per_rank = { 3, 1 } } }
    assert.are.equal(4, config.load(tp, { world_size = 4 }).train_batch_size)
    tp.sampler.micro_batch_per_rank = { 3, 1, 2, 2 }
    has(problems(tp, 4), 'sampler.micro_batch_per_rank: has 4 entries, the world size is 2 (one per rank)')
    has(problems({ sampler = { micro_batch_per_rank = 48 } }),
        'sampler.micro_batch_per_rank: must be a list of 2 positive integers (one per rank), got 48')
    has(problems({ sampler = { policy = 'unevn', micro_batch_per_rank = { 1, 1 } } }),
        'sampler.policy: unknown policy "unevn", did you mean \'uneven\'?')
    has(problems({ train_batch_size = 100, sampler = { micro_batch_per_rank = { 48, 16 } } }),
        'train_batch_size: 100 is not a multiple of sum(sampler.micro_batch_per_rank) = 64')
    has(problems({ train_batch_size = 128, gradient_accumulation_steps = 1, sampler = { micro_batch_per_rank = { 48, 16 } } }),
        'train_batch_size: 128 != sum(sampler.micro_batch_per_rank) * gradient_accumulation_steps = 64 * 1')
    has(problems({ train_micro_batch_size_per_gpu = 16, sampler = { micro_batch_per_rank = { 48, 16 } } }),
        'train_micro_batch_size_per_gpu: is 16, but sampler.micro_batch_per_rank gives each rank its own (48, 16)')
    has(problems({ train_micro_batch_size_per_gpu = 8, sampler = { policy = 'auto', max_micro_batch_per_rank = { 4, 16 } } }),
        'sampler.max_micro_batch_per_rank[0]: 4 is below sampler.micro_batch_per_rank[0] = 8')
    has(problems({ train_micro_batch_size_per_gpu = 8, sampler = { policy = 'distributed', micro_batch_per_rank = { 8, 4 } } }),
        'the distributed policy gives every rank the same micro batch')
    has(problems({ sampler = { policy = 'uneven' } }), 'sampler.micro_batch_per_rank: missing')
    has(problems({ train_batch_size = 8, sampler = 'uneven' }), 'sampler: must be an object, got "uneven"')
    local dir = tmpdir()
    local custom = write(dir .. '/c.lua', 'return { plan = function() end }')
    has(problems({ train_batch_size = 8, sampler = { policy = custom, size = 3, params = { seed = 1 } } }),
        "sampler.size: unknown key (expected one of: data_share, drop_last, micro_batch_per_rank, params, policy, "
        .. "seed, shuffle) (a custom policy's own settings go in sampler.params)")
    has(problems({ train_batch_size = 8, sampler = { policy = custom, params = { seed = 1 } } }),
        'sampler.params.seed: is a key of the sampler block itself; set it at sampler.seed')
    -- P.new checks a block against the world size it runs on
    has(err(P.new, { micro_batch_per_rank = { 48, 16 } }, { dataset_len = 10, rank = 0, world_size = 3 }),
        'sampler.micro_batch_per_rank: has 2 entries, the world size is 3')
  end)

  it('dslua --check-config prints the resolution and the problems', function()
    local d = tmpdir()
    local path = write(d .. '/ds.json', '{"gradient_accumulation_steps": 2, "sampler": {"policy": "uneven", '
                                        .. '"micro_batch_per_rank": [48, 16], "data_share": [0.75, 0.25]}}')
    local out, status = H.run(bin .. ' --check-config ' .. path .. ' --world-size 2')
    assert.are.equal(0, status, out)
    has(out, 'note: ' .. path .. ': train_batch_size: 128 = sum(sampler.micro_batch_per_rank) '
             .. '* gradient_accumulation_steps = (48 + 16) * 2')
    has(out, '"train_batch_size": 128')
    out, status = H.run(bin .. ' --check-config ' .. path)
    assert.are.equal(1, status)
    has(out, path .. ': sampler.micro_batch_per_rank: has 2 entries, the world size is 1 (one per rank)')
  end)
end)
