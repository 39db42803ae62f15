-- Partitioned construction (ds.zero.Init, lua/dslua/engine/zinit.lua):
-- spec/zinit/run.lua builds tiny GPT-2 and Llama models whole and inside
-- the scope on 2 and 4 ranks, from their constructors and from Hugging
-- Face folders, trains them at stage 3 both ways and raises the scope's
-- errors. The ranged draw and the errors a single process can show are
-- checked here.
local H = require 'helpers'
local ds = H.ds
local Z0 = require('dslua.core')._zero

describe('a ranged draw', function()
  for _, normal in ipairs({ false, true }) do
    it('gives the elements of a whole ' .. (normal and 'randn' or 'rand') .. ' and moves the generator as it',
       function()
      local draw = normal and ds.randn or ds.rand
      ds.manual_seed(3)
      local whole = draw(4099)
      local after = ds.get_rng_state()
      -- every start modulo the 4 words of a Philox block, and an empty range
      for _, r in ipairs({ { 0, 4099 }, { 1, 7 }, { 2, 1000 }, { 3, 4096 }, { 4, 13 }, { 4095, 4 }, { 4099, 0 } }) do
        ds.manual_seed(3)
        local part = Z0.draw(normal, 4099, r[1], r[2], whole)
        assert.are.equal(after, ds.get_rng_state())
        assert.are.equal(r[2], part:numel())
        if r[2] > 0 then H.assert_same(part, whole:narrow(1, r[1] + 1, r[2]), 'elements ' .. r[1]) end
      end
    end)
  end

  it('refuses a range outside the draw', function()
    H.has(H.err(function() Z0.draw(false, 10, 8, 3, ds.zeros(1)) end), 'elements 8..11 are not within a draw of 10')
  end)
end)

describe('ds.zero.Init', function()
  local Z3 = { zero_optimization = { stage = 3 } }

  it('refuses a job that was not launched, naming how to launch it', function()
    H.has(H.err(function() ds.zero.Init(Z3, function() return ds.nn.Linear(400, 400) end) end),
          'ds.zero.Init: not a launched job: run the script with dslua -n N')
    -- no scope was left open
    assert.is_false(ds.zero.active())
  end)

  it('refuses a stage other than 3, tensor parallelism and a config it cannot read', function()
    H.has(H.err(function() ds.zero.Init({ zero_optimization = { stage = 1 } }, function() end) end),
          'zero_optimization.stage is 1: partitioned construction is for stage 3')
    H.has(H.err(function() ds.zero.Init('/nonexistent/ds.json', function() end) end),
          "ds.zero.Init: cannot read '/nonexistent/ds.json'")
    H.has(H.err(function()
      ds.zero.Init({ zero_optimization = { stage = 3 }, tensor_parallel = { autotp_size = 2 } }, function() end)
    end), 'tensor_parallel.autotp_size 2 splits a model built whole')
  end)
end)

describe('partitioned construction on N ranks', function()
  if H.skip_without_mpirun() then return end
  local dir = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. dir) end)

  local runs = {}
  local function run(np)
    if not runs[np] then
      local sub = dir .. '/' .. np
      os.execute('mkdir -p ' .. sub)
      runs[np] = H.run_json(H.ranks_cmd(np) .. ' spec/zinit/run.lua ' .. sub .. '/out.json ' .. sub, sub .. '/out.json')
    end
    return runs[np]
  end

  for _, np in ipairs({ 2, 4 }) do
    for _, kind in ipairs({ 'gpt2', 'llama' }) do
      it(string.format('builds %s as shards equal to a whole build\'s ranges, each rank holding 1/%d (%d ranks)',
                       kind, np, np), function()
        local c = run(np)[kind .. '_f32']
        assert.are.equal(0, c.shard_diff)
        assert.is_true(c.partitioned > 0)
        -- a rank's shards: ceil(n / P) per parameter
        assert.is_true(c.held <= c.total / np + c.partitioned, c.held .. ' of ' .. c.total)
        for _, dtype in ipairs({ 'f32', 'bf16' }) do
          assert.is_true(run(np)[kind .. '_' .. dtype].rng_same, 'the generator moves as a whole build moves it')
        end
      end)

      it(string.format('trains %s at stage 3 bit-identically with and without the scope, fp32 and bf16 (%d ranks)',
                       kind, np), function()
        for _, dtype in ipairs({ 'f32', 'bf16' }) do
          local c = run(np)[kind .. '_' .. dtype]
          assert.are.equal(0, c.start_diff)
          assert.are.equal(3, #c.losses_whole)
          assert.are.same(c.losses_whole, c.losses_part)
          assert.are.same(c.weights_whole, c.weights_part)
        end
      end)

      it(string.format('loads %s from Hugging Face folders into shards equal to the whole load (%d ranks)', kind, np),
         function()
        for _, layout in ipairs({ 'single', 'sharded' }) do
          local c = run(np)['hf_' .. kind .. '_' .. layout]
          assert.is_true(c.partitioned > 0)
          assert.are.equal(0, c.diff)
          assert.are.equal(0, c.gathered_diff)
        end
      end)
    end

    it(string.format('gives clear errors naming what is at fault (%d ranks)', np), function()
      local e = run(np).errors
      H.has(e.nested, 'ds.zero.Init: a partitioned-construction scope is open already: scopes do not nest')
      H.has(e.stage, 'zero_optimization.stage is 2: partitioned construction is for stage 3')
      H.has(e.reads, "Linear 'weight' [8x16] is built partitioned (ds.zero.Init): its values exist only as shards")
      H.has(e.padded, "Embedding 'weight' [48x18] is built partitioned")
      H.has(e.init_stage, "initialize: parameter 'transformer.wte.weight' was built partitioned (ds.zero.Init), "
                          .. 'which needs zero_optimization.stage 3, not 2')
      H.has(e.init_threshold, "initialize: parameter 'transformer.wte.weight' was built partitioned (ds.zero.Init) "
                              .. 'but its 720 elements are within stage3_param_persistence_threshold 1000')
      H.has(e.from_hf_outside, 'gpt2.from_hf: partitioned = true loads into the shards of a model built inside '
                               .. 'ds.zero.Init')
      assert.are.equal('no error', e.after)
    end)
  end
end)
