-- DeepSpeed's configs as users bring them (spec/dsconfigs/*.json): each runs
-- (spec/dsconfigs/run.lua: initialize and two steps) or stops at once with
-- one message naming the key, and `dslua --check-config` says the same
-- thing initialize does: the same verdict, the same message, the same notes.
local H = require 'helpers'

local dir = 'spec/dsconfigs/'

-- name, ranks, runs?, pieces both outputs hold
local CASES = {
  { 'newer_keys', 1, true, {
    "note: spec/dsconfigs/newer_keys.json: cuda_visible_devices: read by DeepSpeed's launcher scripts",
    'compile: DeepCompile (compiled ZeRO graphs) is not in dslua',
    'tensor_parallel: AutoTP is off (size <= 1)',
    'zero_optimization.zenflow: ZenFlow is not in dslua' } },
  { 'unknown_top', 1, true, {
    "warning: spec/dsconfigs/unknown_top.json: launcher_extras: unknown key, ignored (as DeepSpeed ignores it); "
    .. "the nearest known key is 'scheduler'" } },
  { 'typo_top', 1, false, { "gradient_clippin: unknown key, did you mean 'gradient_clipping'?" } },
  -- blocks DeepSpeed reads key by key, as the top level
  { 'lenient_blocks', 1, true, {
    'warning: spec/dsconfigs/lenient_blocks.json: activation_checkpointing.cpu_offload_hint: unknown key, ignored',
    'warning: spec/dsconfigs/lenient_blocks.json: flops_profiler.output_format: unknown key, ignored',
    'warning: spec/dsconfigs/lenient_blocks.json: checkpoint.async_save: unknown key, ignored' } },
  { 'lenient_typo', 1, false, { "flops_profiler.profile_stepp: unknown key, did you mean 'profile_step'?" } },
  { 'strict_block', 1, false, { 'bf16.loss_scale: unknown key (expected one of: bf16_master_weights_and_grads,' } },
  { 'hf_auto', 2, true, {
    'train_batch_size: "auto" resolved to 8 (train_batch_size = train_micro_batch_size_per_gpu * '
    .. 'gradient_accumulation_steps * world size = 4 * 1 * 2)',
    'gradient_accumulation_steps: "auto" resolved to 1',
    "gradient_clipping: \"auto\" resolved to 1 (Hugging Face's max_grad_norm default)",
    'fp16.enabled: "auto" resolved to false',
    'scheduler.params.warmup_min_lr: "auto" resolved to 0' } },
  { 'auto_steps', 1, false, { "scheduler.params.total_num_steps: \"auto\" is filled by Hugging Face's Trainer "
                              .. 'from its own step count, which dslua cannot know; give the number of steps' } },
  { 'compression', 1, false, { "compression_training: DeepSpeed's model compression library (quantization-aware "
                               .. 'training,', 'dslua does not have it yet (later work)' }, never_unknown = true },
  { 'data_efficiency', 1, false, { "data_efficiency: DeepSpeed's data efficiency library",
                                   'dslua does not have it yet (later work)' }, never_unknown = true },
  { 'quiet_blocks', 1, true, {
    'note: spec/dsconfigs/quiet_blocks.json: memory_breakdown: a DeepSpeed setting dslua does not act on',
    'zero_optimization.zero_quantized_gradients: ZeRO++ quantized gradients are not in dslua',
    'zero_optimization.mics_shard_size: MiCS is not in dslua' } },
  { 'offload_param', 2, true, {
    'zero_optimization.offload_param.buffer_count: dslua reads each shard into a buffer of its own' } },
  -- a block DeepSpeed's engine only stores, and a library switched on with every feature in it off
  { 'sparse_attention', 1, true, {
    "sparse_attention: DeepSpeed's engine only stores it for models built on its sparse attention kernels",
    "data_efficiency: DeepSpeed's data efficiency library (curriculum data sampling, random layerwise token "
    .. 'dropping): dslua does not have it; accepted as nothing in it is enabled' } },
  { 'auto_micro', 1, false, { 'train_micro_batch_size_per_gpu: "auto" has nothing to resolve from: Hugging Face\'s '
                              .. 'Trainer fills the batch sizes from per_device_train_batch_size; give a number, or '
                              .. 'the micro batch as batch_size to ds.initialize' } },
  -- what dslua does its own way, each noted under the key set
  { 'zero_inert', 1, true, {
    "weight_quantization: DeepSpeed reads it to quantize weights for ZeRO-Inference",
    'zero_optimization.overlap_comm: dslua launches each bucket\'s reduction while backward runs',
    'zero_optimization.contiguous_gradients: dslua always copies gradients into one flat buffer',
    'zero_optimization.reduce_scatter: dslua reduce-scatters the gradients from stage 1',
    'zero_optimization.allgather_partitions: dslua all-gathers the updated parameters from stage 1',
    'zero_optimization.allgather_bucket_size: dslua all-gathers the updated parameters in the buckets of '
    .. 'reduce_bucket_size',
    'zero_optimization.memory_efficient_linear: dslua\'s linear layers keep no gathered stage 3 weight',
    'zero_optimization.offload_optimizer.pin_memory: not acted on',
    'zero_optimization.zero_quantized_nontrainable_weights: ZeRO++ quantized frozen weights are not in dslua' },
    absent = { 'zero_quantized_weights:', 'unknown key' } },
  { 'lamb_fp16', 1, true, {} },
  { 'sampler_fp16', 1, true, { 'train_batch_size: 4 = sum(sampler.micro_batch_per_rank)' } },
  { 'nvme_lamb', 1, false, { 'optimizer.type: Lamb cannot be streamed from nvme (offload_optimizer.device)' } },
  { 'layout', 2, false, { 'sampler.data_share[0]: rank 0: its share 0.5 fills about 16 of its micro batch 48 each '
                          .. 'step (rank 1, share 0.5 in micro batches of 16, sets the number of steps), so its batch '
                          .. 'would be cut; give shares in proportion to the micro batches (0.75, 0.25) or '
                          .. 'micro_batch_per_rank 16, 16' } },
  { 'sequence_parallel', 1, false, { 'sequence_parallel_size: 2 ranks per sequence do not divide the world of 1 '
                                     .. 'rank' } },
  { 'tensor_parallel', 1, false, { 'tensor_parallel: tensor parallelism over 2 ranks does not divide the world of 1 rank' } },
}

-- Key paths dslua acts on (a path covers what is under it), or a function
-- of the value saying whether it acts on that value (the other values it
-- must note). Every other key a corpus config sets needs a note naming it.
local ACTED = {
  train_batch_size = true, train_micro_batch_size_per_gpu = true, gradient_accumulation_steps = true,
  steps_per_print = true, wall_clock_breakdown = true, gradient_clipping = true, prescale_gradients = true,
  gradient_predivide_factor = true, optimizer = true, scheduler = true, fp16 = true, bf16 = true, bfloat16 = true,
  communication_data_type = true, tensorboard = true, wandb = true, csv_monitor = true, comet = true,
  activation_checkpointing = true, flops_profiler = true, checkpoint = true, comms_logger = true,
  ['zero_optimization.stage'] = true, ['zero_optimization.reduce_bucket_size'] = true,
  ['zero_optimization.sub_group_size'] = true, ['zero_optimization.offload_optimizer.device'] = true,
  ['zero_optimization.offload_optimizer.nvme_path'] = true, ['zero_optimization.offload_param.device'] = true,
  ['zero_optimization.offload_param.nvme_path'] = true, ['zero_optimization.cpu_offload'] = true,
  ['zero_optimization.elastic_checkpoint'] = true, ['zero_optimization.load_from_fp32_weights'] = true,
  ['zero_optimization.ignore_unused_parameters'] = true,
  ['zero_optimization.overlap_comm'] = function(v) return v == true end,
  ['zero_optimization.contiguous_gradients'] = function(v) return v == true end,
  ['zero_optimization.reduce_scatter'] = function(v) return v == true end,
  ['zero_optimization.allgather_partitions'] = function(v) return v == true end,
  ['zero_optimization.memory_efficient_linear'] = function(v) return v == true end,
}
local STAGE3 = { 'prefetch_bucket_size', 'param_persistence_threshold', 'model_persistence_threshold',
                 'max_live_parameters', 'max_reuse_distance', 'gather_16bit_weights_on_model_save',
                 'gather_fp16_weights_on_model_save' }
for _, k in ipairs(STAGE3) do ACTED['zero_optimization.stage3_' .. k] = true end

-- The key paths of a config under prefix that are neither acted on nor
-- named by a note: a block is walked only where its own path is not acted on.
local function silent(v, prefix, notes, out)
  for k, x in pairs(v) do
    local path = prefix == '' and k or prefix .. '.' .. k
    local acted = ACTED[path]
    if type(acted) == 'function' then acted = acted(x) end
    if not acted and not notes:find(': ' .. path .. ':', 1, true) then     -- a note on a block covers its keys
      if type(x) == 'table' and next(x) ~= nil and #x == 0 then silent(x, path, notes, out)
      else out[#out + 1] = path end
    end
  end
  return out
end

local function lines_of(text, prefix)
  local out = {}
  for line in text:gmatch('[^\n]+') do
    if line:sub(1, #prefix) == prefix then out[#out + 1] = line end
  end
  table.sort(out)
  return out
end

describe('DeepSpeed configs', function()
  teardown(H.mpi_cleanup)
  for _, c in ipairs(CASES) do
    local name, np, runs, pieces = c[1], c[2], c[3], c[4]
    it(name .. (runs and ' runs' or ' stops at once') .. ', and --check-config agrees', function()
      local file = dir .. name .. '.json'
      local checked, cstatus = H.run(H.bin() .. ' --check-config ' .. file .. ' --world-size ' .. np)
      local ran, rstatus = H.run(H.ranks_cmd(np) .. ' ' .. dir .. 'run.lua --config ' .. file)
      -- mpirun forwards each rank's stderr as it comes, so a rank's device
      -- line can land inside rank 0's notes on stdout
      ran = ran:gsub('dslua: rank %d+ uses [^\n]*\n', '')
      assert.are.equal(runs, cstatus == 0, checked)
      assert.are.equal(runs, rstatus == 0, ran)
      for _, piece in ipairs(pieces) do
        H.has(checked, piece)
        H.has(ran, piece)
      end
      for _, piece in ipairs(c.absent or {}) do
        assert.is_nil(checked:find(piece, 1, true), checked)
      end
      if c.never_unknown then       -- refused for what it is
        assert.is_nil(checked:find('unknown key', 1, true), checked)
        assert.is_nil(ran:find('unknown key', 1, true), ran)
      end
      if runs then
        H.has(ran, 'ran 2 steps')
        -- rank 0 prints each note once, the ones --check-config prints
        for _, prefix in ipairs({ 'note: ', 'warning: ' }) do
          assert.are.same(lines_of(checked, prefix), lines_of(ran, prefix))
        end
      else
        local first = checked:match('[^\n]+')
        H.has(ran, first)      -- the same first problem
      end
    end)
  end

  it('fills an "auto" micro batch from the batch_size passed to initialize, as Hugging Face does', function()
    local ran, status = H.run(H.ranks_cmd(2) .. ' ' .. dir .. 'run.lua --config ' .. dir .. 'auto_micro.json --pass-batch')
    assert.are.equal(0, status, ran)
    H.has(ran, 'train_micro_batch_size_per_gpu: "auto" resolved to 4 (the batch_size passed to initialize)')
    H.has(ran, 'ran 2 steps')
  end)

  it('refuses a batch_size that is no micro batch, naming it', function()
    local ds = H.ds
    for _, bad in ipairs({ 0, 2.5, 'four' }) do
      local ok, err = pcall(ds.initialize, { model = ds.nn.Linear(2, 2), batch_size = bad,
                                             config = { train_micro_batch_size_per_gpu = 'auto' } })
      assert.is_false(ok)
      H.has(tostring(err), 'initialize: batch_size must be a positive integer, got ' .. tostring(bad))
    end
  end)

  it('says once that fp16 is slower than fp32 and bf16 on the CPU', function()
    local ran, status = H.run(H.ranks_cmd(2) .. ' ' .. dir .. 'run.lua --config ' .. dir .. 'lamb_fp16.json')
    assert.are.equal(0, status, ran)
    local _, n = ran:gsub('dslua: fp16 on the CPU: oneDNN 2.x has no f16 matmul', '')
    assert.are.equal(1, n, ran)
  end)

  it('takes a library\'s own switch on as nothing on until a feature in it is', function()
    local config = require 'dslua.config'
    for _, block in ipairs({ { enabled = true }, { enabled = true, data_sampling = { enabled = false } } }) do
      local cfg, problems = config.check({ train_batch_size = 8, data_efficiency = block })
      assert.is_not_nil(cfg, table.concat(problems, '\n'))
    end
    local cfg, problems = config.check({ train_batch_size = 8, data_efficiency = { data_sampling = {
      enabled = true, curriculum_learning = { enabled = false } } } })
    assert.is_nil(cfg)
    H.has(problems[1], "data_efficiency: DeepSpeed's data efficiency library")
  end)

  it('notes offload_param buffers only where a config sets them', function()
    local config = require 'dslua.config'
    local z3 = { stage = 3, offload_param = { device = 'cpu' } }
    local _, _, notes = config.check({ train_batch_size = 8, zero_optimization = z3 })
    assert.is_nil(table.concat(notes, '\n'):find('buffer_count', 1, true))
    z3.offload_param.max_in_cpu = 1e9
    _, _, notes = config.check({ train_batch_size = 8, zero_optimization = z3 })
    H.has(table.concat(notes, '\n'), 'zero_optimization.offload_param.max_in_cpu: dslua reads each shard')
  end)

  -- DeepSpeed's configs as found (spec/dsconfigs/corpus/SOURCES names each one's
  -- origin), never edited to pass: each is refused naming a key it sets,
  -- or accepted with every key either acted on or noted
  it('acts on, notes or refuses by name every key of a corpus of real configs', function()
    local config, json = require 'dslua.config', require 'dslua.base.json'
    local n = 0
    for line in io.lines(dir .. 'corpus/SOURCES') do
      local name = line:match('^(%S+%.json) ')
      if name then
        n = n + 1
        local path = dir .. 'corpus/' .. name
        local raw = json.decode(assert(io.open(path)):read('*a'), path)
        local cfg, problems, notes = config.check(path)
        if cfg then
          local left = silent(raw, '', table.concat(notes, '\n'), {})
          assert.are.same({}, left, name .. ': keys neither acted on nor noted')
        else
          for _, p in ipairs(problems) do
            local key = p:sub(#path + 3):match('^([%w_]+)')
            local missing = p:find('needs to be provided', 1, true) or p:find(': missing', 1, true)
            assert.is_not_nil(key and (raw[key] or missing), name .. ': refused without naming a key it sets: ' .. p)
          end
        end
      end
    end
    assert.is_true(n >= 40, 'the corpus has ' .. n .. ' configs')
  end)

  it('offloads stage 3 parameters as offload_param says, and says so', function()
    local ran = H.run(H.ranks_cmd(2) .. ' ' .. dir .. 'run.lua --config ' .. dir .. 'offload_param.json')
    H.has(ran, 'ZeRO stage 3 | rank 1 | optimizer holds')
    H.has(ran, '| parameter offload cpu')
    H.has(ran, 'ZeRO | offload_param device cpu: the parameter shards are in host memory already here (no-op)')
  end)

  it('resolves "auto" optimizer and scheduler params from the optimizer passed to initialize', function()
    local ran, status = H.run(H.ranks_cmd(1) .. ' ' .. dir .. 'run.lua --config ' .. dir .. 'hf_auto.json --pass-optimizer')
    assert.are.equal(0, status, ran)
    H.has(ran, 'optimizer.params.lr: "auto" resolved to 0.005 (from the optimizer passed to initialize)')
    H.has(ran, 'optimizer.params.weight_decay: "auto" resolved to 0.02 (from the optimizer passed to initialize)')
    H.has(ran, 'optimizer.params.betas: "auto" resolved to [0.9,0.999] (from the optimizer passed to initialize)')
    H.has(ran, 'scheduler.params.warmup_max_lr: "auto" resolved to 0.005 (the lr of the optimizer passed to initialize)')
    -- without one, what the block gets by default, and --check-config says so
    local checked = H.run(H.bin() .. ' --check-config ' .. dir .. 'hf_auto.json')
    H.has(checked, "optimizer.params.lr: \"auto\" resolved to 0.001 (the optimizer's default")
    H.has(checked, "scheduler.params.warmup_max_lr: \"auto\" resolved to 0.001 (the optimizer block's lr)")
  end)

  it('resolves "auto" scheduler params from the scheduler passed to initialize', function()
    local ran, status = H.run(H.ranks_cmd(1) .. ' ' .. dir .. 'run.lua --config ' .. dir
                              .. 'hf_auto_steps.json --pass-scheduler')
    assert.are.equal(0, status, ran)
    H.has(ran, 'scheduler.params.warmup_num_steps: "auto" resolved to 3 (from the scheduler passed to initialize)')
    H.has(ran, 'scheduler.params.total_num_steps: "auto" resolved to 40 (from the scheduler passed to initialize)')
    -- without one the step counts cannot be known
    local checked = H.run(H.bin() .. ' --check-config ' .. dir .. 'hf_auto_steps.json')
    H.has(checked, "scheduler.params.total_num_steps: \"auto\" is filled by Hugging Face's Trainer")
  end)

  it('resolves ZeRO\'s "auto" bucket sizes from the model\'s hidden size, as Hugging Face does', function()
    local config = require 'dslua.config'
    local block = { train_batch_size = 8, zero_optimization = { stage = 3, reduce_bucket_size = 'auto',
                    stage3_prefetch_bucket_size = 'auto', stage3_param_persistence_threshold = 'auto' } }
    local cfg, notes = config.load(block, { given = { hidden_size = 64 } })
    assert.are.equal(4096, cfg.zero_optimization.reduce_bucket_size)
    assert.are.equal(3686, cfg.zero_optimization.stage3_prefetch_bucket_size)
    assert.are.equal(640, cfg.zero_optimization.stage3_param_persistence_threshold)
    H.has(table.concat(notes, '\n'), 'zero_optimization.reduce_bucket_size: "auto" resolved to 4096 (hidden size^2)')
    cfg, notes = config.load(block)
    assert.are.equal(5e8, cfg.zero_optimization.reduce_bucket_size)
    H.has(table.concat(notes, '\n'), "zero_optimization.reduce_bucket_size: \"auto\" resolved to 500000000 "
          .. "(DeepSpeed's default)")
  end)
end)
