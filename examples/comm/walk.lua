-- A walk through every ds.comm primitive, printing what each rank holds
-- before and after. Run it on any number of ranks:
--
--   mpirun --allow-run-as-root --oversubscribe -np 4 dslua examples/comm/walk.lua
--
-- (plain `dslua examples/comm/walk.lua` runs it on one rank). mpirun
-- forwards each rank's output on its own schedule, so lines of different
-- ranks come out in any order; here rank 0 prints for everyone instead:
-- show() gathers each rank's tensor to rank 0 first.
local ds = require 'dslua'
local c = ds.comm

local r, n = c.rank(), c.world_size()

local function fmt(t)
  local v = t:to('f64'):reshape(-1):totable()
  for i, x in ipairs(v) do v[i] = string.format('%g', x) end
  return string.format('%-4s [%s]', t:dtype(), table.concat(v, ', '))
end

-- every rank's t (first dims may differ), printed by rank 0
local function show(label, t)
  local all = c.gather(t, 0)
  if r ~= 0 then return end
  print('  ' .. label)
  for q = 0, n - 1 do print(string.format('    rank %d: %s', q, fmt(all[q + 1]))) end
end

local function step(title)
  if r == 0 then print('\n' .. title) end
end

-- a list of tensors as one, to show it in one line
local function joined(list) return ds.cat(list, 1) end

if r == 0 then print(string.format('world_size %d, local_size %d', n, c.local_size())) end

step('all_reduce(t) -- sum in place on every rank')
local t = ds.tensor({ r + 1, 10 * (r + 1) })
show('before', t)
c.all_reduce(t)
show('after', t)

step("all_reduce(t, 'avg') in bf16 -- averaged in f32, rounded once")
t = ds.tensor({ r, 1 }, 'bf16')
show('before', t)
c.all_reduce(t, 'avg')
show('after', t)

step("all_reduce(t, 'max') on i64")
t = ds.tensor({ r, -r }, 'i64')
show('before', t)
c.all_reduce(t, 'max')
show('after', t)

step(string.format('broadcast(t, %d) -- rank %d\'s values everywhere', n - 1, n - 1))
t = ds.full({ 3 }, r)
show('before', t)
c.broadcast(t, n - 1)
show('after', t)

step("reduce(t, 0, 'sum') -- the sum on rank 0 only")
t = ds.full({ 2 }, r + 1)
show('before', t)
c.reduce(t, 0, 'sum')
show('after', t)

step('all_gather(t) -- every rank gets every rank\'s t; rank r sends r+1 values')
t = ds.full({ r + 1 }, r)
show('before', t)
show('after (the list, joined)', joined(c.all_gather(t)))

step('gather(t, 0) -- the list on rank 0, nil elsewhere')
t = ds.tensor({ r * r })
show('before', t)
local got = c.gather(t, 0)
if r == 0 then print('  after: rank 0 holds ' .. #got .. ' tensors, joined: ' .. fmt(joined(got))) end
if r == 0 and n > 1 then print('  the other ranks hold nil') end

step('scatter(list, 0) -- rank 0 hands piece r to rank r')
local list
if r == 0 then
  list = {}
  for q = 0, n - 1 do list[q + 1] = ds.arange(q + 1):float():add(100 * q) end
  print('  rank 0 scatters ' .. #list .. ' pieces')
end
show('after', c.scatter(list, 0))

step("reduce_scatter(list, 'sum') -- rank r gets the sum of every rank's list[r+1]")
list = {}
for q = 0, n - 1 do list[q + 1] = ds.full({ 2 }, (r + 1) * (q + 1)) end
show('before (the list, joined)', joined(list))
show('after', c.reduce_scatter(list, 'sum'))

if n > 1 then
  step('send / recv -- around the ring, rank r to rank r+1')
  t = ds.full({ 2 }, r)
  local inbox = ds.zeros(2)
  show('before: outbox', t)
  local w = c.send(t, (r + 1) % n, { async = true })
  c.recv(inbox, (r - 1 + n) % n)
  w:wait()
  show('after: inbox', inbox)
end

step('all_reduce(t, {async = true}) -- a work to wait for')
t = ds.full({ 2 }, r + 1)
local work = c.all_reduce(t, { async = true })
while not work:is_completed() do end      -- other work could run here
show('after work:wait()', work:wait())

step('new_group(even ranks) -- all_reduce inside the group; odd ranks keep theirs')
local evens = {}
for q = 0, n - 1, 2 do evens[#evens + 1] = q end
local g = c.new_group(evens)
t = ds.full({ 1 }, r + 1)
show('before', t)
if g:rank() >= 0 then c.all_reduce(t, { group = g }) end
show('after', t)

step('barrier()')
c.barrier()
if r == 0 then print('  every rank got here') end
