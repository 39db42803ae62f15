local H = require 'helpers'
local ds = H.ds

local F = H.fixture('index')

-- Runs a fixture case: fn(xs, is) with the float inputs xs (needing grad)
-- and index tensors is; output and input gradients against PyTorch.
local function against_torch(name, fn)
  local c, is = F[name], {}
  while c['i' .. (#is + 1)] do is[#is + 1] = H.tensor(c['i' .. (#is + 1)]) end
  local xs = H.against_torch(c, name, function(xs) return fn(xs, is) end)
  for k = 1, #xs do assert.are.equal(c['x' .. k].dtype, xs[k].grad:dtype()) end
end

local function f64(...) return ds.randn({ ... }, 'f64'):requires_grad_() end

local fails = H.fails

describe('embedding', function()
  for _, name in ipairs { 'embedding_i64', 'embedding_i32', 'embedding_3d' } do
    it(name .. ' matches PyTorch (duplicate ids accumulate)', function()
      against_torch(name, function(xs, is) return ds.embedding(xs[1], is[1]) end)
    end)
  end

  it('gradient matches finite differences', function()
    local ids = ds.tensor({ { 2, 0, 2 }, { 1, 2, 4 } }, 'i64')
    H.gradcheck(function(w) return ds.embedding(w, ids) end, { f64(5, 3) })
  end)

  it('sums duplicate ids in parallel, identically for any thread count', function()
    local d = 40
    local ids = ds.zeros({ 64, 64 }, 'i64')
    local v = ds.randn(64, 64, d)
    local before, grads = ds.num_threads(), {}
    for k, threads in ipairs { 1, 2 } do
      ds.num_threads(threads)
      local w = ds.randn(3, d):requires_grad_()
      ;(ds.embedding(w, ids) * v):sum():backward()
      grads[k] = w.grad
    end
    ds.num_threads(before)
    assert.are.same(grads[1]:totable(), grads[2]:totable())
    H.assert_close(grads[1]:narrow(1, 1, 1), v:sum { 1, 2 }:view(1, d), { rtol = 1e-4, atol = 1e-3 })
    H.assert_close(grads[1]:narrow(1, 2, 2), ds.zeros(2, d))
  end)

  it('works for bf16 and f16 weights, accumulating in f32', function()
    for _, dt in ipairs { 'bf16', 'f16', 'f64' } do
      local w = ds.randn(4, 3):to(dt):requires_grad_()
      local ids = ds.tensor({ 3, 3, 0, 3 }, 'i32')
      local out = ds.embedding(w, ids)
      assert.are.equal(dt, out:dtype())
      H.assert_close(out:to('f32'), ds.embedding(w:detach():to('f32'), ids))
      out:sum():backward()
      assert.are.equal(dt, w.grad:dtype())
      assert.are.same({ { 1, 1, 1 }, { 0, 0, 0 }, { 0, 0, 0 }, { 3, 3, 3 } }, w.grad:to('f32'):totable())
    end
  end)

  it('takes empty ids', function()
    local w = ds.randn(4, 3):requires_grad_()
    local out = ds.embedding(w, ds.zeros({ 0 }, 'i64'))
    assert.are.same({ 0, 3 }, out:size())
    out:sum():backward()
    assert.are.same({ 4, 3 }, w.grad:size())
    H.assert_close(w.grad, ds.zeros(4, 3))
  end)

  it('names the bad id, its position and the vocabulary size', function()
    local w = ds.randn(10, 3)
    fails('embedding: ids value 10 at position %(2,3%) of ids %[2,3%] is out of range %[0, 10%) for weight of shape %[10,3%]',
          ds.embedding, w, ds.tensor({ { 0, 1, 2 }, { 3, 4, 10 } }, 'i64'))
    fails('embedding: ids value %-1 at position %(1%)', ds.embedding, w, ds.tensor({ -1, 12 }, 'i32'))
    fails('embedding: ids must be i64 or i32, got f32', ds.embedding, w, ds.tensor { 1, 2 })
    fails('embedding: weight must be 2%-D %[V, D%], got shape %[10%]', ds.embedding, ds.randn(10), ds.tensor({ 1 }, 'i64'))
  end)

  it('keeps checking past many calls, each bad call failing alone', function()
    local w, good = ds.randn(10, 3), ds.tensor({ 1, 2 }, 'i64')
    for i = 1, 200 do
      local ok = pcall(ds.embedding, w, i % 50 == 0 and ds.tensor({ 1, 10 + i }, 'i64') or good)
      assert.are.equal(i % 50 ~= 0, ok)
    end
    fails('ids value 12 at position %(1%)', ds.embedding, w, ds.tensor({ 12 }, 'i64'))
    assert.are.same({ 2, 3 }, ds.embedding(w, good):size())
  end)
end)

describe('index_select', function()
  for _, c in ipairs { { 'index_select_0', 1 }, { 'index_select_1', 2 }, { 'index_select_last', -1 } } do
    it(c[1] .. ' matches PyTorch', function()
      against_torch(c[1], function(xs, is) return xs[1]:index_select(c[2], is[1]) end)
    end)
  end

  it('gradients match finite differences along every dim', function()
    local idx = ds.tensor({ 1, 0, 1, 1 }, 'i32')
    for d = 1, 3 do
      H.gradcheck(function(x) return ds.index_select(x, d, idx) end, { f64(2, 3, 2) })
    end
  end)

  it('takes a non-contiguous input and an empty index', function()
    local x = ds.arange(0, 12, 1, 'f64'):view(3, 4):t()
    assert.are.same({ { 3, 7, 11 }, { 0, 4, 8 } }, x:index_select(1, ds.tensor({ 3, 0 }, 'i64')):totable())
    local e = x:index_select(2, ds.zeros({ 0 }, 'i64'))
    assert.are.same({ 4, 0 }, e:size())
    local strided = ds.tensor({ { 2, 9 }, { 0, 9 } }, 'i32'):narrow(2, 1, 1):view(2)
    assert.are.same({ { 8, 0 }, { 9, 1 } }, x:index_select(2, strided):narrow(1, 1, 2):totable())
  end)

  it('rejects bad indices, dims and index shapes', function()
    local x = ds.zeros(3, 4)
    fails('index_select: index value 4 at position %(2%) of index %[2%] is out of range %[0, 4%) for x of shape %[3,4%]',
          x.index_select, x, 2, ds.tensor({ 0, 4 }, 'i64'))
    fails('index_select: index must be 1%-D, got shape %[1,2%]', x.index_select, x, 1, ds.tensor({ { 0, 1 } }, 'i64'))
    fails('dim 3 out of range for a 2%-dim tensor', x.index_select, x, 3, ds.tensor({ 0 }, 'i64'))
  end)
end)

describe('gather and scatter_add', function()
  for _, c in ipairs { { 'gather_1', 2 }, { 'gather_0_small', 1 }, { 'gather_3d', 3 } } do
    it(c[1] .. ' matches PyTorch', function()
      against_torch(c[1], function(xs, is) return xs[1]:gather(c[2], is[1]) end)
    end)
  end
  for _, c in ipairs { { 'scatter_add_0', 1 }, { 'scatter_add_1', 2 } } do
    it(c[1] .. ' matches PyTorch (duplicate indices accumulate)', function()
      against_torch(c[1], function(xs, is) return ds.scatter_add(xs[1], c[2], is[1], xs[2]) end)
    end)
  end

  it('gather gradient matches finite differences', function()
    local idx = ds.tensor({ { { 0, 1 }, { 1, 1 } }, { { 2, 0 }, { 2, 2 } } }, 'i64')
    H.gradcheck(function(x) return x:gather(1, idx) end, { f64(3, 3, 2) })
    H.gradcheck(function(x) return x:gather(-1, idx:narrow(1, 1, 1):narrow(3, 1, 1)) end, { f64(1, 2, 3) })
  end)

  it('scatter_add gradients match finite differences, src larger than index', function()
    local idx = ds.tensor({ { 0, 2 }, { 2, 2 }, { 1, 0 } }, 'i32')
    H.gradcheck(function(x, src) return x:scatter_add(1, idx, src) end, { f64(3, 4), f64(4, 3) })
    H.gradcheck(function(x, src) return ds.scatter_add(x, 2, idx, src) end, { f64(3, 3), f64(3, 2) })
  end)

  it('scatter_add sums many duplicates in parallel, and leaves x alone', function()
    local x = ds.ones(2, 5)
    local idx = ds.zeros({ 40000, 5 }, 'i64')
    local out = x:scatter_add(1, idx, ds.ones(40000, 5))
    assert.are.same({ 40001, 40001, 40001, 40001, 40001 }, out:narrow(1, 1, 1):view(5):totable())
    assert.are.same({ 1, 1, 1, 1, 1 }, out:narrow(1, 2, 1):view(5):totable())
    assert.are.same({ 1, 1, 1, 1, 1 }, x:narrow(1, 1, 1):view(5):totable())
  end)

  it('works for bf16, f16 and integers', function()
    local idx = ds.tensor({ { 1, 1, 0 } }, 'i64')
    for _, dt in ipairs { 'bf16', 'f16', 'i64', 'i32' } do
      local x = ds.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, dt)
      assert.are.same({ { 4, 5, 3 } }, x:gather(1, idx):totable())
      local s = ds.scatter_add(x, 1, idx, ds.tensor({ { 10, 20, 30 } }, dt))
      assert.are.equal(dt, s:dtype())
      assert.are.same({ { 1, 2, 33 }, { 14, 25, 6 } }, s:totable())
    end
  end)

  it('takes an empty index', function()
    local x = ds.randn(2, 3):requires_grad_()
    local idx = ds.zeros({ 2, 0 }, 'i64')
    assert.are.same({ 2, 0 }, x:gather(2, idx):size())
    local t = ds.tensor({ { 1, 0 }, { 2, 1 } }, 'i64'):t()     -- a transposed index
    assert.are.same({ { 20, 22 }, { 10, 21 } }, ds.tensor({ { 10, 11 }, { 20, 21 }, { 30, 22 } }):gather(1, t):totable())
    local out = ds.scatter_add(x, 2, idx, ds.zeros(2, 0))
    H.assert_close(out, x)
  end)

  it('rejects bad indices, shapes and dtypes naming the op and shapes', function()
    local x = ds.zeros(3, 4)
    fails('gather: index value 4 at position %(2,1%) of index %[2,2%] is out of range %[0, 4%) for x of shape %[3,4%]',
          x.gather, x, 2, ds.tensor({ { 0, 1 }, { 4, 0 } }, 'i64'))
    fails('gather: index of shape %[2,5%] must have as many dims as x %[3,4%]', x.gather, x, 1, ds.zeros({ 2, 5 }, 'i64'))
    fails('gather: index of shape %[2%] must have as many dims as x %[3,4%]', x.gather, x, 1, ds.zeros({ 2 }, 'i64'))
    fails('gather: index must be i64 or i32, got f64', x.gather, x, 1, ds.zeros({ 1, 1 }, 'f64'))
    fails('scatter_add: index of shape %[2,2%] must have as many dims as x %[3,4%] and src %[1,4%]',
          ds.scatter_add, x, 1, ds.zeros({ 2, 2 }, 'i64'), ds.zeros(1, 4))
    fails('scatter_add: src is f64 but x is f32 %(shapes %[1,4%] and %[3,4%]%)',
          ds.scatter_add, x, 1, ds.zeros({ 1, 4 }, 'i64'), ds.zeros(1, 4, 'f64'))
    fails('scatter_add: index value %-2 at position %(1,4%)', ds.scatter_add, x, 1,
          ds.tensor({ { 0, 0, 0, -2 } }, 'i64'), ds.zeros(1, 4))
    fails('dim %-3 out of range', x.gather, x, -3, ds.zeros({ 1, 1 }, 'i64'))
  end)
end)

describe('cat and stack', function()
  local cat_cases = { cat_0 = 1, cat_1 = 2, cat_many = -1, cat_promote = 1 }
  for name, dim in pairs(cat_cases) do
    it(name .. ' matches PyTorch', function()
      against_torch(name, function(xs) return ds.cat(xs, dim) end)
    end)
  end
  local stack_cases = { stack_0 = 1, stack_last = -1, stack_many = 2 }
  for name, dim in pairs(stack_cases) do
    it(name .. ' matches PyTorch', function()
      against_torch(name, function(xs) return ds.stack(xs, dim) end)
    end)
  end

  it('cat gradients reach every one of many inputs (finite differences)', function()
    local xs = {}
    for k = 1, 9 do xs[k] = f64(2, k % 3 + 1) end
    xs[4] = xs[4]:detach()   -- an input without grad in the middle of a group
    H.gradcheck(function(...) return ds.cat({ ... }, 2) end, xs)
    assert.is_nil(xs[4].grad)
    local many = {}
    for k = 1, 70 do many[k] = ds.ones(1, 2):requires_grad_() end
    local y = ds.cat(many)
    assert.are.same({ 70, 2 }, y:size())
    ;(y * ds.arange(0, 140, 1):view(70, 2)):sum():backward()
    for k = 1, 70 do assert.are.same({ { 2 * k - 2, 2 * k - 1 } }, many[k].grad:totable()) end
  end)

  it('stack gradients match finite differences', function()
    H.gradcheck(function(a, b, c, d, e) return ds.stack({ a, b, c, d, e }, 2) end,
                { f64(2, 3), f64(2, 3), f64(2, 3), f64(2, 3), f64(2, 3) })
    H.gradcheck(function(a, b) return ds.stack { a, b } end, { f64(3), f64(3) })
  end)

  it('defaults to dim 1, promotes dtypes and takes views and empty pieces', function()
    local a = ds.arange(0, 6, 1, 'i32'):view(2, 3)
    local c = ds.cat { a, ds.ones(1, 3, 'bf16'), ds.zeros(0, 3) }
    assert.are.equal('f32', c:dtype())
    assert.are.same({ { 0, 1, 2 }, { 3, 4, 5 }, { 1, 1, 1 } }, c:totable())
    assert.are.same({ { 0, 3, 0, 1, 2 }, { 1, 4, 3, 4, 5 }, { 2, 5, 6, 7, 8 } },
                    ds.cat({ a:t(), ds.arange(0, 9, 1, 'i64'):view(3, 3) }, 2):totable())
    assert.are.equal('i64', ds.cat({ a, ds.zeros({ 1, 3 }, 'i64') }):dtype())
    assert.are.same({ 2, 2, 3 }, ds.stack({ a, a }):size())
    assert.are.same({ 2, 3, 2 }, ds.stack({ a, a }, -1):size())
    assert.are.same({ 1, 2 }, ds.stack({ ds.tensor(1), ds.tensor(2) }):totable())
  end)

  it('rejects mismatched shapes naming the tensor and both shapes', function()
    fails('cat: tensor 3 of 3 has shape %[2,4%] but tensor 1 has shape %[2,3%]', ds.cat,
          { ds.zeros(2, 3), ds.zeros(5, 3), ds.zeros(2, 4) }, 1)
    fails('cat: tensor 2 of 2 has shape %[6%] but tensor 1 has shape %[2,3%]', ds.cat, { ds.zeros(2, 3), ds.zeros(6) })
    fails('cat: tensor 1 of 1 is 0%-dim', ds.cat, { ds.tensor(1) })
    fails('cat: expected a non%-empty list', ds.cat, {})
    fails('cat: element 2 of the list is a number', ds.cat, { ds.zeros(2), 3 })
    fails('stack: tensor 2 of 2 has shape %[3,2%] but tensor 1 has shape %[2,3%]', ds.stack, { ds.zeros(2, 3), ds.zeros(3, 2) })
    fails('dim 4 out of range for a 3%-dim result', ds.stack, { ds.zeros(2, 3) }, 4)
    fails('dim 3 out of range for a 2%-dim tensor', ds.cat, { ds.zeros(2, 3) }, 3)
  end)
end)

describe('repeat_interleave', function()
  -- the composition it stands for: rep views of each slice, joined
  local function composed(x, rep, d)
    local u = x:unsqueeze(d + 1)
    local copies = {}
    for i = 1, rep do copies[i] = u end
    local shape = x:size()
    shape[d] = shape[d] * rep
    return ds.cat(copies, d + 1):reshape(shape)
  end

  it('is the joined views in one copy, and its gradient theirs to the bit (f32, bf16; 1 to 4 repeats)', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for rep = 1, 4 do
        for d = 1, 3 do
          local base = ds.randn(2, 3, 4):to(dt)
          local g = ds.randn(2 * (d == 1 and rep or 1), 3 * (d == 2 and rep or 1), 4 * (d == 3 and rep or 1)):to(dt)
          local function run(fn)
            local x = base:detach():requires_grad_()
            local y = fn(x, rep, d)
            ;(y * g):sum():backward()
            return y, x.grad
          end
          local y1, g1 = run(composed)
          local n0 = ds.kernel_calls()
          local y2 = base:repeat_interleave(rep, d)
          assert.are.equal(1, ds.kernel_calls() - n0, 'one copy')
          local _, g2 = run(function(x) return x:repeat_interleave(rep, d) end)
          assert.are.same(y1:to('f64'):totable(), y2:to('f64'):totable())
          assert.are.same(g1:to('f64'):totable(), g2:to('f64'):totable(), dt .. ' rep ' .. rep .. ' dim ' .. d)
        end
      end
    end
  end)

  it('gradients match finite differences, of a view too', function()
    H.gradcheck(function(x) return ds.repeat_interleave(x, 3, 2) end, { f64(2, 3, 2) })
    H.gradcheck(function(x) return x:transpose(1, 2):repeat_interleave(2, -1) end, { f64(3, 2) })
  end)

  it('refuses repeats below 1, a dim out of range and more elements than a tensor holds', function()
    local x = ds.zeros(2, 3)
    fails('repeats must be', x.repeat_interleave, x, 0, 1)
    fails('dim 3 out of range for a 2%-dim tensor', x.repeat_interleave, x, 2, 3)
    fails('%[2,3%] repeated 4611686018427387904 times has more elements than a tensor holds',
          x.repeat_interleave, x, 2^62, 1)
  end)
end)

describe('split and chunk', function()
  it('split by sizes matches PyTorch', function()
    against_torch('split_sizes', function(xs)
      local p = xs[1]:split({ 1, 3 }, 2)
      return ds.cat({ p[2], p[1] * 2 }, 2)
    end)
  end)

  local function weighted(pieces, dim)
    for k = 1, #pieces do pieces[k] = pieces[k] * k end
    return ds.cat(pieces, dim)
  end
  it('split by size matches PyTorch', function()
    against_torch('split_size', function(xs) return weighted(xs[1]:split(2), 1) end)
  end)
  it('chunk matches PyTorch', function()
    against_torch('chunk', function(xs) return weighted(xs[1]:chunk(3, 2), 2) end)
  end)

  it('gradients match finite differences', function()
    H.gradcheck(function(x) return weighted(x:split(2, -1), -1) end, { f64(2, 5) })
    H.gradcheck(function(x) return weighted(x:chunk(4, 1), 1) end, { f64(6, 2) })
  end)

  it('gives views sized like PyTorch, including empty dims', function()
    local x = ds.arange(0, 10, 1):view(2, 5)
    local p = x:split(2, 2)
    assert.are.same({ 2, 2, 1 }, { p[1]:size()[2], p[2]:size()[2], p[3]:size()[2] })
    assert.are.same({ { 4 }, { 9 } }, p[3]:totable())
    assert.are.equal(3, #ds.zeros(6):chunk(4))
    assert.are.equal(3, #ds.zeros(0):chunk(3))
    assert.are.equal(1, #ds.zeros(0):split(2))
    assert.are.equal(2, #x:split(1))
    assert.are.same({ 0, 5 }, x:split({ 0, 2 })[1]:size())
  end)

  it('rejects bad sizes naming the op and shape', function()
    local x = ds.zeros(5, 3)
    fails('split: sizes add up to 6 but the split dim has size 5 in shape %[5,3%]', x.split, x, { 2, 4 })
    fails('split: split size 0 must be positive for shape %[5,3%]', x.split, x, 0)
    fails('split: size %-1 of piece 1 is negative', x.split, x, { -1, 6 })
    fails('chunk: chunks must be >= 1, got 0 %(shape %[5,3%]%)', x.chunk, x, 0)
    fails('dim 3 out of range for a 2%-dim tensor', x.chunk, x, 2, 3)
  end)
end)
