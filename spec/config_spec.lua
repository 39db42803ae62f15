-- ds.json, ds.config (DeepSpeed's config semantics), ds.args and
-- `dslua --check-config`.
local H = require 'helpers'
local json = require 'dslua.base.json'
local config = require 'dslua.config'
local args = require 'dslua.base.args'

local bin, tmpdir, write, err, has = H.bin(), H.tmpdir, H.write, H.err, H.has

-- stdout and exit status of a command, stderr dropped
local function run_stdout(cmd)
  local f = io.popen(cmd .. ' 2>/dev/null; echo "exit:$?"')
  local out = f:read('*a')
  f:close()
  local status = tonumber(out:match('exit:(%d+)%s*$'))
  return (out:gsub('exit:%d+%s*$', '')), status
end

describe('ds.json', function()
  it('decodes JSON with the comments and trailing commas DeepSpeed accepts', function()
    local v = json.decode([[
# a hash comment
{
  // a line comment
  "a": 1, /* a block
  comment */ "url": "http://x//y#z /* kept */",
  "list": [1, 2.5, true, null, "s\u00e9",],
  "nested": {"empty": {}, "none": []},
}
]], 'x.json')
    assert.are.equal(1, v.a)
    assert.are.equal('http://x//y#z /* kept */', v.url)
    assert.are.same({ 1, 2.5, true, json.null, 'sé' }, { unpack(v.list, 1, 5) })
    assert.is_true(json.is_array(v.list))
    assert.is_true(json.is_array(v.nested.none))
    assert.is_false(json.is_array(v.nested.empty))
    assert.are.equal(json.null, v.list[4])
  end)

  it('names the source, line and column of a syntax error', function()
    has(err(json.decode, '{"a": tru}', 'f.json'), 'f.json:1:7: invalid JSON near \'tru}\'')
    has(err(json.decode, '{\n"a": 1\n"b": 2}', 'f.json'), 'f.json:3:1: invalid JSON')
    has(err(json.decode, '[1] x', 'f.json'), 'f.json:1:5: invalid JSON')
    has(err(json.decode, '{"a": 1', 'f.json'), 'unexpected end of text')
    has(err(json.decode, '{} /* open', 'f.json'), 'f.json:1:4: unterminated /* comment')
    has(err(json.decode, '  // nothing\n', 'f.json'), 'f.json: no JSON value in the text')
    has(err(json.decode, '{'), 'json:1:2')
  end)

  it('rejects duplicate keys, every one with its key path', function()
    local e = err(json.decode, '{"a":1,"a":2,"b":{"c":1,"c":2},"l":[{"x":1,"x":1}]}', 'ds.json')
    assert.are.equal('ds.json: a: duplicate key\nds.json: b.c: duplicate key\nds.json: l[0].x: duplicate key', e)
    local v, dups = json.decode('{"a":1,"a":2}', 'ds.json', true)
    assert.are.equal(2, v.a)                   -- the later one, as Python's dict
    assert.are.same({ 'a: duplicate key' }, dups)
  end)

  it('encodes with sorted keys, compact or indented, and decodes back', function()
    local v = { b = { 1, 2 }, a = { z = true, y = json.null }, c = 'q"\n', e = json.array({}), o = {} }
    assert.are.equal('{"a":{"y":null,"z":true},"b":[1,2],"c":"q\\"\\n","e":[],"o":{}}', json.encode(v))
    assert.are.equal('{\n  "a": {\n    "y": null,\n    "z": true\n  },\n  "b": [1, 2],\n  "c": "q\\"\\n",\n'
                     .. '  "e": [],\n  "o": {}\n}', json.encode(v, 2))
    local back = json.decode(json.encode(v, 2))
    assert.are.same(v.b, { unpack(back.b) })
    assert.are.equal(json.null, back.a.y)
    for _, x in ipairs({ 0.1, 1 / 3, 1e300, -2.5e-8, 123456789012, 2 ^ 53 }) do
      assert.are.equal(x, json.decode(json.encode({ x }))[1])
    end
    assert.are.equal('[0.1,5e+100,42]', json.encode({ 0.1, 5e100, 42 }))
  end)

  it('refuses what JSON cannot hold, naming where', function()
    has(err(json.encode, { a = { b = print } }), 'json.encode: a.b: cannot encode a function')
    has(err(json.encode, { 0 / 0 }), 'json.encode: [0]: cannot encode nan')
    has(err(json.encode, { [1] = 1, x = 2 }), 'neither a list')
    local t = {}
    t.self = t
    has(err(json.encode, t), 'json.encode: self: the table contains itself')
    has(err(json.encode, 1, -1), 'indent must be a non-negative integer')
  end)
end)

describe('ds.config batch sizes', function()
  -- {train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
  --  world_size, then the resolved triple, or the error DeepSpeed raises}.
  -- DeepSpeedConfig._set_batch_related_parameters fills the missing ones with
  -- Python floor division, then _batch_assertion checks the product.
  local cases = {
    { 32, 4, 8, 1, { 32, 4, 8 } },
    { 32, 4, 4, 2, { 32, 4, 4 } },
    { 32, 4, 2, 4, { 32, 4, 2 } },
    { 32, 4, 4, 1, '32 != 4 * 4 * 1' },
    { 32, 4, nil, 1, { 32, 4, 8 } },              -- ga = tb // mb // ws
    { 32, 4, nil, 2, { 32, 4, 4 } },
    { 32, 4, nil, 4, { 32, 4, 2 } },
    { 10, 3, nil, 1, '10 != 3 * 3 * 1' },
    { 10, 3, nil, 2, '10 != 3 * 1 * 2' },
    { 10, 3, nil, 4, 'Gradient accumulation steps: 0 has to be greater than 0' },
    { 24, 4, nil, 4, '24 != 4 * 1 * 4' },
    { 32, nil, 4, 1, { 32, 8, 4 } },              -- mb = tb // ws // ga
    { 32, nil, 4, 2, { 32, 4, 4 } },
    { 32, nil, 4, 4, { 32, 2, 4 } },
    { 30, nil, 4, 2, '30 != 3 * 4 * 2' },
    { 8, nil, 16, 1, 'Micro batch size per gpu: 0 has to be greater than 0' },
    { nil, 4, 8, 1, { 32, 4, 8 } },               -- tb = mb * ga * ws
    { nil, 4, 8, 2, { 64, 4, 8 } },
    { nil, 4, 8, 4, { 128, 4, 8 } },
    { 32, nil, nil, 1, { 32, 32, 1 } },           -- ga = 1, mb = tb // ws
    { 32, nil, nil, 2, { 32, 16, 1 } },
    { 32, nil, nil, 4, { 32, 8, 1 } },
    { 30, nil, nil, 4, '30 != 7 * 1 * 4' },
    { 2, nil, nil, 4, 'Micro batch size per gpu: 0 has to be greater than 0' },
    { nil, 8, nil, 1, { 8, 8, 1 } },              -- tb = mb * ws, ga = 1
    { nil, 8, nil, 2, { 16, 8, 1 } },
    { nil, 8, nil, 4, { 32, 8, 1 } },
    { nil, nil, 4, 1, 'Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided' },
    { nil, nil, nil, 2, 'Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided' },
    { 0, 4, nil, 1, 'train_batch_size: Train batch size: 0 has to be greater than 0' },
    { 32, -1, nil, 1, 'train_micro_batch_size_per_gpu: Micro batch size per gpu: -1 has to be greater than 0' },
    { 32, 4, 0, 1, 'gradient_accumulation_steps: Gradient accumulation steps: 0 has to be greater than 0' },
    { 144, 24, nil, 1, { 144, 24, 6 } },          -- the tutorial's 144 = 24 x 6 x 1
    { 144, 24, nil, 2, { 144, 24, 3 } },
  }
  for _, c in ipairs(cases) do
    local tb, mb, ga, ws, want = c[1], c[2], c[3], c[4], c[5]
    local name = string.format('tb=%s mb=%s ga=%s world_size=%d', tostring(tb), tostring(mb), tostring(ga), ws)
    it(name, function()
      local t = { train_batch_size = tb, train_micro_batch_size_per_gpu = mb, gradient_accumulation_steps = ga }
      if type(want) == 'table' then
        local cfg = config.load(t, { world_size = ws })
        assert.are.same(want, { cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                cfg.gradient_accumulation_steps })
      else
        local e = err(config.load, t, { world_size = ws })
        has(e, want)
        if want:find('!=', 1, true) then
          has(e, 'train_batch_size: Check batch related parameters. train_batch_size is not equal to '
                 .. 'micro_batch_per_gpu * gradient_acc_step * world_size ')
        end
      end
    end)
  end

  it('names the world size it was given wrongly', function()
    has(err(config.load, { train_batch_size = 8 }, { world_size = 0 }), 'world_size: must be a positive integer, got 0')
  end)
end)

describe('ds.config defaults', function()
  it('fills every default under DeepSpeed key names', function()
    local cfg = config.load({ train_batch_size = 8 })
    assert.are.equal(10, cfg.steps_per_print)
    assert.are.equal(0, cfg.gradient_clipping)
    assert.is_false(cfg.wall_clock_breakdown)
    assert.is_false(cfg.dump_state)
    assert.is_false(cfg.prescale_gradients)
    assert.are.equal(1, cfg.gradient_predivide_factor)
    assert.is_nil(cfg.optimizer)
    assert.is_nil(cfg.scheduler)
    assert.are.same({ enabled = false, auto_cast = false, loss_scale = 0, initial_scale_power = 16,
                      loss_scale_window = 1000, hysteresis = 2, consecutive_hysteresis = false,
                      min_loss_scale = 1, fp16_master_weights_and_grads = false }, cfg.fp16)
    assert.are.same({ enabled = false, immediate_grad_update = false, check_grad_overflow = false,
                      bf16_master_weights_and_grads = false, bf16_optimizer_states = false }, cfg.bf16)
    assert.are.same({ enabled = false, verbose = false, prof_all = true, debug = false, prof_ops = {} },
                    cfg.comms_logger)
    assert.is_true(json.is_array(cfg.comms_logger.prof_ops))
    local z = cfg.zero_optimization
    assert.are.equal(0, z.stage)
    assert.are.equal(5e8, z.reduce_bucket_size)
    assert.are.equal(5e8, z.allgather_bucket_size)
    assert.is_false(z.overlap_comm)
    assert.is_true(z.contiguous_gradients)
    assert.is_true(z.reduce_scatter)
    assert.are.equal(1e9, z.sub_group_size)
    assert.are.equal(5e7, z.stage3_prefetch_bucket_size)
    assert.are.equal(1e5, z.stage3_param_persistence_threshold)
    assert.are.equal(1e9, z.stage3_max_live_parameters)
    assert.are.equal(1e9, z.stage3_max_reuse_distance)
    assert.are.same({ device = 'none', buffer_count = 4, pin_memory = false, pipeline_read = false,
                      pipeline_write = false, fast_init = false, ratio = 1 }, z.offload_optimizer)
    assert.are.same({ device = 'none', buffer_count = 5, buffer_size = 1e8, max_in_cpu = 1e9,
                      pin_memory = false }, z.offload_param)
  end)

  it('derives overlap_comm from the stage and reads the deprecated forms', function()
    assert.is_true(config.load({ train_batch_size = 8, zero_optimization = { stage = 3 } })
                     .zero_optimization.overlap_comm)
    assert.is_false(config.load({ train_batch_size = 8, zero_optimization = { stage = 3, overlap_comm = false } })
                     .zero_optimization.overlap_comm)
    local cfg, notes = config.load({ train_batch_size = 8, zero_optimization = true })
    assert.are.equal(1, cfg.zero_optimization.stage)
    has(table.concat(notes, '\n'), 'deprecated form')
    cfg = config.load({ train_batch_size = 8, zero_optimization = { stage = 2, cpu_offload = true,
                                                                    prefetch_bucket_size = 7 } })
    assert.are.equal('cpu', cfg.zero_optimization.offload_optimizer.device)
    assert.are.equal(7, cfg.zero_optimization.stage3_prefetch_bucket_size)
    assert.is_nil(cfg.zero_optimization.cpu_offload)
    assert.is_true(config.load({ train_batch_size = 8, bfloat16 = { enabled = true } }).bf16.enabled)
  end)

  it('drops "auto" in DeepSpeed\'s pydantic blocks, as DeepSpeedConfigModel does', function()
    local cfg = config.load({ train_batch_size = 8, fp16 = { enabled = 'auto', loss_scale_window = 'auto' } })
    assert.is_false(cfg.fp16.enabled)
    assert.are.equal(1000, cfg.fp16.loss_scale_window)
  end)

  it('keeps optimizer and scheduler params as given, type names as DeepSpeed reads them', function()
    local cfg = config.load({ train_batch_size = 8,
      optimizer = { type = 'adamw', params = { lr = 1e-3, betas = { 0.9, 0.95 } } },
      scheduler = { type = 'WarmupLR', params = { warmup_num_steps = 10 } } })
    assert.are.same({ type = 'adamw', params = { lr = 1e-3, betas = { 0.9, 0.95 } } }, cfg.optimizer)
    assert.are.same({ type = 'WarmupLR', params = { warmup_num_steps = 10 } }, cfg.scheduler)
    cfg = config.load({ train_batch_size = 8, scheduler = { type = 'lua', params = { path = 'spec/config_spec.lua',
                                                                                       peak = 3 } } })
    assert.are.same({ path = 'spec/config_spec.lua', peak = 3 }, cfg.scheduler.params)
  end)

  it('passes dslua\'s extension blocks through and notes DeepSpeed keys it ignores', function()
    local cfg, notes = config.load({ train_batch_size = 8, reload = { every = 5 },
                                     memory_breakdown = false, amp = { enabled = false } })
    assert.are.same({ enabled = true, every = 5, attach = true, budget = 5 }, cfg.reload)
    assert.are.equal(false, cfg.memory_breakdown)
    has(table.concat(notes, '\n'), 'config: memory_breakdown: a DeepSpeed setting dslua does not act on')
    has(table.concat(notes, '\n'), 'config: amp: a DeepSpeed feature dslua does not implement')
    for _, k in ipairs(config.extension_keys) do assert.is_string(k) end
    local fn = function() end                 -- Lua configs may carry functions
    assert.are.equal(fn, config.load({ train_batch_size = 8, hooks = { on_step = fn } }).hooks.on_step)
  end)

  it('reads back its own output to the same config', function()
    local first = config.load('configs/cifar10_adamw_fp16.json', { world_size = 1 })
    local again = config.load(json.decode(json.encode(first)))
    assert.are.same(json.decode(json.encode(first)), json.decode(json.encode(again)))
    assert.are.same(first, config.load(first))
  end)
end)

describe('ds.config errors', function()
  local function problems(t, opts)
    local cfg, list = config.check(t, opts)
    assert.is_nil(cfg)
    return table.concat(list, '\n'), #list
  end

  it('suggests the nearest key for an unknown one', function()
    has(problems({ train_batch_sizee = 8 }), "config: train_batch_sizee: unknown key, did you mean 'train_batch_size'?")
    has(problems({ train_batch_size = 8, zero_optimization = { overlapcomm = true } }),
        "zero_optimization.overlapcomm: unknown key, did you mean 'overlap_comm'?")
    has(problems({ train_batch_size = 8, fp16 = { enable = true } }), "fp16.enable: unknown key, did you mean 'enabled'?")
    has(problems({ train_batch_size = 8, optimizer = { type = 'Adam', params = { beta = { 0.9, 0.9 } } } }),
        "optimizer.params.beta: unknown key, did you mean 'betas'?")
    has(problems({ train_batch_size = 8, optimizer = { type = 'SGD', params = { betas = { 0.9, 0.9 } } } }),
        'optimizer.params.betas: unknown key (expected one of: dampening, lr, momentum, nesterov, weight_decay)')
    has(problems({ train_batch_size = 8, scheduler = { type = 'WarmupLR', params = { warmup_steps = 5 } } }),
        "scheduler.params.warmup_steps: unknown key, did you mean 'warmup_num_steps'?")
    has(problems({ train_batch_size = 8, comms_logger = { prof = true } }), 'comms_logger.prof: unknown key')
  end)

  -- the search for a suggestion once took seconds per megabyte of key (and
  -- 10.6 GB for 10 MB): its work is bounded by the names' lengths; the key
  -- is named by its start and length
  it('rejects a runaway key at once, suggesting nothing', function()
    local key = string.rep('x', 10 * 2 ^ 20)
    local optimizer = { type = 'SGD', params = { [key] = 1 } }
    local _, list, notes = config.check({ train_batch_size = 8, [key] = 1, optimizer = optimizer })
    local shown = '["' .. string.rep('x', 40) .. '... (10485760 bytes)]'
    assert.are.same({ 'config: optimizer.params' .. shown .. ': unknown key (expected one of: dampening, lr, momentum, '
                      .. 'nesterov, weight_decay)' }, list)
    -- at the top level DeepSpeed ignores it: a warning
    assert.are.same({ 'warning: config: ' .. shown .. ": unknown key, ignored (as DeepSpeed ignores it); the nearest "
                      .. "known key is 'activation_checkpointing'" }, notes)
  end)

  it('names empty keys and keys with control bytes, and refuses a NUL it cannot keep', function()
    local _, list, notes = config.check({ train_batch_size = 8, [''] = 1, zero_optimization = { ['\t'] = 2 } })
    assert.are.same({ 'config: zero_optimization["\\t"]: unknown key' }, list)
    has(notes[1], 'warning: config: [""]: unknown key, ignored')
    has(problems({ train_batch_size = 8, ['a\0b'] = 1 }), 'config: ["a\\u0000b"]: unknown key, did you mean \'aio\'?')
    -- JSON: cJSON would cut "a\u0000b" to "a" (once reported as the key "a")
    local d = H.tmpdir()
    H.write(d .. '/nul.json', '{"train_batch_size": 8, "a\\u0000b": 1}')
    has(err(config.load, d .. '/nul.json'), d .. '/nul.json:1:27: a string holds \\u0000 (NUL), which dslua '
        .. 'cannot keep in a key or value')
    os.execute('rm -rf ' .. d)
  end)

  it('range-checks integers as integers: a clear error naming the key', function()
    assert.are.same({ 'config: gradient_accumulation_steps: must be an integer between -2^63 and 2^63 - 1, got 1e+308' },
                    select(2, config.check({ train_batch_size = 8, gradient_accumulation_steps = 1e308 })))
    assert.are.same({ 'config: train_micro_batch_size_per_gpu: must be <= 2147483647, got 9.223372036854776e+18' },
                    select(2, config.check({ train_micro_batch_size_per_gpu = 2 ^ 63 })))
    assert.are.same({ 'config: zero_optimization.reduce_bucket_size: must be an integer between -2^63 and 2^63 - 1, '
                      .. 'got 1e+19' },
                    select(2, config.check({ train_batch_size = 8, zero_optimization = { reduce_bucket_size = 1e19 } })))
    assert.are.same({ 'config: zero_optimization.stage: must be 0, 1, 2 or 3, got "x"' },
                    select(2, config.check({ train_batch_size = 8, zero_optimization = { stage = 'x' } })))
    -- Python's sys.maxsize, as DeepSpeed writes it, still reads
    assert.is_table(config.check({ train_batch_size = 8,
                                   zero_optimization = { stage3_model_persistence_threshold = 2 ^ 63 - 1 } }))
  end)

  it('reads a config file only when it is a regular file (a FIFO would block)', function()
    local d = H.tmpdir()
    assert(os.execute('mkfifo ' .. d .. '/fifo') == 0)
    local out, status = H.run('timeout 20 ' .. H.bin() .. ' --check-config ' .. d .. '/fifo')
    assert.are.equal(1, status, out)
    H.has(out, d .. '/fifo: cannot read: is a FIFO, expected a regular file')
    os.execute('rm -rf ' .. d)
  end)

  it('refuses hooks and sampler policy files that are FIFOs or planted links instead of blocking on them', function()
    local d = H.tmpdir()
    assert(os.execute('mkfifo ' .. d .. '/fifo.lua') == 0)
    H.write(d .. '/hooks.json', '{"train_batch_size": 8, "hooks": "' .. d .. '/fifo.lua"}')
    H.write(d .. '/policy.json', '{"train_batch_size": 8, "sampler": {"policy": "' .. d .. '/fifo.lua"}}')
    for _, case in ipairs({ { 'hooks', 'hooks' }, { 'policy', 'sampler.policy' } }) do
      local out, status = H.run('timeout 20 ' .. H.bin() .. ' --check-config ' .. d .. '/' .. case[1] .. '.json')
      assert.are.equal(1, status, out)
      H.has(out, case[2] .. ': cannot read the ' .. case[1] .. ' file "' .. d .. '/fifo.lua": is a FIFO, expected a '
            .. 'regular file')
    end
    if H.run('id -u') == '0\n' then
      H.write(d .. '/real.lua', 'return {}')
      os.execute('rm ' .. d .. '/fifo.lua && ln -s ' .. d .. '/real.lua ' .. d .. '/fifo.lua && chown -h nobody '
                 .. d .. '/fifo.lua')
      local out = H.run('timeout 20 ' .. H.bin() .. ' --check-config ' .. d .. '/hooks.json')
      H.has(out, "is a link owned by another user (uid 65534): dslua does not follow it")
    end
    os.execute('rm -rf ' .. d)
  end)

  it('reads a config from a folder another user owns (a bind mount), not from one open to every user', function()
    if H.run('id -u') ~= '0\n' then return pending('needs root to make folders of another user') end
    local d = H.tmpdir()
    H.write(d .. '/ds.json', '{"train_batch_size": 8}')
    os.execute('chown -R nobody ' .. d)
    local out, status = H.run(H.bin() .. ' --check-config ' .. d .. '/ds.json')
    assert.are.equal(0, status, out)
    os.execute('chmod 777 ' .. d)
    out, status = H.run(H.bin() .. ' --check-config ' .. d .. '/ds.json')
    assert.are.equal(1, status, out)
    H.has(out, "the directory '" .. d .. "' is writable by others without the sticky bit (mode 777")
    os.execute('rm -rf ' .. d)
  end)

  it('reports a string given for a choice of numbers (the suggester once failed on it)', function()
    assert.are.same({ 'config: zero_optimization.stage: must be 0, 1, 2 or 3, got "3"' },
                    select(2, config.check({ train_batch_size = 8, zero_optimization = { stage = '3' } })))
  end)

  it('names wrong types and out-of-range values with their path', function()
    has(problems({ train_batch_size = '8' }), 'config: train_batch_size: must be an integer, got "8"')
    has(problems({ train_batch_size = 8.5 }), 'train_batch_size: must be an integer, got 8.5')
    has(problems({ train_batch_size = 8, zero_optimization = { stage = 4 } }),
        'config: zero_optimization.stage: must be 0, 1, 2 or 3, got 4')
    has(problems({ train_batch_size = 8, zero_optimization = { reduce_bucket_size = -1 } }),
        'zero_optimization.reduce_bucket_size: must be >= 0, got -1')
    has(problems({ train_batch_size = 8, zero_optimization = { offload_optimizer = { device = 'gpu' } } }),
        'zero_optimization.offload_optimizer.device: must be "none", "cpu" or "nvme", got "gpu"')
    has(problems({ train_batch_size = 8, fp16 = { enabled = 1 } }), 'fp16.enabled: must be true or false, got 1')
    has(problems({ train_batch_size = 8, fp16 = { loss_scale = -1 } }),
        'fp16.loss_scale: must be >= 0 (0 enables dynamic loss scaling), got -1')
    has(problems({ train_batch_size = 8, steps_per_print = 0 }), 'steps_per_print: must be a positive integer, got 0')
    has(problems({ train_batch_size = 8, gradient_clipping = -1 }), 'gradient_clipping: must be >= 0, got -1')
    has(problems({ train_batch_size = 8, comms_logger = { prof_ops = { 'all_reduce', 3 } } }),
        'comms_logger.prof_ops[1]: must be a string, got 3')
    has(problems({ train_batch_size = 8, optimizer = { type = 'Adam', params = { betas = { 1.0, 0.9 } } } }),
        'optimizer.params.betas: Invalid beta parameter at index 0: 1')
    has(problems({ train_batch_size = 8, optimizer = { type = 'Adam', params = { lr = -1 } } }),
        'optimizer.params.lr: must be >= 0, got -1')
    has(problems({ train_batch_size = 8, scheduler = { type = 'WarmupLR', params = { warmup_num_steps = 0 } } }),
        'scheduler.params.warmup_num_steps: must be a positive integer, got 0')
    has(problems({ train_batch_size = 8, scheduler = { type = 'WarmupLR', params = { warmup_type = 'lin' } } }),
        'scheduler.params.warmup_type: must be "log" or "linear", got "lin"')
    has(problems({ train_batch_size = 8, fp16 = 3 }), 'fp16: must be an object, got 3')
    has(problems({ 1, 2 }), 'config: the config must be a JSON object, got a list')
    has(problems(7), 'config: the config must be a file name or a table, got 7')
  end)

  it('checks the rules DeepSpeed asserts across keys, with its messages', function()
    has(problems({ train_batch_size = 8, fp16 = { enabled = true }, bf16 = { enabled = true } }),
        'fp16.enabled: bfloat16 and fp16 modes cannot be simultaneously enabled')
    has(problems({ train_batch_size = 8, fp16 = { fp16_master_weights_and_grads = true } }),
        'Fp16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3.')
    has(problems({ train_batch_size = 8, zero_optimization = { stage = 2, offload_optimizer = { ratio = 0.5 } } }),
        'zero_optimization.offload_optimizer.ratio: Partial offloading only supported for ZeRO Stage 3.')
    -- stage 0 (the default) has no partitioned optimizer to offload
    has(problems({ train_batch_size = 8,
                   zero_optimization = { offload_optimizer = { device = 'nvme', nvme_path = '/tmp' } } }),
        'zero_optimization.offload_optimizer: ZeRO-Offload needs zero_optimization.stage 1, 2 or 3 (device "nvme" '
        .. 'moves the partitioned optimizer; stage 0 has none)')
    has(problems({ train_batch_size = 8, zero_optimization = { cpu_offload = true, offload_optimizer = {} } }),
        "Cannot provide deprecated parameter 'cpu_offload' and replacing parameter 'offload_optimizer' together")
    has(problems({ train_batch_size = 8, optimizer = { type = 'Adam', params = { max_grad_norm = 1 } } }),
        "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer parameter, "
        .. "please switch to using the deepspeed parameter 'gradient_clipping'")
    has(problems({ train_batch_size = 8, optimizer = { type = 'SGD', params = { nesterov = true } } }),
        'Nesterov momentum requires a momentum and zero dampening')
    has(problems({ train_batch_size = 8, scheduler = { type = 'WarmupLr' } }),
        "scheduler.type: DeepSpeed does not recognize LR scheduler WarmupLr, did you mean 'WarmupLR'?")
    has(problems({ train_batch_size = 8, optimizer = { type = 'Adamm' } }),
        "optimizer.type: unknown optimizer \"Adamm\", did you mean 'Adam'?")
    has(problems({ train_batch_size = 8, optimizer = { type = 'MuAdam' } }),
        'is a DeepSpeed optimizer dslua does not implement')
    has(problems({ train_batch_size = 8, optimizer = { params = {} } }), 'optimizer.type: missing: required')
    has(problems({ train_batch_size = 8, scheduler = { type = 'WarmupDecayLR' } }),
        'scheduler.params.total_num_steps: missing: required by WarmupDecayLR')
    has(problems({ train_batch_size = 8, scheduler = { type = 'lua', params = {} } }),
        'scheduler.params.path: missing: required by lua')
    has(problems({ train_batch_size = 8, zero_optimization = { offload_param = { device = 'nvme' } } }),
        'zero_optimization.offload_param.nvme_path: missing: required when device is "nvme"')
    has(problems({ train_batch_size = 8, zero_optimization = { offload_optimizer = { device = 'nvme', nvme_path = '' } } }),
        'zero_optimization.offload_optimizer.nvme_path: must name a directory when device is "nvme", got ""')
    has(problems({ train_batch_size = 8, communication_data_type = 'fp8' }),
        'communication_data_type: must be "fp32", "fp16" or "bf16", got "fp8"')
    has(problems({ train_batch_size = 8, bf16 = {}, bfloat16 = {} }), "give only one of 'bf16' and 'bfloat16'")
    has(problems({ train_batch_size = 8, amp = { enabled = true } }), 'amp: a DeepSpeed feature dslua does not implement')
  end)

  it('reports every problem at once, naming the file, in one raised error', function()
    local d = tmpdir()
    local path = write(d .. '/ds.json', [[
{
  // three problems, and a duplicate
  "train_batch_sizee": 32,
  "train_micro_batch_size_per_gpu": 4,
  "zero_optimization": {"stage": 4},
  "fp16": {"enabled": "yes"},
  "gradient_clipping": 1.0,
  "gradient_clipping": 2.0
}]])
    local e = err(config.load, path)
    local lines = {}
    for l in e:gmatch('[^\n]+') do lines[#lines + 1] = l end
    assert.are.equal(4, #lines)
    has(e, path .. ': gradient_clipping: duplicate key')
    has(e, path .. ": train_batch_sizee: unknown key, did you mean 'train_batch_size'?")
    has(e, path .. ': zero_optimization.stage: must be 0, 1, 2 or 3, got 4')
    has(e, path .. ': fp16.enabled: must be true or false, got "yes"')
    has(err(config.load, d .. '/missing.json'), d .. '/missing.json: cannot read: No such file')
    write(d .. '/broken.json', '{\n  "a": 1,\n  "b" 2\n}')
    has(err(config.load, d .. '/broken.json'), d .. '/broken.json:3:7: invalid JSON')
  end)
end)

describe('ds.args', function()
  it('takes --config/--deepspeed_config and --local_rank in both spellings', function()
    local a = args.parse({ 'train.lua', '--config', 'ds.json', '--lr', '3', '--local_rank=2', 'x' })
    assert.are.equal('ds.json', a.config)
    assert.are.equal(2, a.local_rank)
    assert.are.same({ 'train.lua', '--lr', '3', 'x' }, a.rest)
    a = args.parse({ '--deepspeed', '--deepspeed_config=c.json', '--local-rank', '1' })
    assert.are.equal('c.json', a.config)
    assert.are.equal(1, a.local_rank)
    assert.is_true(a.deepspeed)
    assert.are.same({}, a.rest)
  end)

  it('keeps everything after -- and fails on a missing value', function()
    local a = args.parse({ '--', '--config', 'x.json' })
    assert.is_nil(a.config)
    assert.are.same({ '--', '--config', 'x.json' }, a.rest)
    has(err(args.parse, { '--config' }), '--config: expected a config file name')
    has(err(args.parse, { '--config', '--other' }), '--config: expected a config file name')
    has(err(args.parse, { '--local_rank', 'x' }), "--local_rank: expected an integer, got 'x'")
    assert.are.equal(0, args.parse({}).local_rank)
  end)

  it('reads the global arg of the running script', function()
    local d = tmpdir()
    write(d .. '/t.lua', 'local ds = require "dslua"\n'
                        .. 'print(ds.args.config, ds.args.local_rank, table.concat(ds.args.rest, ","))\n'
                        .. 'print(ds.config == require "dslua.config", ds.json == require "dslua.base.json")')
    local out, status = H.run(bin .. ' ' .. d .. '/t.lua --deepspeed_config ds.json --local_rank 3 --epochs 2')
    assert.are.equal(0, status)
    assert.are.equal('ds.json\t3\t--epochs,2\ntrue\ttrue\n', out)
  end)
end)

describe('dslua --check-config', function()
  it('prints the resolved config and exits 0', function()
    local d = tmpdir()
    local path = write(d .. '/ds.json', '# comment\n{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}')
    local out, status = run_stdout(bin .. ' --check-config ' .. path .. ' --world-size 2')
    assert.are.equal(0, status)
    local cfg = json.decode(out)
    assert.are.equal(4, cfg.gradient_accumulation_steps)
    assert.are.equal(10, cfg.steps_per_print)
    assert.are.equal(0, cfg.zero_optimization.stage)
    out, status = run_stdout(bin .. ' --check-config=' .. path .. ' --world-size=4')
    assert.are.equal(0, status)
    assert.are.equal(2, json.decode(out).gradient_accumulation_steps)
  end)

  it('prints every problem and exits non-zero', function()
    local d = tmpdir()
    local path = write(d .. '/ds.json', '{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,'
                                      .. ' "zero_optimization": {"stage": 4}}')
    local out, status = H.run(bin .. ' --check-config ' .. path)
    assert.are.equal(1, status)
    has(out, path .. ': zero_optimization.stage: must be 0, 1, 2 or 3, got 4')
    out, status = H.run(bin .. ' --check-config ' .. write(d .. '/b.json', '{"train_batch_size": 10, '
                                                           .. '"train_micro_batch_size_per_gpu": 3}'))
    assert.are.equal(1, status)
    has(out, '10 != 3 * 3 * 1')
    out, status = H.run(bin .. ' --check-config ' .. d .. '/b.json --world-size 4')
    assert.are.equal(1, status)
    has(out, 'Gradient accumulation steps: 0 has to be greater than 0')
    out, status = H.run(bin .. ' --check-config ' .. d .. '/none.json')
    assert.are.equal(1, status)
    has(out, 'cannot read')
    out, status = H.run(bin .. ' --check-config ' .. path .. ' --world-size two')
    assert.are.equal(1, status)
    has(out, '--world-size must be a positive integer')
    out, status = H.run(bin .. ' --world-size 2')
    assert.are.equal(1, status)
    has(out, '--world-size goes with --check-config')
    out, status = H.run(bin .. ' --check-config')
    assert.are.equal(1, status)
    has(out, "'--check-config' needs an argument")
    has(H.run(bin .. ' --help'), '--check-config FILE [--world-size N]')
  end)

  it('refuses what initialize refuses: what the scaler, optimizer and scheduler constructors refuse', function()
    local d = tmpdir()
    assert(os.execute('mkdir ' .. d .. '/folder.lua && mkfifo ' .. d .. '/fifo.lua') == 0)
    local function both(cfg, piece)
      local path = write(d .. '/ds.json', json.encode(cfg))
      local out, status = H.run('timeout 20 ' .. bin .. ' --check-config ' .. path)
      assert.are.equal(1, status, out)
      has(out, path .. ': ')
      has(out, piece)
      local ok, e = pcall(H.ds.initialize, { model = H.ds.nn.Linear(2, 2), config = path })
      assert.is_false(ok)
      has(tostring(e), piece)
    end
    local adam = { type = 'Adam', params = { lr = 1e-3 } }
    both({ train_batch_size = 2, optimizer = adam, fp16 = { enabled = true, initial_scale_power = 100000 } },
         'loss_scaler: fp16 initial loss scale (2^initial_scale_power) must be a positive finite number, got inf')
    for _, name in ipairs({ 'folder.lua', 'fifo.lua' }) do
      local what = name == 'fifo.lua' and 'a FIFO' or 'a directory'
      both({ train_batch_size = 2, optimizer = adam, scheduler = { type = 'lua', params = { path = d .. '/' .. name } } },
           'cannot load schedule file ' .. d .. '/' .. name .. ': is ' .. what .. ', expected a regular file')
    end
    os.execute('rm -rf ' .. d)
  end)

  -- 200,000 unknown top-level keys once took 73 s: each was weighed
  -- against every known name; past 100 a block's unknown keys are counted
  -- (200,000 now take 1 s, most of it reading the JSON)
  it('weighs the first 100 unknown keys of a block and counts the rest', function()
    local cfg = { train_batch_size = 8, optimizer = { type = 'SGD', params = { lr = 0.1 } } }
    for i = 1, 20000 do cfg[string.format('unknown_key_%05d', i)] = i end
    for i = 1, 150 do cfg.optimizer.params['bad_' .. i] = i end
    local S, weighed = require('dslua.base.suggest'), 0
    local nearest = S.nearest
    S.nearest = function(...) weighed = weighed + 1 return nearest(...) end
    local _, list, notes = config.check(cfg)
    S.nearest = nearest
    assert.are.equal(200, weighed)
    assert.are.equal(101, #notes)
    has(notes[100], 'warning: config: unknown_key_00100: unknown key, ignored')
    assert.are.equal('warning: config: 19900 more unknown keys, ignored (as DeepSpeed ignores them) and not weighed '
                     .. 'as near misses of known keys', notes[101])
    assert.are.equal(101, #list)
    assert.are.equal('config: optimizer.params: 50 more unknown keys', list[101])
  end)

  it('passes every file in configs/', function()
    local p = io.popen('ls configs/*.json')
    local n = 0
    for path in p:lines() do
      local out, status = run_stdout(bin .. ' --check-config ' .. path)
      assert(status == 0, path .. ' fails --check-config:\n' .. select(1, H.run(bin .. ' --check-config ' .. path)))
      assert.is_table(json.decode(out))
      n = n + 1
    end
    p:close()
    assert(n >= 3, 'expected the configs/ files')
  end)

  it('ships the DeepSpeed tutorial starters', function()
    local mnist = config.load('configs/mnist_sgd.json')
    assert.are.equal('SGD', mnist.optimizer.type)
    assert.are.equal('WarmupDecayLR', mnist.scheduler.type)
    local c = config.load('configs/cifar10_adamw_fp16.json')
    assert.are.same({ 144, 24, 6 }, { c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                      c.gradient_accumulation_steps })
    assert.are.equal('AdamW', c.optimizer.type)
    assert.are.equal('WarmupCosineLR', c.scheduler.type)
    assert.is_true(c.fp16.enabled)
    assert.is_true(c.gradient_clipping > 0)
    has(err(config.load, 'configs/cifar10_adamw_fp16.json', { world_size = 2 }), '144 != 24 * 6 * 2')
    local o = config.load('configs/onebit_adam_fp16.json', { world_size = 4 })
    assert.are.equal(64, o.train_batch_size)
    assert.are.same({ 'OneBitAdam', 400 }, { o.optimizer.type, o.optimizer.params.freeze_step })
  end)
end)
