-- dslua.base.suggest: the "did you mean" every unknown name is offered.
local suggest = require 'dslua.base.suggest'

local nearest = suggest.nearest

local WARMUP = { 'warmup_min_lr', 'warmup_max_lr', 'warmup_num_steps', 'warmup_type', 'last_batch_iteration' }
local SCHEDULERS = { 'LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'lua' }
local LOADER = { 'batch_size', 'shuffle', 'drop_last', 'num_workers', 'prefetch', 'seed' }

describe('dslua.base.suggest', function()
  it("first offers the shortest name holding all of the word's parts", function()
    assert.are.equal('warmup_num_steps', nearest('warmup_steps', WARMUP))
    assert.are.equal('warmup_max_lr', nearest('lr_warmup', WARMUP))
  end)

  it('then the nearest by edits, swaps and case, when near enough', function()
    assert.are.equal('warmup_num_steps', nearest('warmup_num_step', WARMUP))
    assert.are.equal('last_batch_iteration', nearest('last_batch_iter', WARMUP))
    assert.are.equal('shuffle', nearest('shuffel', LOADER))
    assert.are.equal('WarmupLR', nearest('warmuplr', SCHEDULERS))
    assert.are.equal('lr', nearest('l', { 'lr', 'betas' }))
    assert.is_nil(nearest('betas', { 'dampening', 'lr', 'momentum', 'nesterov', 'weight_decay' }))
  end)

  it('then the shortest name with a part that starts with the word', function()
    assert.are.equal('num_workers', nearest('worker', LOADER))
    assert.are.equal('block_size', nearest('block', { 'block_size', 'vocab_size' }))
    assert.is_nil(nearest('Cosine', SCHEDULERS))  -- inside a part is too loose
    assert.is_nil(nearest('min', WARMUP))         -- and 3 letters too few
  end)

  it('picks among equals by name, and only among strings', function()
    assert.are.equal('seed_a', nearest('seed_', { 'seed_b', 'seed_a' }))
    assert.is_nil(nearest('3', { 0, 1, 2, 3 }))
    assert.is_nil(nearest('x', {}))
  end)

  it('skips a word far longer than every name without comparing', function()
    assert.is_nil(nearest(string.rep('warmup_type', 2 ^ 20), WARMUP))
    assert.are.equal('warmup_type', nearest('warmup_typeeee', WARMUP))
  end)

  it('words the suggestion', function()
    assert.are.equal("did you mean 'batch_size'?", suggest.did_you_mean('batchsize', LOADER))
    assert.is_nil(suggest.did_you_mean('zzz', LOADER))
  end)

  it('takes a typo only one slip away (two from 8 letters), never a part or a short word', function()
    local METHODS = { 'forward', 'parameters', 'state_dict', 'zero_grad', 'to', 'train', 'named_buffers' }
    assert.are.equal('forward', suggest.typo('forwrd', METHODS))
    assert.are.equal('train', suggest.typo('trian', METHODS))
    assert.are.equal('zero_grad', suggest.typo('zero_gard', METHODS))
    assert.are.equal('parameters', suggest.typo('paramters', METHODS))
    assert.are.equal('state_dict', suggest.typo('stat_dic', METHODS))   -- two edits, 8 letters
    assert.is_nil(suggest.typo('fowrad', METHODS))                      -- two edits, 6 letters
    assert.is_nil(suggest.typo('name', METHODS))                        -- a part: nearest's, not a typo
    assert.is_nil(suggest.typo('zero', METHODS))
    assert.is_nil(suggest.typo('tp', METHODS))                          -- too short to tell
    assert.is_nil(suggest.typo('forward', METHODS))                     -- the name itself
  end)
end)
