-- No Lua call, however wrong, may crash the process. Every function of the
-- `ds` module and every tensor method (found at run time, so ops added later
-- are covered too) is called with a battery of bad argument lists in a child
-- dslua process; a crash shows as a missing completion marker, and the
-- parent then replays the guilty function call by call to name the call.
local H = require 'helpers'

-- The child: builds the battery, calls everything, reports by markers.
--   FN i name / OK i     around each function
--   CALL desc            before each call (verbose mode, one function only)
--   BAD name(desc): why  a call that failed without a string message
--   DONE n               all calls made
local child = [==[
local ds = require 'dslua'
local C = require 'dslua.core'
local verbose, first = tonumber(arg[1]) or 0, tonumber(arg[2]) or 1

local fns = {}
for k, v in pairs(ds) do
  if type(v) == 'function' then fns[#fns + 1] = { name = 'ds.' .. k, fn = v } end
end
for k, v in pairs(C.Tensor.methods) do
  if type(v) == 'function' then fns[#fns + 1] = { name = 'Tensor:' .. k, fn = v } end
end
-- metamethods with a tensor on one side
-- (__gc too: a tensor collected by hand must then fail cleanly when used)
for _, k in ipairs { '__add', '__sub', '__mul', '__div', '__pow', '__unm', '__len', '__tostring', '__index', '__newindex',
                     '__gc' } do
  if type(C.Tensor[k]) == 'function' then fns[#fns + 1] = { name = 'Tensor.' .. k, fn = C.Tensor[k] } end
end
table.sort(fns, function(a, b) return a.name < b.name end)

local NaN = 0 / 0
local function tensors()
  local T = {}
  local function add(desc, t) T[#T + 1] = { desc = desc, v = t } end
  add('f32[2,3]', ds.tensor { { 1, 2, 3 }, { 4, 5, 6 } })
  add('f64[3]', ds.tensor({ 1, -2, 3 }, 'f64'))
  add('f64[3,1] requires_grad', ds.tensor({ { 1 }, { 2 }, { 3 } }, 'f64'):requires_grad_())
  add('non-leaf f32[2]', ds.tensor({ 1, 2 }):requires_grad_() * 2)
  add('bf16[2,3]', ds.ones(2, 3, 'bf16'))
  add('f16[2]', ds.ones(2, 'f16'))
  add('i64[2,3]', ds.tensor({ { 0, 1, 2 }, { 3, 4, 5 } }, 'i64'))
  add('i64[3] bad indices', ds.tensor({ -5, 1e15, -2^62 }, 'i64'))
  add('i32[3]', ds.tensor({ 1, 0, 2 }, 'i32'))
  add('u8[2,2]', ds.tensor({ { 1, 255 }, { 0, 7 } }, 'u8'))
  add('bool[2,3]', ds.tensor({ { true, false, true }, { false, false, true } }, 'bool'))
  add('empty f32[0]', ds.zeros(0))
  add('empty f32[0,3]', ds.zeros(0, 3))
  add('0-dim f32', ds.tensor(2.5))
  add('8-dim f32', ds.ones(1, 2, 1, 2, 1, 2, 1, 2))
  add('transposed f32[3,2]', ds.tensor { { 1, 2, 3 }, { 4, 5, 6 } }:transpose(1, 2))
  add('narrowed f32[2,2]', ds.ones(2, 4):narrow(2, 2, 2))
  add('f32[4,5]', ds.rand(4, 5))
  add('f32 nan/inf[4]', ds.tensor { NaN, math.huge, -math.huge, 0 })
  add('f64[2,3,4]', ds.randn(2, 3, 4, 'f64'))
  add('f32[2000]', ds.zeros(2000))
  add('f32[2048]', ds.zeros(2048))
  return T
end

local V = {}
local function val(desc, v) V[#V + 1] = { desc = desc, v = v } end
val('nil', nil); val('false', false); val('true', true)
val('0', 0); val('1', 1); val('2', 2); val('3', 3); val('-1', -1); val('0.5', 0.5); val('-7', -7)
val('2^40', 2^40); val('2^53', 2^53); val('2^62', 2^62); val('2^63', 2^63); val('-2^63', -2^63)
val('1e300', 1e300); val('inf', math.huge); val('-inf', -math.huge); val('nan', NaN)
val("''", ''); val("'f32'", 'f32'); val("'i64'", 'i64'); val("'bogus'", 'bogus'); val("'cuda:7'", 'cuda:7')
val("'-1'", '-1')
val('{}', {}); val('{2,3}', { 2, 3 }); val('{-1}', { -1 }); val('{{1,2},{3}}', { { 1, 2 }, { 3 } })
val('{2^62,8}', { 2^62, 8 }); val('{nan}', { NaN }); val("{'a'}", { 'a' }); val('{{}}', { {} })
val('{1,2,3,4,5,6,7,8,9}', { 1, 2, 3, 4, 5, 6, 7, 8, 9 }); val('{x=1}', { x = 1 })
val('function', function() return 1 end); val('io.stdout', io.stdout)
val('coroutine', coroutine.create(function() end))

-- a few values for the longer argument lists
local S = { 'nil', '1', '-1', '2', '2^62', 'nan', "'f32'", '{}', 'true', '0' }

local function pick(desc)
  for _, v in ipairs(V) do if v.desc == desc then return v end end
end

local function battery(T)
  local L = {}
  local function add(...) L[#L + 1] = { n = select('#', ...), ... } end
  add()
  for _, v in ipairs(V) do add(v) end
  for _, t in ipairs(T) do add(t) end
  for _, t in ipairs(T) do
    for _, v in ipairs(V) do add(t, v) end
    for _, u in ipairs(T) do add(t, u) end
  end
  for _, v in ipairs(V) do add(v, T[1]) end
  for ti = 1, #T, 3 do
    for _, a in ipairs(S) do
      for _, b in ipairs(S) do add(T[ti], pick(a), pick(b)) end
    end
  end
  for _, t in ipairs(T) do
    add(t, t, t)
    add(t, T[1], T[18])
    add(t, pick('1'), pick('1'), pick('1'))
    add(t, pick('1'), pick('2'), pick('true'), pick('1'))
    add(t, pick('-1'), pick('2^62'), pick('2^62'), pick('-1'), pick('nan'))
  end
  -- sizes and offsets whose sums or products wrap around int64: 3 x that
  -- number is 2^64 + 2048, and 1999 + that length passes 2^63
  local wrap, big = { desc = '6148914691236517888', v = 6148914691236517888 }, { desc = '2^63-1024', v = 2^63 - 1024 }
  local T2048, T2000 = T[#T], T[#T - 1]
  add(T2048, pick('3'), wrap)
  add(T2048, { desc = '{3,6148914691236517888}', v = { 3, 6148914691236517888 } })
  add(T2048, wrap, pick('3'))
  add(T2000, pick('1'), { desc = '1999', v = 1999 }, big)
  add(T2000, pick('-1'), { desc = '-1', v = -1 }, big)
  add(wrap, pick('3'))
  add(big, big)
  local nine = {}
  for i = 1, 9 do nine[i] = pick('1') end
  add(unpack(nine))
  add(T[1], unpack(nine))
  return L
end

local function describe_args(args)
  local parts = {}
  for i = 1, args.n do parts[i] = args[i].desc end
  return table.concat(parts, ', ')
end

-- Reads a returned tensor (its last element, and all of it when small):
-- a view reaching past its storage shows here.
local function touch(t)
  if not ds.is_tensor(t) or t:numel() == 0 then return end
  pcall(function()
    local last = t
    for d = 1, t:dim() do last = last:narrow(d, -1, 1) end
    last:to('f64'):sum():item()
    if t:numel() <= 1e5 then tostring(t) end
  end)
end

local calls = 0
for i = first, #fns do
  local f = fns[i]
  io.write('FN ', i, ' ', f.name, '\n')
  io.flush()
  local L = battery(tensors())
  for _, args in ipairs(L) do
    if verbose == i then io.write('CALL ', f.name, '(', describe_args(args), ')\n'); io.flush() end
    local vals = {}
    for k = 1, args.n do vals[k] = args[k].v end
    local res = { pcall(f.fn, unpack(vals, 1, args.n)) }
    calls = calls + 1
    if not res[1] and type(res[2]) ~= 'string' then
      io.write('BAD ', f.name, '(', describe_args(args), '): error value is a ', type(res[2]), '\n')
    end
    for k = 2, table.maxn(res) do touch(res[k]) end
    C.set_grad_enabled(true)
  end
  io.write('OK ', i, '\n')
  io.flush()
  collectgarbage()
end

io.write('DONE ', calls, '\n')
]==]

describe('robustness', function()
  it('no call with bad arguments crashes the process', function()
    local bin, dir = H.bin(), H.tmpdir()
    local script = dir .. '/battery.lua'
    H.write(script, child)
    -- in its own directory (functions that write files write there), no stdin
    local function run(verbose, first)
      return H.run(string.format('cd %s && timeout 120 %s %s %d %d </dev/null', dir, bin, script, verbose, first))
    end

    local problems, first, total = {}, 1, 0
    for _ = 1, 10 do
      local out, status = run(0, first)
      for line in out:gmatch('BAD [^\n]*') do problems[#problems + 1] = line end
      local done = out:match('\nDONE (%d+)') or out:match('^DONE (%d+)')
      if done and status == 0 then total = total + tonumber(done); break end
      -- the function that started and did not finish
      local last_fn, name
      for i, n in out:gmatch('FN (%d+) ([^\n]+)') do last_fn, name = tonumber(i), n end
      if not last_fn or out:match('\nOK ' .. last_fn .. '\n') then
        problems[#problems + 1] = 'child died outside any function (status ' .. tostring(status) .. '): ' .. out:sub(-500)
        break
      end
      local vout, vstatus = run(last_fn, last_fn)
      local call
      for c in vout:gmatch('CALL ([^\n]+)') do call = c end
      problems[#problems + 1] = string.format('%s crashed the process (exit status %s): %s\n%s', name,
        tostring(vstatus), call or '(no call recorded)', vout:gsub('CALL [^\n]*\n', ''):gsub('FN [^\n]*\n', ''):sub(-400))
      first = last_fn + 1
    end
    os.execute('rm -rf ' .. dir)
    assert(#problems == 0, #problems .. ' problem(s):\n' .. table.concat(problems, '\n'))
  end)
end)

-- Private modules are reachable from Lua too: calls that would free memory
-- still in use are refused with an error (they once crashed the process),
-- and numbers past C's integer ranges are refused before any cast.
describe('robustness of private and numeric edges', function()
  local ds = H.ds
  local C = require 'dslua.core'

  it('refuses to release the data of a dataset tensor while loader threads read it', function()
    -- in a child: before, this was a segfault in the loader thread
    local out, status = H.run(H.bin() .. [[ -e "
      local ds = require 'dslua'
      local Z = require('dslua.core')._zero
      local x = ds.randn(4096, 64)
      local d = ds.data.tensors{ x = x, y = ds.arange(4096) }
      local l = ds.data.loader(d, { batch_size = 64, num_workers = 2, shuffle = true })
      local n = 0
      for _, b in l:epoch(1) do
        if n == 2 then print(select(2, pcall(Z.release_data, x))) end
        n = n + 1
      end
      print('epoch done', n, x:sum():item() == x:sum():item())"]])
    assert.are.equal(0, status, out)
    H.has(out, 'release_data: the f32 [4096,64] tensor\'s data is in use by a dataset (its loader threads read it)')
    H.has(out, 'epoch done\t64\ttrue')
  end)

  it('refuses to swap out bytes an asynchronous transfer still reads', function()
    local d = H.tmpdir()
    local f = ds.aio.open(d .. '/a.bin', 4 * 2 ^ 20)
    local t = ds.ones(2 ^ 20)
    local r = f:write(t, 0)
    H.has(H.err(C._zero.release_data, t), 'release_data: the f32 [1048576] tensor\'s data is in use by an '
          .. 'asynchronous file transfer (wait for it first)')
    H.has(H.err(C._zero.set_data, t, ds.zeros(2 ^ 20)), 'set_data: the f32 [1048576] tensor\'s data is in use')
    r:wait()
    C._zero.release_data(t)                          -- done: nothing reads it now
    assert.is_true(C._zero.is_released(t))
    f:close()
    os.execute('rm -rf ' .. d)
  end)

  it('range-checks numbers before casting them to C integers', function()
    H.has(H.err(ds.comm.new_group, { 1e300 }), 'new_group: entry 1 of the rank list is not an integer')
    H.has(H.err(ds.comm.send, ds.ones(1), 0, { tag = 2 ^ 40 }), 'send: tag must be an integer in [0, 2147483647], got 1099511627776')
    H.has(H.err(ds.lr.warmup_lr, 1e300, { warmup_num_steps = 10 }),
          'warmup_lr: iteration must be an integer that fits in 64 bits, got 1.0000000000000001e+300')
    H.has(H.err(C.data_core.windows, ds.arange(10), { 1e300 }, 2, 2),
          'windows: a segment length must be an integer >= 0, got 1.0000000000000001e+300')
    H.has(H.err(C.data_core.windows, ds.arange(10), { 10 }, 2 ^ 64, 2),
          'windows: block_size must be an integer >= 1, got 1.8446744073709552e+19')
    H.has(H.err(ds.zeros, { 2, 1e300 }), 'a shape entry must be an integer that fits in 64 bits, got 1.0000000000000001e+300')
  end)

  it('says what happened when a destroyed engine is stepped', function()
    local model = require('models.mlp'){ input_size = 4, hidden = { 8 }, num_classes = 2 }
    local e = ds.initialize{ model = model, config = { train_batch_size = 2,
                                                       optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
    local b = { x = ds.randn(2, 4), y = ds.tensor({ 0, 1 }, 'i64') }
    e:backward(e(b))
    e:step()
    e:destroy()
    H.has(H.err(e.step, e), 'engine:step: the engine was destroyed (engine:destroy()); make a new one with '
          .. 'ds.initialize')
    H.has(H.err(e.backward, e, e(b)), 'engine:backward: the engine was destroyed')
  end)
end)
