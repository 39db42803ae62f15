-- Datasets and the loader: ds.data.
--
-- A dataset has #dataset and dataset:get(i) (i 1-based) -> sample table.
-- The readers here (mnist, cifar10, text, shards, tensors) are C-backed:
-- their data sits in tensors and dataset:batch(indices) gathers a whole
-- batch in C, which is what the loader's prefetch threads run. Any Lua
-- object with get (or a plain list of samples) works as a dataset too.
--
-- Batches are {x = tensor, y = tensor} with the batch dim first. Index
-- values inside tensors are 0-based; Lua lists of indices are 1-based.
local core = require 'dslua.core'
local C = core.data_core
local suggest = require 'dslua.base.suggest'

local M = {}
local fmt = string.format

local function fail(fname, msg, ...)
  error(fname .. ': ' .. fmt(msg, ...), 0)
end

-- Calls a core function, prefixing its error with the caller's name.
local function try(fname, f, ...)
  local res = { pcall(f, ...) }
  if not res[1] then error(fname .. ': ' .. tostring(res[2]), 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Objects that # works on: LuaJIT ignores __len on tables, so every
-- dataset and loader is a proxy userdata whose fields live in a table.
local function object(class, fields)
  local p = newproxy(true)
  local mt = getmetatable(p)
  mt.__index = setmetatable(fields, { __index = class })
  mt.__newindex = fields
  mt.__len = class.__len
  mt.__tostring = class.__tostring
  return p
end

-- Unknown option keys are errors naming the key, the nearest valid one
-- and all of them.
local function check_opts(fname, opts, allowed)
  if type(opts) ~= 'table' then fail(fname, 'expected a table of options, got a %s', type(opts)) end
  local set = {}
  for _, k in ipairs(allowed) do set[k] = true end
  for k in pairs(opts) do
    if not set[k] then
      local key = tostring(k)
      local hint = suggest.did_you_mean(key, allowed)
      fail(fname, "unknown option '%s'%s; options are %s", key, hint and ' (' .. hint .. ')' or '',
           table.concat(allowed, ', '))
    end
  end
end

local function check_int(fname, opts, key, default, min)
  local v = opts[key]
  if v == nil then return default end
  if type(v) ~= 'number' or v ~= math.floor(v) or v < min then
    fail(fname, '%s must be an integer >= %d, got %s', key, min, tostring(v))
  end
  return v
end

local function check_type(fname, opts, key, want)
  local v = opts[key]
  if v ~= nil and type(v) ~= want then fail(fname, '%s must be a %s, got a %s', key, want, type(v)) end
  return v
end

local function join(dir, name)
  if name:sub(1, 1) == '/' then return name end
  return dir .. '/' .. name
end

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil and not C.is_dir(path)
end

---------------------------------------------------------------------------
-- C-backed datasets

local Dataset = {}

function Dataset.__len(self) return C.len(self._c) end

function Dataset.__tostring(self)
  return fmt('%s dataset of %d samples', self.kind, C.len(self._c))
end

-- dataset:get(i) -> {x = ..., y = ...}, one sample without a batch dim.
function Dataset:get(i) return C.get(self._c, i) end

-- dataset:batch(indices) -> {x = ..., y = ...}: the samples of a Lua list
-- of 1-based indices or of an integer tensor of 0-based ones, gathered in C.
function Dataset:batch(indices) return C.gather(self._c, indices) end

local function dataset(kind, c, fields)
  fields.kind, fields._c = kind, c
  return object(Dataset, fields)
end

-- The rows [first, first + count) of each tensor of fields (count nil: to the end).
local function slice_rows(fname, fields, first, count)
  local n = fields[next(fields)]:size(1)
  if first > n + 1 or (count and first - 1 + count > n) then
    fail(fname, 'first=%d count=%s is past the %d samples', first, tostring(count), n)
  end
  count = count or n - first + 1
  if first == 1 and count == n then return fields end
  local out = {}
  for k, t in pairs(fields) do out[k] = t:narrow(1, first, count):contiguous() end
  return out
end

local function rows_dataset(kind, fields)
  local names, tensors = {}, {}
  for k in pairs(fields) do names[#names + 1] = k end
  table.sort(names)
  for i, k in ipairs(names) do tensors[i] = fields[k] end
  local c = try('ds.data.' .. kind, C.rows, names, tensors)
  local f = {}
  for k, t in pairs(fields) do f[k] = t end
  return dataset(kind, c, f)
end

-- Pixels u8 -> f32 in [0, 1], then (x - mean) / std per channel when asked;
-- in place, so a dataset takes its f32 copy once, not once per step.
local function to_unit(u8, mean, std)
  local x = u8:to('f32'):div_(255)
  if not mean then return x end
  local c = x:size(2)
  local m = core.tensor(type(mean) == 'table' and mean or { mean }):reshape({ 1, type(mean) == 'table' and c or 1, 1, 1 })
  local s = core.tensor(type(std) == 'table' and std or { std }):reshape({ 1, type(std) == 'table' and c or 1, 1, 1 })
  return x:sub_(m):div_(s)
end

local function normalisation(fname, v, mean, std)
  if v == nil or v == false then return nil end
  if v == true then return mean, std end
  if type(v) == 'table' and v.mean and v.std then return v.mean, v.std end
  fail(fname, 'normalize must be true, false or {mean = ..., std = ...}, got %s', tostring(v))
end

local MNIST_OPTS = { 'path', 'split', 'images', 'labels', 'first', 'count', 'normalize' }

-- ds.data.mnist{path = dir or file prefix, split = 'train' | 'test',
-- images = file, labels = file, first = 1, count = all, normalize = false}:
-- x f32 [N,1,28,28] in [0,1] (normalize = true: (x - 0.1307) / 0.3081, or
-- {mean=, std=}), y i64 [N]. In a folder the files are
-- <train|t10k>-<images-idx3|labels-idx1>-ubyte[.gz]; split defaults to
-- 'train' when its files are there, else 'test'. first/count pick a range
-- of samples (first 1-based).
function M.mnist(opts)
  local fname = 'ds.data.mnist'
  check_opts(fname, opts, MNIST_OPTS)
  local path = check_type(fname, opts, 'path', 'string')
  local split = check_type(fname, opts, 'split', 'string')
  if split and split ~= 'train' and split ~= 'test' then
    fail(fname, "split must be 'train' or 'test', got '%s'", split)
  end
  local first = check_int(fname, opts, 'first', 1, 1)
  local count = check_int(fname, opts, 'count', nil, 0)
  local function pick(base)
    if exists(base .. '.gz') then return base .. '.gz' end
    if exists(base) then return base end
  end
  local function file(explicit, what)
    if explicit then return path and C.is_dir(path) and join(path, explicit) or explicit end
    if not path then fail(fname, 'needs path (a folder or a file prefix) or images and labels') end
    if not C.is_dir(path) then
      local base = path .. '-' .. what
      return pick(base) or base .. '.gz'
    end
    if not split then
      split = pick(join(path, 'train-images-idx3-ubyte')) and 'train'
              or pick(join(path, 't10k-images-idx3-ubyte')) and 'test' or 'train'
    end
    local base = join(path, (split == 'train' and 'train' or 't10k') .. '-' .. what)
    return pick(base) or base .. '.gz'
  end
  local images = file(opts.images, 'images-idx3-ubyte')
  local labels = file(opts.labels, 'labels-idx1-ubyte')
  local mean, std = normalisation(fname, opts.normalize, 0.1307, 0.3081)
  -- the counts the headers declare agree before either file's data is read
  local n_images, n_labels = try(fname, C.idx_items, images, 3), try(fname, C.idx_items, labels, 1)
  if n_images ~= n_labels then
    fail(fname, '%s has %d images, %s has %d labels', images, n_images, labels, n_labels)
  end
  local px = try(fname, C.read_idx, images, 3, first - 1, count or -1)
  local lab = try(fname, C.read_idx, labels, 1, first - 1, count or -1)
  local n, h, w = px:size(1), px:size(2), px:size(3)
  -- MNIST's declared ranges, checked here rather than deep in a model
  if n_images == 0 then fail(fname, '%s holds 0 images', images) end
  if h < 1 or w < 1 then fail(fname, '%s: images are %dx%d', images, h, w) end
  if n > 0 and lab:amax():item() > 9 then
    local at = lab:gt(9):to('i32'):argmax():item()        -- the first label past 9, 0-based in the slice
    fail(fname, '%s: label %d at item %d (byte offset %d), expected 0-9', labels, lab:narrow(1, at + 1, 1):item(),
         first + at, 8 + first - 1 + at)
  end
  local d = rows_dataset('mnist', {
    x = to_unit(px:reshape({ n, 1, h, w }), mean, std),
    y = lab:to('i64'),
  })
  d.files = { images = images, labels = labels }
  return d
end

local CIFAR_OPTS = { 'path', 'files', 'split', 'first', 'count', 'normalize' }

-- ds.data.cifar10{path = folder | files = {...}, split = 'train' | 'test',
-- first, count, normalize}: x f32 [N,3,32,32] in [0,1] (normalize = true:
-- per channel with CIFAR-10's mean and std), y i64 [N]. A folder holds
-- data_batch_1..5.bin (train) and test_batch.bin (test), maybe .gz, maybe
-- inside cifar-10-batches-bin/.
function M.cifar10(opts)
  local fname = 'ds.data.cifar10'
  check_opts(fname, opts, CIFAR_OPTS)
  local path = check_type(fname, opts, 'path', 'string')
  local files = check_type(fname, opts, 'files', 'table')
  local split = check_type(fname, opts, 'split', 'string')
  if split and split ~= 'train' and split ~= 'test' then
    fail(fname, "split must be 'train' or 'test', got '%s'", split)
  end
  local first = check_int(fname, opts, 'first', 1, 1)
  local count = check_int(fname, opts, 'count', nil, 0)
  if not files then
    if not path then fail(fname, 'needs path (a folder) or files (a list of batch files)') end
    if not C.is_dir(path) then
      files = { path }
    else
      if C.is_dir(join(path, 'cifar-10-batches-bin')) then path = join(path, 'cifar-10-batches-bin') end
      local function find(name)
        if exists(join(path, name)) then return join(path, name) end
        if exists(join(path, name .. '.gz')) then return join(path, name .. '.gz') end
      end
      split = split or (find('data_batch_1.bin') and 'train' or find('test_batch.bin') and 'test' or 'train')
      local names = split == 'train' and { 'data_batch_1.bin', 'data_batch_2.bin', 'data_batch_3.bin',
                                           'data_batch_4.bin', 'data_batch_5.bin' } or { 'test_batch.bin' }
      files = {}
      for i, name in ipairs(names) do files[i] = find(name) or join(path, name) end
    end
  elseif path then
    local full = {}
    for i, f in ipairs(files) do full[i] = join(path, f) end
    files = full
  end
  local mean, std = normalisation(fname, opts.normalize, { 0.4914, 0.4822, 0.4465 }, { 0.2470, 0.2435, 0.2616 })
  local px, lab = try(fname, C.read_cifar10, files)
  local fields = slice_rows(fname, { x = px, y = lab }, first, count)
  local d = rows_dataset('cifar10', { x = to_unit(fields.x, mean, std), y = fields.y })
  d.files = files
  return d
end

-- ds.data.tensors{x = tensor, y = tensor, ...}: sample i is row i of each
-- (the same leading size). Fields are kept as given: dataset.x, dataset.y.
function M.tensors(fields)
  local fname = 'ds.data.tensors'
  if type(fields) ~= 'table' or next(fields) == nil then fail(fname, 'expected a table of named tensors') end
  for k, t in pairs(fields) do
    if type(k) ~= 'string' then fail(fname, 'field names must be strings, got %s', tostring(k)) end
    if not core.is_tensor(t) then fail(fname, "field '%s' is a %s, expected a tensor", k, type(t)) end
  end
  return rows_dataset('tensors', fields)
end

---------------------------------------------------------------------------
-- Token datasets: windows of block_size tokens and their next tokens

local function vocab_list(s)
  local v = {}
  for i = 1, #s do v[i] = s:sub(i, i) end
  return v
end

-- dataset:encode(str) -> i64 tensor of token ids (0-based).
function Dataset:encode(str)
  if not self._vocab then fail('encode', 'a %s dataset has no vocabulary', self.kind) end
  if type(str) ~= 'string' then fail('encode', 'expected a string, got a %s', type(str)) end
  return C.encode(str, self._vocab)
end

-- dataset:decode(ids) -> string; ids a tensor (on any device) or a list
-- of 0-based ids.
function Dataset:decode(ids)
  if not self._vocab then fail('decode', 'a %s dataset has no vocabulary', self.kind) end
  if core.is_tensor(ids) then
    if ids:device() ~= 'cpu' then ids = ids:to('cpu') end
    return C.decode(ids, self._vocab)
  end
  if type(ids) ~= 'table' then fail('decode', 'expected a tensor or a list of token ids, got a %s', type(ids)) end
  local out = {}
  for i, id in ipairs(ids) do
    local c = self.vocab[(tonumber(id) or -1) + 1]
    if not c or id ~= math.floor(id) then
      fail('decode', 'token %s at position %d is outside the vocabulary [0, %d)', tostring(id), i, #self.vocab)
    end
    out[i] = c
  end
  return table.concat(out)
end

-- block_size (required) and stride (default_stride, else block_size) of
-- the windowed datasets, text and shards.
local function check_window(fname, opts, default_stride)
  local T = check_int(fname, opts, 'block_size', nil, 1)
  if not T then fail(fname, 'needs block_size (the context length)') end
  return T, check_int(fname, opts, 'stride', default_stride or T, 1)
end

-- Where a dataset's source comes from: exactly one of keys a and b (of
-- their types), both values returned.
local function one_of(fname, opts, a, a_type, a_is, b, b_type, b_is)
  local x, y = check_type(fname, opts, a, a_type), check_type(fname, opts, b, b_type)
  if (x == nil) == (y == nil) then fail(fname, 'needs exactly one of %s (%s) and %s (%s)', a, a_is, b, b_is) end
  return x, y
end

local TEXT_OPTS = { 'path', 'text', 'block_size', 'stride', 'vocab' }

-- ds.data.text{path = file | text = string, block_size = T, stride = 1,
-- vocab = another dataset's vocab}: character level (the vocabulary is the
-- sorted distinct bytes, as nanoGPT's char example). Sample i (1-based) is
-- x = tokens[s .. s+T-1], y = tokens[s+1 .. s+T] (i64) with s = (i-1)*stride.
-- dataset.vocab (list of chars), vocab_size, tokens, encode, decode.
function M.text(opts)
  local fname = 'ds.data.text'
  check_opts(fname, opts, TEXT_OPTS)
  local path, text = one_of(fname, opts, 'path', 'string', 'a file', 'text', 'string', 'a string')
  local T, stride = check_window(fname, opts, 1)
  if path then text = try(fname, C.read_file, path) end
  local source = path or 'the text'
  if #text < T + 1 then
    fail(fname, 'block_size %d is larger than %s: %d characters, a sample needs block_size + 1 = %d', T, source,
         #text, T + 1)
  end
  local tokens, vocab
  if opts.vocab then
    vocab = type(opts.vocab) == 'table' and table.concat(opts.vocab) or opts.vocab
    if type(vocab) ~= 'string' then fail(fname, 'vocab must be a list of characters or a string') end
    tokens = try(fname, C.encode, text, vocab)
  else
    tokens, vocab = C.char_tokens(text)
  end
  local c = try(fname, C.windows, tokens, { #text }, T, stride)
  return dataset('text', c, {
    tokens = tokens, block_size = T, stride = stride, path = path,
    vocab = vocab_list(vocab), vocab_size = #vocab, _vocab = vocab,
  })
end

local SHARD_OPTS = { 'paths', 'pattern', 'block_size', 'stride', 'vocab_size' }

-- ds.data.shards{paths = {...} | pattern = 'dir/*_train_*.bin', block_size = T,
-- stride = T, vocab_size = V}: llm.c token shards (256 int32 header: magic
-- 20240520, version 1, token count; then uint16 tokens), memory-mapped: a
-- batch's windows are read from the files in the loader's threads, so the
-- corpus costs no anonymous memory, whatever its size. Windows stay inside
-- a shard; stride defaults to block_size (non-overlapping sequences, as
-- llm.c reads them). Every shard must hold a window (block_size + 1
-- tokens); with vocab_size every token must be below it (GPT-2: 50257),
-- checked by reading each shard once. dataset.lengths, dataset.paths.
function M.shards(opts)
  local fname = 'ds.data.shards'
  check_opts(fname, opts, SHARD_OPTS)
  local paths, pattern = one_of(fname, opts, 'paths', 'table', 'a list', 'pattern', 'string', 'a glob')
  local T, stride = check_window(fname, opts)
  if pattern then
    paths = C.glob(pattern)
    if #paths == 0 then fail(fname, "no file matches '%s'", pattern) end
  elseif #paths == 0 then
    fail(fname, 'paths is an empty list')
  end
  local vocab = check_int(fname, opts, 'vocab_size', nil, 1)
  local c, lengths = try(fname, C.shards, paths, T, stride, vocab or 0)
  return dataset('shards', c, { lengths = lengths, paths = paths, block_size = T, stride = stride })
end

-- ds.data.permutation(n, seed) -> i64 tensor: a permutation of [0, n) that
-- depends only on (n, seed) (a Feistel network of Philox rounds), the
-- order the loader shuffles by, there read position by position.
function M.permutation(n, seed) return C.permutation(n, seed) end

local ORDER_MT = getmetatable(C.order(0, false, {}))

-- ds.data.is_order(v) -> whether v is an order (ds.data.order).
function M.is_order(v) return getmetatable(v) == ORDER_MT end

-- ds.data.order(n [, {seed =, runs =, window =}]) -> an epoch's order held
-- as its description, 0-based indices of [0, n) computed where read:
-- position k is the k-th run position p, taken mod span (a sampler's
-- padding) plus first, through ds.data.permutation(n, seed)'s bijection
-- with a seed, else that position itself. runs: {{start, stride, block,
-- count}, ...}, positions start + j * stride + i for j < count, i < block
-- (default: 0 .. span-1). window: {first, span}, the positions [first,
-- first + span) of [0, n) the runs index (default {0, n}; the rest of an
-- epoch resumed on other ranks is a window). #order, order:at(k),
-- order:cut(runs) (the same permutation and window over other runs),
-- order:domain() (n), order:totable(), order:tensor() (i64),
-- order:describe() (these options and n: ds.data.order(d.n, d) is the same
-- order; what a checkpoint keeps of a plan).
function M.order(n, opts)
  opts = opts or {}
  local w = opts.window
  if w ~= nil and (type(w) ~= 'table' or #w ~= 2) then
    fail('ds.data.order', 'window must be {first, span}, got %s', type(w) == 'table' and #w .. ' numbers' or type(w))
  end
  local first, span = w and w[1] or 0, w and w[2] or n
  return C.order(n, opts.seed or false, opts.runs or { { 0, 1, 1, span } }, first, span)
end

---------------------------------------------------------------------------
-- The loader

local function dataset_len(d)
  if type(d) == 'userdata' then return #d end
  if type(d.len) == 'function' then return d:len() end
  return #d
end

-- ds.data.len(dataset) -> its number of samples, as the loader counts them.
M.len = dataset_len

local function dataset_get(d, i)
  if d.get then return d:get(i) end
  return d[i]
end

-- Stacks samples into a batch: tensors stack along a new first dim,
-- numbers become a tensor (i64 when all are integers), tables collate
-- field by field.
local function default_collate(samples)
  local first = samples[1]
  if core.is_tensor(first) then return core.stack(samples) end
  if type(first) == 'number' then
    local integral = true
    for _, v in ipairs(samples) do integral = integral and v == math.floor(v) end
    return core.tensor(samples, integral and 'i64' or 'f32')
  end
  if type(first) == 'table' then
    local out = {}
    for k in pairs(first) do
      local col = {}
      for i, s in ipairs(samples) do col[i] = s[k] end
      out[k] = default_collate(col)
    end
    return out
  end
  error(fmt('ds.data.loader: cannot collate samples of type %s; pass collate_fn', type(first)), 0)
end

local Loader = {}

local LOADER_OPTS = { 'batch_size', 'shuffle', 'seed', 'drop_last', 'collate_fn', 'num_workers', 'prefetch_factor',
                      'sampler', 'device' }

local function count_of(indices)
  if core.is_tensor(indices) then return indices:numel() end
  return #indices          -- a list or an order
end

-- The samples an epoch visits: the sampler's count, else the dataset's.
local function epoch_len(self)
  local s = self.sampler
  if not s then return dataset_len(self.dataset) end
  if type(s.len) == 'function' then return s:len() end
  return count_of(s:indices(self.current_epoch or 1))
end

-- #loader: batches per epoch.
function Loader.__len(self)
  local n, b = epoch_len(self), self.batch_size
  if self.drop_last then return math.floor(n / b) end
  return math.ceil(n / b)
end

function Loader.__tostring(self)
  return fmt('loader: %d batches of %d%s, %d workers%s', #self, self.batch_size, self.shuffle and ', shuffled' or '',
             self.num_workers, self.device ~= 'cpu' and ', on ' .. self.device or '')
end

-- A batch (a tensor, or a table of them as collate functions make) on device.
local function to_device(batch, device)
  if core.is_tensor(batch) then return batch:to(device) end
  if type(batch) ~= 'table' then return batch end
  local out = {}
  for k, v in pairs(batch) do out[k] = core.is_tensor(v) and v:to(device) or v end
  return out
end

-- loader:set_batch_size(n): later batches have n samples, from the next
-- one on (batches already prefetched at the old size are dropped and
-- gathered again).
function Loader:set_batch_size(n)
  if type(n) ~= 'number' or n ~= math.floor(n) or n < 1 then
    fail('loader:set_batch_size', 'batch size must be an integer >= 1, got %s', tostring(n))
  end
  self.batch_size = n
end

-- Uses the C gatherer (and the workers) for C-backed datasets without a
-- collate_fn; collate_fn runs on the main thread.
function Loader:gathers_in_c()
  return type(self.dataset) == 'userdata' and self.dataset._c ~= nil and self.collate_fn == nil
end

-- loader:close(): stops the worker threads now (they stop at collection
-- otherwise); a later epoch starts them again.
function Loader:close()
  if self._c then C.close(self._c) end
  self._c = nil
end

-- loader:epoch(e) -> iterator of (step, batch); step counts from 1 in the
-- epoch. Shuffled by ds.data.permutation(#dataset, seed + e), read as
-- ds.data.order (nothing per sample held). e defaults to the epoch after
-- the last one started (the first is 1). With a sampler, sampler:set_epoch(e)
-- then sampler:order(e) where it has one, else sampler:indices(e), give the
-- epoch's order.
function Loader:epoch(e)
  e = e or (self.current_epoch or 0) + 1
  if type(e) ~= 'number' or e ~= math.floor(e) or e < 0 then
    fail('loader:epoch', 'epoch must be a non-negative integer, got %s', tostring(e))
  end
  self.current_epoch = e
  self._generation = self._generation + 1
  local generation = self._generation
  local d = self.dataset
  local n, order
  if self.sampler then
    local s = self.sampler
    s:set_epoch(e)
    if type(s.order) == 'function' then order = s:order(e) else order = s:indices(e) end
    if type(order) ~= 'table' and not core.is_tensor(order) and not M.is_order(order) then
      fail('loader:epoch', 'sampler:indices must return a list or a tensor of 0-based indices, got a %s', type(order))
    end
    n = count_of(order)
    if n == 0 then
      order = nil
    elseif type(order) == 'table' and self:gathers_in_c() then
      order = core.tensor(order, 'i64')
    end
  else
    n = dataset_len(d)
    order = self.shuffle and n > 0 and M.order(n, { seed = self.seed + e }) or nil
  end
  local pos, submitted, step, submit_size = 0, 0, 0, self.batch_size
  -- a checkpoint's position (loader:resume) starts this epoch where it was,
  -- in the order it gives (the rest of an epoch resumed on other ranks)
  local resume = self._resume
  self._resume = nil
  local own
  if resume and resume.epoch == e then
    pos, submitted, step, own = resume.samples, resume.samples, resume.step, resume.order
    if own then
      order, n = own, #own
      if n > 0 and type(own) == 'table' and self:gathers_in_c() then order = core.tensor(own, 'i64') end
    end
  end
  local at = { epoch = e, step = step, samples = pos, order = own }
  self.position = at
  local cd, ring, at_pos

  if self:gathers_in_c() then
    cd = d._c
    if not self._c then
      -- on a device the batch after the one handed out is on its way up,
      -- so at least two are in flight
      local least = self.device == 'cpu' and 1 or 2
      self._c = C.loader(cd, self.num_workers, math.max(least, self.num_workers * self.prefetch_factor), self.device)
    end
    ring = self._c
    C.drain(ring)            -- batches of an epoch left early
  elseif M.is_order(order) then
    at_pos = function(p) return order:at(p - 1) end
  elseif order then
    local list = core.is_tensor(order) and order:totable() or order
    at_pos = function(p) return list[p] end
  end

  -- the size of the batch starting at position p, or nil when none is left
  local function size_at(p, b)
    local left = n - p
    if left <= 0 or (self.drop_last and left < b) then return nil end
    return math.min(b, left)
  end

  return function()
    if generation ~= self._generation then
      error('loader: this epoch was superseded by a later loader:epoch() call', 2)
    end
    local b = size_at(pos, self.batch_size)
    if not b then return nil end
    local batch
    if ring then
      if submit_size ~= self.batch_size then      -- set_batch_size mid-epoch
        C.drain(ring)
        submitted, submit_size = pos, self.batch_size
      end
      local depth = C.depth(ring)
      while C.queued(ring) < depth do
        local s = size_at(submitted, submit_size)
        if not s then break end
        C.submit(ring, cd, order, submitted, s)
        submitted = submitted + s
      end
      batch = C.next(ring, cd)
    else
      local samples = {}
      for k = 1, b do samples[k] = dataset_get(d, at_pos and at_pos(pos + k) + 1 or pos + k) end
      batch = (self.collate_fn or default_collate)(samples)
      if self.device ~= 'cpu' then batch = to_device(batch, self.device) end
    end
    pos = pos + b
    step = step + 1
    at.step, at.samples = step, pos
    return step, batch
  end
end

-- loader.position: {epoch, step, samples [, order]} of the batches handed
-- out so far in the current epoch. loader:resume{epoch, step, samples [,
-- order]}: the next loader:epoch() (or loader:epoch(epoch)) starts there,
-- after `step` batches holding `samples` samples, reading that epoch in
-- `order` (0-based indices, a list or a ds.data.order) when given (a
-- checkpoint's load sets it; an epoch() of another epoch drops it).
function Loader:resume(at)
  if type(at) ~= 'table' then fail('loader:resume', 'expected {epoch, step, samples}, got a %s', type(at)) end
  for _, k in ipairs({ 'epoch', 'step', 'samples' }) do
    local v = at[k]
    if type(v) ~= 'number' or v ~= math.floor(v) or v < 0 then
      fail('loader:resume', '%s must be a non-negative integer, got %s', k, tostring(v))
    end
  end
  local n = dataset_len(self.dataset)
  if M.is_order(at.order) then
    if #at.order > 0 and at.order:domain() > n then
      fail('loader:resume', 'order is an order of [0, %d), the dataset has %d', at.order:domain(), n)
    end
  elseif at.order ~= nil then
    if type(at.order) ~= 'table' then
      fail('loader:resume', 'order must be a list of 0-based indices or an order, got a %s', type(at.order))
    end
    for i, v in ipairs(at.order) do
      if type(v) ~= 'number' or v ~= math.floor(v) or v < 0 or v >= n then
        fail('loader:resume', 'order[%d] = %s is not an index of the dataset [0, %d)', i, tostring(v), n)
      end
    end
  end
  self._resume = { epoch = at.epoch, step = at.step, samples = at.samples, order = at.order }
  self.current_epoch = at.epoch - 1
end

-- ds.data.loader(dataset, {batch_size = 1, shuffle = true, seed = 0,
-- drop_last = false, collate_fn = nil, num_workers = 0, prefetch_factor = 2,
-- sampler = nil, device = 'cpu'})
-- sampler: an object with sampler:indices(epoch) -> the epoch's 0-based
-- dataset indices (a list, a 1-D integer tensor or a ds.data.order),
-- sampler:set_epoch(e), called before every epoch, and optionally
-- sampler:len() and sampler:order(epoch) (read instead of indices: a
-- ds.data.order, what a large epoch is best given as); it replaces
-- shuffle (as in PyTorch, shuffle = true with a sampler is an error).
-- num_workers > 0: that many C threads gather C-backed datasets' batches
-- ahead, up to num_workers * prefetch_factor batches in flight. The
-- batches are the same with or without workers.
-- device (engine.device, ds.device(); 'cpu' by default): the batches'
-- tensors are on it. For a GPU, C-backed datasets gather into page-locked
-- memory and each batch's copy starts when the batch before it is handed
-- out, on a stream of its own, so it overlaps that batch's step; other
-- datasets' batches are copied when handed out.
function M.loader(d, opts)
  local fname = 'ds.data.loader'
  opts = opts or {}
  check_opts(fname, opts, LOADER_OPTS)
  if type(d) ~= 'userdata' and type(d) ~= 'table' then fail(fname, 'expected a dataset, got a %s', type(d)) end
  if type(d) == 'table' and not d.get and d[1] == nil and type(d.len) ~= 'function' then
    fail(fname, 'expected a dataset (get and a length) or a list of samples')
  end
  local shuffle = opts.shuffle
  if shuffle == nil then shuffle = opts.sampler == nil end
  check_type(fname, opts, 'shuffle', 'boolean')
  local sampler = opts.sampler
  if sampler ~= nil then
    if (type(sampler) ~= 'table' and type(sampler) ~= 'userdata') or type(sampler.indices) ~= 'function'
       or type(sampler.set_epoch) ~= 'function' then
      fail(fname, 'sampler must be an object with indices(epoch) and set_epoch(epoch) methods, got a %s', type(sampler))
    end
    if shuffle then fail(fname, 'sampler option is mutually exclusive with shuffle') end
  end
  check_type(fname, opts, 'drop_last', 'boolean')
  check_type(fname, opts, 'collate_fn', 'function')
  local device = check_type(fname, opts, 'device', 'string')
  if device then device = try(fname, C.device, device) end
  return object(Loader, {
    dataset = d,
    batch_size = check_int(fname, opts, 'batch_size', 1, 1),
    shuffle = shuffle,
    seed = check_int(fname, opts, 'seed', 0, 0),
    drop_last = opts.drop_last or false,
    collate_fn = opts.collate_fn,
    sampler = sampler,
    num_workers = check_int(fname, opts, 'num_workers', 0, 0),
    prefetch_factor = check_int(fname, opts, 'prefetch_factor', 2, 1),
    device = device or 'cpu',
    _generation = 0,
  })
end

return M
