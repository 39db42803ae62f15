-- Run by spec/zero_spec.lua on 1 rank and under mpirun on 2: the kernels
-- (ds.kernel_calls) of the step engine's backward and step over n
-- parameters of 3 elements in k buckets, their gradients set by hand so
-- that none are autograd's: bf16 masters at stages 0-3 (reduced), fp32
-- flat (a backward that does not reduce), n 8 and 64, k 1, 2 and 4, the
-- second step's counts. On CPU ranks the collectives' own copies count
-- too, some in backward or in the step as they complete. Rank 0 writes
-- {case = {[n .. ' ' .. k] = {backward, step}}}.
local ds = require 'dslua'
package.path = 'spec/?.lua;' .. package.path
local write_json = require 'ranks.write_json'
local Z0 = require('dslua.core')._zero

local out_path = assert(arg[1], 'usage: kernels.lua out.json')

local CASES = {
  { name = 'bf16 stage 0', masters = true, stage = 0 },
  { name = 'bf16 stage 1', masters = true, stage = 1 },
  { name = 'bf16 stage 2', masters = true, stage = 2 },
  { name = 'bf16 stage 3', masters = true, stage = 3 },
  { name = 'f32 flat', masters = false, stage = 0 },
}

local function counts(case, n, k)
  local p = {}
  for i = 1, n do p[i] = ds.full({ 3 }, 0.5 + i, case.masters and 'bf16' or 'f32'):requires_grad_() end
  local opt, z
  local options = { stage = case.stage, masters = case.masters, comm_dtype = case.masters and 'bf16' or nil,
                    bucket_size = 3 * n / k, groups = { p }, persistence_threshold = 0 }
  if case.masters then
    z = Z0.engine(options)
    opt = ds.optim.SGD({ z:master(1) }, { lr = 0.01 })
    z:attach(opt)
  else
    opt = ds.optim.SGD(p, { lr = 0.01 })
    options.optimizer = opt
    z = Z0.engine(options)
  end
  assert(z:buckets() == k, case.name .. ': ' .. z:buckets() .. ' buckets')
  local backward, step
  for _ = 1, 2 do
    if case.stage == 3 then z:gather_all() end
    for i = 1, n do p[i].grad = ds.full({ 3 }, 0.25, p[i]:dtype()) end
    local k0 = ds.kernel_calls()
    z:backward(nil, case.masters)
    local k1 = ds.kernel_calls()
    z:step(opt.param_groups, 1, 1.0, case.masters)
    backward, step = k1 - k0, ds.kernel_calls() - k1
  end
  z:close()
  return { backward, step }
end

local out = {}
for _, case in ipairs(CASES) do
  out[case.name] = {}
  for _, n in ipairs({ 8, 64 }) do
    for _, k in ipairs({ 1, 2, 4 }) do out[case.name][n .. ' ' .. k] = counts(case, n, k) end
  end
end
if ds.comm.rank() == 0 then write_json(out_path, out) end
