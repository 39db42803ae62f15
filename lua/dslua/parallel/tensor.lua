-- ds.nn.parallel: tensor parallelism as Megatron-LM builds it. A layer's
-- weight is split across the ranks of a tensor group (a ds.comm group,
-- ds.topology's group('tensor')); activations between the splits travel
-- through four autograd functions:
--
--   copy_to_region(x, g)       identity forward, all-reduce of the gradient backward
--   reduce_from_region(x, g)   all-reduce forward, identity backward
--   gather_from_region(x, g)   all-gather on the last dim forward, this rank's piece backward
--   scatter_to_region(x, g)    this rank's piece of the last dim forward, all-gather backward
--
-- The layers: ColumnParallelLinear (weight split on out; its input copied
-- into the region, its output split unless gathered), RowParallelLinear
-- (split on in; its output all-reduced, the bias added after), and
-- VocabParallelEmbedding (rows split by vocabulary: a masked lookup and an
-- all-reduce); vocab_parallel_cross_entropy takes logits split by
-- vocabulary, so no rank holds the full logits. A layer built on the full
-- shape draws the full weight (the same on every rank, from the same
-- generator state) and keeps its piece, so a model has the same weights on
-- any tensor degree; each constructor also takes a built layer to split.
--
-- Each split parameter records how (module field tp_split: {name = {axis,
-- stride}}); every other parameter is replicated across the tensor group.
-- params(model) lists both, for the gradient norm (a replicated parameter
-- counts once), checkpoints and full_state_dict.
local ds = require 'dslua'
local C = require 'dslua.core'
local base = require 'dslua.nn.module'
local fp8 = require 'dslua.nn.fp8'
local nn, fmt, options, Module = base.nn, base.fmt, base.options, base.Module

local M = {}

local is_module = base.is_module

local function size_of(g) return g and g:size() or 1 end
local function rank_of(g) return g and g:rank() or 0 end

-- The log names collectives of the tensor group go under in the comms logger.
M.LOG = { all_reduce = 'tensor_all_reduce', all_gather = 'tensor_all_gather' }

local function all_reduce(t, op, g)
  return ds.comm.all_reduce(t, op, { group = g, log_name = M.LOG.all_reduce })
end

local function all_gather_last(x, g)
  local parts = ds.comm.all_gather(x:contiguous(), { group = g, log_name = M.LOG.all_gather })
  return ds.cat(parts, x:dim())
end

local function piece_last(x, g)
  local n = x:size(x:dim()) / size_of(g)
  return x:narrow(x:dim(), rank_of(g) * n + 1, n):contiguous()
end

-- y = forward(x) recorded as one autograd node whose backward is
-- backward(grad_y) (no node when x needs no gradient or autograd is off).
local function node(x, forward, backward)
  local prev = C.set_grad_enabled(false)
  local ok, out = pcall(forward, x)
  C.set_grad_enabled(prev)
  if not ok then error(out, 0) end
  if not (prev and x.requires_grad) then return out end
  return C.function_node(out, backward, x)
end

function M.copy_to_region(x, g)
  if size_of(g) == 1 then return x end
  return node(x, function(t) return t:detach() end, function(grad) return all_reduce(grad:clone(), 'sum', g) end)
end

function M.reduce_from_region(x, g)
  if size_of(g) == 1 then return x end
  return node(x, function(t) return all_reduce(t:clone(), 'sum', g) end, function(grad) return grad end)
end

function M.gather_from_region(x, g)
  if size_of(g) == 1 then return x end
  return node(x, function(t) return all_gather_last(t, g) end, function(grad) return piece_last(grad, g) end)
end

function M.scatter_to_region(x, g)
  if size_of(g) == 1 then return x end
  return node(x, function(t) return piece_last(t, g) end, function(grad) return all_gather_last(grad, g) end)
end

---------------------------------------------------------------- splitting

-- The piece of rank r of n along axis of a full tensor t, with stride
-- parts: the axis is `stride` equal blocks (a fused q,k,v projection's
-- three), each cut in n, and the piece is block by block rank r's cut.
function M.piece(t, axis, r, n, stride)
  stride = stride or 1
  local len = t:size(axis)
  if len % (n * stride) ~= 0 then
    error(fmt('tensor parallel: dim %d of size %d does not split into %d x %d equal parts', axis, len, stride, n), 2)
  end
  local block, cut = len / stride, len / (n * stride)
  local parts = {}
  for s = 0, stride - 1 do parts[s + 1] = t:narrow(axis, s * block + r * cut + 1, cut) end
  return (#parts == 1 and parts[1] or ds.cat(parts, axis)):contiguous()
end

-- The full tensor from every rank's piece (a list, rank order): piece's inverse.
function M.join(pieces, axis, stride)
  stride = stride or 1
  local n = #pieces
  if stride == 1 then return ds.cat(pieces, axis) end
  local cut = pieces[1]:size(axis) / stride
  local parts = {}
  for s = 0, stride - 1 do
    for r = 1, n do parts[#parts + 1] = pieces[r]:narrow(axis, s * cut + 1, cut) end
  end
  return ds.cat(parts, axis)
end

-- param: this rank's piece of full, a new leaf that requires grad
local function shard(full, axis, g, stride)
  return ds.no_grad(function()
    return M.piece(full:detach(), axis, rank_of(g), size_of(g), stride):requires_grad_(true)
  end)
end

local function check_group(g, who)
  if g ~= nil and not C._comm.is_group(g) then
    error(fmt('%s: group must be a ds.comm group (ds.topology(...):group(\'tensor\')), got %s', who, type(g)), 4)
  end
  if g ~= nil and g:rank() < 0 then error(fmt('%s: this rank is not a member of the tensor group', who), 4) end
  return g
end

local function divides(n, g, who, what)
  if n % size_of(g) ~= 0 then
    error(fmt('%s: %s %d is not divisible by the tensor-parallel degree %d', who, what, n, size_of(g)), 4)
  end
end

---------------------------------------------------------------- layers

-- What of a parallel linear's fp8 casts is split over its tensor group
-- (the rest every rank holds whole): a column-parallel layer's weight and
-- output gradient (its columns), a row-parallel layer's weight and input
-- (its rows of the sum); the column's input (copied into the region) and
-- the row's output gradient (of the all-reduced output) are replicated.
local COLUMN_SPLIT = { weight = true, grad_output = true }
local ROW_SPLIT = { weight = true, input = true }

-- x w^T (+ b): in fp8 inside ds.fp8.autocast unless the layer says fp8 =
-- false, each split cast with one scale over the group
local function product(self, x, b, split)
  local r = fp8.active()
  if not (r and fp8.runs(self)) then return ds.linear(x, self.weight, b) end
  local g = self.group
  return fp8.linear(r, r:parallel_layer(self, g), x, self.weight, b, size_of(g) > 1 and g or nil, split)
end

-- a Linear marked fp8 = false (an lm_head) stays so once split
local function keep_fp8_mark(self, full)
  if rawget(full, 'fp8') == false then self.fp8 = false end
end

local ColumnParallelLinear = Module:extend('ColumnParallelLinear')
nn.ColumnParallelLinear = ColumnParallelLinear
M.ColumnParallelLinear = ColumnParallelLinear

-- ColumnParallelLinear(in, out [, {bias = true, gather_output = false,
-- group, stride = 1, copy_input = true, dtype, device}]): nn.Linear(in,
-- out)'s weight [out, in] drawn whole and split on out (weight [out / t,
-- in], bias [out / t]). ColumnParallelLinear(linear [, opts]) splits a
-- built nn.Linear. copy_input = false: the caller copies the input into
-- the region, once for several layers reading it (one all-reduce backward).
local COLUMN = { bias = true, gather_output = false, group = nn.NONE, stride = 1, copy_input = true,
                 dtype = 'f32', device = 'cpu' }

-- the whole layer (built by make from the options, or given: an
-- instance of cls) and the options
local function whole(who, defaults, make, cls, a, b, c)
  if is_module(a) then
    if getmetatable(a) ~= cls then error(fmt('%s: expected an nn.%s to split, got a %s', who, cls.__name, a.__name), 4) end
    return a, options(b, who, defaults)
  end
  local opts = options(c, who, defaults, defaults.bias ~= nil and 'bias' or nil)
  return make(a, b, opts), opts
end

local function linear(i, o, opts)
  return nn.Linear(i, o, { bias = opts.bias, dtype = opts.dtype, device = opts.device })
end

function ColumnParallelLinear:init(a, b, c)
  local full, opts = whole('ColumnParallelLinear', COLUMN, linear, nn.Linear, a, b, c)
  local g = check_group(opts.group, 'ColumnParallelLinear')
  divides(full.out_features, g, 'ColumnParallelLinear', 'out_features')
  self.group, self.gather_output, self.stride, self.copy_input = g, opts.gather_output, opts.stride, opts.copy_input
  self.in_features, self.out_features = full.in_features, full.out_features
  keep_fp8_mark(self, full)
  self.weight = shard(full.weight, 1, g, self.stride)
  self.tp_split = { weight = { axis = 1, stride = self.stride } }
  if full.bias then
    self.bias = shard(full.bias, 1, g, self.stride)
    self.tp_split.bias = { axis = 1, stride = self.stride }
  end
end

function ColumnParallelLinear:forward(x)
  if self.copy_input then x = M.copy_to_region(x, self.group) end
  local y = product(self, x, self.bias, COLUMN_SPLIT)
  return self.gather_output and M.gather_from_region(y, self.group) or y
end

function ColumnParallelLinear:extra_repr()
  return fmt('in_features=%d, out_features=%d/%d, bias=%s', self.in_features, self.out_features, size_of(self.group),
             tostring(self.bias ~= nil))
end

local RowParallelLinear = Module:extend('RowParallelLinear')
nn.RowParallelLinear = RowParallelLinear
M.RowParallelLinear = RowParallelLinear

-- RowParallelLinear(in, out [, {bias = true, input_is_parallel = true,
-- group, dtype, device}]) or RowParallelLinear(linear [, opts]): weight
-- [out, in / t]; the bias is whole, replicated, added once after the
-- all-reduce.
local ROW = { bias = true, input_is_parallel = true, group = nn.NONE, dtype = 'f32', device = 'cpu' }

function RowParallelLinear:init(a, b, c)
  local full, opts = whole('RowParallelLinear', ROW, linear, nn.Linear, a, b, c)
  local g = check_group(opts.group, 'RowParallelLinear')
  divides(full.in_features, g, 'RowParallelLinear', 'in_features')
  self.group, self.input_is_parallel = g, opts.input_is_parallel
  self.in_features, self.out_features = full.in_features, full.out_features
  keep_fp8_mark(self, full)
  self.weight = shard(full.weight, 2, g)
  self.tp_split = { weight = { axis = 2, stride = 1 } }
  if full.bias then self.bias = ds.no_grad(function() return full.bias:detach():clone():requires_grad_(true) end) end
end

function RowParallelLinear:forward(x)
  if not self.input_is_parallel then x = M.scatter_to_region(x, self.group) end
  local y = M.reduce_from_region(product(self, x, nil, ROW_SPLIT), self.group)
  if self.bias then y = y + self.bias end
  return y
end

function RowParallelLinear:extra_repr()
  return fmt('in_features=%d/%d, out_features=%d, bias=%s', self.in_features, size_of(self.group), self.out_features,
             tostring(self.bias ~= nil))
end

local VocabParallelEmbedding = Module:extend('VocabParallelEmbedding')
nn.VocabParallelEmbedding = VocabParallelEmbedding
M.VocabParallelEmbedding = VocabParallelEmbedding

-- VocabParallelEmbedding(num, dim [, {group, dtype, device}]) or
-- VocabParallelEmbedding(embedding [, opts]): rows [start, start + num /
-- t) of nn.Embedding(num, dim)'s weight; ids outside give zeros here and
-- the all-reduce sums the one rank's row.
local VOCAB = { group = nn.NONE, dtype = 'f32', device = 'cpu' }

local function embedding(n, d, opts) return nn.Embedding(n, d, { dtype = opts.dtype, device = opts.device }) end

function VocabParallelEmbedding:init(a, b, c)
  local full, opts = whole('VocabParallelEmbedding', VOCAB, embedding, nn.Embedding, a, b, c)
  local g = check_group(opts.group, 'VocabParallelEmbedding')
  divides(full.num_embeddings, g, 'VocabParallelEmbedding', 'num_embeddings')
  self.group = g
  self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
  self.per_rank = full.num_embeddings / size_of(g)
  self.vocab_start = rank_of(g) * self.per_rank
  self.weight = shard(full.weight, 1, g)
  self.tp_split = { weight = { axis = 1, stride = 1 } }
end

-- ids - start where in [start, start + n), else 0; and that mask
local function local_ids(ids, start, n)
  local lo = ids - start
  local inside = ds.where(lo:lt(n), lo:ge(0), false)
  return ds.where(inside, lo, 0), inside
end

function VocabParallelEmbedding:forward(ids)
  if size_of(self.group) == 1 then return ds.embedding(self.weight, ids) end
  local idx, inside = local_ids(ids, self.vocab_start, self.per_rank)
  local rows = ds.where(inside:unsqueeze(inside:dim() + 1), ds.embedding(self.weight, idx), 0)
  return M.reduce_from_region(rows, self.group)
end

function VocabParallelEmbedding:extra_repr()
  return fmt('%d/%d, %d', self.num_embeddings, size_of(self.group), self.embedding_dim)
end

---------------------------------------------------------------- attention

local checkpointing = require 'dslua.nn.checkpointing'

local ParallelSelfAttention = nn.CausalSelfAttention:extend('ParallelSelfAttention')
nn.ParallelSelfAttention = ParallelSelfAttention
M.ParallelSelfAttention = ParallelSelfAttention

-- ParallelSelfAttention(attn [, {group}]): a built nn.CausalSelfAttention
-- with its heads split: c_attn column-parallel with q, k and v each cut by
-- heads (stride 3), c_proj row-parallel. The attention dropout (on split
-- heads) draws from the tracker's model-parallel state, the residual
-- dropout (after the all-reduce) from the default one.
function ParallelSelfAttention:init(attn, opts)
  opts = options(opts, 'ParallelSelfAttention', { group = nn.NONE })
  local g = check_group(opts.group, 'ParallelSelfAttention')
  divides(attn.n_head, g, 'ParallelSelfAttention', 'n_head')
  self.group, self.attention, self.n_embd = g, attn.attention, attn.n_embd
  self.n_head = attn.n_head / size_of(g)
  self.c_attn = ColumnParallelLinear(attn.c_attn, { group = g, stride = 3 })
  self.c_proj = RowParallelLinear(attn.c_proj, { group = g })
  self.attn_dropout, self.resid_dropout = attn.attn_dropout, attn.resid_dropout
end

function ParallelSelfAttention:attend(qkv)
  local attend = nn.CausalSelfAttention.attend
  if not (self.attn_dropout.training and self.attn_dropout.p > 0) then return attend(self, qkv) end
  return checkpointing.get_rng_tracker():fork(checkpointing.MODEL_PARALLEL_RNG, attend, self, qkv)
end

function ParallelSelfAttention:extra_repr()
  return fmt('n_embd=%d, n_head=%d/%d', self.n_embd, self.n_head * size_of(self.group), size_of(self.group))
end

---------------------------------------------------------------- models

-- The seed of the model-parallel state a model adds when there is none
-- (ds.checkpointing.model_parallel_manual_seed chooses another).
M.DEFAULT_SEED = 1234

-- A model's tensor-parallel config resolved: cfg.tp (the degree) and
-- cfg.topology (a ds.topology; by default ds.topology{tensor = tp} over
-- the world, made here: every rank builds the model). Sets on model what
-- the engine reads: topology, tensor_group, dp_group (where gradients are
-- reduced and ZeRO partitions), dp_size, dp_rank, dp_root (the world rank
-- the data group broadcasts from) and model_parallel_group (over which the
-- gradient norm sums). Returns the tensor group, nil for tp 1 and no topology.
function M.setup(model, cfg, who)
  local tp, topo = cfg.tp, cfg.topology
  if topo then
    if type(topo) ~= 'table' or getmetatable(topo) == nil or type(topo.group) ~= 'function' then
      error(fmt('%s: topology must be a ds.topology, got %s', who, type(topo)), 0)
    end
    if tp ~= 1 and tp ~= topo:get_dim('tensor') then
      error(fmt("%s: tp %d and the topology's tensor degree %d differ", who, tp, topo:get_dim('tensor')), 0)
    end
  elseif tp > 1 then
    local ok, made = pcall(ds.topology, { tensor = tp })
    if not ok then error(fmt('%s: %s', who, tostring(made):gsub('^[^\n]-:%d+: ', '')), 0) end
    topo = made
  else
    return nil
  end
  local g = topo:group('tensor')
  local root = topo:coord()
  root.data = 0
  model.topology, model.tensor_group = topo, g
  model.dp_group, model.dp_size, model.dp_rank = topo:group('data'), topo:get_dim('data'), topo:coord('data')
  model.dp_root = topo:get_rank(root)
  model.model_parallel_group = topo:group { 'pipe', 'tensor' }
  local tracker = checkpointing.get_rng_tracker()
  if not tracker.states[checkpointing.MODEL_PARALLEL_RNG] then
    tracker:add(checkpointing.MODEL_PARALLEL_RNG, M.DEFAULT_SEED + 2718 + g:rank())
  end
  return g
end

-- The tensor-parallel degree of a model's config (its topology's tensor
-- degree when one is given), after checking that each {what, n} of sizes
-- divides by it: an error names the model, the size and both numbers.
function M.degree(who, cfg, sizes)
  local tp = cfg.tp
  if type(tp) ~= 'number' or tp < 1 or tp % 1 ~= 0 then
    error(fmt('%s: tp must be a positive integer, got %s', who, tostring(tp)), 0)
  end
  local topo = cfg.topology
  if topo and type(topo) == 'table' and type(topo.get_dim) == 'function' then tp = topo:get_dim('tensor') end
  for _, s in ipairs(sizes) do
    if s[2] % tp ~= 0 then
      error(fmt('%s: %s %d is not divisible by the tensor-parallel degree %d', who, s[1], s[2], tp), 0)
    end
  end
  return tp
end

-- model:parallelize(tp [, topology]) of a model with a tensor-parallel
-- form: its config (model.config) checked by check with tp and topology
-- set, then M.setup and model:split(group). Returns model.
function M.parallelize(model, check, who, tp, topology)
  if rawget(model, 'tensor_group') then
    error(fmt('%s: parallelize: the model is split across %d ranks already', who, model.tensor_group:size()), 0)
  end
  local cfg = {}
  for k, v in pairs(model.config) do cfg[k] = v end
  cfg.tp, cfg.topology = tp or 1, topology or false
  cfg = check(cfg)
  local g = M.setup(model, cfg, who)
  if g then
    model.config = cfg
    model:split(g)
  end
  return model
end

-- The tensor group a model's pipeline layers split over (who: its
-- pipe_layers), nil for tp 1: the pipeline's topology must be given, the
-- one the PipelineModule takes too.
function M.pipe_group(who, cfg)
  local tp = cfg.topology and cfg.topology:get_dim('tensor') or cfg.tp
  if tp == 1 then return nil end
  if not cfg.topology then
    error(fmt("%s: tp %d needs the pipeline's topology (topology = ds.topology{pipe = ..., tensor = %d}), which "
              .. 'the PipelineModule takes too', who, tp, tp), 0)
  end
  return cfg.topology:group('tensor')
end

-- Errors when model is split across a tensor group (what reads whole
-- weights, such as an export, needs an unsplit model).
function M.check_whole(model, who)
  local g = rawget(model, 'tensor_group')
  if g and g:size() > 1 then
    error(fmt('%s: the model is split across a tensor group of %d ranks: load nn.parallel.full_state_dict(model) '
              .. 'into a model built with tp = 1 first', who, g:size()), 0)
  end
end

---------------------------------------------------------------- loss

-- vocab_parallel_cross_entropy(logits, targets [, {group, vocab_start,
-- classes, ignore_index = -100}]): the mean cross-entropy of logits [..,
-- V / t] holding columns [vocab_start, vocab_start + V / t) of the full
-- logits; classes: the real vocabulary (columns past it are padding).
-- The row maxima, the target logits and the sums of exponentials are
-- all-reduced over the group (three [..] messages); backward needs none.
function M.vocab_parallel_cross_entropy(logits, targets, opts)
  opts = options(opts, 'vocab_parallel_cross_entropy', { group = nn.NONE, vocab_start = 0, classes = nn.NONE,
                                                         ignore_index = -100 })
  local g, d = opts.group, logits:dim()
  local n = logits:size(d)
  -- 16-bit logits: the sums in f32, as Megatron's float() before the loss
  if logits:dtype() == 'bf16' or logits:dtype() == 'f16' then logits = logits:to('f32') end
  if opts.classes then
    local real = math.max(0, math.min(n, opts.classes - opts.vocab_start))
    if real < n then
      -- padding columns: -inf, so they add nothing to the sum of exponentials
      local col = ds.arange(n, 'i64', logits:device())
      logits = ds.where(col:lt(real), logits, -math.huge)
    end
  end
  local mx = ds.no_grad(function() return logits:detach():amax(d) end)
  if size_of(g) > 1 then mx = all_reduce(mx, 'max', g) end
  local shifted = logits - mx:unsqueeze(d)
  local idx, inside = local_ids(targets, opts.vocab_start, n)
  local picked = ds.where(inside, ds.gather(shifted, d, idx:unsqueeze(d)):squeeze(d), 0)
  local sum_exp = shifted:exp():sum(d)
  picked, sum_exp = M.reduce_from_region(picked, g), M.reduce_from_region(sum_exp, g)
  local valid = targets:ne(opts.ignore_index)
  local count = valid:to(logits:dtype()):sum():item()
  local per = ds.where(valid, sum_exp:log() - picked, 0)
  return per:sum() * (1 / math.max(count, 1))
end

---------------------------------------------------------------- parameters

-- Every parameter of model once: {name, tensor, axis (nil: replicated
-- across the tensor group), stride, group}, in named_parameters' order.
function M.params(model)
  local split = {}
  for _, nm in ipairs(model:named_modules()) do
    local m = nm[2]
    local s = rawget(m, 'tp_split')
    if s then
      for key, how in pairs(s) do
        local t = rawget(m, key)
        if t then split[t] = { axis = how.axis, stride = how.stride, group = rawget(m, 'group') } end
      end
    end
  end
  local out = {}
  for _, e in ipairs(model:named_parameters()) do
    local s = split[e[2]]
    out[#out + 1] = { name = e[1], tensor = e[2], axis = s and s.axis, stride = s and s.stride, group = s and s.group,
                      replicated = s == nil }
  end
  return out
end

-- The parameters the gradient norm and the overflow count leave out on
-- this rank: replicated ones everywhere but on tensor rank 0 of group g.
function M.norm_excluded(model, g)
  if rank_of(g) == 0 then return {} end
  local out = {}
  for _, p in ipairs(M.params(model)) do
    if p.replicated then out[#out + 1] = p.tensor end
  end
  return out
end

-- {name = full tensor} on every rank: split parameters gathered over
-- their group, replicated ones as they are (a collective of the group).
function M.full_state_dict(model)
  local out = {}
  for _, p in ipairs(M.params(model)) do
    local t = p.tensor:detach()
    if p.axis and size_of(p.group) > 1 then
      local pieces = ds.comm.all_gather(t:contiguous(), p.group)
      out[p.name] = M.join(pieces, p.axis, p.stride)
    else
      out[p.name] = t
    end
  end
  return out
end

return M
