-- Runs a list of matrix cells and judges each against its reference (the
-- parent side of spec/matrix/batch.lua, for spec/matrix_spec.lua and
-- scripts/matrix.lua). Cells go in one launch per rank count; a launch
-- that dies (a crash, a hang past the timeout) marks the cell it was in
-- as crashed and starts again after it. References are trained here, on
-- this one process.
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
    local cmd = string.format('timeout %d env %s spec/matrix/batch.lua %s.json %s %s/nvme %d', limit, H.ranks_cmd(np),
                              tag, tag, dir, first)
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

-- Runs cells (settings.lua tables): a row per cell, in order (see
-- judge.lua's row). opts: dir (a scratch folder), timeout (seconds a
-- launch may take beyond PER_CELL a cell; 60), chunk (cells per launch;
-- all), on_row(row, done, total) after each cell.
function M.run(cells, opts)
  local by_np, order = {}, {}
  for i, c in ipairs(cells) do
    if not by_np[c.ranks] then by_np[c.ranks] = {}; order[#order + 1] = c.ranks end
    table.insert(by_np[c.ranks], i)
  end
  local rows, refs, done = {}, {}, 0
  local chunk = opts.chunk or #cells
  for _, np in ipairs(order) do
    local ids = by_np[np]
    for from = 1, #ids, chunk do
      local list = {}
      for k = from, math.min(from + chunk - 1, #ids) do list[#list + 1] = cells[ids[k]] end
      local got = launch(list, np, opts.dir, opts.timeout or 60)
      for k, c in ipairs(list) do
        local i = ids[from + k - 1]
        local key = Judge.reference_key(c)
        if not S.refusal(c) and not refs[key] then refs[key] = Cell.reference(c) end
        rows[i] = Judge.row(c, got[k], refs[key])
        done = done + 1
        if opts.on_row then opts.on_row(rows[i], done, #cells) end
      end
    end
  end
  return rows
end

return M
