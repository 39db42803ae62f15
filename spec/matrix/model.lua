-- The configuration matrix's model (spec/matrix_spec.lua, scripts/matrix.lua):
-- a token model of awkward shapes, as one module and as pipeline layers
-- with the same initial weights (layer i built from seed 1234 + i, as
-- ds.pipe.PipelineModule builds it). A 13 x 7 embedding tied to the
-- output head, a 7 -> 11 and an 11 -> 7 Linear (91, 77, 11, 77 and 7
-- elements: none splits evenly over 2 or 3 ranks), a parameter no forward
-- reads and one with no elements. At tensor degree t the hidden width is
-- 11 t, the 7 -> 11 t Linear split by columns and the 11 t -> 7 one by
-- rows (each rank's pieces 77, 11 and 77 elements again), through the
-- model's parallelize, which tensor_parallel.autotp_size calls.
local ds = require 'dslua'
local nn, pipe = ds.nn, ds.pipe

local M = { V = 13, D = 7, H = 11, T = 5, SEED = 1234 }

local Mid = nn.Module:extend('MatrixMid')
function Mid:init(h)
  self.fc = nn.Linear(M.D, h or M.H)
  self:register_parameter('unused', ds.randn({ 5 }))
  self:register_parameter('empty', ds.zeros({ 0 }))
end
function Mid:forward(x) return self.fc(x):tanh() + self.empty:sum() end

-- the head: logits from the embedding's own weight
local function head(emb, h) return h:matmul(emb.weight:t()) end

function M.loss(logits, y) return ds.cross_entropy(logits:reshape({ -1, M.V }):to('f32'), y:reshape({ -1 })) end

function M.pipe_layers(h)
  h = h or M.H
  return {
    pipe.TiedLayerSpec { 'wte', nn.Embedding, M.V, M.D },
    pipe.LayerSpec(Mid, h),
    pipe.LayerSpec(nn.Linear, h, M.D),
    pipe.TiedLayerSpec { 'wte', nn.Embedding, M.V, M.D, forward_fn = head },
  }
end

-- The same model as one module: children l1, l2, l3 (the layers' indices).
local Plain = nn.Module:extend('MatrixModel')
function Plain:init(tp)
  local rng = ds.get_rng_state()
  self.config = { tp = 1, width = M.H * tp }
  local layers = M.pipe_layers(self.config.width)
  for i = 1, 3 do
    ds.manual_seed(M.SEED + i)
    self['l' .. i] = layers[i]:build()
  end
  ds.set_rng_state(rng)
end
function Plain:forward(b)
  return M.loss(head(self.l1, self.l3(self.l2(self.l1(b.x)))), b.y)
end

-- parallelize(tp): the model split across tp ranks (built at that degree's width)
function Plain:parallelize(tp)
  return nn.parallel.parallelize(self, function(cfg)
    nn.parallel.degree('matrix model', cfg, { { 'hidden width', cfg.width } })
    return cfg
  end, 'matrix model', tp)
end

function Plain:split(g)
  self.l2.fc = nn.parallel.ColumnParallelLinear(self.l2.fc, { group = g })
  self.l3 = nn.parallel.RowParallelLinear(self.l3, { group = g })
end

-- The model whole, at tensor degree tp's width (1: 11).
function M.plain(tp) return Plain(tp or 1) end

function M.pipeline(stages)
  return pipe.PipelineModule { layers = M.pipe_layers(), num_stages = stages, loss_fn = M.loss,
                               partition_method = 'uniform', base_seed = M.SEED }
end

-- Every weight of this rank as f64 lists under the plain model's names
-- (a pipeline's layer k as l<k+1>; its tied module once, as l1; a split
-- model's gathered whole).
function M.weights(model)
  local out = {}
  local function add(prefix, mod)
    for _, e in ipairs(mod:named_parameters()) do out[prefix .. e[1]] = e[2]:to('f64'):reshape({ -1 }):totable() end
  end
  if model.tensor_group then
    for name, t in pairs(nn.parallel.full_state_dict(model)) do out[name] = t:to('f64'):reshape({ -1 }):totable() end
  elseif not model.is_pipeline then
    add('', model)
  else
    for k, mod in ipairs(model.layers) do add('l' .. (model.layer_of[k] + 1) .. '.', mod) end
  end
  return out
end

-- The samples of a run: n windows of T + 1 tokens, the same on every rank.
function M.data(n)
  local rng = ds.get_rng_state()
  ds.manual_seed(11)
  local tokens = (ds.rand(n, M.T + 1) * (M.V - 0.01)):to('i64')   -- truncated: 0 .. V - 1
  ds.set_rng_state(rng)
  return { x = tokens:narrow(2, 1, M.T):contiguous(), y = tokens:narrow(2, 2, M.T):contiguous() }
end

-- Samples first .. first + n - 1 (1-based) of data.
function M.slice(data, first, n)
  return { x = data.x:narrow(1, first, n):contiguous(), y = data.y:narrow(1, first, n):contiguous() }
end

return M
