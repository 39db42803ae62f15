-- The lm_head of models/gpt2.lua and models/llama.lua: a Linear [vocab,
-- n_embd] without bias whose GEMMs run on a row count padded to a multiple
-- of 64. cuBLAS takes a slow kernel for N = 50257 (GPT-2's vocab, what its
-- checkpoints hold) and a fast one for 50304. The parameter keeps the real
-- vocab, so parameters, state_dict, checkpoints and Hugging Face files see
-- only it: each forward multiplies by the weight with zero rows appended,
-- and M.loss and M.real count only the real columns, so a padded column
-- never wins a sample and never counts in the cross-entropy (its gradient
-- is zero).
--
-- The config key pad_vocab: 'auto' (pads on a GPU; on the CPU a round row
-- count gains nothing), a multiple to pad to on any device, or false.
local ds = require 'dslua'
local nn = ds.nn

local M = {}

-- The multiple a forward pads to under pad_vocab p, for a weight w; or false.
local function multiple(p, w)
  if p == 'auto' then return w:device() ~= 'cpu' and 64 end
  return p
end

-- M.head(n_embd, vocab, cfg) -> the lm_head: an nn.Linear without bias
-- (what tensor parallelism splits, as any Linear) whose forward pads under
-- cfg.pad_vocab; cfg.dtype, cfg.device.
function M.head(n_embd, vocab, cfg)
  local head = nn.Linear(n_embd, vocab, { bias = false, dtype = cfg.dtype, device = cfg.device })
  head.fp8 = false      -- the logits stay in the model's dtype under ds.fp8, as Transformer Engine's users keep them
  local p = cfg.pad_vocab
  if p then
    function head.forward(self, x)
      local w = self.weight
      local m = multiple(p, w)
      local extra = m and (-w:size(1)) % m or 0
      if extra > 0 then w = ds.cat({ w, ds.zeros({ extra, w:size(2) }, w:dtype(), w:device()) }, 1) end
      return ds.linear(x, w)
    end
  end
  return head
end

-- The pad_vocab key of a model's config checked, naming the model.
function M.check(who, cfg)
  local p = cfg.pad_vocab
  if p ~= 'auto' and p ~= false and (type(p) ~= 'number' or p ~= math.floor(p) or p < 1) then
    error(string.format("%s: pad_vocab must be 'auto', false or an integer >= 1, got %s", who, tostring(p)), 0)
  end
end

-- The logits [..., V] of the real vocab, a view of padded ones.
function M.real(logits, V)
  local d = logits:dim()
  return logits:size(d) > V and logits:narrow(d, 1, V) or logits
end

-- The mean cross-entropy over the first V columns of logits (read in
-- place: no copy of the real columns) and the real logits. opts as
-- ds.cross_entropy's.
function M.loss(logits, targets, V, opts)
  local o = { classes = V }
  for k, v in pairs(opts or {}) do o[k] = v end
  return ds.cross_entropy(logits, targets, o), M.real(logits, V)
end

return M
