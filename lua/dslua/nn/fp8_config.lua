-- The "fp8" block's checker (dslua's own block: DeepSpeed hands FP8 to
-- Transformer Engine, whose DelayedScaling these keys are), beside
-- nn/fp8.lua, which acts on it; ds.config and ds.fp8.recipe check with it.
local S = require 'dslua.base.schema'

local M = {}

M.SCHEMA = { fields = {
  enabled = S.bool(false),
  format = S.enum('hybrid', { 'hybrid', 'e4m3' }),
  recipe = S.enum('delayed', { 'delayed', 'current' }),
  amax_history_len = S.int(1024, 1),
  amax_compute_algo = S.enum('max', { 'max', 'most_recent' }),
  margin = S.int(0, 0, { max = 64 }),
} }

return M
