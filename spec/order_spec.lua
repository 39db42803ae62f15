-- ds.data.order: an epoch's order held as its description (runs of
-- positions through ds.data.permutation's bijection), what the loader's own
-- shuffle, DistributedSampler and the uneven policy hand the loader; and
-- that an epoch of 20M windows costs no memory per window.
local H = require 'helpers'
local ds = H.ds
local DS = require 'samplers.distributed'

local function sorted(t)
  local c = { unpack(t) }
  table.sort(c)
  return c
end

describe('ds.data.permutation', function()
  it('is a permutation of [0, n) for every n, a pure function of (n, seed)', function()
    for _, n in ipairs({ 0, 1, 2, 3, 4, 5, 15, 16, 17, 64, 97, 1000, 4097 }) do
      local p = ds.data.permutation(n, 7):totable()
      local want = {}
      for i = 1, n do want[i] = i - 1 end
      assert.are.same(want, sorted(p), 'n = ' .. n)
      assert.are.same(p, ds.data.permutation(n, 7):totable())
      if n >= 5 then assert.are_not.same(p, ds.data.permutation(n, 8):totable()) end
    end
  end)

  it('reaches every permutation of a small set, odd ones too', function()
    -- a Feistel network alone makes only even permutations of its domain
    -- (4 elements for n = 4): half of the 24 would never appear
    for _, n in ipairs({ 3, 4, 5 }) do
      local seen, count, all = {}, 0, ({ [3] = 6, [4] = 24, [5] = 120 })[n]
      for seed = 0, 100 * all - 1 do
        local key = table.concat(ds.data.permutation(n, seed):totable(), ',')
        if not seen[key] then seen[key], count = true, count + 1 end
      end
      assert.are.equal(all, count, 'n = ' .. n)
    end
  end)
end)

describe('ds.data.order', function()
  it('is the permutation read position by position, over runs of positions taken mod n', function()
    for _, n in ipairs({ 1, 10, 97 }) do
      local perm = ds.data.permutation(n, 4):totable()
      local whole = ds.data.order(n, { seed = 4 })
      assert.are.equal(n, #whole)
      assert.are.equal(n, whole:domain())
      assert.are.same(perm, whole:totable())
      assert.are.same(perm, whole:tensor():totable())
      assert.are.equal(perm[n], whole:at(n - 1))
      -- two runs: positions 3, 4, 8, 9, 13, 14 then n - 1, n, n + 1 (the last two wrap to 0, 1)
      local cut = whole:cut { { 3, 5, 2, 3 }, { n - 1, 1, 1, 3 } }
      local want = {}
      for i, p in ipairs({ 3, 4, 8, 9, 13, 14, n - 1, n, n + 1 }) do want[i] = perm[p % n + 1] end
      assert.are.same(want, cut:totable())
      assert.are.equal(cut, whole:cut { { 3, 5, 2, 3 }, { n - 1, 1, 1, 3 } })
      assert.are_not.equal(cut, ds.data.order(n, { seed = 5 }):cut { { 3, 5, 2, 3 }, { n - 1, 1, 1, 3 } })
    end
    assert.are.same({ 0, 1, 2, 3, 4 }, ds.data.order(5):totable())
    assert.are.same({ 1, 3, 0, 2 }, ds.data.order(5, { runs = { { 1, 2, 1, 4 } } }):totable())
  end)

  it('reads a window of the permutation, and describes itself as ds.data.order takes it', function()
    local n = 97
    local perm = ds.data.permutation(n, 4):totable()
    local w = ds.data.order(n, { seed = 4, window = { 30, 50 } })
    assert.are.equal(50, #w)
    assert.are.same({ unpack(perm, 31, 80) }, w:totable())
    -- runs over the window wrap within it: positions 48, 49, 50, 51 are 78, 79, 30, 31
    local cut = w:cut { { 48, 1, 1, 4 } }
    assert.are.same({ perm[79], perm[80], perm[31], perm[32] }, cut:totable())
    for _, o in ipairs({ cut, w, ds.data.order(n, { runs = { { 1, 3, 2, 5 } } }), ds.data.order(0) }) do
      local d = ds.json.decode(ds.json.encode(o:describe()))      -- as a checkpoint keeps it
      assert.are.equal(o, ds.data.order(d.n, d))
      assert.are.same(o:totable(), ds.data.order(d.n, d):totable())
    end
    assert.are_not.equal(w, ds.data.order(n, { seed = 4, window = { 31, 50 } }))
    assert.are.same({}, ds.data.order(n, { seed = 4, window = { 97, 0 } }):totable())
  end)

  it('names bad runs and positions', function()
    local function fails(piece, fn, ...) H.has(H.err(fn, ...), piece) end
    fails('order: start must be an integer in [0, 2^53), got -1', ds.data.order, 5, { runs = { { -1, 1, 1, 1 } } })
    fails('order: run 2 is a number, expected {start, stride, block, count}', ds.data.order, 5,
          { runs = { { 0, 1, 1, 1 }, 3 } })
    fails('order: 2 positions over an empty dataset', ds.data.order, 0, { runs = { { 0, 1, 1, 2 } } })
    fails('order:at: position 5 is outside [0, 5)', function() return ds.data.order(5):at(5) end)
    fails('order: the window [3, 8) is not inside [0, 5)', ds.data.order, 5, { window = { 3, 5 } })
    fails('order: 1 positions over an empty window', ds.data.order, 5, { window = { 2, 0 }, runs = { { 0, 1, 1, 1 } } })
    fails('ds.data.order: window must be {first, span}, got 1 numbers', ds.data.order, 5, { window = { 2 } })
    fails('dataset: positions [4, 6) are outside the order of 5', require('dslua.core').data_core.gather,
          ds.data.tensors { x = ds.arange(0, 5) }._c, ds.data.order(5), 4, 2)
    fails('sampler policy mine: plan() indices are an order of [0, 30), the dataset has 23',
          require('samplers.policy').check_plan, { indices = ds.data.order(30), micro_batch = 1 }, 23, 'mine')
  end)

  it('is what DistributedSampler and the uneven policy give the loader, the lists they hand out the same', function()
    local s = DS(23, { num_replicas = 3, rank = 2, seed = 1 })
    assert.is_true(ds.data.is_order(s:order(4)))
    assert.are.same(s:indices(4), s:order(4):totable())
    local P = require 'samplers.policy'
    local u = P.new({ policy = 'uneven', micro_batch_per_rank = { 3, 2 }, seed = 1 }, { dataset_len = 23, rank = 1,
                                                                                       world_size = 2 })
    u:set_epoch(2)
    assert.is_true(ds.data.is_order(u:order(2)))
    assert.are.same(u:order(2):totable(), u:indices(2):totable())
  end)
end)

describe('an epoch resumed on other ranks from its plans', function()
  local P = require 'samplers.policy'

  local function samplers(block, n, W)
    local out = {}
    for r = 0, W - 1 do out[r + 1] = P.new(block, { dataset_len = n, rank = r, world_size = W }) end
    return out
  end

  -- what each rank read in its first s steps, and what it holds of the epoch
  local function cut_at(list, s)
    local saved, read, all = {}, {}, {}
    for i, sm in ipairs(list) do
      local k = 0
      for j = 1, math.min(s, sm:steps()) do k = k + sm:batch_size(j) end
      local idx = sm:order():totable()
      for q, v in ipairs(idx) do
        all[v] = true
        if q <= k then read[v] = true end
      end
      saved[i] = { order = ds.json.decode(ds.json.encode(sm:saved_plan().order)), samples = k }
    end
    local want = {}
    for v in pairs(all) do
      if not read[v] then want[#want + 1] = v end
    end
    table.sort(want)
    return saved, want
  end

  -- the rest planned on W ranks: every index of it read once, no other
  -- (DistributedSampler's padding repeats some of it), each plan an order
  local function replan(block, rest, W, e)
    local list, count = samplers(block, rest:domain(), W), {}
    for _, sm in ipairs(list) do
      sm:restore_plan(sm:plan_of(e, rest))
      sm:set_epoch(e)
      assert.is_true(ds.data.is_order(sm:order()))
      for _, v in ipairs(sm:order():totable()) do count[v] = (count[v] or 0) + 1 end
    end
    for _, v in ipairs(rest:totable()) do
      assert.is_truthy(count[v], 'index ' .. v .. ' of the rest is not read')
      assert.is_true(block.policy == 'distributed' or count[v] == 1, 'index ' .. v .. ' read twice')
      count[v] = nil
    end
    assert.are.same({}, count)
    return list
  end

  local CASES = {
    { n = 23, block = { policy = 'distributed', micro_batch_per_rank = { 4, 4 }, seed = 2 } },
    { n = 23, block = { policy = 'distributed', micro_batch_per_rank = { 4, 4 }, seed = 2, drop_last = true } },
    { n = 101, block = { policy = 'uneven', micro_batch_per_rank = { 6, 2 }, data_share = { 0.75, 0.25 }, seed = 3 } },
    { n = 101, block = { policy = 'uneven', micro_batch_per_rank = { 5, 3 }, data_share = { 0.6, 0.4 }, seed = 3,
                         drop_last = true } },
  }
  local AGAIN = {
    distributed = { [1] = { 3 }, [2] = { 2, 2 }, [3] = { 2, 2, 2 } },
    uneven = { [1] = { 8 }, [2] = { 3, 5 }, [3] = { 3, 3, 2 } },
  }

  it('is a window of the saved order, the exact rest of any step, planned on 1, 2 and 3 ranks', function()
    for _, case in ipairs(CASES) do
      local saved_ranks = samplers(case.block, case.n, 2)
      for _, sm in ipairs(saved_ranks) do sm:set_epoch(1) end
      for s = 0, saved_ranks[1]:steps() do
        local saved, want = cut_at(saved_ranks, s)
        local rest = P.unread(saved)
        local where = case.block.policy .. (case.block.drop_last and ' drop_last' or '') .. ' step ' .. s
        assert.is_truthy(rest, where)
        assert.are.same(want, sorted(rest:totable()), where)
        for W, micro in pairs(AGAIN[case.block.policy]) do
          local block = { policy = case.block.policy, micro_batch_per_rank = micro, seed = case.block.seed }
          local list = replan(block, rest, W, 1)
          -- saved again one step on, on W ranks: the rest of that
          if list[1]:steps() > 0 then
            local again, want2 = cut_at(list, 1)
            local rest2 = P.unread(again)
            assert.is_truthy(rest2, where .. ', again on ' .. W)
            assert.are.same(want2, sorted(rest2:totable()), where .. ', again on ' .. W)
            assert.is_true(#want2 < #want)
          end
        end
      end
    end
  end)

  it('is refused (nil: the lists are read) when the saved orders do not cover a prefix of one window', function()
    local o = ds.data.order(10, { seed = 1 })
    local d = o:cut({ { 0, 2, 1, 5 } }):describe()
    assert.is_nil(P.unread { { order = d, samples = 2 } })                             -- positions 0, 2: a gap
    assert.is_nil(P.unread { { order = d, samples = 1 }, { order = d, samples = 1 } })  -- the same order twice
    local e = ds.data.order(10, { seed = 2 }):cut({ { 1, 2, 1, 5 } }):describe()
    assert.is_nil(P.unread { { order = d, samples = 1 }, { order = e, samples = 1 } })  -- two permutations
    assert.is_nil(P.unread { { samples = 0 } })                                         -- a list plan
    local f = o:cut({ { 1, 2, 1, 5 } }):describe()
    assert.are.same({ o:at(2), o:at(3), o:at(4), o:at(5), o:at(6), o:at(7), o:at(8), o:at(9) },
                    P.unread({ { order = d, samples = 1 }, { order = f, samples = 1 } }):totable())
  end)

  it('maps positions of the rest onto it: runs over its window, else a list', function()
    local rest = ds.data.order(10, { seed = 1, window = { 4, 6 } })
    assert.are.equal(rest:cut { { 1, 2, 1, 4 } }, P.over(rest, ds.data.order(6, { runs = { { 1, 2, 1, 4 } } })))
    assert.are.same({ rest:at(1), rest:at(3), rest:at(5), rest:at(1) },
                    rest:cut({ { 1, 2, 1, 4 } }):totable())                  -- the padding wraps within the rest
    -- positions over a window of their own (mod 4, not 6) or shuffled are looked up one by one
    local inner = ds.data.order(6, { window = { 0, 4 }, runs = { { 2, 1, 1, 4 } } })
    assert.are.same({ rest:at(2), rest:at(3), rest:at(0), rest:at(1) }, P.over(rest, inner))
    local shuffled = ds.data.order(6, { seed = 3 })
    local want = {}
    for i, k in ipairs(shuffled:totable()) do want[i] = rest:at(k) end
    assert.are.same(want, P.over(rest, shuffled))
    assert.are.same({ 7, 9 }, P.over({ 5, 7, 9 }, { 1, 2 }))
  end)
end)

describe('an epoch of 20M windows', function()
  -- A child process: the prelude (20M samples, sample i holding i; read(l,
  -- order, from) reads 50 batches of loader l from position from, each
  -- checked against order, counting mismatches in bad, and keeps the most
  -- its anonymous resident memory and its Lua heap grew since the start)
  -- then body; it prints bad, body's figures and that growth (KB). Returns
  -- the figures, bad and the growth checked: under a byte a window (an
  -- order kept per window, a list or a tensor of int32 or int64, of the 20M
  -- or a rank's 10M is 40-160 MB), what stays being two threads' stacks
  -- and arenas and a few batches.
  local PRELUDE = [[
    local ds = require 'dslua'
    local DS = require 'samplers.distributed'
    local P = require 'samplers.policy'
    local N = 20000000
    local d = ds.data.tensors { x = ds.arange(0, N):to('i32') }
    local function anon()
      local f = io.open('/proc/self/status')
      local v = tonumber(f:read('*a'):match('RssAnon:%s*(%d+)'))
      f:close()
      return v
    end
    collectgarbage()
    local anon0, lua0, grown, lua_grown, bad = anon(), collectgarbage('count'), 0, 0, 0
    local function read(l, order, from)
      local k = from
      for step, b in l:epoch(1) do
        for _, v in ipairs(b.x:totable()) do
          if v ~= order:at(k) then bad = bad + 1 end
          k = k + 1
        end
        collectgarbage()
        grown, lua_grown = math.max(grown, anon() - anon0), math.max(lua_grown, collectgarbage('count') - lua0)
        if step == 50 then break end
      end
      l:close()
    end
    local function figures(...) print('figures', bad, ...) end
  ]]

  local function child(body)
    local dir = H.tmpdir()
    finally(function() os.execute('rm -rf ' .. dir) end)
    local script = H.write(dir .. '/child.lua', PRELUDE .. body .. '\nprint(grown, lua_grown)\n')
    local out, status = H.run('timeout 300 ' .. H.bin() .. ' ' .. script)
    assert.are.equal(0, status, out)
    local list = {}
    for x in (out:match('figures%s+([^\n]*\n[^\n]*)') or ''):gmatch('%S+') do list[#list + 1] = tonumber(x) end
    local lua_grown, grown = table.remove(list), table.remove(list)
    assert.are.equal(0, table.remove(list, 1), out)
    local bound = 16 * 1024
    assert.is_true(grown < bound, 'anonymous memory grew by ' .. grown .. ' KB, bound ' .. bound .. ' KB')
    assert.is_true(lua_grown < 1024, 'the Lua heap grew by ' .. lua_grown .. ' KB')
    return list
  end

  it('is built, read and resumed with memory that does not grow with the epoch', function()
    -- batches of the loader's own shuffle, of rank 1 of 2 through
    -- DistributedSampler resumed near the end of its share, and of rank 0 of
    -- 2 under the uneven policy, every batch from 2 threads
    child [[
      local B = 8
      read(ds.data.loader(d, { batch_size = B, seed = 3, num_workers = 2 }), ds.data.order(N, { seed = 4 }), 0)
      local s = DS(d, { num_replicas = 2, rank = 1, seed = 3 })
      local l = ds.data.loader(d, { batch_size = B, sampler = s, num_workers = 2 })
      local at = N / 2 - 10 * B
      l:resume { epoch = 1, step = at / B, samples = at }
      read(l, s:order(1), at)
      local u = P.new({ policy = 'uneven', micro_batch_per_rank = { 8, 4 }, seed = 3 }, { dataset = d, rank = 0,
                                                                                         world_size = 2 })
      read(P.loader(d, u, { num_workers = 2, quiet = true }), u:order(1), 0)
      figures()
    ]]
  end)

  it('is resumed mid-epoch on 3 ranks from 2 ranks\' saved plans with memory that does not grow with it', function()
    -- the plans of 2 ranks under the uneven policy halfway through the
    -- epoch as a checkpoint keeps them (JSON), then for each of 3 ranks the
    -- rest planned and 50 batches of it read; the same for DeepSpeed's
    -- loader; figures: the saved plans' bytes, and how far each rest's
    -- length is from the samples not read
    local f = child [[
      local bytes, read_sum, saved = 0, 0, {}
      for r = 0, 1 do
        local sm = P.new({ policy = 'uneven', micro_batch_per_rank = { 8, 4 }, seed = 3 }, { dataset = d, rank = r,
                                                                                              world_size = 2 })
        sm:set_epoch(1)
        local text = ds.json.encode((sm:saved_plan()))
        local k = 0
        for j = 1, math.floor(sm:steps() / 2) do k = k + sm:batch_size(j) end
        saved[r + 1], bytes, read_sum = { order = ds.json.decode(text).order, samples = k }, bytes + #text, read_sum + k
      end
      local rest = P.unread(saved)
      for r = 0, 2 do
        local u = P.new({ policy = 'uneven', micro_batch_per_rank = { 4, 4, 4 }, seed = 3 }, { dataset = d, rank = r,
                                                                                              world_size = 3 })
        u:restore_plan(u:plan_of(1, rest))
        local l = P.loader(d, u, { num_workers = 2, quiet = true })
        l:resume { epoch = 1, step = 0, samples = 0 }
        read(l, u:order(1), 0)
      end
      -- DeepSpeed's loader: DistributedSampler's shares on 2 ranks after
      -- 1000 batches of 8, the rest split so on 3
      local shares = {}
      for r = 0, 1 do
        shares[r + 1] = { order = DS(d, { num_replicas = 2, rank = r, seed = 0 }):order(1):describe(), samples = 8000 }
      end
      local left = P.unread(shares)
      for r = 0, 2 do
        local mine = P.over(left, DS(#left, { num_replicas = 3, rank = r, shuffle = false }):order(0))
        local l = ds.data.loader(d, { batch_size = 8, shuffle = false, num_workers = 2 })
        l:resume { epoch = 1, step = 0, samples = 0, order = mine }
        read(l, mine, 0)
      end
      figures(bytes, N - read_sum - #rest, N - 16000 - #left)
    ]]
    -- each rank's plan a few runs, where its indices were 8 bytes each
    assert.is_true(f[1] < 1024, 'the saved plans take ' .. f[1] .. ' bytes')
    assert.are.equal(0, f[2], 'the rest is not the samples left unread')
    assert.are.equal(0, f[3], 'the rest of DistributedSampler\'s epoch is not the samples left unread')
  end)
end)
