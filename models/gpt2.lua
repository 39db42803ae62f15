-- GPT-2 as nanoGPT builds it: token and position embeddings, pre-norm
-- blocks (ln_1, causal self-attention, ln_2, MLP with tanh GELU), a final
-- LayerNorm and an lm_head tied to the token embedding. Parameter names
-- are nanoGPT's state_dict keys ("transformer.h.0.attn.c_attn.weight"), so
-- its weights load as they are.
--
--   local GPT = require 'models.gpt2'
--   local model = GPT 'gpt2'                                  -- 124M
--   local model = GPT{ n_layer = 4, n_head = 4, n_embd = 128, vocab_size = 65, block_size = 128 }
--   local loss = model{ x = ids, y = targets }                -- or model(ids, targets); logits without y
--   local out = model:generate(ids, 100, { temperature = 0.8, top_k = 40 })
--   local fast = GPT{ name = 'gpt2', padded_vocab_size = 50304 }  -- GEMM-friendly lm_head
local ds = require 'dslua'
local json = require 'dslua.base.json'
local nn = ds.nn
local VocabHead = require 'models.vocab_head'

local M = {}

-- Named sizes: OpenAI's four GPT-2 models and minGPT's small ones.
M.configs = {
  ['gpt2'] = { n_layer = 12, n_head = 12, n_embd = 768 },          -- 124M
  ['gpt2-medium'] = { n_layer = 24, n_head = 16, n_embd = 1024 },  -- 350M
  ['gpt2-large'] = { n_layer = 36, n_head = 20, n_embd = 1280 },   -- 774M
  ['gpt2-xl'] = { n_layer = 48, n_head = 25, n_embd = 1600 },      -- 1558M
  ['gpt-mini'] = { n_layer = 6, n_head = 6, n_embd = 192 },
  ['gpt-micro'] = { n_layer = 4, n_head = 4, n_embd = 128 },
  ['gpt-nano'] = { n_layer = 3, n_head = 3, n_embd = 48 },
}

-- Every key a config may hold, with its default (GPT-2's).
M.defaults = {
  vocab_size = 50257, block_size = 1024, n_layer = 12, n_head = 12, n_embd = 768,
  dropout = 0.0,        -- embedding, attention and residual dropout
  bias = true,          -- biases in the Linears and LayerNorms
  gelu = 'tanh',        -- GPT-2's approximation; 'none' for the erf form
  checkpoint = false,   -- activation checkpointing: true (every block) or k (segments of k blocks)
  attention_backend = 'auto',  -- 'fused' or 'math' to force one (ds.scaled_dot_product_attention's backend)
  -- Rows of wte and lm_head, false for vocab_size. A round size (50304 for
  -- 50257, as nanoGPT and llm.c) keeps the lm_head GEMMs on cuBLAS's fast
  -- kernels; the padded rows start at zero, and the loss and the logits
  -- returned count only the first vocab_size columns.
  padded_vocab_size = false,
  -- Ranks each sequence is split over (DeepSpeed-Ulysses, ds.sequence):
  -- n_head and the sequence length divisible by it; every rank of a
  -- sequence group is given the same whole batch and keeps its own tokens
  sequence_parallel = 1,
  -- Tensor parallelism (docs/parallel.md): tp ranks split the heads, the
  -- MLP and the vocabulary; topology a ds.topology (ds.topology{tensor =
  -- tp} over the world by default)
  tp = 1, topology = false,
  -- The lm_head's GEMMs on its rows padded to a multiple of 64 on a GPU,
  -- the parameter keeping the real vocab (models/vocab_head.lua): 'auto',
  -- a multiple (any device) or false.
  pad_vocab = 'auto',
  dtype = 'f32', device = 'cpu',
}

-- The full config from a name ('gpt2'), or a table of overrides that may
-- start from a named size (name = 'gpt2-medium').
function M.config(cfg)
  local out = nn.model_config('gpt2', M.defaults, M.configs, cfg)
  nn.check_positive('gpt2', out, { 'vocab_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'sequence_parallel' })
  if out.n_embd % out.n_head ~= 0 then
    error(string.format('gpt2: n_embd %d is not divisible by n_head %d', out.n_embd, out.n_head), 0)
  end
  if out.n_head % out.sequence_parallel ~= 0 then
    error(string.format('gpt2: n_head %d is not divisible by sequence_parallel %d', out.n_head, out.sequence_parallel), 0)
  end
  ds.sequence.alone('gpt2', out)
  ds.checkpointing.interval('gpt2', out.checkpoint)
  local pv = out.padded_vocab_size
  if pv and (type(pv) ~= 'number' or pv ~= math.floor(pv) or pv < out.vocab_size) then
    error(string.format('gpt2: padded_vocab_size must be false or an integer >= vocab_size %d, got %s',
                        out.vocab_size, tostring(pv)), 0)
  end
  nn.parallel.degree('gpt2', out, { { 'n_head', out.n_head },
                                    { pv and 'padded_vocab_size' or 'vocab_size', pv or out.vocab_size } })
  VocabHead.check('gpt2', out)
  return out
end

local MLP = nn.Module:extend('MLP')
M.MLP = MLP

function MLP:init(cfg)
  local lin = { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device }
  self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, lin)
  self.gelu = nn.GELU(cfg.gelu)
  self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, lin)
  self.dropout = nn.Dropout(cfg.dropout)
end

-- Plain Linear, GELU, Linear (no forward replaced on an instance, as
-- ZeRO stage 3 and the flops profiler do) run as one ds.gelu_mlp, whose
-- GELU rides in the GEMMs on the GPU; anything else runs as composed, and
-- so does the MLP in ds.fp8's scope, where each Linear runs in fp8.
local function plain(m, class) return getmetatable(m) == class and rawget(m, 'forward') == nil end

function MLP:forward(x)
  if plain(self.c_fc, nn.Linear) and plain(self.c_proj, nn.Linear) and plain(self.gelu, nn.GELU)
     and not ds.fp8.active() then
    local h = ds.gelu_mlp(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias,
                          { approximate = self.gelu.approximate })
    return self.dropout(h)
  end
  return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
end

local Block = nn.Module:extend('Block')
M.Block = Block

function Block:init(cfg)
  local ln = { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device }
  self.ln_1 = nn.LayerNorm(cfg.n_embd, ln)
  self.attn = nn.CausalSelfAttention { n_embd = cfg.n_embd, n_head = cfg.n_head, bias = cfg.bias,
                                       dropout = cfg.dropout, dtype = cfg.dtype, device = cfg.device,
                                       attention_backend = cfg.attention_backend }
  self.ln_2 = nn.LayerNorm(cfg.n_embd, ln)
  self.mlp = MLP(cfg)
end

-- block(x) -> its output; block(x, res), res a tensor or false -> h, r,
-- the output of block(x + res) being h + r: ln_1 adds res in its kernel
-- and the MLP's r is left for the next norm to add
-- (ds.checkpointing.residual_sequential).
Block.residual_kind = 'block'
function Block:forward(x, res)
  local h
  h, x = self.ln_1(x, res or false)
  h, x = self.ln_2(x, self.attn(h))      -- ln_2(x + attn) and x + attn, one kernel
  if res == nil then return x + self.mlp(h) end
  return x, self.mlp(h)
end

local GPT = nn.Module:extend('GPT')
M.GPT = GPT

-- nanoGPT's _init_weights: N(0, 0.02) weights and embeddings, the
-- residual projections scaled by 1/sqrt(2 n_layer); biases stay zero.
local function init_weights(module, n_layer)
  for _, p in ipairs(module:named_parameters()) do
    local name, t = p[1], p[2]
    if t:dim() >= 2 then
      nn.init.normal_(t, 0, name:match('c_proj%.weight$') and 0.02 / math.sqrt(2 * n_layer) or 0.02)
    end
  end
end

function GPT:init(cfg)
  cfg = M.config(cfg)
  self.config = cfg
  nn.skip_init(self.build, self, cfg)
  init_weights(self, cfg.n_layer)
  local attns = {}
  for i, block in ipairs(self.transformer.h:children()) do attns[i] = block.attn end
  ds.sequence.apply(self, cfg.sequence_parallel, attns)
  local rows = self.transformer.wte.weight:size(1)
  if rows > cfg.vocab_size then
    ds.no_grad(function() self.transformer.wte.weight:narrow(1, cfg.vocab_size + 1, rows - cfg.vocab_size):fill_(0) end)
  end
  self:parallelize(cfg.tp, cfg.topology)
end

-- parallelize(tp [, topology]): this model, built whole, split across tp
-- ranks (a topology's tensor groups; ds.topology{tensor = tp} by
-- default), as the tp config key does; initialize calls it for
-- DeepSpeed's tensor_parallel.autotp_size.
function GPT:parallelize(tp, topology) return nn.parallel.parallelize(self, M.config, 'gpt2', tp, topology) end

-- Tensor parallel over group g, from the whole model built: the token
-- embedding by vocabulary (the lm_head its piece: logits split by
-- vocabulary), each block's attention by heads, c_fc column- and c_proj
-- row-parallel. Everything else is replicated.
-- a Block's attention by heads, c_fc column- and c_proj row-parallel over g
local function split_block(b, g)
  local P = nn.parallel
  b.attn = P.ParallelSelfAttention(b.attn, { group = g })
  b.mlp.c_fc = P.ColumnParallelLinear(b.mlp.c_fc, { group = g })
  b.mlp.c_proj = P.RowParallelLinear(b.mlp.c_proj, { group = g })
end

function GPT:split(g)
  local P, tr = nn.parallel, self.transformer
  tr.wte = P.VocabParallelEmbedding(tr.wte, { group = g })
  for _, b in ipairs(tr.h) do split_block(b, g) end
  self.lm_head = P.ColumnParallelLinear(self.lm_head, { group = g })
  self.lm_head.weight = tr.wte.weight     -- tied again, to the embedding's piece
end

function GPT:build(cfg)
  local where = { dtype = cfg.dtype, device = cfg.device }
  local tr = nn.Module()
  tr.wte = nn.Embedding(cfg.padded_vocab_size or cfg.vocab_size, cfg.n_embd, where)
  tr.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, where)
  tr.drop = nn.Dropout(cfg.dropout)
  local blocks = {}
  for i = 1, cfg.n_layer do blocks[i] = Block(cfg) end
  tr.h = nn.ModuleList(blocks)
  tr.ln_f = nn.LayerNorm(cfg.n_embd, { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device })
  self.transformer = tr
  self.lm_head = VocabHead.head(cfg.n_embd, cfg.padded_vocab_size or cfg.vocab_size, cfg)
  self.lm_head.weight = tr.wte.weight
end

-- The final hidden states [B, T, n_embd] of token ids idx [B, T] (with
-- sequence_parallel P, of this rank's T / P tokens).
function GPT:hidden(idx)
  if not ds.is_tensor(idx) or idx:dim() ~= 2 then
    error('GPT: expected token ids [B, T], got ' .. (ds.is_tensor(idx) and ('[' .. table.concat(idx:size(), 'x') .. ']')
                                                    or type(idx)), 0)
  end
  local T = idx:size(2)
  if T > self.config.block_size then
    error(string.format('GPT: cannot forward sequence of length %d, block size is only %d', T, self.config.block_size), 0)
  end
  local tr = self.transformer
  local pos = ds.arange(T, 'i64', idx:device())
  local sp = rawget(self, 'seq')
  if sp then
    sp:check(T, 'GPT')
    idx, pos = sp:chunk(idx), pos:narrow(1, sp:offset(T) + 1, T / sp.size)
  end
  local x = tr.drop(tr.wte(idx) + tr.wpe(pos))
  local r
  x, r = ds.checkpointing.residual_sequential(tr.h, ds.checkpointing.interval('gpt2', self.config.checkpoint), x)
  return (tr.ln_f(x, r))     -- the last block's MLP added in ln_f's kernel
end

-- forward(batch) with batch = {x = ids, y = targets}, or forward(ids [,
-- targets]): the mean cross-entropy (targets -1 ignored, as nanoGPT) and
-- the logits when targets are given, else the logits [B, T, vocab]. Tensor
-- parallel: the logits with the loss are this rank's vocabulary columns,
-- without targets all of them. With sequence_parallel the loss is the mean
-- over the whole sequences, the logits this rank's tokens'.
function GPT:forward(idx, targets)
  if type(idx) == 'table' then idx, targets = idx.x, idx.y end
  local V = self.config.vocab_size
  local logits = self.lm_head(self:hidden(idx))
  local g = self.tensor_group
  if g then
    -- tensor parallel: this rank's columns of the logits, and the loss from all of them
    if targets == nil then return self:_whole(logits) end
    return nn.parallel.vocab_parallel_cross_entropy(logits, targets, {
      group = g, vocab_start = self.transformer.wte.vocab_start, classes = V, ignore_index = -1 }), logits
  end
  local real = logits:size(3) > V and logits:narrow(3, 1, V) or logits
  if targets == nil then return real end
  -- the loss reads the padded logits in place: no copy of the real columns
  local opts = { ignore_index = -1, classes = V }
  local sp = rawget(self, 'seq')
  return sp and sp:cross_entropy(logits, targets, opts) or ds.cross_entropy(logits, targets, opts), real
end

-- Logits [B, vocab] of the last position only: what sampling needs.
function GPT:last_logits(idx)
  local x = self:hidden(idx)
  local logits = self:_whole(self.lm_head(x:narrow(2, x:size(2), 1)))
  local V = self.config.vocab_size
  return logits:narrow(3, 1, V):reshape({ idx:size(1), V })
end

-- the logits of every column from this rank's, less the padding
function GPT:_whole(logits)
  local g = self.tensor_group
  if g then logits = nn.parallel.gather_from_region(logits, g) end
  local V = self.config.vocab_size
  return logits:size(3) > V and logits:narrow(3, 1, V) or logits
end

-- generate(idx, max_new_tokens [, {temperature = 1, top_k}]) -> idx with
-- the new tokens appended (see ds.nn.generate).
function GPT:generate(idx, max_new_tokens, opts)
  return nn.generate(self, idx, max_new_tokens, opts)
end

-- Parameter count; nanoGPT leaves the position embeddings out by default.
function GPT:num_params(non_embedding)
  local n = self:num_parameters()
  if non_embedding ~= false then n = n - self.transformer.wpe.weight:numel() end
  return n
end

function GPT:extra_repr()
  local c = self.config
  return string.format('n_layer=%d, n_head=%d, n_embd=%d, vocab_size=%d, block_size=%d', c.n_layer, c.n_head,
                       c.n_embd, c.vocab_size, c.block_size)
end

---------------------------------------------------------------- pipeline layers

-- The position embedding and dropout after the token embedding.
local Positions = nn.Module:extend('Positions')
M.Positions = Positions

function Positions:init(cfg)
  self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, { dtype = cfg.dtype, device = cfg.device })
  self.drop = nn.Dropout(cfg.dropout)
end

function Positions:forward(x) return self.drop(x + self.wpe(ds.arange(x:size(2), 'i64', x:device()))) end

-- cls with nanoGPT's init instead of its own, under cls's name (so
-- partition_method 'type:Block' finds the blocks)
local function initialized(cls, n_layer)
  local c = cls:extend(cls.__name)
  function c:init(...)
    nn.skip_init(cls.init, self, ...)
    init_weights(self, n_layer)
  end
  return c
end

local function logits(wte, x) return ds.linear(x, wte.weight) end

-- The pipeline's loss: GPT's (targets -1 ignored).
function M.pipe_loss(out, targets) return ds.cross_entropy(out, targets, { ignore_index = -1 }) end

-- The tensor-parallel pieces of the pipeline layers over group g: the
-- embedding drawn whole with nanoGPT's init and split by vocabulary (its
-- lm_head's logits this rank's columns, the loss vocab-parallel), each
-- Block drawn whole and split as GPT:split splits it.
local function pipe_pieces(cfg, g)
  local P, V = nn.parallel, cfg.vocab_size
  local Embedding = P.VocabParallelEmbedding:extend('Embedding')
  function Embedding:init(num, dim, where)
    local e = nn.skip_init(function() return nn.Embedding(num, dim, where) end)
    init_weights(e, cfg.n_layer)
    P.VocabParallelEmbedding.init(self, e, { group = g })
  end
  local SplitBlock = Block:extend('Block')
  function SplitBlock:init(c)
    nn.skip_init(Block.init, self, c)
    init_weights(self, cfg.n_layer)
    split_block(self, g)
  end
  local function head(wte, x) return ds.linear(P.copy_to_region(x, g), wte.weight) end
  local function loss(out, targets)
    return P.vocab_parallel_cross_entropy(out, targets, { group = g, vocab_start = g:rank() * V / g:size(),
                                                          ignore_index = -1 })
  end
  return Embedding, SplitBlock, head, loss
end

-- The GPT of cfg as ds.pipe layers: the token embedding (TiedLayerSpec
-- 'wte', tied to the lm_head in the last layer), the positions, the
-- blocks, ln_f, the lm_head; and the loss_fn for them (M.pipe_loss).
-- Weights start as GPT's do; the PipelineModule's
-- activation_checkpoint_interval takes the place of the checkpoint option.
-- With tp above 1, cfg.topology is the pipeline's (a ds.topology of pipe,
-- data and tensor axes) and the layers are tensor parallel over its
-- tensor group, their weights those of the whole layers.
function M.pipe_layers(cfg)
  cfg = M.config(cfg)
  local pipe = ds.pipe
  local where = { dtype = cfg.dtype, device = cfg.device }
  local embedding, block, head, loss = initialized(nn.Embedding, cfg.n_layer), initialized(Block, cfg.n_layer), logits,
                                       M.pipe_loss
  local g = nn.parallel.pipe_group('gpt2.pipe_layers', cfg)
  if g then embedding, block, head, loss = pipe_pieces(cfg, g) end
  local function wte(forward_fn)
    return pipe.TiedLayerSpec { 'wte', embedding, cfg.vocab_size, cfg.n_embd, where, forward_fn = forward_fn }
  end
  local layers = { wte(), pipe.LayerSpec(initialized(Positions, cfg.n_layer), cfg) }
  for _ = 1, cfg.n_layer do layers[#layers + 1] = pipe.LayerSpec(block, cfg) end
  layers[#layers + 1] = pipe.LayerSpec(nn.LayerNorm, cfg.n_embd, { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device })
  layers[#layers + 1] = wte(head)
  return layers, loss
end

-- A pipeline's weights by layer (engine:save_16bit_model's layer_05.weight,
-- the layers of M.pipe_layers) under GPT's names, for GPT:load_state_dict:
-- layer 0 the embedding (the lm_head's too), 1 the positions, then the
-- blocks and ln_f.
function M.from_pipe_state_dict(sd)
  local out, last = {}, 0    -- last: ln_f, the last layer saved (the lm_head is layer 0's)
  for name in pairs(sd) do last = math.max(last, tonumber(name:match('^layer_(%d+)%.')) or 0) end
  for name, t in pairs(sd) do
    local i, rest = name:match('^layer_(%d+)%.(.+)$')
    i = tonumber(i)
    if i == 0 and rest == 'weight' then
      out['transformer.wte.weight'], out['lm_head.weight'] = t, t
    elseif i == 1 then
      out['transformer.' .. rest] = t
    elseif i and i >= 2 and i < last then
      out[string.format('transformer.h.%d.%s', i - 2, rest)] = t
    elseif i == last then
      out['transformer.ln_f.' .. rest] = t
    else
      error(string.format("from_pipe_state_dict: '%s' is not a tensor of GPT-2's pipeline layers", name), 2)
    end
  end
  return out
end

---------------------------------------------------------------- Hugging Face's weights

-- Hugging Face's GPT-2 keeps these four as Conv1D weights, [in, out]: the
-- transpose of nn.Linear's [out, in] (nanoGPT's from_pretrained does the same).
local CONV1D = { 'attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight' }

-- HF's name -> nanoGPT's (GPT2Model files have no "transformer." prefix,
-- GPT2LMHeadModel files do); nil for the attention masks HF stores.
local function nano_name(k)
  if k:match('%.attn%.bias$') or k:match('%.attn%.masked_bias$') then return nil end
  if k:match('^transformer%.') or k:match('^lm_head%.') then return k end
  return 'transformer.' .. k
end

local function is_conv1d(name)
  for _, suffix in ipairs(CONV1D) do
    if name:sub(-#suffix) == suffix then return true end
  end
  return false
end

local hf = require 'models.hf'

-- The state_dict of weights in Hugging Face's GPT-2 layout, {name =
-- tensor} as hf.load reads them, under nanoGPT's names, Conv1D weights
-- transposed, lm_head tied to wte.
local function nano_state_dict(raw, path)
  local sd = {}
  for k, t in pairs(raw) do
    local name = nano_name(k)
    if name then sd[name] = is_conv1d(name) and t:transpose(1, 2):contiguous() or t end
  end
  if not sd['transformer.wte.weight'] then
    error(string.format("gpt2: '%s' has no wte.weight: not a Hugging Face GPT-2 file", path), 0)
  end
  sd['lm_head.weight'] = sd['lm_head.weight'] or sd['transformer.wte.weight']
  return sd
end

-- The state_dict of a safetensors file (model.safetensors of
-- openai-community/gpt2 and friends) or a Hugging Face folder.
function M.hf_state_dict(path)
  local _, raw = hf.load(path, 'gpt2.from_hf')
  return nano_state_dict(raw, path)
end

-- config.json's key -> the config's (GPT2Config's names).
local HF_KEYS = { n_embd = 'n_embd', n_layer = 'n_layer', n_head = 'n_head', n_positions = 'block_size',
                  vocab_size = 'vocab_size' }

-- Settings of GPT2Config this model does not implement, refused unless at
-- the value it builds.
local HF_REFUSED = {
  activation_function = { 'gelu_new', 'gelu_pytorch_tanh' }, layer_norm_epsilon = { 1e-5 },
  n_inner = {}, scale_attn_weights = { true }, scale_attn_by_inverse_layer_idx = { false },
  add_cross_attention = { false },
}

-- from_hf(path [, overrides]) -> a GPT with the weights of a Hugging Face
-- folder (config.json and model.safetensors or the sharded index) or of
-- one safetensors file (sizes read from the tensors, n_head from the named
-- size of that width or overrides.n_head); f32, bf16 or f16 in the files,
-- dtype and device from overrides. Inside ds.zero.Init each rank reads
-- only its shards' ranges of the files (partitioned = true says so).
function M.from_hf(path, overrides)
  local who = 'gpt2.from_hf'
  overrides = hf.overrides(overrides, who)
  local config, raw = hf.load(path, who)
  local sd = nano_state_dict(raw, path)
  local wte, wpe = sd['transformer.wte.weight'], sd['transformer.wpe.weight']
  local n_layer = 0
  while sd[string.format('transformer.h.%d.ln_1.weight', n_layer)] do n_layer = n_layer + 1 end
  local cfg = { vocab_size = wte:size(1), n_embd = wte:size(2), block_size = wpe:size(1), n_layer = n_layer,
                bias = sd['transformer.ln_f.bias'] ~= nil }
  if config then
    hf.check_type(config, 'gpt2', who)
    hf.require_values(config, HF_REFUSED, who)
    for key, name in pairs(HF_KEYS) do cfg[name] = config[key] or cfg[name] end
  else
    for _, named in pairs(M.configs) do
      if named.n_embd == cfg.n_embd then cfg.n_head = named.n_head end
    end
  end
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  local pv = cfg.padded_vocab_size
  if pv and pv > cfg.vocab_size then     -- zero rows below the file's vocab (tied: one tensor for both names)
    local padded = ds.zeros({ pv, cfg.n_embd }, wte:dtype())
    padded:narrow(1, 1, cfg.vocab_size):copy_(wte)
    sd['transformer.wte.weight'], sd['lm_head.weight'] = padded, padded
  end
  if not cfg.n_head then
    error(string.format('gpt2: no named size has n_embd %d: pass n_head in the overrides', cfg.n_embd), 0)
  end
  -- the files hold whole weights: a tensor-parallel model splits once they are in
  local tp, topology = cfg.tp, cfg.topology
  cfg.tp, cfg.topology = nil, nil
  local model = GPT(cfg)
  hf.load_state_dict(model, sd, who)
  if tp or topology then model:parallelize(tp, topology) end
  return model
end

-- save_hf(model, dir [, opts]): config.json and safetensors that
-- transformers' GPT2LMHeadModel.from_pretrained loads: Conv1D weights
-- transposed back, wte cut to vocab_size rows (the lm_head is wte's),
-- opts.dtype ('f32', 'bf16', 'f16'; the model's by default),
-- opts.max_shard_bytes (shards and the index above it; 5 GiB by default).
function M.save_hf(model, dir, opts)
  local c, who = model.config, 'gpt2.save_hf'
  nn.parallel.check_whole(model, who)
  if not c.bias or c.gelu ~= 'tanh' then
    error(who .. ": Hugging Face's GPT-2 has biases and the tanh GELU: this model has bias = "
          .. tostring(c.bias) .. ", gelu = '" .. tostring(c.gelu) .. "'", 0)
  end
  local config = { architectures = { 'GPT2LMHeadModel' }, model_type = 'gpt2', activation_function = 'gelu_new',
                   layer_norm_epsilon = 1e-5, n_inner = json.null, n_ctx = c.block_size,
                   scale_attn_weights = true, tie_word_embeddings = true }
  for key, name in pairs(HF_KEYS) do config[key] = c[name] end
  local entries = {}
  for _, e in ipairs(model:named_parameters()) do
    local name, t = e[1], e[2]
    if name == 'transformer.wte.weight' then
      entries[#entries + 1] = { name, t:narrow(1, 1, c.vocab_size) }
    elseif name ~= 'lm_head.weight' then
      entries[#entries + 1] = { name, is_conv1d(name) and t:transpose(1, 2) or t }
    end
  end
  hf.save(dir, config, entries, opts, who)
end

return setmetatable(M, { __call = function(_, cfg) return GPT(cfg) end })
