-- Turns the result lines of bench_gemm_ref, bench/ops.lua and
-- bench/ops_torch.py into the table bench/run.sh prints:
--   dslua bench/table.lua RESULTS_FILE
-- A row's ratio is reference time / dslua time (> 1: dslua is faster); for
-- GFLOP/s rows it is dslua GFLOP/s / reference GFLOP/s, the same thing.
local fmt = string.format

local results, info, order = {}, {}, {}
for line in io.lines(arg[1]) do
  local f = {}
  for field in line:gmatch('[^\t]+') do f[#f + 1] = field end
  if f[1] == 'result' then
    -- Rounds repeat every line: keep the best of each row, the round least
    -- disturbed by whatever else ran on the machine.
    local impl, op, shape, value, unit = f[2], f[3], f[4], f[5], f[6]
    local key, new = impl .. ' ' .. op .. ' ' .. shape, { value = tonumber(value), status = value, unit = unit }
    local old = results[key]
    if not old then
      if impl == 'dslua' then order[#order + 1] = { op = op, shape = shape } end
      results[key] = new
    elseif new.value and (not old.value or (unit == 'gflops') == (new.value > old.value)) then
      results[key] = new
    end
  elseif f[1] == 'info' then
    info[f[2] .. ' ' .. f[3]] = f[4]
  end
end

-- What each dslua row is compared with, and the aim its ratio should meet
-- (nil: shown for information, no verdict).
local kinds = {
  matmul = { { ref = 'sgemm', aim = 0.90, aim_text = '>= 0.90 of sgemm' },
             { ref = 'torch', label = 'matmul vs torch' } },
  add = { { ref = 'torch', aim = 1.0, aim_text = '>= 1.0 vs torch' } },
  add_ = { { ref = 'torch', label = 'add_ (in place)' } },
  gelu_tanh = { { ref = 'torch', aim = 1.0, aim_text = '>= 1.0 vs torch' } },
  layer_norm = { { ref = 'torch', aim = 1.0, aim_text = '>= 1.0 vs torch' } },
  softmax = { { ref = 'torch', aim = 1.0, aim_text = '>= 1.0 vs torch' } },
  small_add = { { ref = 'torch', label = 'small op a+b', aim = 1.0, aim_text = 'faster than torch' } },
}

local function show(r)
  if r.unit == 'gflops' then return fmt('%.1f GFLOP/s', r.value) end
  if r.value < 1e-3 then return fmt('%.2f us', r.value * 1e6) end
  return fmt('%.3f ms', r.value * 1e3)
end

local rows = { { 'op', 'shape', 'dslua', 'reference', 'ratio', 'verdict' } }
local below = 0
for _, o in ipairs(order) do
  for _, k in ipairs(kinds[o.op] or { { ref = 'torch' } }) do
    local ds = results['dslua ' .. o.op .. ' ' .. o.shape]
    local ref = results[k.ref .. ' ' .. o.op .. ' ' .. o.shape]
    local cells = { k.label or o.op, o.shape }
    if not ds.value then
      cells[3], cells[5], cells[6] = '-', '-', ds.status == 'missing' and 'n/a (op missing)' or 'n/a (op failed)'
    else
      cells[3] = show(ds)
    end
    if not ref or not ref.value then
      cells[4] = '-'
      cells[5], cells[6] = cells[5] or '-', cells[6] or fmt('n/a (no %s result)', k.ref)
    else
      cells[4] = k.ref .. ' ' .. show(ref)
    end
    if ds.value and ref and ref.value then
      local ratio = ds.unit == 'gflops' and ds.value / ref.value or ref.value / ds.value
      cells[5] = fmt('%.2f', ratio)
      if not k.aim then cells[6] = 'info'
      elseif ratio >= k.aim then cells[6] = 'ok (aim ' .. k.aim_text .. ')'
      else
        cells[6] = 'BELOW aim (' .. k.aim_text .. ')'
        below = below + 1
      end
    end
    rows[#rows + 1] = cells
  end
end

local width = {}
for _, r in ipairs(rows) do
  for i, c in ipairs(r) do width[i] = math.max(width[i] or 0, #c) end
end
local function line(r)
  local parts = {}
  for i, c in ipairs(r) do
    parts[i] = (i == 3 or i == 4 or i == 5) and (' '):rep(width[i] - #c) .. c or c .. (' '):rep(width[i] - #c)
  end
  return (table.concat(parts, '  '):gsub('%s+$', ''))
end

print(fmt('threads: sgemm %s, dslua %s, torch %s   torch %s',
          info['sgemm threads'] or '?', info['dslua threads'] or '?', info['torch threads'] or '?',
          info['torch version'] or '(not run)'))
print(line(rows[1]))
local rule = {}
for i = 1, #width do rule[i] = ('-'):rep(width[i]) end
print(table.concat(rule, '  '))
for i = 2, #rows do print(line(rows[i])) end
print(fmt('%d row(s) below aim', below))
