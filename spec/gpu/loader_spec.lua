-- The loader on the GPU (ds.data.loader{device = ...}, the engine's loader):
-- batches equal the CPU loader's, with and without prefetch threads,
-- shuffled, across epochs, a batch size changed mid-epoch and an epoch
-- left early; they are gathered into page-locked memory that is reused
-- from the second epoch on; and the batch after the one handed out is
-- already on the device (its upload started one batch ahead). Skips
-- without a GPU.
local H = require 'helpers'
local ds = H.ds

local function same(a, b, what)
  assert.are.equal('cpu', a:device(), what)
  assert.are.equal(b:device(), ds.device(), what)
  assert.are.same(a:size(), b:size(), what)
  assert.are.same(a:totable(), b:cpu():totable(), what)
end

-- every batch of `epochs` epochs of a CPU loader and a device loader with opts
local function compare(dataset, opts, epochs, what)
  local cpu_opts, dev_opts = {}, {}
  for k, v in pairs(opts) do cpu_opts[k], dev_opts[k] = v, v end
  dev_opts.device = ds.device()
  local a, b = ds.data.loader(dataset, cpu_opts), ds.data.loader(dataset, dev_opts)
  for e = 1, epochs do
    local ia, ib = a:epoch(e), b:epoch(e)
    while true do
      local sa, ba = ia()
      local sb, bb = ib()
      assert.are.equal(sa, sb, what)
      if not sa then break end
      for k in pairs(ba) do same(ba[k], bb[k], string.format('%s epoch %d step %d %s', what, e, sa, k)) end
    end
  end
  return b
end

describe('#gpu loader on the GPU', function()
  if not H.has_cuda() then pending('skipped: no CUDA device') return end
  local rows = ds.data.tensors { x = ds.randn(203, 3, 5), y = ds.arange(203), w = ds.rand(203):gt(0.5) }
  local text = ds.data.text { text = string.rep('the quick brown fox jumps over the lazy dog. ', 40), block_size = 16 }

  it('gives the CPU loader\'s batches on the device, with and without threads', function()
    for _, workers in ipairs({ 0, 2 }) do
      compare(rows, { batch_size = 16, num_workers = workers, seed = 3 }, 2, 'rows, ' .. workers .. ' workers')
      compare(text, { batch_size = 8, num_workers = workers, drop_last = true }, 2, 'text, ' .. workers .. ' workers')
    end
    -- a Lua dataset with a collate_fn: copied when handed out
    local list = {}
    for i = 1, 10 do list[i] = { x = ds.full({ 2 }, i) } end
    local b = ds.data.loader(list, { batch_size = 4, shuffle = false, device = ds.device() })
    for step, batch in b:epoch(1) do
      assert.are.equal(ds.device(), batch.x:device())
      assert.are.equal(4 * (step - 1) + 1, batch.x:cpu():totable()[1][1])
    end
  end)

  it('keeps the batches right across a batch size change and an epoch left early', function()
    local cpu = ds.data.loader(rows, { batch_size = 10, seed = 5 })
    local dev = ds.data.loader(rows, { batch_size = 10, seed = 5, num_workers = 2, device = ds.device() })
    for _, l in ipairs({ cpu, dev }) do
      l.out = {}
      for step, batch in l:epoch(1) do
        l.out[#l.out + 1] = batch.y:cpu():totable()
        if step == 3 then l:set_batch_size(7) end
        if step == 6 then break end
      end
      for _, batch in l:epoch(2) do l.out[#l.out + 1] = batch.y:cpu():totable() end
    end
    assert.are.same(cpu.out, dev.out)
  end)

  it('gathers into page-locked memory and reuses it', function()
    local before = ds.cuda.memory_info().pinned_allocs
    local l = ds.data.loader(rows, { batch_size = 16, num_workers = 2, device = ds.device() })
    local batches = 0
    for e = 1, 5 do for _ in l:epoch(e) do batches = batches + 1 end end
    local info = ds.cuda.memory_info()
    assert(info.pinned > 0, 'no page-locked memory held')
    -- at most depth (4) + 1 batches of 3 tensors live at once, in two sizes
    -- (the last batch of an epoch is short): 30 buffers serve all 195
    assert.are.equal(5 * 13, batches)
    assert(info.pinned_allocs - before <= 2 * 5 * 3, string.format('%d cudaHostAlloc calls for %d batches',
                                                                    info.pinned_allocs - before, batches))
  end)

  it('has the next batch on the device when it hands one out', function()
    local big = ds.data.tensors { x = ds.randn(64, 256, 256) }      -- 4 MiB a batch of 16
    local bytes = 16 * 256 * 256 * 4
    local l = ds.data.loader(big, { batch_size = 16, shuffle = false, device = ds.device() })
    collectgarbage()
    ds.cuda.synchronize()
    local before = ds.cuda.memory_info().allocated
    local it = l:epoch(1)
    local _, b1 = it()
    local after = ds.cuda.memory_info().allocated
    assert(after - before >= 2 * bytes, string.format('%d bytes more on the device after the first batch, '
                                                      .. 'expected two batches (%d)', after - before, 2 * bytes))
    local _, b2 = it()
    same(big.x:narrow(1, 1, 16), b1.x, 'batch 1')
    same(big.x:narrow(1, 17, 16), b2.x, 'batch 2')
  end)

  it('feeds the engine on its device', function()
    ds.manual_seed(0)
    local data = ds.data.tensors { x = ds.randn(64, 4), y = ds.randn(64, 1) }
    local Net = ds.nn.Module:extend('Net')
    function Net:init() self.fc = ds.nn.Linear(4, 1) end
    function Net:forward(batch) return ds.mse_loss(self.fc(batch.x), batch.y) end
    local engine, _, loader = ds.initialize { model = Net(), training_data = data, config = {
      train_batch_size = 8, optimizer = { type = 'SGD', params = { lr = 0.1 } }, steps_per_print = 1000 } }
    assert.are.equal(ds.device(), engine.device)
    local first
    for _ = 1, 3 do
      for _, batch in loader:epoch() do
        assert.are.equal(engine.device, batch.x:device())
        engine:backward(engine(batch))
        engine:step()
        first = first or engine.last_loss
      end
    end
    assert(engine.last_loss < first, string.format('loss %.4f after 24 steps, %.4f at the first', engine.last_loss,
                                                   first))
  end)
end)
