-- A Llama-style decoder as Hugging Face's LlamaForCausalLM lays it out:
-- RMSNorm before attention and MLP, rotary position embeddings in the
-- rotate_half convention (the first and second halves of each head are
-- the pair rotated together), grouped-query attention (n_kv_head key/value
-- heads shared by n_head query heads), a SwiGLU MLP, no biases, and an
-- lm_head tied to the embedding or not. Parameter names are Hugging
-- Face's ("model.layers.0.self_attn.q_proj.weight").
--
--   local Llama = require 'models.llama'
--   local model = Llama{ n_layer = 4, n_head = 8, n_kv_head = 2, n_embd = 256, vocab_size = 65, block_size = 256 }
--   local loss = model{ x = ids, y = targets }     -- targets -100 ignored; logits without y
local ds = require 'dslua'
local json = require 'dslua.base.json'
local nn = ds.nn
local VocabHead = require 'models.vocab_head'

local M = {}

M.configs = {
  ['llama2-7b'] = { n_layer = 32, n_head = 32, n_kv_head = 32, n_embd = 4096, intermediate_size = 11008,
                    vocab_size = 32000, block_size = 4096 },
  ['tinyllama-1.1b'] = { n_layer = 22, n_head = 32, n_kv_head = 4, n_embd = 2048, intermediate_size = 5632,
                         vocab_size = 32000, block_size = 2048 },
  ['llama-micro'] = { n_layer = 4, n_head = 4, n_kv_head = 2, n_embd = 128 },
}

-- Every key a config may hold. n_kv_head defaults to n_head (plain
-- multi-head attention); intermediate_size to Llama's rule, 2/3 of 4 x
-- n_embd rounded up to a multiple of multiple_of.
M.defaults = {
  vocab_size = 32000, block_size = 2048, n_layer = 32, n_head = 32, n_kv_head = false, n_embd = 4096,
  intermediate_size = false, multiple_of = 256, norm_eps = 1e-5, rope_theta = 10000.0,
  tie_embeddings = false, initializer_range = 0.02, dtype = 'f32', device = 'cpu',
  checkpoint = false,   -- activation checkpointing: true (every layer) or k (segments of k layers)
  -- Ranks each sequence is split over (DeepSpeed-Ulysses, ds.sequence):
  -- n_head, n_kv_head and the sequence length divisible by it; every rank
  -- of a sequence group is given the same whole batch
  sequence_parallel = 1,
  -- Tensor parallelism (docs/parallel.md): tp ranks split the query and
  -- key/value heads, the MLP and the vocabulary; topology a ds.topology
  -- (ds.topology{tensor = tp} over the world by default)
  tp = 1, topology = false,
  -- The lm_head's GEMMs on its rows padded to a multiple of 64 on a GPU,
  -- the parameter keeping the real vocab (models/vocab_head.lua): 'auto',
  -- a multiple (any device) or false.
  pad_vocab = 'auto',
}

function M.config(cfg)
  local out = nn.model_config('llama', M.defaults, M.configs, cfg)
  ds.checkpointing.interval('llama', out.checkpoint)
  out.n_kv_head = out.n_kv_head or out.n_head
  if not out.intermediate_size then
    local h = math.floor(2 * 4 * out.n_embd / 3)
    out.intermediate_size = out.multiple_of * math.ceil(h / out.multiple_of)
  end
  nn.check_positive('llama', out, { 'vocab_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd',
                                   'intermediate_size', 'sequence_parallel' })
  if out.n_embd % out.n_head ~= 0 or (out.n_embd / out.n_head) % 2 ~= 0 then
    error(string.format('llama: n_embd %d must split into n_head %d heads of an even size', out.n_embd, out.n_head), 0)
  end
  if out.n_head % out.n_kv_head ~= 0 then
    error(string.format('llama: n_head %d is not a multiple of n_kv_head %d', out.n_head, out.n_kv_head), 0)
  end
  if out.n_kv_head % out.sequence_parallel ~= 0 then
    error(string.format('llama: n_kv_head %d (and n_head %d) must be divisible by sequence_parallel %d', out.n_kv_head,
                        out.n_head, out.sequence_parallel), 0)
  end
  ds.sequence.alone('llama', out)
  nn.parallel.degree('llama', out, { { 'n_head', out.n_head }, { 'n_kv_head', out.n_kv_head },
                                     { 'intermediate_size', out.intermediate_size }, { 'vocab_size', out.vocab_size } })
  VocabHead.check('llama', out)
  return out
end

-- cos and sin [block_size, head_dim] of the rotary angles pos * theta^(-2i/d),
-- each frequency twice (cat(freqs, freqs)), as Hugging Face builds them.
local function rope_tables(cfg)
  local d = cfg.n_embd / cfg.n_head
  local cos, sin = {}, {}
  for p = 0, cfg.block_size - 1 do
    local row_c, row_s = {}, {}
    for i = 0, d / 2 - 1 do
      local a = p * cfg.rope_theta ^ (-2 * i / d)
      row_c[i + 1], row_c[i + 1 + d / 2] = math.cos(a), math.cos(a)
      row_s[i + 1], row_s[i + 1 + d / 2] = math.sin(a), math.sin(a)
    end
    cos[p + 1], sin[p + 1] = row_c, row_s
  end
  local function tensor(t)
    local x = ds.tensor(t, cfg.dtype)
    return cfg.device ~= 'cpu' and x:to(cfg.device) or x
  end
  return tensor(cos), tensor(sin)
end

local Attention = nn.Module:extend('LlamaAttention')
M.Attention = Attention

function Attention:init(cfg)
  local lin = { bias = false, dtype = cfg.dtype, device = cfg.device }
  self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.n_embd / cfg.n_head
  self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, lin)
  self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, lin)
  self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, lin)
  self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, lin)
end

-- [B, heads, T, D] <-> [B, T, A, heads, D], the layout of ds.sequence's all-to-alls
local function wire(x) return x:transpose(2, 3):unsqueeze(3) end
local function unwire(x, a) return x:narrow(3, a, 1):squeeze(3):transpose(2, 3) end

-- With a sequence layout set (`sequence`, as sequence_parallel sets it) x
-- holds this rank's T / P tokens, rotated at their own positions (cos and
-- sin), and an all-to-all gives it every token of its heads around the
-- attention (DeepSpeed-Ulysses).
function Attention:forward(x, cos, sin)
  if self.group then x = nn.parallel.copy_to_region(x, self.group) end    -- tensor parallel: q, k, v read one copy
  local B, T = x:size(1), x:size(2)
  local H, KV, D = self.n_head, self.n_kv_head, self.head_dim
  -- q and k rotated: x cos + cat(-x2, x1) sin over the halves of the head dim, one kernel each way
  local q = ds.rope(self.q_proj(x):view({ B, T, H, D }):transpose(2, 3), cos, sin)
  local k = ds.rope(self.k_proj(x):view({ B, T, KV, D }):transpose(2, 3), cos, sin)
  local v = self.v_proj(x):view({ B, T, KV, D }):transpose(2, 3)
  local sp = rawget(self, 'sequence')
  if sp then
    q = unwire(sp:seq_to_heads(wire(q)), 1)
    local kv = sp:seq_to_heads(ds.cat({ wire(k), wire(v) }, 3))
    k, v = unwire(kv, 1), unwire(kv, 2)
  end
  -- k and v keep their KV heads: query head h reads kv head h / (H / KV) in the kernel, with no
  -- repeated copy (Hugging Face's repeat_kv) forward nor its reduction backward
  local y = ds.scaled_dot_product_attention(q, k, v)
  if sp then return self.o_proj(sp:heads_to_seq(wire(y)):reshape({ B, T, H * D })) end
  return self.o_proj(y:transpose(2, 3):reshape({ B, T, H * D }))
end

local MLP = nn.Module:extend('LlamaMLP')
M.MLP = MLP

function MLP:init(cfg)
  local lin = { bias = false, dtype = cfg.dtype, device = cfg.device }
  self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, lin)
  self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, lin)
  self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, lin)
end

function MLP:forward(x)
  if self.group then x = nn.parallel.copy_to_region(x, self.group) end    -- tensor parallel: gate and up read one copy
  -- silu(gate) * up in one kernel each way, keeping gate and up alone for the backward
  return self.down_proj(ds.swiglu(self.gate_proj(x), self.up_proj(x)))
end

local Layer = nn.Module:extend('LlamaDecoderLayer')
M.Layer = Layer

function Layer:init(cfg)
  local norm = { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device }
  self.self_attn = Attention(cfg)
  self.mlp = MLP(cfg)
  self.input_layernorm = nn.RMSNorm(cfg.n_embd, norm)
  self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, norm)
end

-- layer(x, cos, sin) -> its output; layer(x, cos, sin, res), res a tensor
-- or false -> h, r, the output of layer(x + res, cos, sin) being h + r, as
-- GPT-2's Block: each residual add is done by the RMS norm after it.
Layer.residual_kind = 'block'
function Layer:forward(x, cos, sin, res)
  local h
  h, x = self.input_layernorm(x, res or false)
  h, x = self.post_attention_layernorm(x, self.self_attn(h, cos, sin))
  if res == nil then return x + self.mlp(h) end
  return x, self.mlp(h)
end

local Llama = nn.Module:extend('Llama')
M.Llama = Llama

function Llama:init(cfg)
  cfg = M.config(cfg)
  self.config = cfg
  nn.skip_init(self.build, self, cfg)
  -- Hugging Face's _init_weights: N(0, initializer_range) for every
  -- Linear and Embedding weight; the norms stay ones.
  for _, p in ipairs(self:parameters()) do
    if p:dim() >= 2 then nn.init.normal_(p, 0, cfg.initializer_range) end
  end
  local attns = {}
  for i, layer in ipairs(self.model.layers:children()) do attns[i] = layer.self_attn end
  ds.sequence.apply(self, cfg.sequence_parallel, attns)
  self:parallelize(cfg.tp, cfg.topology)
end

-- parallelize(tp [, topology]): this model, built whole, split across tp
-- ranks (a topology's tensor groups; ds.topology{tensor = tp} by
-- default), as the tp config key does; initialize calls it for
-- DeepSpeed's tensor_parallel.autotp_size.
function Llama:parallelize(tp, topology) return nn.parallel.parallelize(self, M.config, 'llama', tp, topology) end

-- Tensor parallel over group g, from the whole model built: the embedding
-- and the lm_head by vocabulary (a tied lm_head is the embedding's piece),
-- q_proj, k_proj and v_proj column-parallel (each rank n_head / t query
-- heads and their n_kv_head / t key/value heads), o_proj row-parallel,
-- gate_proj and up_proj column- and down_proj row-parallel. The norms are
-- replicated.
-- a decoder layer's attention and MLP split over g
local function split_layer(layer, g)
  local P, t = nn.parallel, g:size()
  -- q, k and v (gate and up) read one copy of their input, which the
  -- attention (the MLP) makes: one all-reduce backward each
  local col, row = function(l) return P.ColumnParallelLinear(l, { group = g, copy_input = false }) end,
                   function(l) return P.RowParallelLinear(l, { group = g }) end
  local a, m = layer.self_attn, layer.mlp
  a.q_proj, a.k_proj, a.v_proj, a.o_proj = col(a.q_proj), col(a.k_proj), col(a.v_proj), row(a.o_proj)
  a.n_head, a.n_kv_head, a.group = a.n_head / t, a.n_kv_head / t, g
  m.gate_proj, m.up_proj, m.down_proj, m.group = col(m.gate_proj), col(m.up_proj), row(m.down_proj), g
end

function Llama:split(g)
  local P = nn.parallel
  self.model.embed_tokens = P.VocabParallelEmbedding(self.model.embed_tokens, { group = g })
  for _, layer in ipairs(self.model.layers) do split_layer(layer, g) end
  self.lm_head = P.ColumnParallelLinear(self.lm_head, { group = g })
  if self.config.tie_embeddings then self.lm_head.weight = self.model.embed_tokens.weight end
end

function Llama:build(cfg)
  local where = { dtype = cfg.dtype, device = cfg.device }
  local model = nn.Module()
  model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd, where)
  local layers = {}
  for i = 1, cfg.n_layer do layers[i] = Layer(cfg) end
  model.layers = nn.ModuleList(layers)
  model.norm = nn.RMSNorm(cfg.n_embd, { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device })
  self.model = model
  self.lm_head = VocabHead.head(cfg.n_embd, cfg.vocab_size, cfg)
  if cfg.tie_embeddings then self.lm_head.weight = model.embed_tokens.weight end
  local cos, sin = rope_tables(cfg)
  self:register_buffer('rope_cos', cos, false)
  self:register_buffer('rope_sin', sin, false)
end

function Llama:hidden(idx)
  if not ds.is_tensor(idx) or idx:dim() ~= 2 then
    error('Llama: expected token ids [B, T], got ' .. (ds.is_tensor(idx) and ('[' .. table.concat(idx:size(), 'x') .. ']')
                                                      or type(idx)), 0)
  end
  local T = idx:size(2)
  if T > self.config.block_size then
    error(string.format('Llama: cannot forward sequence of length %d, block size is only %d', T, self.config.block_size), 0)
  end
  local first, sp = 1, rawget(self, 'seq')
  if sp then
    sp:check(T, 'Llama')
    idx, first, T = sp:chunk(idx), sp:offset(T) + 1, T / sp.size
  end
  local cos, sin = self.rope_cos:narrow(1, first, T), self.rope_sin:narrow(1, first, T)
  local x = self.model.embed_tokens(idx)
  local r
  local every = ds.checkpointing.interval('llama', self.config.checkpoint)
  x, r = ds.checkpointing.residual_sequential(self.model.layers, every, x, cos, sin)
  return (self.model.norm(x, r))
end

-- forward(batch) or forward(ids [, targets]): targets are the next tokens
-- (already shifted, as the loaders make them; -100 ignored). Returns the
-- mean cross-entropy and the logits, or the logits [B, T, vocab]. Tensor
-- parallel: the logits with the loss are this rank's vocabulary columns,
-- without targets all of them. With sequence_parallel the loss is the mean
-- over the whole sequences, the logits this rank's tokens'.
function Llama:forward(idx, targets)
  if type(idx) == 'table' then idx, targets = idx.x, idx.y end
  local logits = self.lm_head(self:hidden(idx))
  local g = self.tensor_group
  if g then
    -- tensor parallel: this rank's columns of the logits, and the loss from all of them
    if targets == nil then return nn.parallel.gather_from_region(logits, g) end
    return nn.parallel.vocab_parallel_cross_entropy(logits, targets, {
      group = g, vocab_start = self.model.embed_tokens.vocab_start }), logits
  end
  local V = self.config.vocab_size
  if targets == nil then return VocabHead.real(logits, V) end
  local sp = rawget(self, 'seq')
  if sp then return sp:cross_entropy(logits, targets, { classes = V }), VocabHead.real(logits, V) end
  return VocabHead.loss(logits, targets, V)
end

function Llama:last_logits(idx)
  local x = self:hidden(idx)
  local logits = self.lm_head(x:narrow(2, x:size(2), 1))
  if self.tensor_group then logits = nn.parallel.gather_from_region(logits, self.tensor_group) end
  logits = VocabHead.real(logits, self.config.vocab_size)
  return logits:reshape({ idx:size(1), self.config.vocab_size })
end

function Llama:generate(idx, max_new_tokens, opts)
  return nn.generate(self, idx, max_new_tokens, opts)
end

function Llama:extra_repr()
  local c = self.config
  return string.format('n_layer=%d, n_head=%d, n_kv_head=%d, n_embd=%d, intermediate_size=%d, vocab_size=%d, '
                       .. 'block_size=%d', c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.intermediate_size,
                       c.vocab_size, c.block_size)
end

---------------------------------------------------------------- pipeline layers

-- Hugging Face's init on a module built without its own: N(0,
-- initializer_range) for every weight of 2 dims or more.
local function init_normal(m, cfg)
  for _, p in ipairs(m:parameters()) do
    if p:dim() >= 2 then nn.init.normal_(p, 0, cfg.initializer_range) end
  end
  return m
end

-- The Llama of cfg as ds.pipe layers: the embedding, the decoder layers
-- (each with its own rotary tables, rotating at positions 0..T-1), the
-- final norm, the lm_head (a TiedLayerSpec 'embed' with the embedding
-- under tie_embeddings); and the loss_fn for them (the mean cross-entropy,
-- targets -100 ignored). With tp above 1, cfg.topology is the pipeline's
-- (a ds.topology of pipe, data and tensor axes) and each layer is drawn
-- whole, then split over its tensor group as Llama:split splits the model:
-- the embedding and the lm_head by vocabulary (the loss vocab-parallel),
-- q, k, v and gate, up column- and o, down row-parallel.
function M.pipe_layers(cfg)
  cfg = M.config(cfg)
  local P, pipe = nn.parallel, ds.pipe
  local g = P.pipe_group('llama.pipe_layers', cfg)
  local where = { dtype = cfg.dtype, device = cfg.device }
  local function whole(make) return init_normal(nn.skip_init(make), cfg) end
  local Embedding = nn.Module:extend('LlamaEmbedding')
  function Embedding:init()
    local e = whole(function() return nn.Embedding(cfg.vocab_size, cfg.n_embd, where) end)
    self.embed = g and P.VocabParallelEmbedding(e, { group = g }) or e
    self.weight = self.embed.weight      -- the tied lm_head's, by this name
  end
  function Embedding:forward(ids) return self.embed(ids) end
  local Head = nn.Module:extend('LlamaHead')
  function Head:init()
    local l = whole(function() return nn.Linear(cfg.n_embd, cfg.vocab_size, { bias = false, dtype = cfg.dtype,
                                                                              device = cfg.device }) end)
    l.fp8 = false     -- as VocabHead's: the logits stay out of ds.fp8
    self.lm_head = g and P.ColumnParallelLinear(l, { group = g }) or l
  end
  function Head:forward(x) return self.lm_head(x) end
  local PipeLayer = Layer:extend('LlamaDecoderLayer')
  function PipeLayer:init()
    nn.skip_init(Layer.init, self, cfg)
    init_normal(self, cfg)
    if g then split_layer(self, g) end
    local cos, sin = rope_tables(cfg)
    self:register_buffer('rope_cos', cos, false)
    self:register_buffer('rope_sin', sin, false)
  end
  function PipeLayer:forward(x, res)
    local T = x:size(2)
    return Layer.forward(self, x, self.rope_cos:narrow(1, 1, T), self.rope_sin:narrow(1, 1, T), res)
  end
  local function tied_head(e, x)
    return ds.linear(g and P.copy_to_region(x, g) or x, e.weight)
  end
  local layers = { cfg.tie_embeddings and pipe.TiedLayerSpec { 'embed', Embedding } or pipe.LayerSpec(Embedding) }
  for _ = 1, cfg.n_layer do layers[#layers + 1] = pipe.LayerSpec(PipeLayer) end
  layers[#layers + 1] = pipe.LayerSpec(nn.RMSNorm, cfg.n_embd, { eps = cfg.norm_eps, dtype = cfg.dtype,
                                                                 device = cfg.device })
  layers[#layers + 1] = cfg.tie_embeddings and pipe.TiedLayerSpec { 'embed', Embedding, forward_fn = tied_head }
                        or pipe.LayerSpec(Head)
  local V = cfg.vocab_size
  local function loss(out, targets)
    if not g then return ds.cross_entropy(out, targets) end
    return P.vocab_parallel_cross_entropy(out, targets, { group = g, vocab_start = g:rank() * V / g:size() })
  end
  return layers, loss
end

---------------------------------------------------------------- Hugging Face's folders

local hf = require 'models.hf'

-- config.json's key -> the config's (LlamaConfig's names).
local HF_KEYS = {
  hidden_size = 'n_embd', intermediate_size = 'intermediate_size', num_hidden_layers = 'n_layer',
  num_attention_heads = 'n_head', num_key_value_heads = 'n_kv_head', rms_norm_eps = 'norm_eps',
  rope_theta = 'rope_theta', vocab_size = 'vocab_size', max_position_embeddings = 'block_size',
  tie_word_embeddings = 'tie_embeddings', initializer_range = 'initializer_range',
}

-- Settings of LlamaConfig this model does not implement, refused unless
-- at the value it builds.
local HF_REFUSED = {
  rope_scaling = {}, attention_bias = { false }, mlp_bias = { false }, hidden_act = { 'silu' },
  attention_dropout = { 0, 0.0 },
}

-- from_hf(dir [, overrides]) -> a Llama with the weights of a Hugging Face
-- folder (config.json and model.safetensors or the sharded index), f32,
-- bf16 or f16 in the files, converted to the config's dtype (overrides:
-- dtype, device, checkpoint, tp, ...). Inside ds.zero.Init each rank
-- reads only its shards' ranges of the files (partitioned = true says so).
function M.from_hf(dir, overrides)
  local who = 'llama.from_hf'
  overrides = hf.overrides(overrides, who)
  local config, sd = hf.load(dir, who)
  if not config then error(who .. ": expected a folder with config.json, got '" .. dir .. "'", 0) end
  hf.check_type(config, 'llama', who)
  hf.require_values(config, HF_REFUSED, who)
  local d = config.num_attention_heads and config.hidden_size and config.hidden_size / config.num_attention_heads
  hf.require_values(config, { head_dim = { d } }, who)
  local cfg = {}
  for key, name in pairs(HF_KEYS) do
    if config[key] ~= nil and config[key] ~= json.null then cfg[name] = config[key] end
  end
  cfg.tie_embeddings = cfg.tie_embeddings or false
  for k, v in pairs(overrides or {}) do cfg[k] = v end
  for name in pairs(sd) do     -- the rotary tables older transformers saved: built here from rope_theta
    if name:match('%.rotary_emb%.inv_freq$') then sd[name] = nil end
  end
  -- the files hold whole weights: a tensor-parallel model splits once they are in
  local tp, topology = cfg.tp, cfg.topology
  cfg.tp, cfg.topology = nil, nil
  local model = Llama(cfg)
  if model.config.tie_embeddings then sd['lm_head.weight'] = sd['lm_head.weight'] or sd['model.embed_tokens.weight'] end
  hf.load_state_dict(model, sd, who)
  if tp or topology then model:parallelize(tp, topology) end
  return model
end

-- save_hf(model, dir [, opts]): config.json and safetensors that
-- transformers' LlamaForCausalLM.from_pretrained loads; opts.dtype ('f32',
-- 'bf16', 'f16'; the model's by default), opts.max_shard_bytes (shards and
-- model.safetensors.index.json above it; 5 GiB by default). A tied lm_head
-- is written once, as the embedding.
function M.save_hf(model, dir, opts)
  local c = model.config
  nn.parallel.check_whole(model, 'llama.save_hf')
  local config = { architectures = { 'LlamaForCausalLM' }, model_type = 'llama', hidden_act = 'silu',
                   attention_bias = false, mlp_bias = false, rope_scaling = json.null,
                   head_dim = c.n_embd / c.n_head }
  for key, name in pairs(HF_KEYS) do config[key] = c[name] end
  local entries = {}
  for _, e in ipairs(model:named_parameters()) do
    if not (c.tie_embeddings and e[1] == 'lm_head.weight') then entries[#entries + 1] = e end
  end
  hf.save(dir, config, entries, opts, 'llama.save_hf')
end

return setmetatable(M, { __call = function(_, cfg) return Llama(cfg) end })
