-- ds.data: the readers on small files written here (IDX raw and gzip,
-- CIFAR-10 batches, text, llm.c token shards), their errors, and the
-- loader: every sample once per epoch, seeded shuffles, drop_last, batch
-- sizes, prefetch threads giving the same batches, nothing leaking.
local H = require 'helpers'
local ds = H.ds

local dir

local fails = H.fails

local function write(name, bytes)
  local path = dir .. '/' .. name
  local f = assert(io.open(path, 'wb'))
  f:write(bytes)
  f:close()
  return path
end

local function gzip(path)
  assert(os.execute('gzip -knf ' .. path) == 0, 'gzip failed')
  return path .. '.gz'
end

local bytes_of = H.read

local function be32(v)
  return string.char(math.floor(v / 16777216) % 256, math.floor(v / 65536) % 256, math.floor(v / 256) % 256, v % 256)
end

local function le32(v)
  return be32(v):reverse()
end

-- pixel (item i, row r, col c), all 0-based: a pattern that tells items apart
local function pixel(i, r, c) return (i * 37 + r * 11 + c * 5) % 256 end

local function idx_images(n, h, w)
  local parts = { be32(0x803), be32(n), be32(h), be32(w) }
  for i = 0, n - 1 do
    for r = 0, h - 1 do
      for c = 0, w - 1 do parts[#parts + 1] = string.char(pixel(i, r, c)) end
    end
  end
  return table.concat(parts)
end

local function idx_labels(labels)
  local parts = { be32(0x801), be32(#labels) }
  for _, l in ipairs(labels) do parts[#parts + 1] = string.char(l) end
  return table.concat(parts)
end

local LABELS = { 3, 1, 4, 1, 5, 9, 2 }

-- an MNIST-like pair (7 items of 4x3) in folder sub with file prefix
local function write_mnist(sub, prefix, gz)
  os.execute('mkdir -p ' .. dir .. '/' .. sub)
  local im = write(sub .. '/' .. prefix .. '-images-idx3-ubyte', idx_images(#LABELS, 4, 3))
  local lb = write(sub .. '/' .. prefix .. '-labels-idx1-ubyte', idx_labels(LABELS))
  if gz then
    gzip(im)
    gzip(lb)
    os.remove(im)
    os.remove(lb)
  end
  return dir .. '/' .. sub
end

local function values(t) return t:reshape(-1):totable() end

local function live_bytes()
  collectgarbage()
  collectgarbage()
  return ds.memory_stats().current.total
end

local function threads()
  local f = io.open('/proc/self/status')
  if not f then return 0 end
  local n = tonumber(f:read('*a'):match('Threads:%s*(%d+)'))
  f:close()
  return n
end

setup(function()
  dir = os.tmpname()
  os.remove(dir)
  assert(os.execute('mkdir -p ' .. dir) == 0)
end)

teardown(function()
  os.execute('rm -rf ' .. dir)
end)

describe('ds.data.mnist', function()
  it('reads gzip IDX files into f32 images in [0, 1] and i64 labels', function()
    local path = write_mnist('gz', 't10k', true)
    local d = ds.data.mnist{ path = path }
    assert.are.equal(#LABELS, #d)
    assert.are.same({ 7, 1, 4, 3 }, d.x:size())
    assert.are.equal('f32', d.x:dtype())
    assert.are.equal('i64', d.y:dtype())
    assert.are.same(LABELS, values(d.y))
    local s = d:get(3)
    assert.are.same({ 1, 4, 3 }, s.x:size())
    assert.are.equal(4, s.y:item())
    local want = {}
    for r = 0, 3 do for c = 0, 2 do want[#want + 1] = pixel(2, r, c) / 255 end end
    H.assert_close(s.x, want, nil, 'item 3')
  end)

  it('reads plain IDX files the same, and a file prefix as path', function()
    local gz = ds.data.mnist{ path = write_mnist('gz', 't10k', true) }
    local raw = ds.data.mnist{ path = write_mnist('raw', 't10k', false) }
    H.assert_close(raw.x, gz.x)
    local pre = ds.data.mnist{ path = dir .. '/raw/t10k' }
    H.assert_close(pre.x, gz.x)
    assert.are.same(values(gz.y), values(pre.y))
  end)

  it('picks the train split when its files are there, the test split otherwise or when asked', function()
    local path = write_mnist('both', 't10k', true)
    local f = assert(io.open(path .. '/train-images-idx3-ubyte', 'wb'))
    f:write(idx_images(2, 4, 3)); f:close()
    f = assert(io.open(path .. '/train-labels-idx1-ubyte', 'wb'))
    f:write(idx_labels({ 0, 8 })); f:close()
    assert.are.equal(2, #ds.data.mnist{ path = path })
    assert.are.equal(#LABELS, #ds.data.mnist{ path = path, split = 'test' })
    assert.are.equal(#LABELS, #ds.data.mnist{ path = path, images = 't10k-images-idx3-ubyte.gz',
                                              labels = 't10k-labels-idx1-ubyte.gz' })
  end)

  it('reads a range of items with first and count', function()
    local path = write_mnist('gz', 't10k', true)
    local all = ds.data.mnist{ path = path }
    local d = ds.data.mnist{ path = path, first = 3, count = 4 }
    assert.are.equal(4, #d)
    assert.are.same({ 4, 1, 5, 9 }, values(d.y))
    H.assert_close(d.x, all.x:narrow(1, 3, 4))
    local tail = ds.data.mnist{ path = path, first = 6 }
    assert.are.same({ 9, 2 }, values(tail.y))
  end)

  it('normalizes with MNIST mean and std when asked', function()
    local path = write_mnist('gz', 't10k', true)
    local plain = ds.data.mnist{ path = path }
    local d = ds.data.mnist{ path = path, normalize = true }
    H.assert_close(d.x, (plain.x - 0.1307) / 0.3081)
    local own = ds.data.mnist{ path = path, normalize = { mean = 0.5, std = 0.25 } }
    H.assert_close(own.x, (plain.x - 0.5) / 0.25)
  end)

  it('names the file and the expected magic when images and labels are swapped', function()
    local path = write_mnist('gz', 't10k', true)
    local err = fails('magic 0x00000801, expected 0x00000803 %(IDX images%)', ds.data.mnist,
                      { path = path, images = 't10k-labels-idx1-ubyte.gz' })
    assert.matches('t10k%-labels%-idx1%-ubyte%.gz', err)
    fails('t10k%-images%-idx3%-ubyte%.gz: magic 0x00000803, expected 0x00000801 %(IDX labels%)', ds.data.mnist,
          { path = path, labels = 't10k-images-idx3-ubyte.gz' })
  end)

  it('reports truncated files, plain and gzip', function()
    local good = idx_images(#LABELS, 4, 3)
    os.execute('mkdir -p ' .. dir .. '/trunc')
    write('trunc/t10k-labels-idx1-ubyte', idx_labels(LABELS))
    write('trunc/t10k-images-idx3-ubyte', good:sub(1, #good - 5))
    fails('t10k%-images%-idx3%-ubyte: truncated: 79 bytes of data, expected 7 items of 12 bytes', ds.data.mnist,
          { path = dir .. '/trunc' })
    write('trunc/t10k-images-idx3-ubyte', good:sub(1, 10))
    fails('truncated: 10 bytes, the IDX images header needs 16', ds.data.mnist, { path = dir .. '/trunc' })
    local gz = bytes_of(gzip(write('trunc/t10k-images-idx3-ubyte', good)))
    os.remove(dir .. '/trunc/t10k-images-idx3-ubyte')
    write('trunc/t10k-images-idx3-ubyte.gz', gz:sub(1, #gz - 12))
    fails('t10k%-images%-idx3%-ubyte%.gz: truncated gzip stream', ds.data.mnist, { path = dir .. '/trunc' })
  end)

  it('reports a bad gzip stream, a missing file and a short file', function()
    os.execute('mkdir -p ' .. dir .. '/bad')
    write('bad/t10k-labels-idx1-ubyte', idx_labels(LABELS))
    local gz = bytes_of(gzip(write('bad/t10k-images-idx3-ubyte', idx_images(#LABELS, 4, 3))))
    os.remove(dir .. '/bad/t10k-images-idx3-ubyte')
    -- the first deflate block header says block type 3, which does not exist
    write('bad/t10k-images-idx3-ubyte.gz', gz:sub(1, 10) .. '\255' .. gz:sub(12))
    fails('t10k%-images%-idx3%-ubyte%.gz: bad gzip stream %(zlib: ', ds.data.mnist, { path = dir .. '/bad' })
    fails('nowhere/train%-images%-idx3%-ubyte%.gz: cannot open %(No such file or directory%)', ds.data.mnist,
          { path = dir .. '/nowhere/train' })
    write('bad/t10k-images-idx3-ubyte.gz', '\0\0')
    fails('too short for an IDX magic number', ds.data.mnist, { path = dir .. '/bad' })
  end)

  it('rejects ranges past the end, mismatched files and unknown options', function()
    local path = write_mnist('gz', 't10k', true)
    fails('items 6 to 9 requested %(counting from 1%), the file has 7', ds.data.mnist,
          { path = path, first = 6, count = 4 })
    fails('first must be an integer >= 1', ds.data.mnist, { path = path, first = 0 })
    write('gz/few-labels-idx1-ubyte', idx_labels({ 1, 2 }))
    fails('has 7 images, .*few%-labels%-idx1%-ubyte has 2 labels', ds.data.mnist,
          { path = path, labels = 'few-labels-idx1-ubyte' })
    -- a header declaring 1.3M images beside 7 labels: refused from the headers,
    -- before a byte of the images' data is read (it reads 1 GB, or finds it short)
    write('gz/many-images-idx3-ubyte', be32(0x803) .. be32(1300000) .. be32(28) .. be32(28) .. ('\0'):rep(100))
    fails('many%-images%-idx3%-ubyte has 1300000 images, .*t10k%-labels%-idx1%-ubyte%.gz has 7 labels', ds.data.mnist,
          { path = path, images = 'many-images-idx3-ubyte' })
    fails("unknown option 'firts' %(did you mean 'first'%?%)", ds.data.mnist, { path = path, firts = 2 })
    fails("split must be 'train' or 'test'", ds.data.mnist, { path = path, split = 'validation' })
    fails('needs path', ds.data.mnist, {})
  end)
end)

describe('ds.data.cifar10', function()
  -- n records; record i has label (i * 3) % 10 and pixel p = (i * 7 + p) % 256
  local function batch(n, offset)
    local parts = {}
    for i = offset, offset + n - 1 do
      local px = {}
      for p = 0, 3071 do px[p + 1] = string.char((i * 7 + p) % 256) end
      parts[#parts + 1] = string.char((i * 3) % 10) .. table.concat(px)
    end
    return table.concat(parts)
  end

  it('reads binary batches into f32 [N,3,32,32] and i64 labels', function()
    os.execute('mkdir -p ' .. dir .. '/cifar/cifar-10-batches-bin')
    write('cifar/cifar-10-batches-bin/test_batch.bin', batch(3, 0))
    local d = ds.data.cifar10{ path = dir .. '/cifar' }
    assert.are.equal(3, #d)
    assert.are.same({ 3, 3, 32, 32 }, d.x:size())
    assert.are.same({ 0, 3, 6 }, values(d.y))
    local x = d:get(2).x
    H.assert_close(x:narrow(1, 2, 1):narrow(2, 1, 1):narrow(3, 1, 2):reshape(-1),
                   { (7 + 1024) % 256 / 255, (7 + 1025) % 256 / 255 })
  end)

  it('concatenates files, reads gzip ones, takes a range and normalizes per channel', function()
    local a = write('c1.bin', batch(2, 0))
    local b = gzip(write('c2.bin', batch(3, 2)))
    local d = ds.data.cifar10{ files = { a, b } }
    assert.are.same({ 0, 3, 6, 9, 2 }, values(d.y))
    local r = ds.data.cifar10{ files = { a, b }, first = 2, count = 3 }
    assert.are.same({ 3, 6, 9 }, values(r.y))
    H.assert_close(r.x, d.x:narrow(1, 2, 3))
    local n = ds.data.cifar10{ files = { a, b }, normalize = true }
    local mean = ds.tensor({ 0.4914, 0.4822, 0.4465 }):reshape({ 1, 3, 1, 1 })
    local std = ds.tensor({ 0.2470, 0.2435, 0.2616 }):reshape({ 1, 3, 1, 1 })
    H.assert_close(n.x, (d.x - mean) / std)
  end)

  it('reports truncated files and labels out of range', function()
    local whole = batch(2, 0)
    local p = write('cut.bin', whole:sub(1, #whole - 100))
    fails('cut%.bin: 6046 bytes, expected a whole number of 3073%-byte records', ds.data.cifar10, { files = { p } })
    p = write('badlabel.bin', whole:sub(1, 3073) .. '\12' .. whole:sub(3075))
    fails('badlabel%.bin: record 2 has label 12, expected 0%-9', ds.data.cifar10, { files = { p } })
    fails('missing%.bin: cannot open', ds.data.cifar10, { files = { dir .. '/missing.bin' } })
    fails("unknown option 'file'", ds.data.cifar10, { file = { p } })
  end)
end)

describe('ds.data.text', function()
  local TEXT = 'to be, or not to be'

  it('builds the vocabulary from the sorted distinct characters', function()
    local d = ds.data.text{ text = TEXT, block_size = 4 }
    assert.are.same({ ' ', ',', 'b', 'e', 'n', 'o', 'r', 't' }, d.vocab)
    assert.are.equal(8, d.vocab_size)
    assert.are.equal(#TEXT - 4, #d)
    assert.are.equal(TEXT, d:decode(d.tokens))
  end)

  it('gives windows x = tokens[i..i+T-1] and next-token targets y', function()
    local d = ds.data.text{ text = TEXT, block_size = 4 }
    for _, i in ipairs({ 1, 2, 7, #d }) do
      local s = d:get(i)
      assert.are.equal('i64', s.x:dtype())
      assert.are.equal(TEXT:sub(i, i + 3), d:decode(s.x))
      assert.are.equal(TEXT:sub(i + 1, i + 4), d:decode(s.y))
    end
    local b = d:batch({ 1, #d })
    assert.are.same({ 2, 4 }, b.x:size())
    assert.are.equal(TEXT:sub(1, 4) .. TEXT:sub(#d, #d + 3), d:decode(b.x))
    local s = ds.data.text{ text = TEXT, block_size = 4, stride = 4 }
    assert.are.equal(4, #s)
    assert.are.equal(TEXT:sub(5, 8), s:decode(s:get(2).x))
  end)

  it('encodes and decodes strings, tensors and lists', function()
    local d = ds.data.text{ text = TEXT, block_size = 2 }
    local ids = d:encode('not to')
    assert.are.same({ 4, 5, 7, 0, 7, 5 }, values(ids))
    assert.are.equal('not to', d:decode(ids))
    assert.are.equal('bet', d:decode({ 2, 3, 7 }))
    fails("encode: byte 0x78 %('x'%) at position 3 is not in the vocabulary of 8", d.encode, d, 'tox')
    fails('decode: token 8 at position 2 is outside the vocabulary %[0, 8%)', d.decode, d, ds.tensor({ 1, 8 }, 'i64'))
    fails('decode: token 9 at position 1', d.decode, d, { 9 })
  end)

  it('reads a file and shares a vocabulary with another split', function()
    local p = write('input.txt', TEXT .. '\n')
    local d = ds.data.text{ path = p, block_size = 3 }
    assert.are.equal(#TEXT + 1 - 3, #d)
    assert.are.equal('\n', d.vocab[1])
    local val = ds.data.text{ text = 'not be', block_size = 2, vocab = d.vocab }
    assert.are.same(d.vocab, val.vocab)
    assert.are.equal('not be', val:decode(val.tokens))
  end)

  it('rejects a block_size larger than the text, missing files and bad options', function()
    fails('block_size 19 is larger than the text: 19 characters, a sample needs block_size %+ 1 = 20', ds.data.text,
          { text = TEXT, block_size = 19 })
    fails('ds.data.text: .*nope%.txt: cannot open %(No such file', ds.data.text, { path = dir .. '/nope.txt', block_size = 2 })
    fails('needs exactly one of path', ds.data.text, { text = TEXT, path = 'x', block_size = 2 })
    fails('needs block_size', ds.data.text, { text = TEXT })
    fails("unknown option 'block' %(did you mean 'block_size'%?%)", ds.data.text, { text = TEXT, block = 2 })
    fails('block_size must be an integer >= 1, got 0', ds.data.text, { text = TEXT, block_size = 0 })
  end)
end)

describe('ds.data.shards', function()
  local function shard(name, tokens, magic, version, count)
    local parts = { le32(magic or 20240520), le32(version or 1), le32(count or #tokens), string.rep('\0', 253 * 4) }
    for _, t in ipairs(tokens) do parts[#parts + 1] = string.char(t % 256, math.floor(t / 256)) end
    return write(name, table.concat(parts))
  end

  local A = { 50256, 1, 2, 3, 4, 5, 6, 7, 8, 9 }
  local B = { 50256, 300, 301, 302, 303, 304, 305 }

  it('reads uint16 tokens and cuts windows that stay inside a shard', function()
    os.execute('mkdir -p ' .. dir .. '/shards')
    local a, b = shard('shards/tok_000.bin', A), shard('shards/tok_001.bin', B)
    local d = ds.data.shards{ paths = { a, b }, block_size = 3 }
    assert.are.same({ 10, 7 }, d.lengths)
    assert.are.equal(3 + 2, #d)   -- (10 - 1) // 3 + (7 - 1) // 3, llm.c's non-overlapping sequences
    assert.are.same({ 50256, 1, 2 }, values(d:get(1).x))
    assert.are.same({ 1, 2, 3 }, values(d:get(1).y))
    assert.are.same({ 6, 7, 8 }, values(d:get(3).x))
    assert.are.same({ 7, 8, 9 }, values(d:get(3).y))
    assert.are.same({ 50256, 300, 301 }, values(d:get(4).x))
    assert.are.same({ 303, 304, 305 }, values(d:get(5).y))
    local g = ds.data.shards{ pattern = dir .. '/shards/tok_*.bin', block_size = 3, stride = 1 }
    assert.are.same({ a, b }, g.paths)
    assert.are.equal(7 + 4, #g)
  end)

  it('reports a wrong magic, version, a truncated shard and no match', function()
    local p = shard('m.bin', A, 20240521)
    fails('m%.bin: magic 20240521, expected 20240520 %(llm%.c token shard%)', ds.data.shards,
          { paths = { p }, block_size = 2 })
    p = shard('v.bin', A, nil, 7)
    fails('v%.bin: version 7, expected 1', ds.data.shards, { paths = { p }, block_size = 2 })
    p = shard('t.bin', A, nil, nil, 12)
    fails('t%.bin: truncated: 20 bytes of tokens, the header says 12 tokens %(24 bytes%)', ds.data.shards,
          { paths = { p }, block_size = 2 })
    fails("no file matches '.*zzz_%*%.bin'", ds.data.shards, { pattern = dir .. '/zzz_*.bin', block_size = 2 })
    fails('ok%.bin: 10 tokens, a window of block_size 10 needs 11', ds.data.shards,
          { paths = { shard('ok.bin', A) }, block_size = 10 })
    fails('ok%.bin%.gz: gzip%-compressed; token shards are memory%-mapped, decompress it first', ds.data.shards,
          { paths = { gzip(dir .. '/ok.bin') }, block_size = 2 })
  end)

  it('maps a glob of 3000 shards in name order, keeping no file open', function()
    os.execute('mkdir -p ' .. dir .. '/many')
    for k = 0, 2999 do shard(string.format('many/m_%05d.bin', k), { k, k + 1, k + 2, k + 3 }) end
    local glob = require('dslua.core').data_core.glob
    local fds = #glob('/proc/self/fd/*')
    local d = ds.data.shards{ pattern = dir .. '/many/m_*.bin', block_size = 2, stride = 1 }
    assert.are.equal(3000, #d.lengths)
    assert.are.equal(2 * 3000, #d)
    assert.are.equal(fds, #glob('/proc/self/fd/*'))
    assert.are.same({ 0, 1 }, values(d:get(1).x))
    assert.are.same({ 2, 3 }, values(d:get(2).y))
    assert.are.same({ 2999, 3000 }, values(d:get(2 * 3000 - 1).x))
    assert.are.same({ 3001, 3002 }, values(d:get(2 * 3000).y))
    local b = d:batch({ 2 * 1234 + 1, 2 * 2345 + 2 })
    assert.are.same({ 1234, 1235, 2346, 2347 }, values(b.x))
  end)

  -- The windows of each shard by their definition, as rows of x and y.
  local function windows_of(shards, T, stride)
    local x, y = {}, {}
    for _, toks in ipairs(shards) do
      for s = 0, #toks - T - 1, stride do
        local wx, wy = {}, {}
        for t = 1, T do wx[t], wy[t] = toks[s + t], toks[s + t + 1] end
        x[#x + 1], y[#y + 1] = wx, wy
      end
    end
    return ds.data.tensors{ x = ds.tensor(x, 'i64'), y = ds.tensor(y, 'i64') }
  end

  local function batches(d, opts, resume)
    local l = ds.data.loader(d, opts)
    if resume then l:resume(resume) end
    local out = {}
    for step, b in l:epoch(2) do out[#out + 1] = { step, values(b.x), values(b.y) } end
    l:close()
    return out
  end

  it('gives the batches of the windows in memory: shuffled, in threads, per rank (even, uneven), resumed', function()
    os.execute('mkdir -p ' .. dir .. '/same')
    local seed, shards = 7, {}
    for k, n in ipairs { 301, 17, 250, 64 } do
      local toks = {}
      for i = 1, n do
        seed = (seed * 1103515245 + 12345) % 2147483648
        toks[i] = math.floor(seed / 32768) % 65536
      end
      shards[k] = toks
      shard(string.format('same/s_%03d.bin', k), toks)
    end
    local DS, U = require 'samplers.distributed', require 'samplers.uneven'
    for _, w in ipairs { { T = 16, stride = 16, n = 18 + 1 + 15 + 3 }, { T = 5, stride = 3, n = 99 + 4 + 82 + 20 } } do
      local d = ds.data.shards{ pattern = dir .. '/same/s_*.bin', block_size = w.T, stride = w.stride }
      local ref = windows_of(shards, w.T, w.stride)
      assert.are.equal(w.n, #d)
      assert.are.equal(w.n, #ref)
      local cases = { { batch_size = 4, seed = 3 }, { batch_size = 5, seed = 3, num_workers = 2, prefetch_factor = 3 } }
      for r = 0, 2 do
        local sampler = DS(d, { num_replicas = 3, rank = r, seed = 5 })
        cases[#cases + 1] = { batch_size = 3, num_workers = 1, sampler = sampler }
      end
      -- the uneven policy: micro batches 4 and 2, shares 0.7 and 0.3
      local L = U.layout(#d, { 4, 2 }, { 0.7, 0.3 }, false)
      for r = 0, 1 do
        local sampler = { set_epoch = function() end,
                          indices = function(_, e) return U.indices(L, r, U.order(#d, true, 5, e)) end }
        local micro = U.micro_batch(L, r)        -- a list where the sizes vary: its first
        local b = type(micro) == 'table' and micro[1] or micro
        cases[#cases + 1] = { batch_size = b, num_workers = 2, sampler = sampler }
      end
      for _, opts in ipairs(cases) do
        local want = batches(ref, opts)
        assert.is_true(#want >= 2)
        assert.are.same(want, batches(d, opts))
        -- resumed at the exact window: the third batch on
        local at = { epoch = 2, step = 2, samples = 2 * opts.batch_size }
        assert.are.same({ unpack(want, 3) }, batches(d, opts, at))
      end
    end
  end)

  it('reads a 100M-token shard with anonymous memory bounded by the batches in flight and no file pages kept', function()
    -- 96 writes of 2 MB (16 chunks of 65536 tokens: 201 MB), each chunk the
    -- tokens 0, 1, 2, ... 50255 and on; writes this large leave the page
    -- cache holding the file in large folios, as a shard written by numpy
    -- or read cold from disk
    local chunk, ntok = {}, 96 * 16 * 65536
    for i = 0, 65535 do chunk[#chunk + 1] = string.char(i % 50256 % 256, math.floor(i % 50256 / 256)) end
    chunk = table.concat(chunk):rep(16)
    local path = dir .. '/big.bin'
    local f = assert(io.open(path, 'wb'))
    f:write(le32(20240520), le32(1), le32(ntok), string.rep('\0', 253 * 4))
    for _ = 1, 96 do f:write(chunk) end
    f:close()
    -- a child opens it (checking every token against the vocabulary, which
    -- reads it whole) and takes 400 shuffled batches from 2 threads with up
    -- to 4 in flight; it prints the growth of its anonymous resident memory
    -- and of the file's pages it holds
    local script = write('big.lua', [[
      local ds = require 'dslua'
      local function kb(key)
        local f = io.open('/proc/self/status')
        local v = tonumber(f:read('*a'):match(key .. ':%s*(%d+)'))
        f:close()
        return v
      end
      collectgarbage()
      local anon, hwm, file, grown = kb('RssAnon'), kb('VmHWM'), kb('RssFile'), 0
      local d = ds.data.shards{ paths = { arg[1] }, block_size = 1024, vocab_size = 50257 }
      local l = ds.data.loader(d, { batch_size = 8, num_workers = 2, prefetch_factor = 2, seed = 1 })
      local last
      for step, b in l:epoch(1) do
        collectgarbage()
        grown = math.max(grown, kb('RssAnon') - anon)
        last = b
        if step == 400 then break end
      end
      local x, y = last.x, last.y
      print(#d, grown, kb('VmHWM') - hwm, (y:narrow(2, 1, 1023) - x:narrow(2, 2, 1023)):abs():sum():item(),
            x:amax():item(), kb('RssFile') - file)
    ]])
    local out, status = H.run('timeout 300 ' .. H.bin() .. ' ' .. script .. ' ' .. path)
    assert.are.equal(0, status, out)
    local n, grown, peak, diff, top, mapped = out:match('^(%d+)%s+(%-?%d+)%s+(%-?%d+)%s+(%d+)%s+(%d+)%s+(%-?%d+)')
    assert.are.equal(tostring(math.floor((ntok - 1025) / 1024) + 1), n, out)
    assert.are.equal('0', diff, out)                    -- y is x shifted by one token
    assert.is_true(tonumber(top) < 50256, out)
    -- 4 batches in flight of x and y, 8 x 1024 i64 each (512 KB), and 32 MB
    -- for what does not grow with the shard (two threads' stacks and malloc
    -- arenas, the loader's ring, the Lua objects of one batch); the shard
    -- read into memory would be 400 MB (i32) or 200 MB (its own uint16)
    local bound = 4 * 2 * 8 * 1024 * 8 / 1024 + 32 * 1024
    assert.is_true(tonumber(grown) < bound, 'anonymous memory grew by ' .. grown .. ' KB, bound ' .. bound .. ' KB')
    -- the peak of all resident memory, the mapped file's pages too: the
    -- vocabulary check holds 16 MB of the file at a time, a window its pages
    local peak_bound = bound + 16 * 1024
    assert.is_true(tonumber(peak) < peak_bound, 'peak resident memory grew by ' .. peak .. ' KB, bound ' .. peak_bound
                   .. ' KB')
    -- after the batches, the file's pages still mapped: each of the two
    -- threads holds at most the window it copies, in at most two 2 MB
    -- folios (what a fault maps); 3200 windows read held hundreds of MB
    -- when a drop missed the folio's rest
    assert.is_true(tonumber(mapped) <= 2 * 2 * 2048, 'the file\'s mapped pages grew by ' .. mapped .. ' KB')
  end)
end)

describe('ds.data on hostile files', function()
  it('refuses a FIFO, a directory or a device as a data path instead of blocking', function()
    local fifo = dir .. '/fifo'
    assert(os.execute('mkfifo ' .. fifo) == 0)
    -- in a child with a deadline: a reader that opens the FIFO would wait forever for a writer
    for _, case in ipairs {
      { "ds.data.text{ path = '" .. fifo .. "', block_size = 2 }", 'is a FIFO, expected a regular file' },
      { "ds.data.shards{ paths = { '" .. fifo .. "' }, block_size = 2 }", 'is a FIFO, expected a regular file' },
      { "ds.data.mnist{ images = '" .. fifo .. "', labels = '" .. fifo .. "' }", 'is a FIFO, expected a regular file' },
      { "ds.data.cifar10{ files = { '/dev/zero' } }", '/dev/zero: is a device, expected a regular file' },
      { "ds.data.text{ path = '" .. dir .. "', block_size = 2 }", 'is a directory, expected a regular file' },
    } do
      local out, status = H.run('timeout 20 ' .. H.bin() .. [[ -e "local ds = require 'dslua'; ]] .. case[1] .. '"')
      assert.are_not.equal(124, status, 'timed out (blocked): ' .. case[1])
      assert.are_not.equal(0, status, out)
      H.has(out, case[2])
    end
  end)

  it('decompresses no more than the header declares (a gzip bomb stops at its header)', function()
    -- an IDX of 10 labels followed by 200 MB of zeros, gzipped to ~200 KB
    local head = write('bomb.head', be32(0x801) .. be32(10))
    local bomb = dir .. '/bomb-labels-idx1-ubyte.gz'
    assert(os.execute('(cat ' .. head .. '; head -c 200000000 /dev/zero) | gzip -1 > ' .. bomb) == 0)
    -- a child reads it and reports its peak resident size before and after
    local script = write('bomb.lua', [[
      local C = require('dslua.core').data_core
      local function hwm()
        local f = io.open('/proc/self/status')
        local kb = tonumber(f:read('*a'):match('VmHWM:%s*(%d+)'))
        f:close()
        return kb
      end
      local before = hwm()
      local t = C.read_idx(arg[1], 1, 0, -1)
      print(t:numel(), t:sum():item(), hwm() - before)
    ]])
    local out, status = H.run(H.bin() .. ' ' .. script .. ' ' .. bomb)
    assert.are.equal(0, status, out)
    local n, sum, grown = out:match('^(%d+)%s+(%d+)%s+(%-?%d+)')
    assert.are.equal('10', n, out)
    assert.are.equal('0', sum, out)
    assert.is_true(tonumber(grown) < 50 * 1024, 'peak resident size grew by ' .. grown .. ' KB reading 10 labels')
    -- text has no header: its gzip trailer's size bounds it
    local liar = dir .. '/liar.txt.gz'
    assert(os.execute('head -c 10000000 /dev/zero | tr "\\0" a | gzip -1 > ' .. liar) == 0)
    local f = assert(io.open(liar, 'r+b'))
    f:seek('end', -4)
    f:write(le32(1000))                       -- the trailer now says 1000 bytes
    f:close()
    fails('liar%.txt%.gz: decompresses past the 1000 bytes its gzip trailer declares', ds.data.text,
          { path = liar, block_size = 2 })
  end)

  it('checks labels, item counts and token ids at load, naming the file and the offset', function()
    os.execute('mkdir -p ' .. dir .. '/bad')
    local im = write('bad/x-images-idx3-ubyte', idx_images(3, 4, 3))
    local lb = write('bad/x-labels-idx1-ubyte', idx_labels({ 1, 200, 3 }))
    fails('x%-labels%-idx1%-ubyte: label 200 at item 2 %(byte offset 9%), expected 0%-9', ds.data.mnist,
          { images = im, labels = lb })
    local ok = ds.data.mnist{ images = im, labels = lb, count = 1 }       -- the bad label is outside the range read
    assert.are.equal(1, #ok)
    fails('label 200 at item 2 %(byte offset 9%)', ds.data.mnist, { images = im, labels = lb, first = 2 })
    local empty_im = write('bad/e-images-idx3-ubyte', idx_images(0, 28, 28))
    local empty_lb = write('bad/e-labels-idx1-ubyte', idx_labels({}))
    fails('e%-images%-idx3%-ubyte holds 0 images', ds.data.mnist, { images = empty_im, labels = empty_lb })
    local flat_im = write('bad/f-images-idx3-ubyte', idx_images(3, 0, 5))
    fails('f%-images%-idx3%-ubyte: images are 0x5', ds.data.mnist, { images = flat_im, labels = lb })
    -- token shards: too short for one window, and a token past the vocabulary
    local function shard(name, tokens)
      local parts = { le32(20240520), le32(1), le32(#tokens), string.rep('\0', 253 * 4) }
      for _, t in ipairs(tokens) do parts[#parts + 1] = string.char(t % 256, math.floor(t / 256)) end
      return write(name, table.concat(parts))
    end
    local long = shard('bad/long.bin', { 1, 2, 3, 4, 5, 6, 7, 8, 9 })
    for _, short in ipairs { {}, { 7 }, { 7, 8, 9 } } do
      local p = shard('bad/short' .. #short .. '.bin', short)
      fails('short' .. #short .. '%.bin: ' .. #short .. ' tokens?, a window of block_size 4 needs 5', ds.data.shards,
            { paths = { long, p }, block_size = 4 })
    end
    local wild = shard('bad/wild.bin', { 1, 2, 65535, 4, 5 })
    fails('wild%.bin: token 65535 at position 3 %(byte offset 1028%) is outside the vocabulary %[0, 50257%)',
          ds.data.shards, { paths = { long, wild }, block_size = 4, vocab_size = 50257 })
    assert.are.equal(3, #ds.data.shards{ paths = { long, wild }, block_size = 4 })   -- no vocabulary: any uint16
  end)
end)

describe('ds.data.tensors', function()
  it('makes samples of rows and gathers batches from lists or index tensors', function()
    local x = ds.arange(0, 30, 1, 'f32'):reshape({ 10, 3 })
    local d = ds.data.tensors{ x = x, y = ds.arange(10) }
    assert.are.equal(10, #d)
    assert.are.same({ 3, 4, 5 }, values(d:get(2).x))
    assert.are.equal(1, d:get(2).y:item())
    local b = d:batch({ 10, 1 })
    assert.are.same({ 9, 0 }, values(b.y))
    assert.are.same({ 27, 28, 29, 0, 1, 2 }, values(b.x))
    assert.are.same({ 9, 0 }, values(d:batch(ds.tensor({ 9, 0 }, 'i64')).y))
    assert.are.same({ 2, 1 }, values(d:batch(ds.tensor({ 2, 1 }, 'i32')).y))
  end)

  it('copies non-contiguous tensors and checks sizes and indices', function()
    local x = ds.arange(0, 12, 1, 'f32'):reshape({ 3, 4 }):t()
    local d = ds.data.tensors{ x = x }
    assert.are.same({ 1, 5, 9 }, values(d:get(2).x))
    fails("field 'y' has shape %[3%], expected 4 samples like 'x'", ds.data.tensors, { x = x, y = ds.zeros(3) })
    fails("field 'y' is a number, expected a tensor", ds.data.tensors, { x = x, y = 3 })
    fails('index 5 at position 2 is outside %[1, 4%]', d.batch, d, { 1, 5 })
    fails('sample index 4 %(0%-based%) out of range for 4 samples', d.batch, d, ds.tensor({ 4 }, 'i64'))
    fails('dataset:get: index 0 is outside %[1, 4%]', d.get, d, 0)
  end)
end)

describe('ds.data.loader', function()
  local function numbered(n)
    return ds.data.tensors{ x = ds.arange(0, 2 * n, 1, 'f32'):reshape({ n, 2 }), y = ds.arange(n) }
  end

  -- the y values of every batch of an epoch, and the batch sizes
  local function run(loader, e)
    local ys, sizes, steps = {}, {}, {}
    for step, b in loader:epoch(e) do
      steps[#steps + 1] = step
      sizes[#sizes + 1] = b.y:size(1)
      for _, v in ipairs(values(b.y)) do ys[#ys + 1] = v end
      assert.are.same(values(b.y:to('f32') * 2), values(b.x:narrow(2, 1, 1)))
    end
    return ys, sizes, steps
  end

  it('visits every sample once per epoch, in batches of batch_size with a short last one', function()
    local l = ds.data.loader(numbered(103), { batch_size = 10, seed = 5 })
    assert.are.equal(11, #l)
    local ys, sizes, steps = run(l, 1)
    assert.are.same({ 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 3 }, sizes)
    assert.are.same({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }, steps)
    local sorted = { unpack(ys) }
    table.sort(sorted)
    for i = 1, 103 do assert.are.equal(i - 1, sorted[i]) end
    local inorder = true
    for i = 1, 103 do inorder = inorder and ys[i] == i - 1 end
    assert.is_false(inorder, 'shuffle=true (the default) shuffles')
  end)

  it('resumes an epoch in an order given, with and without workers, and refuses an index outside the dataset', function()
    for _, workers in ipairs({ 0, 2 }) do
      local l = ds.data.loader(numbered(10), { batch_size = 3, num_workers = workers })
      l:resume { epoch = 2, step = 0, samples = 0, order = { 7, 1, 4, 9 } }
      local ys, sizes = run(l)
      assert.are.same({ 7, 1, 4, 9 }, ys)
      assert.are.same({ 3, 1 }, sizes)
      assert.are.same({ 7, 1, 4, 9 }, l.position.order)
      assert.are.equal(10, #run(l, 3))          -- the next epoch reads the whole dataset again
    end
    local l = ds.data.loader(numbered(10), { batch_size = 3 })
    local e = H.err(l.resume, l, { epoch = 1, step = 0, samples = 0, order = { 1, 10 } })
    H.has(e, 'order[2] = 10 is not an index of the dataset [0, 10)')
  end)

  it('drops the last short batch with drop_last, as PyTorch', function()
    local l = ds.data.loader(numbered(103), { batch_size = 10, drop_last = true })
    assert.are.equal(10, #l)
    local ys, sizes = run(l, 1)
    assert.are.equal(10, #sizes)
    assert.are.equal(100, #ys)
    local seen = {}
    for _, y in ipairs(ys) do
      assert.is_nil(seen[y])
      seen[y] = true
    end
    assert.are.equal(10, #ds.data.loader(numbered(100), { batch_size = 10, drop_last = true }))
    assert.are.equal(0, #ds.data.loader(numbered(7), { batch_size = 10, drop_last = true }))
    assert.are.equal(1, #ds.data.loader(numbered(7), { batch_size = 10 }))
  end)

  it('shuffles reproducibly from seed + epoch, and not at all with shuffle = false', function()
    local d = numbered(50)
    local a = run(ds.data.loader(d, { batch_size = 8, seed = 3 }), 2)
    local b = run(ds.data.loader(d, { batch_size = 8, seed = 3 }), 2)
    local c = run(ds.data.loader(d, { batch_size = 8, seed = 3 }), 3)
    local e = run(ds.data.loader(d, { batch_size = 8, seed = 2 }), 3)
    assert.are.same(a, b)
    assert.are_not.same(a, c)
    assert.are.same(a, e)               -- seed + epoch is what counts
    assert.are.same(values(ds.data.permutation(50, 5)), a)
    local plain = run(ds.data.loader(d, { batch_size = 8, shuffle = false }), 1)
    for i = 1, 50 do assert.are.equal(i - 1, plain[i]) end
    local l = ds.data.loader(d, { batch_size = 8 })
    local e1, e2 = run(l), run(l)
    assert.are.equal(2, l.current_epoch)
    assert.are.same(run(ds.data.loader(d, { batch_size = 8 }), 1), e1)
    assert.are_not.same(e1, e2)
  end)

  it('gives the same batches with prefetch threads as without', function()
    local text = ds.data.text{ text = string.rep('the quick brown fox jumps over the lazy dog. ', 20), block_size = 16 }
    for _, d in ipairs({ numbered(257), text }) do
      local ref = ds.data.loader(d, { batch_size = 7, seed = 11 })
      for _, workers in ipairs({ 1, 3 }) do
        local l = ds.data.loader(d, { batch_size = 7, seed = 11, num_workers = workers, prefetch_factor = 3 })
        assert.is_true(l:gathers_in_c())
        for e = 1, 3 do
          local got = {}
          for step, b in l:epoch(e) do got[step] = b end
          local n = 0
          for step, b in ref:epoch(e) do
            n = n + 1
            assert.are.same(values(b.x), values(got[step].x), 'epoch ' .. e .. ' step ' .. step)
            assert.are.same(values(b.y), values(got[step].y))
          end
          assert.are.equal(#l, n)
          assert.are.equal(n, #got)
        end
        l:close()
      end
    end
  end)

  it('changes the batch size mid-epoch, with and without workers alike', function()
    local d = numbered(40)
    local function sizes(workers)
      local l = ds.data.loader(d, { batch_size = 4, seed = 1, num_workers = workers })
      local out, ys = {}, {}
      for step, b in l:epoch(1) do
        out[step] = b.y:size(1)
        for _, v in ipairs(values(b.y)) do ys[#ys + 1] = v end
        if step == 3 then l:set_batch_size(10) end
      end
      l:close()
      return out, ys
    end
    local s0, y0 = sizes(0)
    local s2, y2 = sizes(2)
    assert.are.same({ 4, 4, 4, 10, 10, 8 }, s0)
    assert.are.same(s0, s2)
    assert.are.same(y0, y2)
    assert.are.same(values(ds.data.permutation(40, 2)), y0)
    fails('batch size must be an integer >= 1', function() ds.data.loader(d):set_batch_size(0) end)
  end)

  it('starts over cleanly after an epoch left early, and refuses a superseded iterator', function()
    local l = ds.data.loader(numbered(64), { batch_size = 4, num_workers = 2 })
    local it = l:epoch(1)
    it()
    it()
    local ys = run(l, 2)
    assert.are.equal(64, #ys)
    assert.are.same(values(ds.data.permutation(64, 2)), ys)
    fails('superseded by a later loader:epoch', it)
    l:close()
  end)

  it('runs collate_fn on the main thread over samples from get', function()
    local d = numbered(10)
    local calls = 0
    local l = ds.data.loader(d, { batch_size = 4, shuffle = false, num_workers = 2, collate_fn = function(samples)
      calls = calls + 1
      local ys = {}
      for i, s in ipairs(samples) do ys[i] = s.y:item() end
      return { y = ys }
    end })
    assert.is_false(l:gathers_in_c())
    local got = {}
    for step, b in l:epoch(1) do got[step] = b.y end
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 }, { 8, 9 } }, got)
    assert.are.equal(3, calls)
  end)

  it('loads Lua datasets and lists of samples with the default collate', function()
    local list = {}
    for i = 1, 9 do list[i] = { x = ds.tensor({ i, -i }), y = i % 3, w = i / 2 } end
    local l = ds.data.loader(list, { batch_size = 4, shuffle = false })
    assert.are.equal(3, #l)
    local batches = {}
    for step, b in l:epoch(1) do batches[step] = b end
    assert.are.same({ 4, 2 }, batches[1].x:size())
    assert.are.equal('i64', batches[1].y:dtype())
    assert.are.equal('f32', batches[1].w:dtype())
    assert.are.same({ 2, 0, 1, 2 }, values(batches[2].y))
    local obj = { n = 5 }
    function obj:len() return self.n end
    function obj:get(i) return ds.tensor({ i }) end
    local ys = {}
    for _, b in ds.data.loader(obj, { batch_size = 2, seed = 4 }):epoch(1) do
      for _, v in ipairs(values(b)) do ys[#ys + 1] = v - 1 end
    end
    assert.are.same(values(ds.data.permutation(5, 5)), ys)
  end)

  it('rejects unknown and bad options, naming them', function()
    local d = numbered(5)
    fails("ds.data.loader: unknown option 'batchsize' %(did you mean 'batch_size'%?%); options are batch_size, shuffle",
          ds.data.loader, d, { batchsize = 4 })
    fails('batch_size must be an integer >= 1, got 0', ds.data.loader, d, { batch_size = 0 })
    fails('num_workers must be an integer >= 0, got %-1', ds.data.loader, d, { num_workers = -1 })
    fails('shuffle must be a boolean, got a string', ds.data.loader, d, { shuffle = 'yes' })
    fails('expected a dataset', ds.data.loader, 42)
  end)

  it('hands out batches on a device: cpu changes nothing, a device that is not here is an error at once', function()
    local d = numbered(23)
    local ref = ds.data.loader(d, { batch_size = 5, seed = 2 })
    for _, workers in ipairs({ 0, 2 }) do
      local l = ds.data.loader(d, { batch_size = 5, seed = 2, num_workers = workers, device = 'cpu' })
      assert.are.equal('cpu', l.device)
      assert.are.same({ run(ref, 1) }, { run(l, 1) })
    end
    assert.are.equal('loader: 5 batches of 5, shuffled, 0 workers', tostring(ref))
    fails("ds.data.loader: unknown device 'tpu' %(expected 'cpu', 'cuda' or 'cuda:N'%)", ds.data.loader, d,
          { device = 'tpu' })
    fails('ds.data.loader: device must be a string, got a number', ds.data.loader, d, { device = 0 })
    if not ds.cuda.is_available() then
      fails('ds.data.loader: device: no CUDA device available %(' .. ds.cuda.unavailable_reason():gsub('%p', '%%%0')
            .. '%)', ds.data.loader, d, { device = 'cuda' })
    end
  end)

  it('leaks no memory and no threads over 100 epochs with workers', function()
    local d = ds.data.text{ text = string.rep('abcdefghij', 50), block_size = 8 }
    local before, threads_before = live_bytes(), threads()
    local l = ds.data.loader(d, { batch_size = 16, num_workers = 3 })
    local sum = 0
    for e = 1, 100 do
      for _, b in l:epoch(e) do sum = sum + b.x:size(1) end
    end
    assert.are.equal(100 * #d, sum)
    if threads_before > 0 then assert.are.equal(threads_before + 3, threads()) end
    l:close()
    assert.are.equal(threads_before, threads())
    -- loaders dropped mid-epoch are joined when collected
    for _ = 1, 20 do
      local k = ds.data.loader(d, { batch_size = 4, num_workers = 2 })
      local it = k:epoch(1)
      it()
    end
    l = nil
    assert.are.equal(before, live_bytes())
    assert.are.equal(threads_before, threads())
  end)
end)

describe('ds.data on the real MNIST', function()
  it('reads the t10k files: 8,000 to train on and 2,000 to evaluate', function()
    local data, absent = H.shared_data('mnist/t10k-images-idx3-ubyte.gz')
    if not data then return pending(absent) end
    local train = ds.data.mnist{ path = data .. '/mnist', first = 1, count = 8000 }
    local test = ds.data.mnist{ path = data .. '/mnist', first = 8001, count = 2000 }
    assert.are.equal(8000, #train)
    assert.are.equal(2000, #test)
    assert.are.same({ 8000, 1, 28, 28 }, train.x:size())
    assert.are.equal(7, train:get(1).y:item())    -- the first t10k digit is a 7
    assert.are.equal(0, train.x:amin():item())
    assert.are.equal(1, train.x:amax():item())
    assert.are.equal(0, train.y:amin():item())
    assert.are.equal(9, train.y:amax():item())
    local all = ds.data.mnist{ path = data .. '/mnist' }
    assert.are.equal(10000, #all)
    assert.is_true(math.abs(all.x:to('f64'):mean():item() - 0.1325) < 1e-3)
    local l = ds.data.loader(train, { batch_size = 64, num_workers = 2 })
    local seen, label_sum = 0, 0
    for _, b in l:epoch(1) do
      seen = seen + b.x:size(1)
      label_sum = label_sum + b.y:sum():item()
    end
    l:close()
    assert.are.equal(8000, seen)
    assert.are.equal(train.y:sum():item(), label_sum)
  end)
end)
