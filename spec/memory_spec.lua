-- A long training loop keeps a flat resident size: the tape frees
-- activations during backward, the binding steps the Lua GC when native
-- bytes grow, and nothing leaks per step. The loop runs in a fresh dslua
-- process, as a user's training script would: the specs run before it
-- leave heaps and GC thresholds that would blur the resident size.
local H = require 'helpers'

local script = [==[
local ds = require 'dslua'

-- Resident set size of this process in bytes.
local function rss()
  local f = assert(io.open('/proc/self/statm'))
  local pages = tonumber(f:read('*l'):match('^%d+%s+(%d+)'))
  f:close()
  return pages * 4096
end

local function settled()
  collectgarbage()
  collectgarbage()
  return ds.memory_stats().current
end

-- ds.matmul where it exists; else the same product from a broadcast
-- multiply and a sum, [n,k] x [k,m] -> [n,k,m] -> [n,m].
local matmul = ds.matmul or function(a, b) return (a:unsqueeze(3) * b):sum(2) end

local base = settled()
ds.manual_seed(1)
local n, din, hidden = 16, 8, 32
local function param(...)
  return (ds.randn(...) * 0.3):detach():set_category('parameters'):requires_grad_()
end
local w1, b1, w2, b2 = param(din, hidden), param(hidden), param(hidden, 1), param(1)
local params = { w1, b1, w2, b2 }
local x = ds.randn(n, din)
local target = x:narrow(2, 1, 1):tanh() * 0.5 + x:narrow(2, 2, 1) * 0.25
local lr = 0.05

local function step()
  local h = (matmul(x, w1) + b1):tanh()
  local y = matmul(h, w2) + b2
  local d = y - target
  local loss = (d * d):mean()
  loss:backward()
  ds.no_grad(function()
    for _, p in ipairs(params) do
      p:sub_(p.grad * lr)
      p.grad = nil
    end
  end)
  return loss:item()
end

local r = { first_loss = step(), live_early = 0, live_late = 0 }
for i = 2, 10000 do
  r.last_loss = step()
  -- no forced collection here: garbage must not pile up on its own
  local live = ds.memory_stats().current.total
  if i <= 2000 then r.live_early = math.max(r.live_early, live) end
  if i > 9000 then r.live_late = math.max(r.live_late, live) end
  if i == 1000 then r.total1000, r.rss1000 = settled().total, rss() end
end
local s = settled()
r.total10000, r.rss10000 = s.total, rss()
r.act_left = s.activations - base.activations
r.matmul = ds.matmul and 'ds.matmul' or 'mul+sum'
for k, v in pairs(r) do print('RESULT', k, v) end
]==]

describe('memory over a long training loop', function()
  it('stays flat over 10,000 steps of a 2-layer MLP with SGD', function()
    local dir = H.tmpdir()
    H.write(dir .. '/train.lua', script)
    local out, status = H.run(H.bin() .. ' ' .. dir .. '/train.lua')
    os.execute('rm -rf ' .. dir)
    assert.are.equal(0, status, out)
    local r = {}
    for k, v in out:gmatch('RESULT\t(%S+)\t(%S+)') do r[k] = tonumber(v) or v end
    assert.is_number(r.rss10000, out)

    assert.is_true(r.last_loss < r.first_loss * 0.5,
                   string.format('the model trains: loss %.4g -> %.4g', r.first_loss, r.last_loss))
    assert.are.equal(r.total1000, r.total10000, 'live tensor bytes after a collection, step 1000 and 10000')
    assert.are.equal(0, r.act_left, 'activations left after the loop')
    -- 10,000 steps allocate hundreds of MB in all; uncollected garbage stays bounded
    assert.is_true(r.live_late < 128 * 2^20, string.format('uncollected bytes reached %.1f MB', r.live_late / 2^20))
    assert.is_true(r.live_late <= r.live_early * 2,
                   string.format('uncollected bytes grew: %.1f MB early, %.1f MB late', r.live_early / 2^20,
                                 r.live_late / 2^20))
    local growth = r.rss10000 - r.rss1000
    assert.is_true(growth < 4 * 2^20, string.format('resident size grew by %.1f MB (%s)', growth / 2^20, r.matmul))
  end)
end)
