-- samplers/distributed.lua against PyTorch's DistributedSampler
-- (spec/fixtures/gen_sampler.py), and the loader's sampler option.
local H = require 'helpers'
local ds = H.ds
local DS = require 'samplers.distributed'

local ref = H.fixture('sampler')

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

-- the 0-based dataset indices a batch holds (x is the index as f32)
local function batch_indices(batch)
  local out = {}
  for i, v in ipairs(batch.x:totable()) do out[i] = v end
  return out
end

local function indexed_dataset(n)
  return ds.data.tensors { x = ds.arange(0, n):to('f32'), y = ds.arange(0, n) }
end

describe('DistributedSampler', function()
  it('gives every rank the indices PyTorch gives it without shuffling', function()
    for _, name in ipairs(sorted_keys(ref)) do
      local c = ref[name]
      for r, want in ipairs(c.ranks) do
        local s = DS(c.n, { num_replicas = c.num_replicas, rank = r - 1, shuffle = false, drop_last = c.drop_last })
        assert.are.equal(want.len, s:len(), name .. ' rank ' .. (r - 1))
        assert.are.same(want.indices, s:indices(), name .. ' rank ' .. (r - 1))
      end
    end
  end)

  it('shuffles by ds.data.permutation(n, seed + epoch), the positions staying PyTorch\'s', function()
    for _, name in ipairs({ 'n10_r3_pad', 'n13_r4_drop', 'n1_r5_pad', 'n12_r2_pad', 'n13_r2_drop' }) do
      local c = ref[name]
      for _, seed in ipairs({ 0, 5 }) do
        for _, epoch in ipairs({ 0, 1, 7 }) do
          local perm = ds.data.permutation(c.n, seed + epoch):totable()
          for r, want in ipairs(c.ranks) do
            local s = DS(c.n, { num_replicas = c.num_replicas, rank = r - 1, seed = seed, drop_last = c.drop_last })
            s:set_epoch(epoch)
            local expected = {}
            for j, p in ipairs(want.indices) do expected[j] = perm[p + 1] end
            assert.are.same(expected, s:indices(), name)
            assert.are.same(expected, DS(c.n, { num_replicas = c.num_replicas, rank = r - 1, seed = seed,
                                                drop_last = c.drop_last }):indices(epoch), name)
          end
        end
      end
    end
  end)

  it('covers the dataset once per epoch across ranks, and reorders it each epoch', function()
    local n, N = 100, 4
    local seen, orders = {}, {}
    for e = 1, 2 do
      local count = 0
      for r = 0, N - 1 do
        local s = DS(n, { num_replicas = N, rank = r })
        s:set_epoch(e)
        for _, i in ipairs(s:indices()) do
          seen[e .. ':' .. i] = true
          count = count + 1
        end
        if r == 0 then orders[e] = s:indices() end
      end
      assert.are.equal(n, count)
      for i = 0, n - 1 do assert.is_true(seen[e .. ':' .. i]) end
    end
    assert.are_not.same(orders[1], orders[2])
  end)

  it('takes num_replicas and rank from ds.comm by default, and a dataset for its length', function()
    local s = DS(indexed_dataset(5))
    assert.are.equal(1, s.num_replicas)
    assert.are.equal(0, s.rank)
    assert.are.equal(5, s:len())
    assert.is_true(s.shuffle)
    assert.are.equal(0, s.seed)
    assert.is_false(s.drop_last)
  end)

  it('names bad arguments', function()
    local function fails(pattern, ...)
      local ok, err = pcall(DS, ...)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(pattern, 1, true), tostring(err))
    end
    fails('DistributedSampler: Invalid rank 4, rank should be in the interval [0, 3]', 10, { num_replicas = 4, rank = 4 })
    fails('Invalid rank -1', 10, { num_replicas = 4, rank = -1 })
    fails('num_replicas must be an integer >= 1, got 0', 10, { num_replicas = 0, rank = 0 })
    fails("unknown option 'shufle'", 10, { shufle = true })
    fails('expected a dataset or its length, got a string', 'x')
    local s = DS(10)
    local ok, err = pcall(s.set_epoch, s, -1)
    assert.is_false(ok)
    assert.truthy(err:find('epoch must be an integer >= 0, got -1', 1, true), err)
  end)
end)

describe('ds.data.loader with a sampler', function()
  for _, gather in ipairs({ 'C', 'Lua' }) do
    it('reads the sampler\'s order and calls set_epoch every epoch (' .. gather .. ' gathering)', function()
      local d = indexed_dataset(11)
      local collate = gather == 'Lua' and function(samples)
        local xs = {}
        for i, s in ipairs(samples) do xs[i] = s.x end
        return { x = ds.stack(xs) }
      end or nil
      local s = DS(d, { num_replicas = 3, rank = 1, seed = 3 })
      local loader = ds.data.loader(d, { batch_size = 2, sampler = s, collate_fn = collate })
      assert.are.equal(2, #loader)                     -- 4 samples per rank
      for e = 1, 2 do
        local got = {}
        for _, batch in loader:epoch(e) do
          for _, i in ipairs(batch_indices(batch)) do got[#got + 1] = i end
        end
        assert.are.equal(e, s.epoch)
        assert.are.same(DS(d, { num_replicas = 3, rank = 1, seed = 3 }):indices(e), got)
      end
    end)
  end

  it('takes any object with indices and set_epoch; a tensor of indices works too', function()
    local d = indexed_dataset(6)
    local custom = { epochs = {} }
    function custom:set_epoch(e) self.epochs[#self.epochs + 1] = e end
    function custom:indices() return ds.tensor({ 5, 0, 3 }, 'i64') end
    local loader = ds.data.loader(d, { batch_size = 2, sampler = custom })
    assert.are.equal(2, #loader)
    local got = {}
    for _, batch in loader:epoch(4) do
      for _, i in ipairs(batch_indices(batch)) do got[#got + 1] = i end
    end
    assert.are.same({ 5, 0, 3 }, got)
    assert.are.same({ 4 }, custom.epochs)
  end)

  it('refuses shuffle with a sampler, and objects that are not samplers', function()
    local d = indexed_dataset(4)
    local ok, err = pcall(ds.data.loader, d, { sampler = DS(d), shuffle = true })
    assert.is_false(ok)
    assert.truthy(err:find('sampler option is mutually exclusive with shuffle', 1, true), err)
    ok, err = pcall(ds.data.loader, d, { sampler = {} })
    assert.is_false(ok)
    assert.truthy(err:find('sampler must be an object with indices(epoch) and set_epoch(epoch)', 1, true), err)
    local bad = { set_epoch = function() end, indices = function() return 3 end }
    ok, err = pcall(function()
      for _ in ds.data.loader(d, { sampler = bad }):epoch(1) do end
    end)
    assert.is_false(ok)
    assert.truthy(err:find('sampler:indices must return a list or a tensor', 1, true), err)
  end)

  it('gives N ranks together the global batches one shuffled loader gives', function()
    local n, N, mb = 40, 4, 3
    local d = indexed_dataset(n)
    local single = ds.data.loader(d, { batch_size = mb * N, drop_last = true })
    local per_rank = {}
    for r = 0, N - 1 do
      local l = ds.data.loader(d, { batch_size = mb, drop_last = true, sampler = DS(d, { num_replicas = N, rank = r }) })
      per_rank[r + 1] = {}
      for _, batch in l:epoch(2) do per_rank[r + 1][#per_rank[r + 1] + 1] = batch_indices(batch) end
    end
    local step = 0
    for _, batch in single:epoch(2) do
      step = step + 1
      local want = batch_indices(batch)
      local got = {}
      for r = 1, N do
        for _, i in ipairs(per_rank[r][step]) do got[#got + 1] = i end
      end
      table.sort(want)
      table.sort(got)
      assert.are.same(want, got)
    end
    assert.are.equal(3, step)
  end)
end)
