-- Sequence parallelism as DeepSpeed-Ulysses: the P ranks of a sequence
-- group each hold 1/P of every sequence; around attention an all-to-all
-- turns this rank's tokens of every head [B, T/P, H] into every token of
-- its heads [B, T, H/P], attention runs on whole sequences, and the
-- reverse all-to-all brings the output back to the rank's tokens.
--
--   local sp = ds.sequence.new(P)      -- or new(topology): every rank calls it
--   sp:chunk(ids)                      -- this rank's tokens [B, T/P] of ids [B, T]
--   sp:seq_to_heads(x)                 -- [B, T/P, A, H, D] -> [B, T, A, H/P, D], autograd
--   sp:heads_to_seq(y)                 -- the reverse
--   sp:cross_entropy(logits, targets)  -- the mean over the whole sequences
--
-- Ranks are laid out by ds.topology (with pipe and tensor degrees 1, as
-- DeepSpeed's: a sequence group is P consecutive ranks). Each sequence
-- group reads one batch; gradients are averaged over data x sequence,
-- which the loss accounts for.
local ds = require 'dslua'
local C = require 'dslua.core'

local M = {}

-- The names the comms logger gives the sequence group's collectives.
M.LOG = { all_to_all = 'sequence_all_to_all', all_reduce = 'sequence_all_reduce' }

local Seq = {}
Seq.__index = Seq

local function shape_str(t) return '[' .. table.concat(t:size(), 'x') .. ']' end

-- new(P | topology) -> this rank's sequence layout: size P, rank (in its
-- group), group, and the data index it reads (dp_rank of dp_size), over a
-- topology of sequence degree P (ds.topology{sequence = P}, made from P
-- here, so every rank calls it).
function M.new(spec)
  local topo = spec
  if type(spec) ~= 'table' then
    if type(spec) ~= 'number' or spec < 1 or spec % 1 ~= 0 then
      error('sequence_parallel must be a positive integer, got ' .. tostring(spec), 2)
    end
    local ok, t = pcall(ds.topology, { sequence = spec })
    if not ok then error('sequence_parallel ' .. spec .. ': ' .. tostring(t):gsub('^[^\n]-:%d+: ', ''), 2) end
    topo = t
  end
  local c = topo:coord()
  return setmetatable({
    size = topo:get_dim('sequence'), rank = c.sequence, group = topo:group('sequence'), topology = topo,
    dp_size = topo:get_dim('data'), dp_rank = c.data, dp_group = topo:group { 'data', 'sequence' },
    dp_root = topo:get_rank { pipe = c.pipe, tensor = c.tensor },
  }, Seq)
end

-- M.new(P) set on model: model.seq, the layout of each attention module of
-- attns, and the fields the engine reads (dslua/engine/init.lua): the batch
-- split over dp_size data indices, gradients reduced over dp_group (data x
-- sequence), the weights broadcast from dp_root.
function M.apply(model, P, attns)
  if P == 1 then return end
  local sp = M.new(P)
  for _, k in ipairs({ 'dp_size', 'dp_rank', 'dp_group', 'dp_root' }) do rawset(model, k, sp[k]) end
  rawset(model, 'sequence_parallel', P)
  rawset(model, 'seq', sp)
  for _, a in ipairs(attns) do rawset(a, 'sequence', sp) end
end

-- Errors when a model's config (who: the model) asks for sequence_parallel
-- with tensor parallelism (tp, or a topology of its own): the two do not
-- combine in one model.
function M.alone(who, cfg)
  if cfg.sequence_parallel > 1 and (cfg.tp > 1 or cfg.topology) then
    error(string.format('%s: sequence_parallel %d cannot combine with tensor parallelism (tp %d%s)', who,
                        cfg.sequence_parallel, cfg.tp, cfg.topology and ', a topology' or ''), 0)
  end
end

-- Errors unless sequences of T tokens split over the group (who: the model).
function Seq:check(T, who)
  if T % self.size ~= 0 then
    error(string.format('%s: sequence length %d is not divisible by sequence_parallel %d', who, T, self.size), 0)
  end
end

-- This rank's chunk of the sequences of t [B, T, ...].
function Seq:chunk(t)
  if self.size == 1 then return t end
  local Tl = t:size(2) / self.size
  return t:narrow(2, self.rank * Tl + 1, Tl):contiguous()
end

-- the token offset of this rank's chunk in sequences of T tokens
function Seq:offset(T) return self.rank * (T / self.size) end

---------------------------------------------------------------- the all-to-alls

-- [B, Tl, A, H, D] -> [B, P * Tl, A, H / P, D]: head group j goes to rank
-- j, rank j's tokens come back in place j.
local function to_heads(x, group, P)
  local B, Tl, A, H, D = x:size(1), x:size(2), x:size(3), x:size(4), x:size(5)
  local send = x:reshape({ B, Tl, A, P, H / P, D }):permute(4, 1, 2, 3, 5, 6):contiguous()
  local got = ds.comm.all_to_all(send, { group = group, log_name = M.LOG.all_to_all })
  return got:permute(2, 1, 3, 4, 5, 6):contiguous():view({ B, P * Tl, A, H / P, D })
end

-- [B, P * Tl, A, Hl, D] -> [B, Tl, A, P * Hl, D]: to_heads reversed.
local function to_seq(y, group, P)
  local B, T, A, Hl, D = y:size(1), y:size(2), y:size(3), y:size(4), y:size(5)
  local send = y:reshape({ B, P, T / P, A, Hl, D }):permute(2, 1, 3, 4, 5, 6):contiguous()
  local got = ds.comm.all_to_all(send, { group = group, log_name = M.LOG.all_to_all })
  return got:permute(2, 3, 4, 1, 5, 6):contiguous():view({ B, T / P, A, P * Hl, D })
end

-- fwd(x) with a backward of back(grad): an all-to-all and its reverse.
-- x [B, T, A, H, D] must split on dim (T or H) over the group.
local function exchange(self, x, fwd, back, what, dim)
  if not ds.is_tensor(x) or x:dim() ~= 5 or x:size(dim) % self.size ~= 0 then
    error(string.format('%s: expected a tensor [B, T, A, H, D] with %s divisible by sequence_parallel %d, got %s',
                        what, dim == 2 and 'T' or 'H', self.size, ds.is_tensor(x) and shape_str(x) or type(x)), 3)
  end
  if self.size == 1 then return x end
  local group, P = self.group, self.size
  local y = ds.no_grad(fwd, x, group, P)
  return C.function_node(y, function(g) return back(g, group, P) end, x)
end

function Seq:seq_to_heads(x) return exchange(self, x, to_heads, to_seq, 'seq_to_heads', 4) end
function Seq:heads_to_seq(y) return exchange(self, y, to_seq, to_heads, 'heads_to_seq', 2) end

---------------------------------------------------------------- the loss

-- The sum of x over the group, on every rank; its backward multiplies by
-- P: each rank's copy of the loss stands for the whole sequence, and the
-- engine averages gradients over data x sequence, so P copies count once.
function Seq:sum(x)
  if self.size == 1 then return x end
  local y = ds.no_grad(function()
    return ds.comm.all_reduce(x:clone(), 'sum', { group = self.group, log_name = M.LOG.all_reduce })
  end)
  local P = self.size
  return C.function_node(y, function(g) return g * P end, x)
end

-- The mean cross-entropy over the whole sequences of logits, this rank's
-- chunk [B, T/P, V] of them, and targets [B, T] (every token's, so the
-- count of those not ignored is known without a collective): the sum over
-- the chunk's tokens divided by that count, summed over the group.
-- opts as ds.cross_entropy's (ignore_index, classes).
function Seq:cross_entropy(logits, targets, opts)
  if self.size == 1 then return ds.cross_entropy(logits, targets, opts) end
  local o = { reduction = 'sum' }
  for k, v in pairs(opts or {}) do o[k] = v end
  local ignore = o.ignore_index or -100
  local count = ds.no_grad(function() return targets:ne(ignore):to('f64'):sum():item() end)
  local part = ds.cross_entropy(logits, self:chunk(targets), o) / math.max(count, 1)
  return self:sum(part)
end

return M
