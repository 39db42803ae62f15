-- Topology and tensor parallelism: ds.topology's layout and groups, the
-- tensor-parallel layers and models against one rank (the rank scripts
-- in spec/tp/ under mpirun).
local H = require 'helpers'
local ds = H.ds

describe('ds.topology', function()
  it('lays ranks out pipe, data, sequence, tensor, tensor innermost', function()
    local t = ds.topology { pipe = 2, tensor = 2, world_size = 8, groups = false }
    assert.are.equal(2, t:get_dim('data'))
    assert.are.same({ pipe = 1, data = 0, sequence = 0, tensor = 1 }, t:get_coord(5))
    assert.are.equal(5, t:get_rank { pipe = 1, tensor = 1 })
    for r = 0, 7 do assert.are.equal(r, t:get_rank(t:get_coord(r))) end
    assert.are.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, t:get_axis_comm_lists('tensor'))
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, t:get_axis_comm_lists('data'))
    assert.are.same({ { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }, t:get_axis_comm_lists('pipe'))
    assert.are.same({ 3, 7 }, t:group_ranks('pipe', 7))
    assert.are.same({ 2, 3, 6, 7 }, t:group_ranks({ 'tensor', 'pipe' }, 7))
    assert.are.same({ 1, 3, 5, 7 }, t:group_ranks({ 'data', 'pipe' }, 7))
    local s = ds.topology { sequence = 2, tensor = 2, world_size = 8, groups = false }
    assert.are.same({ { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }, s:get_axis_comm_lists('sequence'))
    assert.are.same({ 0, 1, 2, 3 }, s:group_ranks({ 'sequence', 'tensor' }, 0))
  end)

  it('matches ds.pipe\'s PipeDataParallelTopology without tensor and sequence axes', function()
    local t = ds.topology { pipe = 3, world_size = 6, groups = false }
    local p = ds.pipe.PipeDataParallelTopology { num_pp = 3, num_dp = 2 }
    for r = 0, 5 do
      local c = t:get_coord(r)
      assert.are.equal(p:get_rank(c.pipe, c.data), r)
    end
  end)

  it('names the degrees and the world when they do not divide it', function()
    H.has(H.err(function() ds.topology { tensor = 3, world_size = 8 } end),
          'pipe 1 x tensor 3 x sequence 1 = 3 does not divide the world of 8 ranks')
    H.has(H.err(function() ds.topology { tensor = 2, data = 3, world_size = 8 } end),
          'pipe 1 x data 3 x sequence 1 x tensor 2 = 6 ranks, the world has 8')
    H.has(H.err(function() ds.topology { tensor = 0 } end),
          'tensor must be a positive integer, got 0')
    H.has(H.err(function() ds.topology { model = 2 } end),
          "unknown key 'model'")
    H.has(H.err(function() ds.topology { world_size = 4, groups = false }:group('data') end),
          'has no groups')
    H.has(H.err(function() ds.topology { world_size = 4, groups = false }:get_dim('expert') end),
          "no axis 'expert'")
  end)

  describe('under mpirun', function()
    if H.skip_without_mpirun() then return end
    local dir = H.tmpdir()
    teardown(function() os.execute('rm -rf ' .. dir) end)

    -- every group of every combination of axes holds exactly the ranks
    -- that share the other coordinates: its size and the sum of its ranks
    for _, dims in ipairs({ { 2, 2, 1, 2 }, { 1, 2, 2, 2 } }) do
      it(string.format('makes every group on 8 ranks (pipe, data, sequence, tensor = %s)', table.concat(dims, ',')),
         function()
        local out = dir .. '/topo.json'
        local text, status = H.run(string.format('%s spec/tp/topology.lua %s %s 2>&1', H.ranks_cmd(8), out,
                                                 table.concat(dims, ',')))
        assert.are.equal(0, status, text)
        local ref = ds.topology { pipe = dims[1], data = dims[2], sequence = dims[3], tensor = dims[4],
                                  world_size = 8, groups = false }
        for r = 0, 7 do
          local seen = ds.json.decode(H.read(out .. '.' .. r))
          assert.are.same(ref:get_coord(r), seen.coord)
          assert.are.equal(15, (function() local n = 0; for _ in pairs(seen.groups) do n = n + 1 end; return n end)())
          for k, v in pairs(seen.groups) do
            local axes = {}
            for a in k:gmatch('[^+]+') do axes[#axes + 1] = a end
            local ranks, sum = ref:group_ranks(axes, r), 0
            for _, q in ipairs(ranks) do sum = sum + q end
            assert.are.equal(#ranks, v.size, k)
            assert.are.equal(sum, v.sum, k)
          end
        end
      end)
    end
  end)
end)
