-- The configuration matrix (spec/matrix/), all of it or a slice, as a
-- table: every cell's verdict against one fp32 rank, its loss and weight
-- errors, and the counts. From the repository root:
--   build/dslua scripts/matrix.lua [--pairwise] [--list] [--failures] [--chunk N] [factor=v1,v2 ...]
-- factor=values keeps the cells whose factor is one of them (factors:
-- stage ga dtype ranks bucket clip offload sampler onebit pipe tp fp8 ckpt,
-- values as in spec/matrix/settings.lua), e.g. stage=2,3 ga=33 ranks=2 or
-- tp=2 ckpt=resume. --pairwise:
-- the covering subset the suite runs; --list: count the cells and stop;
-- --failures: the table lists failed cells only; --chunk: cells per
-- mpirun launch (20). Progress and an estimate of the time left go to
-- stderr. The exit status is 1 when a cell fails.
package.path = 'spec/?.lua;' .. package.path
local H = require 'helpers'
local ds = H.ds
local S = require 'matrix.settings'
local P = require 'matrix.pairwise'
local R = require 'matrix.runner'

local function die(msg)
  io.stderr:write('matrix.lua: ', msg, ' (see the comment at the top of scripts/matrix.lua)\n')
  os.exit(2)
end

local opts, keep = { chunk = 20 }, {}
local i = 1
while i <= #arg do
  local a = arg[i]
  local f, vals = a:match('^(%w+)=(.+)$')
  if a == '--pairwise' or a == '--list' or a == '--failures' then
    opts[a:sub(3)] = true
  elseif a == '--chunk' then
    i = i + 1
    opts.chunk = tonumber(arg[i]) or die('--chunk takes a number')
  elseif f then
    keep[f] = {}
    for v in vals:gmatch('[^,]+') do keep[f][v] = true end
  else
    die('unknown argument ' .. a)
  end
  i = i + 1
end
local known = {}
for _, spec in ipairs(S.FACTORS) do known[spec[1]] = spec[2] end
for f, vals in pairs(keep) do
  if not known[f] then die('no factor ' .. f) end
  for v in pairs(vals) do
    local found = false
    for _, x in ipairs(known[f]) do found = found or tostring(x) == v end
    if not found then die(string.format('%s has no value %s', f, v)) end
  end
end

local function wanted(c)
  for f, vals in pairs(keep) do
    if not vals[tostring(c[f])] then return false end
  end
  return true
end

local all = {}
if opts.pairwise then
  all = P.cells()
else
  for _, v in ipairs(P.product()) do all[#all + 1] = P.cell_of(v) end
end
local cells = {}
for _, c in ipairs(all) do if wanted(c) then cells[#cells + 1] = c end end
io.stdout:write(string.format('%d cells of %d%s\n', #cells, #all, opts.pairwise and ' (pairwise subset)' or ''))
if opts.list or #cells == 0 then os.exit(0) end

local dir = H.tmpdir()
local t0 = ds.wall_time()
local rows = R.run(cells, { dir = dir, chunk = opts.chunk, timeout = 60, on_row = function(row, done, total)
  local spent = ds.wall_time() - t0
  io.stderr:write(string.format('[%d/%d] %.0f s, about %.0f s left: %s %s\n', done, total, spent,
                                spent / done * (total - done), row.verdict, row.name))
end })
os.execute('rm -rf ' .. dir)

local function num(x) return x and string.format('%.2e', x) or '-' end
local counts = { pass = 0, refused = 0, FAIL = 0 }
local crashed = 0
io.stdout:write(string.format('%-58s %-8s %-10s %-10s %-7s %s\n', 'cell', 'verdict', 'loss err', 'weight err',
                              'x tol', 'why'))
for _, row in ipairs(rows) do
  counts[row.verdict] = counts[row.verdict] + 1
  if row.verdict == 'FAIL' and row.why:match('^crashed') then crashed = crashed + 1 end
  if not opts.failures or row.verdict == 'FAIL' then
    local why = row.verdict == 'pass' and '' or (row.why:match('^[^\n]*'))
    io.stdout:write(string.format('%-58s %-8s %-10s %-10s %-7s %s\n', row.name, row.verdict, num(row.loss_err),
                                  num(row.weight_err), row.exact and 'exact' or row.within and string.format('%.3f', row.within) or '-', why))
  end
end
io.stdout:write(string.format('\ncells %d: trained %d, passed %d (tolerance met), refused as expected %d, '
                              .. 'failed %d (crashed %d); %.0f s\n', #rows,
                              counts.pass + counts.FAIL, counts.pass, counts.refused, counts.FAIL, crashed,
                              ds.wall_time() - t0))
os.exit(counts.FAIL > 0 and 1 or 0)
