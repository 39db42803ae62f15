-- Run by spec/comm_spec.lua under mpirun with 2, 3 or 4 ranks: every
-- primitive on every dtype, checked for values, shapes and dtypes, with
-- uneven sizes, non-contiguous tensors, async works and groups. Each rank
-- prints `PASS <name>` per check (`FAIL <name>: why` otherwise) and rank 0
-- ends with `DONE checks=N failures=M` (summed over ranks).
-- `primitives.lua cuda` (spec/gpu/nccl_spec.lua) puts the tensors of the
-- per-dtype and view checks on this rank's GPU, so they go through NCCL.
local ds = require 'dslua'
local c = ds.comm

local r, n = c.rank(), c.world_size()
local dev = arg[1] == 'cuda' and ds.device() or 'cpu'
local checks, failures = 0, 0

local function values(t)
  if t:dim() == 0 then return { t:to('f64'):item() } end
  local out = {}
  local function flat(v)
    if type(v) == 'table' then for _, x in ipairs(v) do flat(x) end else out[#out + 1] = v end
  end
  flat(t:to('f64'):totable())
  return out
end

local function fmt(list)
  local s = {}
  for i, v in ipairs(list) do s[i] = string.format('%.9g', v) end
  return '{' .. table.concat(s, ',') .. '}'
end

-- t has dtype, shape (a list) and exactly the values expected
local function check(name, t, dtype, shape, expect)
  checks = checks + 1
  local why
  if not ds.is_tensor(t) then
    why = 'not a tensor: ' .. tostring(t)
  elseif dev ~= 'cpu' and t:device() ~= dev then
    why = 'on ' .. t:device() .. ', expected ' .. dev
  elseif t:dtype() ~= dtype then
    why = 'dtype ' .. t:dtype() .. ', expected ' .. dtype
  elseif table.concat(t:size(), 'x') ~= table.concat(shape, 'x') then
    why = 'shape ' .. table.concat(t:size(), 'x') .. ', expected ' .. table.concat(shape, 'x')
  else
    local got = values(t)
    if #got ~= #expect then why = #got .. ' values, expected ' .. #expect end
    for i = 1, #expect do
      if not why and got[i] ~= expect[i] then why = 'values ' .. fmt(got) .. ', expected ' .. fmt(expect) end
    end
  end
  if why then
    failures = failures + 1
    c.print('FAIL ' .. name .. ': ' .. why)
  else
    c.print('PASS ' .. name)
  end
end

local function check_true(name, ok, why)
  checks = checks + 1
  if ok then c.print('PASS ' .. name) else failures = failures + 1; c.print('FAIL ' .. name .. ': ' .. tostring(why)) end
end

local function make(list, dtype, shape)
  local t = ds.tensor(list, 'f64'):to(dtype):to(dev)
  return shape and t:reshape(shape) or t
end

local function range(k, f)
  local out = {}
  for i = 1, k do out[i] = f(i) end
  return out
end

local DTYPES = { 'f32', 'f64', 'bf16', 'f16', 'i32', 'i64', 'u8', 'bool' }
local FLOAT = { f32 = true, f64 = true, bf16 = true, f16 = true }
local tri = n * (n + 1) / 2

for _, dt in ipairs(DTYPES) do
  local isbool = dt == 'bool'
  local base = { 1, 2, 3, 0, 5 }
  local mine = isbool and { r == 0 and 1 or 0, 0, 1, r % 2, 1 } or range(5, function(i) return base[i] * (r + 1) end)
  local bool_or = { 1, 0, 1, n > 1 and 1 or 0, 1 }
  local bool_and = { n == 1 and 1 or 0, 0, 1, 0, 1 }

  -- all_reduce, every op
  local t = make(mine, dt)
  check('all_reduce sum ' .. dt, c.all_reduce(t), dt, { 5 },
        isbool and bool_or or range(5, function(i) return base[i] * tri end))
  check('all_reduce max ' .. dt, c.all_reduce(make(mine, dt), 'max'), dt, { 5 },
        isbool and bool_or or range(5, function(i) return base[i] * n end))
  check('all_reduce min ' .. dt, c.all_reduce(make(mine, dt), 'min'), dt, { 5 },
        isbool and bool_and or base)
  local twos = 0
  for q = 0, n - 1 do if q % 2 == 1 then twos = twos + 1 end end
  check('all_reduce prod ' .. dt, c.all_reduce(make(isbool and mine or range(5, function() return r % 2 + 1 end), dt), 'prod'),
        dt, { 5 }, isbool and bool_and or range(5, function() return 2 ^ twos end))
  if FLOAT[dt] then
    check('all_reduce avg ' .. dt, c.all_reduce(make(mine, dt), 'avg'), dt, { 5 },
          range(5, function(i) return base[i] * (n + 1) / 2 end))
  else
    local ok, err = pcall(c.all_reduce, make(mine, dt), 'avg')
    check_true('all_reduce avg refused ' .. dt, not ok and err:find('avg needs a floating dtype, got ' .. dt, 1, true), err)
  end

  -- broadcast from the last rank; reduce to the last rank
  local src = n - 1
  check('broadcast ' .. dt, c.broadcast(make(mine, dt, { 5, 1 }), src), dt, { 5, 1 },
        isbool and { src == 0 and 1 or 0, 0, 1, src % 2, 1 } or range(5, function(i) return base[i] * n end))
  check('reduce ' .. dt, c.reduce(make(mine, dt), src, 'sum'), dt, { 5 },
        r == src and (isbool and bool_or or range(5, function(i) return base[i] * tri end)) or mine)

  -- all_gather and gather with uneven first dims, rank 0 sending none
  local rows = function(q) return range(q * 2, function(i) return isbool and (q + i) % 2 or q * 10 + i end) end
  local piece = make(r == 0 and { 0, 0 } or rows(r), dt):narrow(1, 1, r == 0 and 0 or 2 * r):reshape(r, 2)
  local all = c.all_gather(piece)
  check_true('all_gather count ' .. dt, #all == n, #all)
  for q = 0, n - 1 do check('all_gather ' .. dt .. ' from ' .. q, all[q + 1], dt, { q, 2 }, q == 0 and {} or rows(q)) end
  local got = c.gather(piece, 0)
  if r == 0 then
    for q = 0, n - 1 do check('gather ' .. dt .. ' from ' .. q, got[q + 1], dt, { q, 2 }, q == 0 and {} or rows(q)) end
  else
    check_true('gather ' .. dt .. ' nil off dst', got == nil, got)
  end

  -- scatter from the last rank: rank q gets q+1 values
  local vals = function(q) return range(q + 1, function(i) return isbool and (q + i) % 2 or q * 10 + i end) end
  local list = r == src and range(n, function(i) return make(vals(i - 1), dt) end) or nil
  check('scatter ' .. dt, c.scatter(list, src), dt, { r + 1 }, vals(r))

  -- reduce_scatter: piece q has q+1 elements; rank p contributes p+1
  local pieces = range(n, function(i) return make(range(i, function() return isbool and (r == 0 and 1 or 0) or r + 1 end), dt) end)
  check('reduce_scatter ' .. dt, c.reduce_scatter(pieces, 'sum'), dt, { r + 1 },
        range(r + 1, function() return isbool and 1 or tri end))

  -- all_to_all of a transposed [n, 2]: row q goes to rank q
  local row = function(p, q, a) return isbool and (a == 1 and (p + q) % 2 or 1) or p * 10 + q + 5 * (a - 1) end
  local cols = {}
  for a = 1, 2 do for q = 0, n - 1 do cols[#cols + 1] = row(r, q, a) end end
  local want = {}
  for j = 0, n - 1 do want[#want + 1], want[#want + 2] = row(j, r, 1), row(j, r, 2) end
  check('all_to_all ' .. dt, c.all_to_all(make(cols, dt, { 2, n }):t()), dt, { n, 2 }, want)

  -- send/recv around the ring (async sends, so no rank blocks the next)
  if n > 1 then
    local to, from = (r + 1) % n, (r - 1 + n) % n
    local w = c.isend(make(range(3, function(i) return isbool and (r + i) % 2 or r * 3 + i end), dt), to, { tag = 7 })
    check('recv ' .. dt, c.recv(make({ 0, 0, 0 }, dt), from, { tag = 7 }), dt, { 3 },
          range(3, function(i) return isbool and (from + i) % 2 or from * 3 + i end))
    w:wait()
  end
end

-- MPI: bf16 sums are f32 sums rounded once: 256 + 1 + 1 + 1 is 260 (ties
-- to even), where rounding at every step would stay at 256. NCCL reduces
-- bf16 natively, on the wire.
if dev == 'cpu' then
  local t = c.all_reduce(ds.tensor({ r == 0 and 256 or 1 }, 'bf16'))
  local exact = 256 + (n - 1)
  check('bf16 sum rounded once', t, 'bf16', { 1 }, { ds.tensor({ exact }, 'f32'):to('bf16'):to('f64'):item() })
else
  check('bf16 sum on the wire', c.all_reduce(make({ r + 1, 0.5 }, 'bf16')), 'bf16', { 2 }, { tri, 0.5 * n })
end

-- non-contiguous tensors: results land in the view, the rest untouched
do
  local m = ds.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }):mul(r + 1):to(dev)
  local tr = m:transpose(1, 2)
  c.all_reduce(tr)
  check('all_reduce transposed', tr, 'f32', { 3, 2 }, { 1 * tri, 4 * tri, 2 * tri, 5 * tri, 3 * tri, 6 * tri })
  local row = ds.zeros(3, 4):to(dev)
  local col = row:narrow(2, 2, 1)
  if r == 0 then col:fill_(9) end
  c.broadcast(col, 0)
  check('broadcast into a column', row, 'f32', { 3, 4 }, { 0, 9, 0, 0, 0, 9, 0, 0, 0, 9, 0, 0 })
  local half = ds.ones(4, 2, 'bf16'):mul(r + 1):to(dev):transpose(1, 2)
  c.all_reduce(half, 'avg')
  check('all_reduce avg bf16 transposed', half, 'bf16', { 2, 4 }, range(8, function() return (n + 1) / 2 end))
  if n > 1 then
    local buf = ds.zeros(2, 3):to(dev)
    local view = buf:transpose(1, 2)
    if r == 0 then c.send(ds.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }):to(dev), 1, { tag = 3 })
    elseif r == 1 then c.recv(view, 0, { tag = 3 }) end
    if r == 1 then check('recv into transposed', buf, 'f32', { 2, 3 }, { 1, 3, 5, 2, 4, 6 }) end
  end
end

-- 0-dim and empty tensors
do
  check('all_reduce 0-dim', c.all_reduce(ds.tensor(r + 1.0):reshape({})), 'f32', {}, { tri })
  local all = c.all_gather(ds.tensor(r * 1.0):reshape({}))
  check_true('all_gather 0-dim', #all == n and all[n]:dim() == 0 and all[n]:item() == n - 1, #all)
  check('all_reduce empty', c.all_reduce(ds.zeros(0, 3)), 'f32', { 0, 3 }, {})
end

-- async: several in flight, waited for in reverse order; is_completed
do
  local ts, ws = {}, {}
  for i = 1, 4 do
    ts[i] = ds.full({ 1000 }, i * (r + 1))
    ws[i] = c.all_reduce(ts[i], 'sum', { async = true })
  end
  for i = 4, 1, -1 do check('async all_reduce ' .. i, ws[i]:wait(), 'f32', { 1000 }, range(1000, function() return i * tri end)) end
  local w = c.all_gather(ds.tensor({ r }), { async = true })
  while not w:is_completed() do end
  local got = w:wait()
  check_true('async all_gather', #got == n and got[n]:item() == n - 1, #got)
  local b = c.broadcast(ds.full({ 3 }, r), 0, { async = true })
  check('async broadcast', b:wait(), 'f32', { 3 }, { 0, 0, 0 })
  local s = c.reduce_scatter(range(n, function() return ds.ones(2) end), 'avg', { async = true })
  check('async reduce_scatter avg', s:wait(), 'f32', { 2 }, { 1, 1 })
  -- dropped without a wait: completes in the background
  c.all_reduce(ds.ones(10), 'sum', { async = true })
  collectgarbage()
  c.barrier({ async = true }):wait()
  c.barrier()
  check_true('barrier', true)
end

-- groups: the even ranks, and every rank in reverse order
do
  local evens = {}
  for q = 0, n - 1, 2 do evens[#evens + 1] = q end
  local g = c.new_group(evens)
  if r % 2 == 0 then
    check_true('group rank', g:rank() == r / 2 and g:size() == #evens, g:rank())
    local t = c.all_reduce(ds.full({ 2 }, r + 1), { group = g })
    local sum = 0
    for _, q in ipairs(evens) do sum = sum + q + 1 end
    check('group all_reduce', t, 'f32', { 2 }, { sum, sum })
    check('group broadcast', c.broadcast(ds.full({ 1 }, r), evens[#evens], g), 'f32', { 1 }, { evens[#evens] })
  else
    check_true('group non-member', g:rank() == -1, g:rank())
    local ok, err = pcall(c.all_reduce, ds.ones(1), { group = g })
    check_true('group non-member refused', not ok and err:find('is not a member of group', 1, true), err)
  end
  local rev = range(n, function(i) return n - i end)
  local gr = c.new_group(rev)
  local all = c.all_gather(ds.tensor({ r }), { group = gr })
  check_true('reversed group order', all[1]:item() == n - 1 and all[n]:item() == 0, all[1]:item())
  check('reversed group reduce_scatter', c.reduce_scatter(range(n, function(i) return ds.full({ 1 }, i) end), 'sum', gr),
        'f32', { 1 }, { n * (gr:rank() + 1) })
  local ok, err = pcall(c.broadcast, ds.ones(1), n + 5, gr)
  check_true('group bad src', not ok and err:find('src ' .. (n + 5) .. ' is not a rank of group', 1, true), err)
end

-- wrong calls raise the same error on every rank, and the job goes on
do
  local ok, err = pcall(c.all_gather, ds.zeros(2, r + 1))
  check_true('all_gather trailing dims refused', n == 1 or (not ok and err:find('may differ only in their first dim', 1, true)), err)
  ok, err = pcall(c.scatter, r == 0 and { ds.ones(1) } or nil, 0)
  check_true('scatter short list refused', n == 1 or (not ok and (err:find('needs a list of ' .. n, 1, true) or
                                                     err:find('on rank 0 (src) was not valid', 1, true))), err)
  ok, err = pcall(c.reduce_scatter, range(n, function(i) return ds.ones(i + r) end))
  check_true('reduce_scatter uneven refused', n == 1 or (not ok and err:find('elements but rank', 1, true)), err)
  ok, err = pcall(c.all_to_all, ds.ones(n + 1))
  check_true('all_to_all uneven refused', n == 1 or (not ok and err:find('elements do not split into ' .. n ..
                                                                         ' equal pieces', 1, true)), err)
  ok, err = pcall(c.all_reduce, ds.ones(1), 'mean')
  check_true('unknown op refused', not ok and err:find("unknown op 'mean'", 1, true), err)
  ok, err = pcall(c.send, ds.ones(1), r)
  check_true('send to self refused', not ok and err:find('is this rank', 1, true), err)
  check('still in step', c.all_reduce(ds.ones(1)), 'f32', { 1 }, { n })
end

-- on a GPU, all-reduces run on the communication stream while the compute
-- stream works
if dev ~= 'cpu' then
  local ws, x = {}, ds.randn(256, 256):to(dev)
  for i = 1, 4 do
    ws[i] = c.all_reduce(ds.full({ 100000 }, i * (r + 1)):to(dev), 'sum', { async = true })
    x = x:matmul(x):tanh()             -- queued on the compute stream meanwhile
  end
  for i = 4, 1, -1 do
    local off = (ws[i]:wait() - i * tri):abs():amax():item()
    check_true('async all_reduce during compute ' .. i, off == 0, 'off by ' .. off)
  end
  local sum = x:sum():item()
  check_true('compute during comm', sum == sum, 'NaN')
end

-- the comms logger, DeepSpeed's table on rank 0
c.configure_logger({ enabled = true })
for _ = 1, 3 do c.all_reduce(ds.ones(1024)) end
c.all_gather(ds.ones(256))
c.broadcast(ds.ones(10), 0)
local lines = c.log_summary()
local rec = c.logger_records()
check_true('logger counts', rec.all_reduce and rec.all_reduce[4096].count == 3 and rec.all_gather[1024].count == 1, lines[2])
c.configure_logger({ enabled = false })

local total = c.all_reduce(ds.tensor({ checks, failures }, 'i64'))
local sums = total:totable()
c.print0(string.format('DONE checks=%d failures=%d', sums[1], sums[2]))
