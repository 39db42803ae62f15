-- PyTorch's torch.utils.data.distributed.DistributedSampler: each of
-- num_replicas ranks reads its own share of the dataset, the shares of one
-- epoch together covering it once (plus padding).
--
--   local DS = require 'samplers.distributed'
--   local sampler = DS(dataset, { num_replicas = 4, rank = 1, shuffle = true, seed = 0, drop_last = false })
--   local loader = ds.data.loader(dataset, { batch_size = 8, sampler = sampler })   -- set_epoch(e) every epoch
--
-- As in PyTorch: num_replicas and rank default to ds.comm's world size and
-- rank; with shuffle the epoch's order is a permutation seeded by
-- seed + epoch, else 0 .. n-1; without drop_last the order is padded to a
-- multiple of num_replicas by repeating it from the start, with drop_last
-- its tail is cut to one; rank r takes positions r, r + N, r + 2N, ...
-- The one difference: the permutation is ds.data.permutation(n, seed +
-- epoch) (Philox), not torch.randperm under torch.Generator, whose stream
-- dslua does not reproduce; it is the order ds.data.loader's own shuffle
-- gives for that seed, so one rank with shuffle and N ranks with this
-- sampler read the same samples per global batch.
local ds = require 'dslua'

local M = {}

local Sampler = {}
Sampler.__index = Sampler

local function fail(msg, ...) error('DistributedSampler: ' .. string.format(msg, ...), 3) end

local function integer(v, name, min)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < min then
    fail('%s must be an integer >= %d, got %s', name, min, tostring(v))
  end
  return v
end

local KNOWN = { num_replicas = true, rank = true, shuffle = true, seed = true, drop_last = true }

-- DistributedSampler(dataset_or_length [, opts])
function M.new(dataset, opts)
  opts = opts or {}
  if type(opts) ~= 'table' then fail('options must be a table, got a %s', type(opts)) end
  for k in pairs(opts) do
    if not KNOWN[k] then fail("unknown option '%s' (num_replicas, rank, shuffle, seed, drop_last)", tostring(k)) end
  end
  local n
  if type(dataset) == 'number' then
    n = integer(dataset, 'the dataset length', 0)
  elseif type(dataset) == 'table' or type(dataset) == 'userdata' then
    n = type(dataset.len) == 'function' and dataset:len() or #dataset
  else
    fail('expected a dataset or its length, got a %s', type(dataset))
  end
  local replicas = integer(opts.num_replicas or ds.comm.world_size(), 'num_replicas', 1)
  local rank = opts.rank or ds.comm.rank()
  if type(rank) ~= 'number' or rank ~= math.floor(rank) or rank < 0 or rank >= replicas then
    fail('Invalid rank %s, rank should be in the interval [0, %d]', tostring(rank), replicas - 1)
  end
  local shuffle = opts.shuffle
  if shuffle == nil then shuffle = true end
  local drop_last = opts.drop_last or false
  local num_samples
  if drop_last and n % replicas ~= 0 then
    num_samples = math.ceil((n - replicas) / replicas)
  else
    num_samples = math.ceil(n / replicas)
  end
  if num_samples <= 0 then num_samples = 0 end     -- Python's ceil of (n - N) / N < 0 is 0, not -0
  return setmetatable({
    dataset_len = n, num_replicas = replicas, rank = rank, shuffle = shuffle and true or false,
    seed = integer(opts.seed or 0, 'seed', 0), drop_last = drop_last and true or false, epoch = 0,
    num_samples = num_samples, total_size = num_samples * replicas,
  }, Sampler)
end

setmetatable(M, { __call = function(_, ...) return M.new(...) end })

function Sampler:set_epoch(epoch)
  self.epoch = integer(epoch, 'epoch', 0)
end

-- Samples per epoch on this rank (PyTorch's len(sampler)).
function Sampler:len() return self.num_samples end

-- order([epoch]) -> this rank's share of the epoch (default: the one
-- set_epoch set) as a ds.data.order, what the loader reads: position j is
-- the epoch order's position rank + j * N, mod n (the padding repeats the
-- order from its start). Nothing per sample is held.
function Sampler:order(epoch)
  epoch = epoch == nil and self.epoch or integer(epoch, 'epoch', 0)
  return ds.data.order(self.dataset_len, { seed = self.shuffle and self.seed + epoch or nil,
                                           runs = { { self.rank, self.num_replicas, 1, self.num_samples } } })
end

-- indices([epoch]) -> this rank's 0-based dataset indices, a Lua list.
function Sampler:indices(epoch) return self:order(epoch):totable() end

M.Sampler = Sampler
return M
