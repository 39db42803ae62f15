-- `dslua plot <csv file or event dir> [-o curves.png]`: the loss and the lr
-- against the step (DeepSpeed's monitors count samples) as a PNG, read
-- from what csv_monitor or tensorboard wrote (dslua/io/monitor.lua), drawn
-- by cairo (core/io/ds_plot).
local core = require 'dslua.core'
local file = require 'dslua.base.file'

local M = {}

local CURVES = { 'Train/Samples/train_loss', 'Train/Samples/lr' }
local MAX_CSV = 2 ^ 30      -- bytes of one csv file: 30 million rows
local USAGE = 'usage: dslua plot <csv file or event dir> [-o curves.png]'

local function quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function list_dir(dir)
  local p = assert(io.popen('ls -1 -- ' .. quote(dir) .. ' 2>/dev/null'))
  local names = {}
  for l in p:lines() do names[#names + 1] = l end
  p:close()
  return names
end

local function is_dir(path)
  local f = io.open(path .. '/.')
  if f then f:close() end
  return f ~= nil
end

-- The runs of one csv_monitor file, {{x = steps, y = values, label}...}:
-- each run appends its own `step,<name>` header, so a header starts a run.
local function read_csv(path)
  local text, why = file.text(path, MAX_CSV)
  if not text then error(path .. ': ' .. why, 0) end
  local runs, s = {}, nil
  for line in text:gmatch('([^\n]*)\n?') do
    line = line:gsub('\r$', '')
    local step, v = line:match('^([^,]+),(.+)$')
    if step == 'step' then
      s = { x = {}, y = {}, label = string.format('run %d', #runs + 1) }
      runs[#runs + 1] = s
    elseif not s then
      if line ~= '' then error(path .. ': not a csv_monitor file (no `step,<name>` header)', 0) end
    elseif line ~= '' then
      if not (tonumber(step) and tonumber(v)) then
        error(string.format('%s: not a `step,value` row: %s', path, line:sub(1, 80)), 0)
      end
      s.x[#s.x + 1], s.y[#s.y + 1] = tonumber(step), tonumber(v)
    end
  end
  return runs
end

-- {tag = {run...}} from the event files in dir: each file is a run (every
-- process writes its own), its points in step order, labelled by the file
local function read_events(dir, files)
  local out = {}
  for _, name in ipairs(files) do
    local series = {}
    local events, torn = core.tfevents.read(dir .. '/' .. name)
    if torn then io.stderr:write('dslua plot: warning: ', torn, '\n') end
    for _, e in ipairs(events) do
      if e.tag then
        series[e.tag] = series[e.tag] or {}
        table.insert(series[e.tag], { e.step, e.value })
      end
    end
    for tag, points in pairs(series) do
      table.sort(points, function(a, b) return a[1] < b[1] end)
      local s = { x = {}, y = {}, label = name }
      for i, p in ipairs(points) do s.x[i], s.y[i] = p[1], p[2] end
      out[tag] = out[tag] or {}
      table.insert(out[tag], s)
    end
  end
  return out
end

-- The curves found at input, {tag = {run...}}: a csv file (with its loss
-- or lr sibling), a csv_monitor directory, or a directory of event files.
function M.load(input)
  local found = {}
  if is_dir(input) then
    local events = {}
    for _, n in ipairs(list_dir(input)) do
      if n:match('^events%.out%.tfevents%.') then events[#events + 1] = n end
    end
    table.sort(events)
    if #events > 0 then return read_events(input, events) end
    for _, tag in ipairs(CURVES) do
      local path = input .. '/' .. tag:gsub('/', '_') .. '.csv'
      if core.ckpt.exists(path) then found[tag] = read_csv(path) end
    end
    return found
  end
  local dir, base = input:match('^(.-)/?([^/]*)$')
  found[base] = read_csv(input)
  for _, tag in ipairs(CURVES) do
    local name = tag:gsub('/', '_') .. '.csv'
    local path = (dir ~= '' and dir .. '/' or '') .. name
    if name == base then found[tag], found[base] = found[base], nil
    elseif core.ckpt.exists(path) then found[tag] = read_csv(path) end
  end
  return found
end

-- The panel entries of one tag's runs (one curve each, labelled when
-- several) and its summary: `loss: 30 points` or `loss: 3 runs of 30, 10, 10 points`.
local function curves(tag, runs, panels)
  local sizes = {}
  for _, s in ipairs(runs) do
    if #s.x > 0 then
      panels[#panels + 1] = { name = tag, x = s.x, y = s.y, label = #runs > 1 and s.label or nil }
      sizes[#sizes + 1] = #s.x
    end
  end
  if #sizes == 0 then return nil end
  local short = tag:match('[^/]*$')
  if #sizes == 1 then return string.format('%s: %d points', short, sizes[1]) end
  return string.format('%s: %d runs of %s points', short, #sizes, table.concat(sizes, ', '))
end

-- main(args) -> exit status; messages on stdout, errors on stderr
function M.main(args)
  local input, out = nil, 'curves.png'
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '-o' or a == '--output' then
      out = args[i + 1]
      if not out then io.stderr:write(USAGE, '\n'); return 2 end
      i = i + 1
    elseif a == '-h' or a == '--help' then
      io.stdout:write(USAGE, '\n')
      return 0
    elseif input then
      io.stderr:write('dslua plot: one input only (got ', input, ' and ', a, ')\n', USAGE, '\n')
      return 2
    else
      input = a
    end
    i = i + 1
  end
  if not input then io.stderr:write(USAGE, '\n'); return 2 end
  local ok, found = pcall(M.load, input)
  if not ok then io.stderr:write('dslua plot: ', tostring(found), '\n'); return 1 end
  local tags = {}
  for _, tag in ipairs(CURVES) do
    if found[tag] then tags[#tags + 1] = tag end
  end
  if #tags == 0 then
    for tag in pairs(found) do tags[#tags + 1] = tag end
    table.sort(tags)
  end
  local panels, summary = {}, {}
  for _, tag in ipairs(tags) do summary[#summary + 1] = curves(tag, found[tag], panels) end
  if #panels == 0 then
    io.stderr:write('dslua plot: no curves in ', input, ' (expected csv_monitor files or TensorBoard event files)\n')
    return 1
  end
  ok, found = pcall(core.plot.png, out, 'step (samples)', panels, 900, 320 * #summary)
  if not ok then io.stderr:write('dslua plot: ', tostring(found), '\n'); return 1 end
  io.stdout:write(string.format('dslua plot: wrote %s (%s)\n', out, table.concat(summary, ', ')))
  return 0
end

return M
