-- Runs a list of matrix cells and judges each against its reference (the
-- parent side of spec/matrix/batch.lua, for spec/matrix_spec.lua and
-- scripts/matrix.lua). Cells go in one launch per rank count; a launch
-- that dies (a crash, a hang past the timeout) marks the cell it was in
-- as crashed and starts again after it. A resumed cell's second run goes
-- in a launch of its own rank count after every first run. cpu offload
-- runs its chunked pipeline (DSLUA_TEST_OFFLOAD_CPU). References are
-- trained here, on this one process.
local H = require 'helpers'
local ds = H.ds
local S = require 'matrix.settings'
local Cell = require 'matrix.cell'
local Judge = require 'matrix.judge'

local M = {}

local function read_lines(path)
  local out = {}
  local f = io.open(path)
  if not f then return out end
  for line in f:lines() do
    local ok, t = pcall(ds.json.decode, line)
    if ok then out[t.i] = t end
  end
  f:close()
  return out
end

local function write_cells(path, cells)
  local f = assert(io.open(path, 'w'))
  f:write(ds.json.encode(cells))
  f:close()
end

-- A launch's time limit: start-up, then each cell (3-rank cells of 33
-- micro steps take about a second here, several under ASan).
local PER_CELL = 10

-- The first line of a dead launch's output that says why (the C
-- library's heap checks, a signal, the sanitizers, a hang), as ": why".
local CAUSES = { 'corrupted', 'free%(%)', 'malloc', 'Segmentation', 'signal %d+', 'AddressSanitizer', 'runtime error',
                 'no end within', 'Aborted' }
local function cause(output)
  for line in output:gmatch('[^\n]+') do
    for _, p in ipairs(CAUSES) do
      if line:find(p) then return ': ' .. line:gsub('^%s+', ''):sub(1, 160) end
    end
  end
  return ''
end

local OFFLOAD = 'DSLUA_TEST_OFFLOAD_CPU=' .. S.OFFLOAD_CHUNK

-- Every rank's line of every cell of `cells` (all on np ranks):
-- per cell {rank lines} or {crash = output tail}.
local launches = 0
local function launch(cells, np, dir, timeout)
  launches = launches + 1
  local tag = string.format('%s/launch%d', dir, launches)
  write_cells(tag .. '.json', cells)
  local got, first = {}, 1
  while first <= #cells do
    local limit = timeout + PER_CELL * (#cells - first + 1)
    local cmd = string.format('timeout %d env %s %s spec/matrix/batch.lua %s.json %s %s/nvme %d', limit, OFFLOAD,
                              H.ranks_cmd(np, { OFFLOAD }), tag, tag, dir, first)
    local output, status = H.run(cmd)
    if status == 124 then output = output .. string.format('\nno end within %d s: killed (a hang)\n', limit) end
    local lines = {}
    for r = 0, np - 1 do lines[r] = read_lines(tag .. '.' .. r .. '.jsonl') end
    local next_first = #cells + 1
    for i = first, #cells do
      local all = {}
      for r = 0, np - 1 do all[r + 1] = lines[r][i] end
      if #all == np then
        got[i] = all
      else
        got[i] = { crash = string.format('exit status %s%s; output ends:\n%s', tostring(status), cause(output),
                                         output:sub(-1500)) }
        next_first = i + 1
        break
      end
    end
    if status == 0 and next_first <= #cells then next_first = #cells + 1 end
    first = next_first
  end
  return got
end

-- Every cell of `cells` run in launches by rank count: got[i] as launch
-- gives it; on_launch(ids, got) after each launch with the cells it ran.
local function run_all(cells, opts, on_launch)
  local by_np, order, got = {}, {}, {}
  for i, c in ipairs(cells) do
    if not by_np[c.ranks] then by_np[c.ranks] = {}; order[#order + 1] = c.ranks end
    table.insert(by_np[c.ranks], i)
  end
  local chunk = opts.chunk or #cells
  for _, np in ipairs(order) do
    local ids = by_np[np]
    for from = 1, #ids, chunk do
      local list, at = {}, {}
      for k = from, math.min(from + chunk - 1, #ids) do list[#list + 1], at[#at + 1] = cells[ids[k]], ids[k] end
      for k, lines in ipairs(launch(list, np, opts.dir, opts.timeout or 60)) do got[at[k]] = lines end
      on_launch(at, got)
    end
  end
  return got
end

local with = H.with

local function trained(lines)
  if lines.crash then return false end
  for _, line in ipairs(lines) do if not line.ok then return false end end
  return true
end

-- A resumed cell's lines: its second run's, each with the first run's
-- losses before its own and the skipped steps of both.
local function joined(first, second)
  if second.crash then return second end
  local out = {}
  for r, line in ipairs(second) do
    if line.ok then
      local losses = {}
      for _, l in ipairs(first[1].losses) do losses[#losses + 1] = l end
      for _, l in ipairs(line.losses) do losses[#losses + 1] = l end
      line = with(line, { losses = losses, skipped = line.skipped + first[1].skipped })
    end
    out[r] = line
  end
  return out
end

-- Runs cells (settings.lua tables): a row per cell, in order (see
-- judge.lua's row). opts: dir (a scratch folder), timeout (seconds a
-- launch may take beyond PER_CELL a cell; 60), chunk (cells per launch;
-- all), on_row(row, done, total) after each cell.
function M.run(cells, opts)
  local rows, refs, done = {}, {}, 0
  local function judge(i, lines)
    local c = cells[i]
    local key = Judge.reference_key(c)
    if not S.refusal(c) and not refs[key] then refs[key] = Cell.reference(c) end
    rows[i] = Judge.row(c, lines, refs[key])
    done = done + 1
    if opts.on_row then opts.on_row(rows[i], done, #cells) end
  end
  local firsts, resumed = {}, {}
  for i, c in ipairs(cells) do
    firsts[i] = c.ckpt == 'resume' and with(c, { save = string.format('%s/ckpt%d', opts.dir, i) }) or c
  end
  local got = run_all(firsts, opts, function(ids, first)
    for _, i in ipairs(ids) do
      if firsts[i].save and not S.refusal(cells[i]) and trained(first[i]) then
        resumed[#resumed + 1] = i
      else
        judge(i, first[i])
      end
    end
  end)
  local seconds = {}
  for j, i in ipairs(resumed) do
    local m, micro = S.resume_ranks(cells[i])
    seconds[j] = with(cells[i], { ranks = m, micro = micro, load = firsts[i].save })
  end
  run_all(seconds, opts, function(ids, again)
    for _, j in ipairs(ids) do judge(resumed[j], joined(got[resumed[j]], again[j])) end
  end)
  return rows
end

return M
