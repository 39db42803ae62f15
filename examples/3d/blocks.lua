-- Megatron's MLP block, as examples/3d/train.lua and spec/tp3d/train.lua
-- build it: LayerNorm, a column-parallel Linear (this tensor rank's share
-- of the 4W hidden units), GELU on them, a row-parallel Linear (its
-- all-reduce makes the output whole on every tensor rank), the residual.
--   require('blocks').layers(n, W, group) -> n LayerSpecs of Block(W, group)
local ds = require 'dslua'
local P = ds.nn.parallel

local M = {}

local Block = ds.nn.Module:extend('Block')
M.Block = Block

function Block:init(w, g)
  self.norm = ds.nn.LayerNorm(w)
  self.fc = P.ColumnParallelLinear(w, 4 * w, { group = g })
  self.proj = P.RowParallelLinear(4 * w, w, { group = g })
end

function Block:forward(x) return x + self.proj(ds.gelu(self.fc(self.norm(x)), 'tanh')) end

function M.layers(n, w, g)
  local out = {}
  for i = 1, n do out[i] = ds.pipe.LayerSpec(Block, w, g) end
  return out
end

return M
