-- The layers of ds.nn, torch.nn's names, parameter names, layouts and
-- initial distributions: Linear, Conv2d, pools, Embedding, the norms,
-- Dropout, activations, Flatten, ModuleList, Sequential and causal
-- self-attention. It adds them to nn and returns nothing, so that the
-- table is loaded (and help() names it) as dslua.nn alone.
local ds = require 'dslua'
local base = require 'dslua.nn.module'
local nn, fmt, shape_str, check_int, options = base.nn, base.fmt, base.shape_str, base.check_int, base.options
local shape_of, empty, is_module, Module = base.shape_of, base.empty, base.is_module, base.Module
local fp8 = require 'dslua.nn.fp8'

-- ---- layers ----

local Linear = Module:extend('Linear')
nn.Linear = Linear

-- Linear(in_features, out_features [, {bias = true, dtype, device}] or bias):
-- weight [out, in] and bias uniform in +-1/sqrt(in), which is torch's
-- kaiming_uniform(a = sqrt(5)) and its bias rule.
function Linear:init(in_features, out_features, opts)
  opts = options(opts, 'Linear', { bias = true, dtype = 'f32', device = 'cpu' }, 'bias')
  self.in_features = check_int(in_features, 'Linear', 'in_features')
  self.out_features = check_int(out_features, 'Linear', 'out_features')
  local bound = 1 / math.sqrt(in_features)
  self:register_parameter('weight', nn.init.uniform_(empty({ out_features, in_features }, opts), -bound, bound))
  self:register_parameter('bias', opts.bias and nn.init.uniform_(empty({ out_features }, opts), -bound, bound) or nil)
end

-- In fp8 inside ds.fp8.autocast, unless the module says fp8 = false.
function Linear:forward(x)
  local r = fp8.active()
  if r and rawget(self, 'fp8') ~= false then
    return fp8.linear(r, r:layer(self), x, self.weight, self.bias, r.sequence_group, fp8.TOKENS)
  end
  return ds.linear(x, self.weight, self.bias)
end

function Linear:extra_repr()
  return fmt('in_features=%d, out_features=%d, bias=%s', self.in_features, self.out_features, tostring(self.bias ~= nil))
end

local function pair(v, who, what, min)
  if type(v) == 'table' then
    if #v ~= 2 then error(fmt('%s: %s must be an integer or {h, w}', who, what), 4) end
    return { check_int(v[1], who, what, min), check_int(v[2], who, what, min) }
  end
  check_int(v, who, what, min)
  return { v, v }
end

local Conv2d = Module:extend('Conv2d')
nn.Conv2d = Conv2d

-- Conv2d(in_channels, out_channels, kernel_size [, {stride = 1, padding = 0,
-- dilation = 1, groups = 1, bias = true, dtype, device}]): weight
-- [out, in/groups, kh, kw], initialised as torch (bound 1/sqrt(fan_in)).
function Conv2d:init(in_channels, out_channels, kernel_size, opts)
  opts = options(opts, 'Conv2d', { stride = 1, padding = 0, dilation = 1, groups = 1, bias = true,
                                   dtype = 'f32', device = 'cpu' })
  self.in_channels = check_int(in_channels, 'Conv2d', 'in_channels')
  self.out_channels = check_int(out_channels, 'Conv2d', 'out_channels')
  self.kernel_size = pair(kernel_size, 'Conv2d', 'kernel_size')
  self.stride = pair(opts.stride, 'Conv2d', 'stride')
  self.padding = pair(opts.padding, 'Conv2d', 'padding', 0)
  self.dilation = pair(opts.dilation, 'Conv2d', 'dilation')
  self.groups = check_int(opts.groups, 'Conv2d', 'groups')
  if in_channels % self.groups ~= 0 or out_channels % self.groups ~= 0 then
    error(fmt('Conv2d: in_channels %d and out_channels %d must both be divisible by groups %d',
              in_channels, out_channels, self.groups), 3)
  end
  local w = empty({ out_channels, in_channels / self.groups, self.kernel_size[1], self.kernel_size[2] }, opts)
  local bound = 1 / math.sqrt(nn.init.fan_in(w))
  self:register_parameter('weight', nn.init.uniform_(w, -bound, bound))
  self:register_parameter('bias', opts.bias and nn.init.uniform_(empty({ out_channels }, opts), -bound, bound) or nil)
  self.conv_opts = { stride = self.stride, padding = self.padding, dilation = self.dilation, groups = self.groups }
end

function Conv2d:forward(x) return ds.conv2d(x, self.weight, self.bias, self.conv_opts) end

function Conv2d:extra_repr()
  local k, s, p = self.kernel_size, self.stride, self.padding
  return fmt('%d, %d, kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d)%s', self.in_channels,
             self.out_channels, k[1], k[2], s[1], s[2], p[1], p[2], self.bias and '' or ', bias=false')
end

local MaxPool2d = Module:extend('MaxPool2d')
nn.MaxPool2d = MaxPool2d

-- MaxPool2d(kernel_size [, {stride = kernel_size, padding = 0}])
function MaxPool2d:init(kernel_size, opts)
  opts = options(opts, 'MaxPool2d', { stride = nn.NONE, padding = 0 })
  self.kernel_size = pair(kernel_size, 'MaxPool2d', 'kernel_size')
  self.pool_opts = { stride = opts.stride and pair(opts.stride, 'MaxPool2d', 'stride') or self.kernel_size,
                     padding = pair(opts.padding, 'MaxPool2d', 'padding', 0) }
end

function MaxPool2d:forward(x) return ds.max_pool2d(x, self.kernel_size, self.pool_opts) end

function MaxPool2d:extra_repr()
  return fmt('kernel_size=%d, stride=%d', self.kernel_size[1], self.pool_opts.stride[1])
end

local AvgPool2d = Module:extend('AvgPool2d')
nn.AvgPool2d = AvgPool2d

-- AvgPool2d(kernel_size [, {stride = kernel_size, padding = 0, count_include_pad = true}])
function AvgPool2d:init(kernel_size, opts)
  opts = options(opts, 'AvgPool2d', { stride = nn.NONE, padding = 0, count_include_pad = true })
  self.kernel_size = pair(kernel_size, 'AvgPool2d', 'kernel_size')
  self.pool_opts = { stride = opts.stride and pair(opts.stride, 'AvgPool2d', 'stride') or self.kernel_size,
                     padding = pair(opts.padding, 'AvgPool2d', 'padding', 0),
                     count_include_pad = opts.count_include_pad }
end

function AvgPool2d:forward(x) return ds.avg_pool2d(x, self.kernel_size, self.pool_opts) end

AvgPool2d.extra_repr = MaxPool2d.extra_repr

local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding

-- Embedding(num_embeddings, embedding_dim [, {dtype, device}]): weight
-- [num, dim] drawn from N(0, 1) as torch; ids are 0-based (i64 or i32).
function Embedding:init(num_embeddings, embedding_dim, opts)
  opts = options(opts, 'Embedding', { dtype = 'f32', device = 'cpu' })
  self.num_embeddings = check_int(num_embeddings, 'Embedding', 'num_embeddings')
  self.embedding_dim = check_int(embedding_dim, 'Embedding', 'embedding_dim')
  self:register_parameter('weight', nn.init.normal_(empty({ num_embeddings, embedding_dim }, opts), 0, 1))
end

function Embedding:forward(ids) return ds.embedding(self.weight, ids) end

function Embedding:extra_repr() return fmt('%d, %d', self.num_embeddings, self.embedding_dim) end

local LayerNorm = Module:extend('LayerNorm')
nn.LayerNorm = LayerNorm

-- LayerNorm(normalized_shape [, {eps = 1e-5, elementwise_affine = true,
-- bias = true, dtype, device}]): weight ones, bias zeros.
function LayerNorm:init(normalized_shape, opts)
  opts = options(opts, 'LayerNorm', { eps = 1e-5, elementwise_affine = true, bias = true, dtype = 'f32', device = 'cpu' })
  self.normalized_shape = shape_of(normalized_shape, 'LayerNorm')
  self.eps = opts.eps
  if opts.elementwise_affine then
    self:register_parameter('weight', nn.init.ones_(empty(self.normalized_shape, opts)))
    self:register_parameter('bias', opts.bias and empty(self.normalized_shape, opts) or nil)
  end
end

-- ln(x), or ln(x, res) -> ln(x + res), x + res: a residual add and the
-- norm after it in one kernel each way (ds.add_layer_norm); x and res of
-- one shape and dtype. ln(x, false) -> ln(x), x: the same pair with no
-- residual to add.
LayerNorm.residual_kind = 'norm'     -- ds.checkpointing.sequential hands it a residual
function LayerNorm:forward(x, res)
  if res then return ds.add_layer_norm(x, res, self.normalized_shape, self.weight, self.bias, self.eps) end
  local y = ds.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
  if res == false then return y, x end
  return y
end

function LayerNorm:extra_repr()
  return fmt('{%s}, eps=%g', table.concat(self.normalized_shape, ', '), self.eps)
end

local RMSNorm = Module:extend('RMSNorm')
nn.RMSNorm = RMSNorm

-- RMSNorm(normalized_shape [, {eps, elementwise_affine = true, dtype, device}]):
-- x / sqrt(mean(x^2) + eps) * weight; eps defaults to the dtype's machine
-- epsilon, as torch.nn.RMSNorm.
function RMSNorm:init(normalized_shape, opts)
  opts = options(opts, 'RMSNorm', { eps = nn.NONE, elementwise_affine = true, dtype = 'f32', device = 'cpu' })
  self.normalized_shape = shape_of(normalized_shape, 'RMSNorm')
  self.eps = opts.eps
  if opts.elementwise_affine then
    self:register_parameter('weight', nn.init.ones_(empty(self.normalized_shape, opts)))
  end
end

-- norm(x), or norm(x, res) -> norm(x + res), x + res in one kernel each
-- way (ds.add_rms_norm), and norm(x, false) -> norm(x), x, as LayerNorm's
RMSNorm.residual_kind = 'norm'
function RMSNorm:forward(x, res)
  if res then return ds.add_rms_norm(x, res, self.normalized_shape, self.weight, self.eps) end
  local y = ds.rms_norm(x, self.normalized_shape, self.weight, self.eps)
  if res == false then return y, x end
  return y
end

function RMSNorm:extra_repr()
  return fmt('{%s}, eps=%s', table.concat(self.normalized_shape, ', '), tostring(self.eps))
end

local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout

-- Dropout(p = 0.5): zeroes with probability p and scales by 1/(1-p) while
-- training; the identity in eval mode.
function Dropout:init(p)
  p = p == nil and 0.5 or p
  if type(p) ~= 'number' or p < 0 or p > 1 then
    error(fmt('Dropout: p must be a number in [0, 1], got %s', tostring(p)), 3)
  end
  self.p = p
end

function Dropout:forward(x)
  if not self.training or self.p == 0 then return x end
  return ds.dropout(x, self.p, true)
end

function Dropout:extra_repr() return fmt('p=%g', self.p) end

-- Stateless activations.
local function activation(name, fn)
  local cls = Module:extend(name)
  cls.forward = function(_, x) return fn(x) end
  nn[name] = cls
  return cls
end

activation('ReLU', ds.relu)
activation('SiLU', ds.silu)
activation('Tanh', ds.tanh)
activation('Sigmoid', ds.sigmoid)
activation('Identity', function(x) return x end)

local GELU = Module:extend('GELU')
nn.GELU = GELU

-- GELU([approximate = 'none']) or GELU{approximate = 'tanh'}: erf form or
-- the tanh approximation GPT-2 uses.
function GELU:init(opts)
  opts = options(opts, 'GELU', { approximate = 'none' }, 'approximate')
  if opts.approximate ~= 'none' and opts.approximate ~= 'tanh' then
    error(fmt("GELU: approximate must be 'none' or 'tanh', got %s", tostring(opts.approximate)), 3)
  end
  self.approximate = opts.approximate
end

function GELU:forward(x) return ds.gelu(x, self.approximate) end

function GELU:extra_repr() return self.approximate == 'tanh' and "approximate='tanh'" or '' end

local Flatten = Module:extend('Flatten')
nn.Flatten = Flatten

-- Flatten([start_dim = 2 [, end_dim = -1]]): dims 1-based, so the default
-- keeps the batch dim as torch's Flatten(1, -1) does.
function Flatten:init(start_dim, end_dim)
  self.start_dim, self.end_dim = start_dim or 2, end_dim or -1
end

function Flatten:forward(x)
  local s, n = x:size(), x:dim()
  local a = self.start_dim < 0 and n + 1 + self.start_dim or self.start_dim
  local b = self.end_dim < 0 and n + 1 + self.end_dim or self.end_dim
  if a < 1 or b > n or a > b then
    error(fmt('Flatten: dims %d..%d out of range for input %s', self.start_dim, self.end_dim, shape_str(x)), 2)
  end
  local shape = {}
  for i = 1, a - 1 do shape[#shape + 1] = s[i] end
  local m = 1
  for i = a, b do m = m * s[i] end
  shape[#shape + 1] = m
  for i = b + 1, n do shape[#shape + 1] = s[i] end
  return x:reshape(shape)
end

-- ---- containers ----

local function add_list(self, who, mods)
  for i, m in ipairs(mods) do
    if not is_module(m) then error(fmt('%s: element %d is a %s, expected a module', who, i, type(m)), 4) end
    self[#self + 1] = m
  end
end

local ModuleList = Module:extend('ModuleList')
nn.ModuleList = ModuleList

-- ModuleList({m1, m2, ...}): self[1], self[2] ... named "0", "1" ...;
-- iterate with ipairs, grow with append.
function ModuleList:init(mods) add_list(self, 'ModuleList', mods or {}) end

function ModuleList:append(m)
  add_list(self, 'ModuleList', { m })
  return self
end

local Sequential = Module:extend('Sequential')
nn.Sequential = Sequential

-- Sequential(m1, m2, ...) or Sequential({m1, m2, ...}): runs them in turn.
function Sequential:init(...)
  local first = ...
  local mods = (select('#', ...) == 1 and type(first) == 'table' and not is_module(first)) and first or { ... }
  add_list(self, 'Sequential', mods)
end

Sequential.append = ModuleList.append

function Sequential:forward(x)
  for _, m in ipairs(self) do x = m(x) end
  return x
end

-- ---- attention ----

local CausalSelfAttention = Module:extend('CausalSelfAttention')
nn.CausalSelfAttention = CausalSelfAttention

-- CausalSelfAttention{n_embd, n_head, bias = true, dropout = 0, dtype, device,
-- attention_backend = 'auto'}: nanoGPT's block: c_attn (the fused q,k,v
-- projection), the causal attention op (ds.qkv_attention with that backend),
-- c_proj, residual dropout. With attention dropout on in training the
-- scores are formed explicitly, since the attention op has no dropout.
function CausalSelfAttention:init(cfg)
  cfg = options(cfg, 'CausalSelfAttention', { n_embd = nn.NONE, n_head = nn.NONE, bias = true, dropout = 0,
                                              dtype = 'f32', device = 'cpu', attention_backend = 'auto' })
  local backend = cfg.attention_backend
  if backend ~= 'auto' and backend ~= 'fused' and backend ~= 'math' then
    error(fmt("CausalSelfAttention: attention_backend must be 'auto', 'fused' or 'math', got %s", tostring(backend)), 3)
  end
  self.attention = { backend = backend }
  local C = check_int(cfg.n_embd, 'CausalSelfAttention', 'n_embd')
  self.n_head = check_int(cfg.n_head, 'CausalSelfAttention', 'n_head')
  if C % self.n_head ~= 0 then
    error(fmt('CausalSelfAttention: n_embd %d is not divisible by n_head %d', C, self.n_head), 3)
  end
  self.n_embd = C
  local lin = { bias = cfg.bias, dtype = cfg.dtype, device = cfg.device }
  self.c_attn = Linear(C, 3 * C, lin)
  self.c_proj = Linear(C, C, lin)
  self.attn_dropout = Dropout(cfg.dropout)
  self.resid_dropout = Dropout(cfg.dropout)
end

-- softmax(q k^T / sqrt(D) + causal mask) with dropout on the weights, times v.
local function attention_with_dropout(q, k, v, p)
  local T, D = q:size(3), q:size(4)
  local pos = ds.arange(T, 'i64', q:device())
  local visible = pos:view({ T, 1 }):ge(pos:view({ 1, T }))
  local att = ds.matmul(q, k:transpose(3, 4)) * (1 / math.sqrt(D))
  att = ds.where(visible, att, -math.huge):softmax(-1)
  return ds.matmul(ds.dropout(att, p, true), v)
end

-- With a sequence layout set (`attn.sequence = ds.sequence.new(P)`, as
-- models.gpt2's sequence_parallel does) x holds this rank's T / P tokens:
-- an all-to-all gives it every token of its n_head / P heads around the
-- attention (DeepSpeed-Ulysses).
function CausalSelfAttention:forward(x)
  if not ds.is_tensor(x) or x:dim() ~= 3 or x:size(3) ~= self.n_embd then
    error(fmt('CausalSelfAttention: expected x [B, T, %d], got %s', self.n_embd,
              ds.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  local qkv, sp = self.c_attn(x), rawget(self, 'sequence')
  if not sp then return self.resid_dropout(self.c_proj(self:attend(qkv))) end
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local nh, D = self.n_head, C / self.n_head
  qkv = sp:seq_to_heads(qkv:view({ B, T, 3, nh, D }))
  local full, mine = qkv:size(2), nh / sp.size
  local y = self:attend(qkv:view({ B, full, 3 * mine * D }), mine)
  y = sp:heads_to_seq(y:view({ B, full, 1, mine, D })):view({ B, T, C })
  return self.resid_dropout(self.c_proj(y))
end

-- The attention of qkv [B, T, 3C] (q, k, v side by side) over n_head
-- heads (self.n_head unless given): y [B, T, C].
function CausalSelfAttention:attend(qkv, n_head)
  local B, T, C = qkv:size(1), qkv:size(2), qkv:size(3) / 3
  local nh = n_head or self.n_head
  if self.attn_dropout.training and self.attn_dropout.p > 0 then
    local parts = qkv:split(C, 3)
    local q = parts[1]:view({ B, T, nh, C / nh }):transpose(2, 3)
    local k = parts[2]:view({ B, T, nh, C / nh }):transpose(2, 3)
    local v = parts[3]:view({ B, T, nh, C / nh }):transpose(2, 3)
    return attention_with_dropout(q, k, v, self.attn_dropout.p):transpose(2, 3):reshape({ B, T, C })
  end
  return ds.qkv_attention(qkv, nh, self.attention)    -- no split, transposes or concatenation in backward
end

function CausalSelfAttention:extra_repr() return fmt('n_embd=%d, n_head=%d', self.n_embd, self.n_head) end
