-- The configuration matrix's settings: each factor and its values, the
-- DeepSpeed config of a cell, the error a refused combination must raise,
-- and the tolerance a cell is held to against the reference (one fp32
-- rank, stage 0, the whole global batch in one micro step).
local M = {}

M.STEPS = 3                 -- optimizer steps per cell
M.MICRO = 2                 -- samples per micro step (plain and pipeline cells)
M.UNEVEN = { 2, 1, 3 }      -- the uneven sampler's micro batch of rank 0, 1, 2
M.CLIP = 0.05               -- below every step's gradient norm here: clipping always acts
M.LR = 1e-2
M.SAVE = 1                  -- a resumed cell saves after this step and loads on resume_ranks(c) ranks
M.OFFLOAD_CHUNK = 16        -- elements a chunk of cpu offload's pipeline moves (DSLUA_TEST_OFFLOAD_CPU)

-- Factors in a fixed order: name, values (the first is the plain setting).
M.FACTORS = {
  { 'stage', { 0, 1, 2, 3 } },
  { 'ga', { 1, 3, 8, 33 } },
  { 'dtype', { 'f32', 'bf16', 'fp16' } },
  { 'ranks', { 1, 2, 3 } },
  { 'bucket', { 'default', 'one' } },      -- one: reduce_bucket_size 1, a bucket per parameter
  { 'clip', { 'off', 'on' } },
  { 'offload', { 'none', 'cpu', 'nvme' } },
  { 'sampler', { 'plain', 'uneven' } },
  { 'onebit', { 'none', 'OneBitAdam', 'ZeroOneAdam', 'OneBitLamb' } },
  { 'pipe', { 'none', 2, 3 } },            -- pipeline stages
  { 'tp', { 1, 2 } },                       -- tensor-parallel degree (tensor_parallel.autotp_size)
  { 'fp8', { 'none', 'current' } },         -- the fp8 block: every Linear in fp8, current scaling
  { 'ckpt', { 'none', 'resume' } },         -- resume: saved after step SAVE, loaded on resume_ranks(c) ranks
}

-- A cell's short name: "z2 ga33 bf16 r3 bucket1 clip off-nvme uneven OneBitAdam pipe2 tp2 fp8-current resume",
-- plain settings left out.
function M.name(c)
  local parts = { 'z' .. c.stage, 'ga' .. c.ga, c.dtype, 'r' .. c.ranks }
  if c.bucket ~= 'default' then parts[#parts + 1] = 'bucket1' end
  if c.clip == 'on' then parts[#parts + 1] = 'clip' end
  if c.offload ~= 'none' then parts[#parts + 1] = 'off-' .. c.offload end
  if c.sampler ~= 'plain' then parts[#parts + 1] = c.sampler end
  if c.onebit ~= 'none' then parts[#parts + 1] = c.onebit end
  if c.pipe ~= 'none' then parts[#parts + 1] = 'pipe' .. c.pipe end
  if c.tp ~= 1 then parts[#parts + 1] = 'tp' .. c.tp end
  if c.fp8 ~= 'none' then parts[#parts + 1] = 'fp8-' .. c.fp8 end
  if c.ckpt ~= 'none' then parts[#parts + 1] = c.ckpt end
  return table.concat(parts, ' ')
end

-- The combinations dslua refuses, in the order it checks them (the first
-- that applies is the message the cell must raise): the pipeline module
-- when built, then the config, then initialize's pipeline checks, then
-- its optimizer's.
M.REFUSALS = {
  { function(c) return c.pipe ~= 'none' and c.ranks % c.pipe ~= 0 end, 'do not split into' },
  { function(c) return c.tp ~= 1 and (c.pipe ~= 'none' and c.ranks / c.pipe or c.ranks) % c.tp ~= 0 end,
    'tensor_parallel: tensor parallelism over 2 ranks does not divide the world of' },
  { function(c) return c.onebit ~= 'none' and c.stage > 0 end, 'runs at ZeRO stage 0' },
  { function(c) return c.offload ~= 'none' and c.stage == 0 end,
    'zero_optimization.offload_optimizer: ZeRO-Offload needs zero_optimization.stage' },
  { function(c) return c.pipe ~= 'none' and c.stage >= 2 end, 'incompatible with pipeline parallelism' },
  { function(c) return c.pipe ~= 'none' and c.sampler ~= 'plain' end,
    'the sampler block does not run with a pipeline' },
  { function(c) return c.onebit == 'OneBitLamb' and c.tp ~= 1 end, "OneBitLamb under tensor parallelism" },
}

-- The message fragment a refused cell must raise, or nil for a cell that trains.
function M.refusal(c)
  for _, r in ipairs(M.REFUSALS) do
    if r[1](c) then return r[2] end
  end
  return nil
end

-- The optimizer block: AdamW, or a 1-bit one whose full-precision phase
-- (freeze_step past the last step; ZeroOneAdam's variance updated every
-- step through var_update_scaler) is AdamW or Lamb without bias correction.
-- eps 1e-3 bounds how much Adam magnifies a gradient's rounding (see
-- M.tolerance).
local ADAM = { lr = M.LR, eps = 1e-3, weight_decay = 0.01 }
function M.optimizer(c)
  local p = {}
  for k, v in pairs(ADAM) do p[k] = v end
  if c.onebit == 'none' then return { type = 'AdamW', params = p } end
  if c.onebit == 'ZeroOneAdam' then
    p.var_freeze_step, p.var_update_scaler = 1000, 1000
  else
    p.freeze_step = 1000
  end
  return { type = c.onebit, params = p }
end

-- The reference's optimizer: the counterpart of the cell's, over one rank.
function M.reference_optimizer(c)
  local p = {}
  for k, v in pairs(ADAM) do p[k] = v end
  if c.onebit == 'none' then return { type = 'AdamW', params = p } end
  p.bias_correction = false
  return { type = c.onebit == 'OneBitLamb' and 'Lamb' or 'AdamW', params = p }
end

-- The micro batch of each data-parallel rank (a list, rank 0 first);
-- c.micro where the cell gives it (a resumed cell's second run).
function M.micro_batches(c)
  if c.micro then return c.micro end
  local dp = math.floor(c.ranks / (c.pipe ~= 'none' and c.pipe or 1) / c.tp)
  local out = {}
  for r = 1, dp do out[r] = c.sampler == 'uneven' and M.UNEVEN[r] or M.MICRO end
  return out
end

-- Where a resumed cell loads: ranks and micro batches over the same
-- global batch, on another rank count (3 -> 2, 2 -> 1, 1 -> 2; split
-- evenly, under the uneven sampler the rest on the last rank) where its
-- data-parallel ranks can share a micro step's samples so; a pipeline's
-- or a tensor group's cell on its own count (at three ranks at most here
-- theirs is fixed).
function M.resume_ranks(c)
  local per = 0
  for _, b in ipairs(M.micro_batches(c)) do per = per + b end
  local m = c.ranks == 1 and 2 or c.ranks - 1
  if c.pipe ~= 'none' or c.tp ~= 1 or (c.sampler ~= 'uneven' and per % m ~= 0) then
    return c.ranks, M.micro_batches(c)
  end
  local micro, each = {}, math.floor(per / m)
  for r = 1, m do micro[r] = each end
  micro[m] = per - each * (m - 1)
  return m, micro
end

-- Samples in one optimizer step.
function M.global_batch(c)
  local s = 0
  for _, b in ipairs(M.micro_batches(c)) do s = s + b end
  return s * c.ga
end

-- The cell's DeepSpeed config; nvme: a folder for offloaded files.
function M.config(c, nvme)
  local zero = { stage = c.stage, stage3_param_persistence_threshold = 0,
                 stage3_gather_16bit_weights_on_model_save = true }
  if c.bucket == 'one' then zero.reduce_bucket_size = 1 end
  if c.offload ~= 'none' then
    -- sub_group_size 50: the streamed pieces split parameters unevenly
    zero.offload_optimizer = { device = c.offload, nvme_path = c.offload == 'nvme' and nvme or nil }
    zero.sub_group_size = 50
    if c.stage == 3 then
      zero.offload_param = { device = c.offload, nvme_path = c.offload == 'nvme' and nvme or nil }
    end
  end
  local cfg = {
    gradient_accumulation_steps = c.ga, steps_per_print = 1e9, optimizer = M.optimizer(c),
    gradient_clipping = c.clip == 'on' and M.CLIP or 0, zero_optimization = zero,
    bf16 = { enabled = c.dtype == 'bf16' },
    -- 2^8: no step overflows here (2^16, DeepSpeed's default, skips the
    -- first steps, which the reference takes)
    fp16 = { enabled = c.dtype == 'fp16', initial_scale_power = 8 },
  }
  if c.tp ~= 1 then cfg.tensor_parallel = { autotp_size = c.tp } end
  if c.fp8 ~= 'none' then cfg.fp8 = M.fp8(c) end
  if c.sampler == 'uneven' then
    cfg.sampler = { policy = 'uneven', micro_batch_per_rank = M.micro_batches(c) }
  else
    cfg.train_micro_batch_size_per_gpu = M.micro_batches(c)[1]
  end
  return cfg
end

-- The fp8 block of a cell (and of its reference: one rank in fp8 too).
function M.fp8(c) return { enabled = true, recipe = c.fp8 } end

-- The reference's config: one fp32 rank, stage 0, the global batch at
-- once, the cell's fp8 block (its model at the cell's width: model.lua).
function M.reference_config(c)
  return { train_batch_size = M.global_batch(c), steps_per_print = 1e9, optimizer = M.reference_optimizer(c),
           gradient_clipping = c.clip == 'on' and M.CLIP or 0, fp8 = c.fp8 ~= 'none' and M.fp8(c) or nil }
end

return M
