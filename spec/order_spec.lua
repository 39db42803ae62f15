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

  it('names bad runs and positions', function()
    local function fails(piece, fn, ...) H.has(H.err(fn, ...), piece) end
    fails('order: start must be an integer in [0, 2^53), got -1', ds.data.order, 5, { runs = { { -1, 1, 1, 1 } } })
    fails('order: run 2 is a number, expected {start, stride, block, count}', ds.data.order, 5,
          { runs = { { 0, 1, 1, 1 }, 3 } })
    fails('order: 2 positions over an empty dataset', ds.data.order, 0, { runs = { { 0, 1, 1, 2 } } })
    fails('order:at: position 5 is outside [0, 5)', function() return ds.data.order(5):at(5) end)
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

describe('an epoch of 20M windows', function()
  it('is built, read and resumed with memory that does not grow with the epoch', function()
    local dir = H.tmpdir()
    finally(function() os.execute('rm -rf ' .. dir) end)
    -- a child reads 50 batches each of the loader's own shuffle, of rank 1
    -- of 2 through DistributedSampler resumed near the end of its share,
    -- and of rank 0 of 2 under the uneven policy, every batch from 2
    -- threads, each checked against the order; it prints the mismatches and
    -- the most its anonymous resident memory and its Lua heap grew (KB)
    local script = H.write(dir .. '/order.lua', [[
      local ds = require 'dslua'
      local DS = require 'samplers.distributed'
      local P = require 'samplers.policy'
      local N, B = 20000000, 8
      local d = ds.data.tensors { x = ds.arange(0, N):to('i32') }      -- sample i holds i
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
      read(ds.data.loader(d, { batch_size = B, seed = 3, num_workers = 2 }), ds.data.order(N, { seed = 4 }), 0)
      local s = DS(d, { num_replicas = 2, rank = 1, seed = 3 })
      local l = ds.data.loader(d, { batch_size = B, sampler = s, num_workers = 2 })
      local at = N / 2 - 10 * B
      l:resume { epoch = 1, step = at / B, samples = at }
      read(l, s:order(1), at)
      local u = P.new({ policy = 'uneven', micro_batch_per_rank = { 8, 4 }, seed = 3 }, { dataset = d, rank = 0,
                                                                                         world_size = 2 })
      read(P.loader(d, u, { num_workers = 2, quiet = true }), u:order(1), 0)
      print(bad, grown, lua_grown)
    ]])
    local out, status = H.run('timeout 300 ' .. H.bin() .. ' ' .. script)
    assert.are.equal(0, status, out)
    local bad, grown, lua_grown = out:match('^(%d+)%s+(%-?%d+)%s+(%-?[%d.]+)')
    assert.are.equal('0', bad, out)
    -- under a byte a window: an order kept per window (a list, a tensor of
    -- int32 or int64) of the 20M or the 10M of a rank is 40-160 MB; what
    -- stays is two threads' stacks and arenas and a few batches
    local bound = 16 * 1024
    assert.is_true(tonumber(grown) < bound, 'anonymous memory grew by ' .. grown .. ' KB, bound ' .. bound .. ' KB')
    assert.is_true(tonumber(lua_grown) < 1024, 'the Lua heap grew by ' .. lua_grown .. ' KB')
  end)
end)
