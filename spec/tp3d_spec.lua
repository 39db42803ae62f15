-- 3D parallelism: a pipeline of tensor-parallel stages, data parallel
-- with ZeRO-1 across them, on 8 CPU ranks against one (spec/tp3d/train.lua).
-- Tensor-parallel checkpoints: each rank saves its pieces with their split,
-- a checkpoint loads on another tensor and data degree (every tensor the
-- same to the bit, training going on as one rank does), the 16-bit export
-- is the whole model; a manifest whose pieces do not fit is refused
-- (spec/ranks/lm.lua). Both under mpirun.
local H = require 'helpers'
local ds = H.ds

describe('pipeline x tensor x data on one rank', function()
  it('refuses a topology with a sequence axis, one that is no topology, and tp without the topology', function()
    local layers = { ds.pipe.LayerSpec(ds.nn.Linear, 2, 2) }
    local topo = ds.topology { sequence = 2, world_size = 2, groups = false }
    H.has(H.err(ds.pipe.PipelineModule, { layers = layers, topology = topo }),
          'PipelineModule: the topology has a sequence degree of 2; a pipeline takes pipe, data and tensor axes')
    H.has(H.err(ds.pipe.PipelineModule, { layers = layers, topology = { pipe = 2 } }),
          'PipelineModule: topology must be a ds.pipe.PipeDataParallelTopology or a ds.topology')
    H.has(H.err(require('models.llama').pipe_layers, { n_head = 4, n_embd = 16, vocab_size = 8,
                                                        intermediate_size = 8, tp = 2 }),
          "llama.pipe_layers: tp 2 needs the pipeline's topology (topology = ds.topology{pipe = ..., tensor = 2})")
  end)
end)

describe('pipeline x tensor x data', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  local kind = 'mlp'
  -- fp8: the fp8 block's recipe, nil for none
  local function run(np, pipe, tensor, zero, ckpt, fp8)
    local path = string.format('%s/%s-%d-%d-%d-%d-%s-%s.json', dir, kind, np, pipe, tensor, zero,
                               ckpt and ckpt:sub(1, 4) or '', fp8 or '')
    return H.run_json(string.format('%s spec/tp3d/train.lua %s %s %d %d %d %s %s', H.ranks_cmd(np), path, kind, pipe,
                                    tensor, zero, ckpt or '', fp8 and 'fp8:' .. fp8 or ''), path)
  end

  -- H.same_training's losses and weights, and the gradient norm (relative)
  -- within 1e-5 in f32
  local function same(one, other, what)
    assert(math.abs(other.norm - one.norm) <= 1e-5 * one.norm, what .. ': gradient norm')
    return H.same_training(one, other, what)
  end

  it('trains pipe 2 x tensor 2 x data 2 (plain and ZeRO-1) and pipe 2 x tensor 2 as one rank, clipped', function()
    local one = run(1, 1, 1, 0)
    assert(one.norm > 0.5, 'the norm is not above the clip: nothing is clipped')
    local three = run(8, 2, 2, 1)
    assert.are.same({ 0, 1 }, three.stages)       -- stage 0: the first two blocks
    assert.are.equal(4 * 6, same(one, three, 'pipe 2 x tensor 2 x data 2, ZeRO-1'))
    same(one, run(8, 2, 2, 0), 'pipe 2 x tensor 2 x data 2')
    same(one, run(4, 2, 2, 0), 'pipe 2 x tensor 2')
  end)

  it('trains a tiny GPT-2 (its embedding tied to the lm_head, split by vocabulary) as pipe 2 x tensor 2 x data 2 '
     .. '(ZeRO-1) as one rank', function()
    kind = 'gpt'
    local one = run(1, 1, 1, 0)
    local export = dir .. '/gpt-export'
    local three = run(8, 2, 2, 1, 'export:' .. export)
    assert.is_not_nil(three.weights['0.weight'])   -- the tied embedding, on the first and last stage alike
    same(one, three, 'GPT-2 pipe 2 x tensor 2 x data 2, ZeRO-1')
    -- save_16bit_model: every layer's weights whole, once (layer_05.weight)
    local n = 0
    for name, t in pairs(ds.checkpoint.load_file(export .. '/model.safetensors')) do
      local w = assert(three.weights[name:gsub('^layer_0*(%d)', '%1')], name)
      assert.are.equal(0, (t:reshape(-1):to('f64') - ds.tensor(w, 'f64')):abs():amax():item(), name)
      n = n + 1
    end
    assert.are.equal(n, #require('models.gpt2')({ n_layer = 2, n_head = 4, n_embd = 16, vocab_size = 32,
                                                 block_size = 8 }):named_parameters())
    kind = 'mlp'
  end)

  -- Current scaling: each split cast's amax agrees over the tensor group,
  -- and the data ranks' output gradients are a power of two times one
  -- rank's, which scales their amaxes and scales exactly: the same codes.
  it('trains a tiny GPT-2 in fp8 (current scaling) as pipe 2 x tensor 2 x data 2 (ZeRO-1) as one rank', function()
    kind = 'gpt'
    local one = run(1, 1, 1, 0, nil, 'current')
    assert.are.equal(2 * 4, one.fp8_layers)         -- each block's attention and MLP linears
    same(one, run(8, 2, 2, 1, nil, 'current'), 'GPT-2 in fp8, pipe 2 x tensor 2 x data 2, ZeRO-1')
    kind = 'mlp'
  end)

  it('trains a tiny Llama (grouped-query heads) as pipe 2 x tensor 2 x data 2 (ZeRO-1) as one rank', function()
    kind = 'llama'
    same(run(1, 1, 1, 0), run(8, 2, 2, 1), 'Llama pipe 2 x tensor 2 x data 2, ZeRO-1')
    kind = 'mlp'
  end)

  it('checkpoints at pipe 2 x tensor 2 x data 2 (ZeRO-1) load on one rank, and one rank\'s at 2 x 2 x 2', function()
    local one = run(1, 1, 1, 0)
    local a, b = dir .. '/ckpt-3d', dir .. '/ckpt-one'
    run(8, 2, 2, 1, 'save:' .. a)
    local resumed = run(1, 1, 1, 0, 'load:' .. a)
    assert.are.equal(2, #resumed.losses)     -- the steps after the saved one
    same(one, resumed, '3d -> one rank')
    run(1, 1, 1, 0, 'save:' .. b)
    same(one, run(8, 2, 2, 1, 'load:' .. b), 'one rank -> 3d')
  end)
end)

describe('tensor-parallel checkpoints', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  -- lm.lua's JSON for kind on np ranks with the arguments args (key=value ...)
  local runs = 0
  local function run(kind, np, args)
    runs = runs + 1
    local path = string.format('%s/run%d.json', dir, runs)
    return H.run_json(string.format('%s spec/ranks/lm.lua %s %s %s', H.ranks_cmd(np), path, kind, args), path)
  end

  local same = H.same_training

  it('tensor 2 -> 1: the same weights and AdamW state, training on as tensor 2 does; the export loads unsplit',
     function()
    local saved, again, export = dir .. '/t2', dir .. '/t2-on-1', dir .. '/t2-export/model.safetensors'
    local two = run('gpt2', 2, 'tp=2 zero=1 optim=adamw save=' .. saved .. ' export=' .. export)
    run('gpt2', 1, 'optim=adamw steps=1 load=' .. saved .. ' resave=' .. again)
    local GPT = require 'models.gpt2'
    local whole = GPT { vocab_size = 32, block_size = 8, n_layer = 2, n_head = 4, n_embd = 16 }
    -- weights, exp_avg and exp_avg_sq of every parameter, whole, to the bit
    assert.are.equal(3 * #whole:named_parameters(), H.same_checkpoints(saved, nil, again, nil))
    same(two, run('gpt2', 1, 'optim=adamw load=' .. saved), 'tensor 2 -> 1')
    whole:load_state_dict(ds.checkpoint.load_file(export))
    for _, e in ipairs(whole:named_parameters()) do
      local w = ds.tensor(two.weights[e[1]], 'f64')
      assert.are.equal(0, (e[2]:reshape(-1):to('f64') - w):abs():amax():item(), e[1])
    end
  end)

  it('1 -> tensor 4, and Llama tensor 2 x data 2 (ZeRO-1) -> tensor 4 (ZeRO-2): the same state', function()
    local one, on4 = dir .. '/one', dir .. '/one-on-4'
    local ref = run('gpt2', 1, 'optim=adamw save=' .. one)
    run('gpt2', 4, 'tp=4 optim=adamw steps=1 load=' .. one .. ' resave=' .. on4)
    assert(H.same_checkpoints(one, nil, on4, nil) > 0)
    same(ref, run('gpt2', 4, 'tp=4 optim=adamw load=' .. one), '1 -> tensor 4')
    local l22, l4 = dir .. '/llama-2x2', dir .. '/llama-on-4'
    run('llama', 4, 'tp=2 zero=1 optim=adamw steps=1 save=' .. l22)
    run('llama', 4, 'tp=4 zero=2 optim=adamw steps=1 load=' .. l22 .. ' resave=' .. l4)
    assert(H.same_checkpoints(l22, nil, l4, nil) > 0)
  end)

  it('refuses a manifest whose pieces do not fit, naming the parameter', function()
    local saved = dir .. '/t2-manifest'
    run('gpt2', 2, 'tp=2 steps=1 save=' .. saved)
    local path = saved .. '/' .. H.read(saved .. '/latest')
    local m = ds.json.decode(H.read(path .. '/manifest.json'))
    local function refused(edit, want)
      local copy = ds.json.decode(ds.json.encode(m))
      edit(copy)
      local bad = H.tmpdir()
      H.write(bad .. '/manifest.json', ds.json.encode(copy))
      H.has(H.err(ds.checkpoint.read_manifest, bad), want)
      os.execute('rm -rf ' .. bad)
    end
    local k = 0
    for i, sp in ipairs(m.parameters) do
      if sp.tp and sp.tp.rank == 1 and k == 0 then k = i end
    end
    assert(k > 0, 'no piece of tensor rank 1 in the manifest')
    local name = m.parameters[k].name
    refused(function(c) table.remove(c.parameters, k) end,
            string.format('"%s" has 1 of its 2 tensor-parallel pieces: the manifest is corrupt', name))
    refused(function(c) c.parameters[k].tp.axis = 3 end,
            string.format('parameters[%d].tp (axis 3, stride', k))
    refused(function(c) c.parameters[k].full[1] = c.parameters[k].full[1] + 1 end,
            string.format('parameters[%d].full', k))
  end)
end)
