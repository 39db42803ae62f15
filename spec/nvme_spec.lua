-- ZeRO's nvme optimizer offload: ds.aio (asynchronous tensor file I/O),
-- ds.optim.apply (one stateless kernel step on flat views) and dslua.engine.nvme
-- (master and state in files, stepped in pieces). The kernels are
-- elementwise, so streaming in pieces must equal ds.optim bit for bit.
local H = require 'helpers'
local ds = H.ds
local nvme = require 'dslua.engine.nvme'

local KEY = 'zero_optimization.offload_optimizer.nvme_path'
local S = { 37, 20 }        -- sub_group_size 8 divides neither
local SUB = 8
local STEPS = 30

local tmpdir, remove_tmpdirs = H.tmpdirs()
teardown(remove_tmpdirs)

local function file_size(path)
  local f = assert(io.open(path, 'rb'))
  local n = f:seek('end')
  f:close()
  return n
end

local read_bytes = H.read

local assert_same = H.assert_same

local CASES = {
  { name = 'AdamW', g1 = { lr = 1e-2, betas = { 0.9, 0.99 }, weight_decay = 0.05 }, g2 = { lr = 3e-3, eps = 1e-6 } },
  { name = 'Adam', g1 = { lr = 1e-2, weight_decay = 0.01 }, g2 = { lr = 2e-3, bias_correction = false } },
  { name = 'SGD', g1 = { lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 1e-3 },
    g2 = { lr = 0.02, momentum = 0.8, nesterov = true } },
  { name = 'Lion', g1 = { lr = 1e-3, weight_decay = 0.1 }, g2 = { lr = 2e-3, betas = { 0.95, 0.98 } } },
  { name = 'Adagrad', g1 = { lr = 0.05, lr_decay = 0.01, initial_accumulator_value = 0.1 },
    g2 = { lr = 0.02, weight_decay = 0.01, eps = 1e-8 } },
}

local with = H.with

-- The in-memory optimizer and the streamed one over the same initial
-- masters, and a gradient sequence.
local function pair(case, dir, nbuf)
  ds.manual_seed(7)
  local init = { ds.randn({ S[1] }), ds.randn({ S[2] }) }
  local ps = { init[1]:clone():requires_grad_(), init[2]:clone():requires_grad_() }
  local mem = ds.optim[case.name]({ with(case.g1, { params = { ps[1] } }), with(case.g2, { params = { ps[2] } }) })
  local streamed = nvme.optimizer{
    name = case.name, path = dir, rank = 1, sub_group_size = SUB, buffer_count = nbuf,
    groups = { with(case.g1, { numel = S[1], init = init[1] }), with(case.g2, { numel = S[2], init = init[2] }) },
  }
  local grads = {}
  for t = 1, STEPS do grads[t] = { ds.randn({ S[1] }), ds.randn({ S[2] }) } end
  return mem, streamed, ps, grads
end

-- Step t of both, with a schedule that changes lr through param_groups.
local function step_both(mem, streamed, ps, grads, t, out)
  for g = 1, 2 do
    local lr = mem.param_groups[g].lr * (1 - 0.01 * t)
    mem.param_groups[g].lr, streamed.param_groups[g].lr = lr, lr
    ps[g].grad:copy_(grads[t][g])
  end
  mem:step()
  streamed:step(grads[t], out)
end

describe('ds.optim.apply', function()
  it('names the state slots of each kind', function()
    assert.are.same({ 'exp_avg', 'exp_avg_sq' }, ds.optim.state_names('AdamW'))
    assert.are.same({ 'momentum_buffer' }, ds.optim.state_names('SGD'))
    assert.are.same({ 'sum' }, ds.optim.state_names('Adagrad'))
    H.has(H.err(ds.optim.state_names, 'Adamax'), "unknown optimizer 'Adamax'")
  end)

  it('is one step of the in-memory kernel', function()
    ds.manual_seed(3)
    local p0, g = ds.randn({ 11 }), ds.randn({ 11 })
    local p = p0:clone():requires_grad_()
    local mem = ds.optim.AdamW({ p }, { lr = 0.1, weight_decay = 0.1 })
    p.grad:copy_(g)
    mem:step()
    local q, m, v = p0:clone(), ds.zeros({ 11 }), ds.zeros({ 11 })
    ds.optim.apply('AdamW', mem.param_groups[1], 1, q, g, { m, v })
    assert_same(q, mem:flat_params(1), 'params')
    assert_same(m, mem:flat_state(1, 'exp_avg'), 'exp_avg')
  end)

  -- The step engine hands its clip and mean factor to the kernels this way
  -- instead of scaling the gradients first; the results must not move.
  it('with a grad_scale equals scaling the gradient first, bit for bit', function()
    ds.manual_seed(5)
    local n = 40000 + 7      -- the threaded path, and a last block cut short
    local kinds = {
      { 'SGD', { lr = 0.05, weight_decay = 1e-3 }, 0 },
      { 'SGD', { lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 1e-3 }, 1 },
      { 'Adam', { lr = 1e-2, weight_decay = 0.01 }, 2 },
      { 'AdamW', { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 } }, 2 },
      { 'Adagrad', { lr = 0.05, weight_decay = 0.01 }, 1 },
      { 'Lion', { lr = 1e-3, weight_decay = 0.1 }, 1 },
    }
    for _, k in ipairs(kinds) do
      local name, group = k[1], with(ds.optim.defaults(k[1]), k[2])
      for _, scale in ipairs({ 1 / 3, 0.0371, 7.5 }) do
        local p0, g = ds.randn({ n }), ds.randn({ n }) * 3
        local g0 = g:clone()
        local fused, plain = p0:clone(), p0:clone()
        local sf, sp = {}, {}
        for s = 1, k[3] do
          sf[s] = ds.rand({ n })
          sp[s] = sf[s]:clone()
        end
        local what = string.format('%s, grad_scale %g', name, scale)
        for t = 1, 2 do
          ds.optim.apply(name, group, t, fused, g, sf, nil, scale)
          ds.optim.apply(name, group, t, plain, g:clone():mul_(scale), sp)
        end
        assert_same(fused, plain, what .. ': params')
        for s = 1, k[3] do assert_same(sf[s], sp[s], what .. ': state ' .. s) end
        assert_same(g, g0, what .. ': the gradient is left as it was')
      end
    end
    local p, g = ds.zeros({ 4 }), ds.zeros({ 4 })
    H.has(H.err(ds.optim.apply, 'SGD', ds.optim.defaults('SGD'), 1, p, g, {}, nil, 0 / 0),
          'optim.SGD: apply: grad_scale must be finite')
  end)

  it('refuses Lamb, mismatched views and bad hyperparameters', function()
    local p, g = ds.zeros({ 4 }), ds.zeros({ 4 })
    local group = ds.optim.defaults('Lamb')
    H.has(H.err(ds.optim.apply, 'Lamb', group, 1, p, g, { ds.zeros({ 4 }), ds.zeros({ 4 }) }), 'whole parameters')
    local adam = ds.optim.defaults('Adam')
    H.has(H.err(ds.optim.apply, 'Adam', adam, 1, p, g, { ds.zeros({ 4 }), ds.zeros({ 3 }) }),
          'optim.Adam: apply: exp_avg_sq has 3 elements, p has 4')
    H.has(H.err(ds.optim.apply, 'Adam', adam, 1, p, g, { ds.zeros({ 4 }) }), 'exp_avg_sq is missing')
    H.has(H.err(ds.optim.apply, 'Adam', adam, 1, p, ds.zeros({ 4 }, 'f64'), { ds.zeros({ 4 }), ds.zeros({ 4 }) }),
          'g is f64 [4]')
    H.has(H.err(ds.optim.apply, 'Adam', adam, 0, p, g, {}), 'step must be an integer >= 1')
    H.has(H.err(ds.optim.apply, 'Adam', with(adam, { lr = -1 }), 1, p, g, { ds.zeros({ 4 }), ds.zeros({ 4 }) }),
          'optim.Adam: lr must be >= 0')
    H.has(H.err(ds.optim.check_group, 'Adam', with(adam, { betas = 0.9 })), 'optim.Adam: apply: betas')
    -- SGD without momentum has no state to pass
    ds.optim.apply('SGD', ds.optim.defaults('SGD'), 1, p, g, {})
  end)
end)

describe('ds.aio', function()
  it('writes and reads tensor bytes at offsets', function()
    local d = tmpdir()
    local f = ds.aio.open(d .. '/a.bin', 64)
    assert.are.equal(64, f:size())
    assert.are.equal(d .. '/a.bin', f:path())
    local w = f:write(ds.tensor({ 1.5, -2, 3, 4.25 }), 16)
    assert.are.equal(16, w:wait())
    assert.is_true(w:done())
    local back = ds.zeros({ 16 })
    f:read(back, 0):wait()
    assert.are.same({ 0, 0, 0, 0, 1.5, -2, 3, 4.25, 0, 0, 0, 0, 0, 0, 0, 0 }, back:totable())
    -- any dtype's bytes
    local h = ds.tensor({ 0.5, 0.25, 8, -1 }):to('bf16')
    f:write(h, 56):wait()
    local hb = ds.zeros({ 4 }, 'bf16')
    f:read(hb, 56):wait()
    assert.are.same({ 0.5, 0.25, 8, -1 }, hb:to('f32'):totable())
    f:close()
    assert.are.equal(64, file_size(d .. '/a.bin'))
  end)

  it('keeps a request\'s tensor alive and finishes pending writes on __gc', function()
    local d = tmpdir()
    local n = 2 ^ 20
    do
      local f = ds.aio.open(d .. '/gc.bin', 4 * n)
      f:write(ds.full({ n }, 1.5), 0)      -- neither the tensor nor the request is kept
    end
    collectgarbage('collect')
    collectgarbage('collect')
    local bytes = read_bytes(d .. '/gc.bin')
    assert.are.equal(4 * n, #bytes)
    assert.is_true(bytes == string.rep('\0\0\192\63', n))     -- 1.5f, little-endian
  end)

  it('raises errors that name the file', function()
    local d = tmpdir()
    local missing = d .. '/no/such/dir/x.bin'
    local e = H.err(ds.aio.open, missing, 16)
    H.has(e, missing)
    H.has(e, 'No such file or directory')
    local path = d .. '/b.bin'
    local f = ds.aio.open(path, 16)
    e = H.err(f.write, f, ds.zeros({ 4 }), 4)
    H.has(e, path)
    H.has(e, '16 bytes at offset 4 do not fit')
    H.has(H.err(f.read, f, ds.zeros({ 4, 4 }):transpose(1, 2), 0), 'must be contiguous')
    H.has(H.err(f.read, f, ds.zeros({ 1 }), -4), "aio.read: '" .. path .. "': byte offset must be an integer >= 0, got -4")
    H.has(H.err(f.read, f, ds.zeros({ 1 }), 1e300), 'byte offset must be an integer >= 0, got 1.0000000000000001e+300')
    H.has(H.err(ds.aio.open, path, 2 ^ 64), "aio.open: '" .. path .. "': size must be an integer >= 0, got 1.8446744073709552e+19")
    -- the file shrinks under the reader: a short read that reaches the end
    H.write(path, '12345678')
    e = H.err(function() f:read(ds.zeros({ 4 }), 0):wait() end)
    H.has(e, "aio: read of 16 bytes at offset 0 from '" .. path .. "' hit the end of the file after 8 bytes")
    f:close()
    f:close()                                  -- twice is harmless
    H.has(H.err(f.read, f, ds.zeros({ 4 }), 0), 'closed')
    local made, why = ds.aio.mkdir(path .. '/sub')
    assert.is_nil(made)
    H.has(why, path)
  end)
end)

describe('ds.aio on hostile directories', function()
  it('replaces a planted link instead of writing through it', function()
    local d = tmpdir()
    local victim = tmpdir() .. '/precious'
    H.write(victim, 'precious bytes')
    assert(os.execute('ln -s ' .. victim .. ' ' .. d .. '/group1.master.bin') == 0)
    local f = ds.aio.open(d .. '/group1.master.bin', 16)
    f:write(ds.ones(4), 0):wait()
    f:close()
    assert.are.equal('precious bytes', read_bytes(victim))
    local out = H.run('stat -c %F ' .. d .. '/group1.master.bin')
    assert.are.equal('regular file\n', out)
    assert.are.equal(16, file_size(d .. '/group1.master.bin'))
    -- no temporary name is left behind
    assert.are.equal('group1.master.bin\n', (H.run('ls -A ' .. d)))
  end)

  it('writes only into directories of its own user that others cannot write', function()
    local d = tmpdir()
    for _, mode in ipairs { '777', '770', '1777' } do
      assert(os.execute('chmod ' .. mode .. ' ' .. d) == 0)
      local e = H.err(ds.aio.open, d .. '/x.bin', 16)
      H.has(e, "aio.open: '" .. d .. "/x.bin': ")
      H.has(e, "directory '" .. d .. "' is writable by ")
      H.has(e, '(mode ' .. mode:sub(-3))
    end
    assert(os.execute('chmod 700 ' .. d) == 0)
    ds.aio.open(d .. '/x.bin', 16):close()
    -- owned by another user (needs root to set up)
    if H.run('id -u') == '0\n' then
      assert(os.execute('chown 65534 ' .. d) == 0)
      H.has(H.err(ds.aio.open, d .. '/y.bin', 16), 'is owned by another user (mode 700, owner uid 65534')
    else
      pending('another owner needs root to set up')
    end
  end)
end)

describe('nvme offload on planted links and foreign folders', function()
  local function streamed(path)
    return nvme.optimizer{ name = 'SGD', path = path, rank = 0, groups = { { lr = 0.1, numel = 4, init = ds.ones(4) } } }
  end
  local function as_root() return H.run('id -u') == '0\n' end

  it('does not follow a rank<r> link another user planted', function()
    if not as_root() then return pending('needs root to make files of another user') end
    local d, victim = tmpdir(), tmpdir()
    H.write(victim .. '/group1.master.bin', 'root-owned bytes')
    assert(os.execute('ln -s ' .. victim .. ' ' .. d .. '/rank0 && chown -h nobody ' .. d .. '/rank0') == 0)
    local e = H.err(streamed, d)
    H.has(e, KEY)
    H.has(e, "'" .. d .. "/rank0' is a link owned by another user (uid 65534): dslua does not follow it")
    assert.are.equal('root-owned bytes', read_bytes(victim .. '/group1.master.bin'))
    assert.are.equal('group1.master.bin\n', (H.run('ls -A ' .. victim)))
  end)

  it('refuses an nvme_path of another user or writable by others', function()
    if not as_root() then return pending('needs root to make files of another user') end
    local d = tmpdir()
    assert(os.execute('chown nobody ' .. d) == 0)
    local e = H.err(streamed, d)
    H.has(e, "the directory '" .. d .. "' is owned by another user (mode 755, owner uid 65534")
    assert.are.equal('', (H.run('ls -A ' .. d)))
    local w = tmpdir()
    assert(os.execute('chmod 777 ' .. w) == 0)
    H.has(H.err(streamed, w .. '/nv'), "the directory '" .. w .. "' is writable by group or others without the sticky bit")
    assert.are.equal('', (H.run('ls -A ' .. w)))
  end)
end)

describe('nvme streamed optimizer', function()
  for ci, case in ipairs(CASES) do
    it(case.name .. ' equals ds.optim bit for bit over ' .. STEPS .. ' steps', function()
      local d = tmpdir()
      local nbuf = 3 + ci % 2
      local mem, streamed, ps, grads = pair(case, d, nbuf)
      local out = { ds.zeros({ S[1] }), ds.zeros({ S[2] }) }
      for t = 1, STEPS do step_both(mem, streamed, ps, grads, t, out) end
      local sd = streamed:state_dict()
      for g = 1, 2 do
        assert_same(out[g], mem:flat_params(g), case.name .. ' group ' .. g .. ' master')
        assert_same(sd.state[g].master, mem:flat_params(g), 'state_dict master')
        assert.are.equal(STEPS, sd.state[g].step)
        for _, slot in ipairs(ds.optim.state_names(case.name)) do
          assert_same(sd.state[g][slot], mem:flat_state(g, slot), case.name .. ' group ' .. g .. ' ' .. slot)
        end
      end
      assert.are.equal(nbuf * (1 + #streamed:state_names()) * SUB * 4, streamed:bytes_in_memory())
      streamed:close()
    end)
  end

  it('makes one file per group and buffer, sized to the shard', function()
    local d = tmpdir()
    local _, streamed = pair(CASES[1], d, 4)
    for g = 1, 2 do
      for _, b in ipairs({ 'master', 'exp_avg', 'exp_avg_sq' }) do
        local path = string.format('%s/rank1/group%d.%s.bin', d, g, b)
        assert.are.equal(path, streamed:file_path(g, b))
        assert.are.equal(S[g] * 4, file_size(path))
      end
    end
    streamed:close()
  end)

  it('writes any float dtype out and continues exactly from a state_dict', function()
    for _, case in ipairs({ CASES[1], CASES[3] }) do
      local mem, streamed, ps, grads = pair(case, tmpdir(), 4)
      local half = STEPS / 2
      for t = 1, half do step_both(mem, streamed, ps, grads, t) end
      local sd = streamed:state_dict()
      streamed:close()
      ds.manual_seed(99)
      local resumed = nvme.optimizer{
        name = case.name, path = tmpdir(), sub_group_size = 5,
        groups = { { numel = S[1], init = ds.randn({ S[1] }) }, { numel = S[2], init = ds.randn({ S[2] }) } },
      }
      resumed:load_state_dict(sd)
      local out = { ds.zeros({ S[1] }, 'bf16'), ds.zeros({ S[2] }, 'f16') }
      for t = half + 1, STEPS do step_both(mem, resumed, ps, grads, t, out) end
      assert_same(out[1], mem:flat_params(1):to('bf16'), case.name .. ' bf16 out')
      assert_same(out[2], mem:flat_params(2):to('f16'), case.name .. ' f16 out')
      assert_same(resumed:state_dict().state[1].master, mem:flat_params(1), case.name .. ' resumed master')
      resumed:close()
    end
  end)

  it('names the nvme_path key when the directory cannot be made or written', function()
    local d = tmpdir()
    local plain = H.write(d .. '/plain', 'x')
    local opts = { name = 'Adam', path = plain, groups = { { numel = 4, init = ds.zeros({ 4 }) } } }
    local e = H.err(nvme.optimizer, opts)
    H.has(e, KEY)
    H.has(e, plain)
    -- a directory where a file must go
    assert(os.execute('mkdir -p ' .. d .. '/busy/rank0/group1.master.bin') == 0)
    opts.path = d .. '/busy'
    e = H.err(nvme.optimizer, opts)
    H.has(e, KEY)
    H.has(e, 'group1.master.bin')
  end)

  it('refuses bad options and bad step arguments', function()
    local d = tmpdir()
    local function opts(extra)
      return with({ name = 'AdamW', path = d, groups = { { numel = 4, init = ds.zeros({ 4 }) } } }, extra)
    end
    H.has(H.err(nvme.optimizer, opts({ name = 'Lamb' })), 'Lamb cannot be streamed')
    H.has(H.err(nvme.optimizer, opts({ buffer_count = 2 })), 'buffer_count must be an integer >= 3')
    H.has(H.err(nvme.optimizer, opts({ sub_group_size = 0 })), 'sub_group_size must be an integer >= 1')
    H.has(H.err(nvme.optimizer, opts({ groups = { { numel = 5, init = ds.zeros({ 4 }) } } })),
          'group 1: init must be a tensor of numel = 5 elements, got f32 [4]')
    H.has(H.err(nvme.optimizer, opts({ groups = { { numel = 4, init = ds.zeros({ 4 }), momentum = 0.9 } } })),
          "group 1: unknown option 'momentum' for AdamW")
    local streamed = nvme.optimizer(opts({}))
    H.has(H.err(streamed.step, streamed, { ds.zeros({ 3 }) }), 'step: grads[1] is f32 [3]')
    H.has(H.err(streamed.step, streamed, { ds.zeros({ 4 }, 'bf16') }), 'grads[1] is bf16 [4]')
    H.has(H.err(streamed.step, streamed, { ds.zeros({ 4 }) }, {}), 'out must be a list of 1 tensors')
    streamed.param_groups[1].lr = -1
    H.has(H.err(streamed.step, streamed, { ds.zeros({ 4 }) }), 'nvme: group 1: optim.AdamW: lr must be >= 0')
    streamed.param_groups[1].lr = 1e-3
    streamed:step({ ds.zeros({ 4 }) })
    streamed:close()
  end)
end)
