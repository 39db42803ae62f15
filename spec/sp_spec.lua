-- Sequence parallelism (DeepSpeed-Ulysses, ds.sequence): the all-to-alls
-- and their gradients, the errors, and tiny GPT-2 and Llama models
-- (grouped-query heads) trained with sequence degree 2 and 4, 2 x data 2
-- with ZeRO-1, and 2 with activation checkpointing, against one rank
-- (spec/sp/ops.lua and spec/ranks/lm.lua under mpirun).
local H = require 'helpers'
local ds = H.ds

describe('ds.sequence on one rank', function()
  it('refuses a degree that does not divide the world, or heads and kv heads it does not divide', function()
    H.has(H.err(function() ds.sequence.new(2) end),
          'sequence_parallel 2: topology: pipe 1 x tensor 1 x sequence 2 = 2 does not divide the world of 1 rank')
    H.has(H.err(function() ds.sequence.new(0) end), 'sequence_parallel must be a positive integer, got 0')
    local GPT, Llama = require 'models.gpt2', require 'models.llama'
    H.has(H.err(GPT, { n_head = 3, n_embd = 12, sequence_parallel = 2 }),
          'gpt2: n_head 3 is not divisible by sequence_parallel 2')
    H.has(H.err(Llama, { n_head = 4, n_kv_head = 1, n_embd = 16, sequence_parallel = 2 }),
          'llama: n_kv_head 1 (and n_head 4) must be divisible by sequence_parallel 2')
    H.has(H.err(GPT, { sequence_parallel = 1.5 }), 'sequence_parallel')
    H.has(H.err(Llama, { n_head = 4, n_embd = 16, intermediate_size = 8, vocab_size = 8, tp = 2, sequence_parallel = 2 }),
          'llama: sequence_parallel 2 cannot combine with tensor parallelism (tp 2)')
  end)

  it('is the identity with degree 1, and the batch sizes count data indices only', function()
    local sp = ds.sequence.new(1)
    local x = ds.randn(2, 4, 3, 2, 5)
    assert.are.equal(x, sp:seq_to_heads(x))
    assert.are.equal(x, sp:chunk(x))
    H.has(H.err(function() sp:heads_to_seq(ds.zeros({ 2, 4 })) end),
          'heads_to_seq: expected a tensor [B, T, A, H, D] with T divisible by sequence_parallel 1, got [2x4]')
    local cfg = assert(ds.config.check({ train_micro_batch_size_per_gpu = 2, sequence_parallel_size = 4 },
                                       { world_size = 8 }))
    assert.are.equal(4, cfg.train_batch_size)     -- 2 data indices of 4 ranks each
    local _, problems = ds.config.check({ train_micro_batch_size_per_gpu = 2, sequence_parallel_size = 3 },
                                        { world_size = 8 })
    H.has(problems[1], 'sequence_parallel_size: 3 ranks per sequence do not divide the world of 8 ranks')
  end)
end)

describe('ds.sequence across ranks', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  it('all-to-alls tokens into heads and back, gradients the reverse all-to-all; names bad shapes', function()
    local path = dir .. '/ops.json'
    local r = H.run_json(string.format('%s spec/sp/ops.lua %s', H.ranks_cmd(2), path), path)
    assert.are.equal(0, r.to_heads)
    assert.are.equal(0, r.back)
    assert.are.equal(0, r.to_heads_grad)
    assert.are.equal(0, r.to_seq_grad)
    H.has(r.bad_heads, 'seq_to_heads: expected a tensor [B, T, A, H, D] with H divisible by sequence_parallel 2, '
          .. 'got [2x2x3x3x2]')
    H.has(r.bad_length, 'GPT: sequence length 7 is not divisible by sequence_parallel 2')
    H.has(r.mismatch, 'initialize: sequence_parallel_size is 1 in the config but the model splits its sequences '
          .. 'over 2 ranks (its sequence_parallel)')
  end)

  -- spec/ranks/lm.lua's JSON for kind on np ranks with sequence degree P,
  -- ZeRO stage zero, more arguments (save=<dir>, load=<dir>, recompute=1)
  local function run(kind, np, P, zero, more)
    local path = string.format('%s/%s-%d-%d-%d-%s.json', dir, kind, np, P, zero or 0, more and more:sub(1, 4) or '')
    return H.run_json(string.format('%s spec/ranks/lm.lua %s %s sp=%d zero=%d %s', H.ranks_cmd(np), path, kind, P,
                                    zero or 0, more or ''), path)
  end

  local same = H.same_training

  for _, kind in ipairs({ 'gpt2', 'llama' }) do
    it(kind .. ' trains with sequence degree 2 and 4, and 2 x data 2 with ZeRO-1, as one rank', function()
      local one = run(kind, 1, 1)
      assert(one.losses[1] > 3, 'an untrained model\'s loss over 32 tokens is near ln 32')
      same(one, run(kind, 2, 2), kind .. ' sequence 2')
      same(one, run(kind, 4, 4), kind .. ' sequence 4')
      same(one, run(kind, 4, 2, 1), kind .. ' sequence 2 x data 2, ZeRO-1')
      -- the all-to-alls run again in the recomputing backward
      same(one, run(kind, 2, 2, 0, 'recompute=1'), kind .. ' sequence 2, every block checkpointed')
    end)
  end

  it("gives a sequence group's ranks the same batches from the engine's loader: 2 and 2 x data 2 as one rank",
     function()
    local function losses(np)
      local path = string.format('%s/loader-%d.json', dir, np)
      return H.run_json(string.format('%s spec/sp/loader.lua %s', H.ranks_cmd(np), path), path).losses
    end
    local one = losses(1)
    assert.are.equal(4, #one)     -- 32 sequences, 8 a step
    for _, np in ipairs({ 2, 4 }) do
      local other = losses(np)
      assert.are.equal(#one, #other)
      for i, l in ipairs(one) do
        assert(math.abs(other[i] - l) <= 1e-5 * l, string.format('%d ranks, step %d: %.9g vs %.9g', np, i, other[i], l))
      end
    end
  end)

  -- Per step (one micro batch), f32, b sequences of T tokens per data
  -- index, width C, L layers: each layer's attention all-to-alls b T/P
  -- tokens of q, k and v and of its output forward, the same backward
  -- (GPT-2: 2 (3C + C) b T/P values in 4 calls; Llama, kv heads of width
  -- KV D: 2 (C + 2 KV D + C) b T/P in 6); the loss is one all-reduce of
  -- 4 bytes over the group.
  it('moves the bytes the formula gives per step over the sequence group', function()
    local function check(kind, np, P, b, C, kv, calls)
      local path = string.format('%s/%s-log.json', dir, kind)
      local r = H.run_json(string.format('%s spec/ranks/lm.lua %s %s sp=%d log=1', H.ranks_cmd(np), path, kind, P),
                           path)
      local L, T = 2, 8
      for s, c in ipairs(r.comm) do
        local want = 2 * (C + kv + C) * b * T / P * L * 4
        assert.are.equal(want, c.sequence_all_to_all.bytes, kind .. ' step ' .. s)
        assert.are.equal(calls * L, c.sequence_all_to_all.calls, kind .. ' step ' .. s)
        assert.are.same({ bytes = 4, calls = 1 }, c.sequence_all_reduce)
      end
      assert.are.equal(3, #r.comm)
    end
    check('gpt2', 2, 2, 4, 16, 2 * 16, 4)          -- one data index: b = 4; GPT-2's k and v as wide as q
    check('llama', 4, 2, 2, 32, 2 * 4 * 4, 6)      -- two data indices: b = 2; 4 kv heads of 4
  end)

  it('checkpoints at sequence 2 with ZeRO-1 load on one rank, and one rank\'s at sequence 2 x data 2', function()
    local one = run('gpt2', 1, 1)
    local a, b = dir .. '/ckpt-sp2', dir .. '/ckpt-one'
    run('gpt2', 2, 2, 1, 'save=' .. a)
    local resumed = run('gpt2', 1, 1, 0, 'load=' .. a)
    assert.are.equal(2, #resumed.losses)       -- the steps after the saved one
    same(one, resumed, 'sequence 2 ZeRO-1 -> one rank')
    run('gpt2', 1, 1, 0, 'save=' .. b)
    same(one, run('gpt2', 4, 2, 1, 'load=' .. b), 'one rank -> sequence 2 x data 2 ZeRO-1')
  end)
end)
