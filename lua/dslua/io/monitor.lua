-- DeepSpeed's monitors (deepspeed/monitor/): on rank 0, at every step,
-- Train/Samples/train_loss (the mean loss of the accumulation window, at
-- the samples before the step), Train/Samples/lr and, with fp16,
-- Train/Samples/loss_scale (at the samples after it) and, with
-- wall_clock_breakdown, Train/Samples/elapsed_time_ms_{forward,backward,step}
-- (this step's milliseconds).
--   csv_monitor: output_path/job_name/<event name with / and space as _>.csv,
--     a `step,<last part of the name>` header once per process, rows
--     appended, as csv_monitor.py writes them (csv.writer: \r\n endings).
--   tensorboard: output_path/job_name/events.out.tfevents.* (core/io/ds_tfevents).
--   wandb, comet: their Python clients are not here; the same events go to
--     TensorBoard files under wandb/<project> and comet/<project> (below
--     WANDB_DIR / COMET_DIR when set), and initialize says once how to
--     upload them.
-- Directories are checked with the config (ds.config.check, through
-- M.dirs: a bad path is an error naming the key and the path, at
-- initialize and under --check-config alike, not mid-run) and made at
-- initialize.
local core = require 'dslua.core'
local json = require 'dslua.base.json'

local M = {}

local Monitor = {}
Monitor.__index = Monitor

-- Python's repr of a float (what csv.writer writes): the shortest text
-- that reads back exactly, integers with '.0'.
local function pyfloat(v)
  if v ~= v then return 'nan' end
  if v == math.huge then return 'inf' elseif v == -math.huge then return '-inf' end
  if v == math.floor(v) and math.abs(v) < 1e16 then return string.format('%.1f', v) end
  return json.shortest_g(v)
end

local function join(dir, name)
  if dir == '' then return name end
  return dir:sub(-1) == '/' and dir .. name or dir .. '/' .. name
end

-- mkdir -p and a probe file: both fail here with the key and the path.
local function make_dir(key, dir)
  local ok, err = pcall(core.ckpt.mkdirs, dir)
  if not ok then error(string.format('initialize: %s: cannot create "%s": %s', key, dir, err), 0) end
  local probe = join(dir, '.dslua-write-check')
  local written, why = pcall(core.file.append, probe, '')
  if not written then error(string.format('initialize: %s: "%s" is not writable: %s', key, dir, why), 0) end
  os.remove(probe)
  return dir
end

local function tfevents(key, dir)
  make_dir(key, dir)
  local ok, w = pcall(core.tfevents.open, dir)
  if not ok then error(string.format('initialize: %s: %s', key, w), 0) end
  return w
end

-- The directories the enabled monitors write: {key, dir} by name.
function M.dirs(cfg)
  local tb, csv, wandb, comet = cfg.tensorboard, cfg.csv_monitor, cfg.wandb, cfg.comet
  local out = {}
  if csv.enabled then out.csv = { 'csv_monitor.output_path', join(csv.output_path, csv.job_name) } end
  if tb.enabled then out.tensorboard = { 'tensorboard.output_path', join(tb.output_path, tb.job_name) } end
  if wandb.enabled then out.wandb = { 'wandb', join(join(os.getenv('WANDB_DIR') or '', 'wandb'), wandb.project) } end
  if comet.enabled then
    out.comet = { 'comet', join(join(os.getenv('COMET_DIR') or '', 'comet'), comet.project or 'deepspeed') }
  end
  return out
end

-- new(cfg, rank) -> a monitor, or nil when no monitor is enabled (or on
-- ranks other than 0, which write nothing, as DeepSpeed's).
function M.new(cfg, rank)
  if rank ~= 0 then return nil end
  local self = setmetatable({ writers = {}, csv_headers = {}, window = { sum = 0, n = 0 } }, Monitor)
  local dirs, wandb = M.dirs(cfg), cfg.wandb
  if dirs.csv then self.csv_dir = make_dir(dirs.csv[1], dirs.csv[2]) end
  if dirs.tensorboard then self.writers[#self.writers + 1] = tfevents(dirs.tensorboard[1], dirs.tensorboard[2]) end
  if dirs.wandb then
    local dir = dirs.wandb[2]
    self.writers[#self.writers + 1] = tfevents('wandb', dir)
    local args = ' --project ' .. wandb.project .. (wandb.team and ' --entity ' .. wandb.team or '')
    io.stdout:write(string.format('wandb: no wandb client in dslua: the metrics are TensorBoard events in %s; '
                                  .. 'upload them with `wandb sync --sync-tensorboard%s %s`\n', dir, args, dir))
  end
  if dirs.comet then
    local dir = dirs.comet[2]
    self.writers[#self.writers + 1] = tfevents('comet', dir)
    io.stdout:write(string.format('comet: no comet_ml client in dslua: the metrics are TensorBoard events in %s; '
                                  .. 'log that folder to Comet from Python (comet_ml) or view it with '
                                  .. '`tensorboard --logdir %s`\n', dir, dir))
  end
  io.stdout:flush()
  if not self.csv_dir and #self.writers == 0 then return nil end
  return self
end

-- each micro step's loss tensor (engine:backward), summed where it lives
-- in f64: read back at the step's report, after the step has waited for
-- the device anyway, not once per micro step
function Monitor:loss(t)
  local v = t:to('f64')
  self.window.sum, self.window.n = self.window.n > 0 and self.window.sum + v or v, self.window.n + 1
end

function Monitor:_write(events)
  for _, e in ipairs(events) do
    local name, value, step = e[1], e[2], e[3]
    for _, w in ipairs(self.writers) do w:scalar(name, value, step) end
    if self.csv_dir then
      local file = name:gsub('[/ ]', '_')
      local path = self.csv_dir .. '/' .. file .. '.csv'
      local row = string.format('%d,%s\r\n', step, pyfloat(value))
      if not self.csv_headers[file] then row = 'step,' .. name:match('[^/]*$') .. '\r\n' .. row end
      local ok, why = pcall(core.file.append, path, row)
      if not ok then error('csv_monitor: ' .. why, 0) end
      self.csv_headers[file] = true
    end
  end
  for _, w in ipairs(self.writers) do w:flush() end
end

-- at every optimizer step (engine:_report)
function Monitor:step(engine)
  local after = engine.global_samples
  local before = self.samples or math.max(0, after - engine:train_batch_size())
  self.samples = after
  local events = {}
  if self.window.n > 0 then
    events[1] = { 'Train/Samples/train_loss', self.window.sum:item() / self.window.n, before }
    self.window.sum, self.window.n = 0, 0
  end
  events[#events + 1] = { 'Train/Samples/lr', engine:get_lr()[1], after }
  if engine.scaler then events[#events + 1] = { 'Train/Samples/loss_scale', engine.scaler.cur_scale, after } end
  local t = engine.timers
  if t then
    -- the engine's totals since its last log line (a new table after it)
    if self.timer_table ~= t.total then self.timer_table, self.timer_seen = t.total, {} end
    for _, name in ipairs({ 'forward', 'backward', 'step' }) do
      local total = t.total[name] or 0
      events[#events + 1] = { 'Train/Samples/elapsed_time_ms_' .. name,
                              1000 * (total - (self.timer_seen[name] or 0)), after }
      self.timer_seen[name] = total
    end
  end
  self:_write(events)
end

-- dump_state: DeepSpeed's print_configuration after initialize, on rank 0:
-- each resolved config key, then the engine's state (its plain fields),
-- as `  name .... value` lines with dots to column 29.
local function dump_lines(title, t)
  local keys = {}
  for k, v in pairs(t) do
    if type(k) == 'string' and type(v) ~= 'function' and type(v) ~= 'userdata' then keys[#keys + 1] = k end
  end
  table.sort(keys)
  io.stdout:write(title, ':\n')
  for _, k in ipairs(keys) do
    local v = t[k]
    local text = type(v) == 'table' and json.encode(v) or tostring(v)
    io.stdout:write(string.format('  %s %s %s\n', k, string.rep('.', math.max(1, 29 - #k)), text))
  end
end

function M.dump_state(engine)
  if engine.rank ~= 0 then return end
  dump_lines('DeepSpeedEngine configuration', engine.config)
  local state = {}
  for k, v in pairs(engine) do
    if type(v) ~= 'table' then state[k] = v end
  end
  state.zero_stage = engine.steps.stage
  state.train_batch_size = engine:train_batch_size()
  state.train_micro_batch_size_per_gpu = engine:train_micro_batch_size_per_gpu()
  state.gradient_accumulation_steps = engine:gradient_accumulation_steps()
  state.loss_scale = engine.scaler and engine.scaler.cur_scale or nil
  dump_lines('DeepSpeedEngine', state)
  io.stdout:flush()
end

function Monitor:close()
  for _, w in ipairs(self.writers) do w:close() end
  self.writers = {}
end

return M
