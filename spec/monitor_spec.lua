-- DeepSpeed's monitors (dslua/io/monitor.lua): csv_monitor and tensorboard
-- files as DeepSpeed writes them, wandb and comet as TensorBoard events
-- with an upload hint, and bad output paths refused at initialize.
local H = require 'helpers'
local ds = H.ds
local core = require 'dslua.core'

local Reg = ds.nn.Module:extend('MonitorReg')
function Reg:init()
  self.fc = ds.nn.Linear(4, 1)
end
function Reg:forward(batch)
  return ds.mse_loss(self.fc(batch.x), batch.y)
end

-- Trains `steps` optimizer steps; returns the engine and every micro step's loss.
local function train(extra, steps)
  ds.manual_seed(5)
  local x, y = ds.randn(64, 4), ds.randn(64, 1)
  local cfg = { train_micro_batch_size_per_gpu = 4, gradient_accumulation_steps = 2, steps_per_print = 1000,
                optimizer = { type = 'SGD', params = { lr = 0.05 } },
                scheduler = { type = 'WarmupLR', params = { warmup_num_steps = 4, warmup_max_lr = 0.05 } } }
  for k, v in pairs(extra) do cfg[k] = v end
  local engine = ds.initialize { model = Reg(), config = cfg, training_data = ds.data.tensors { x = x, y = y } }
  local losses, lrs = {}, {}
  local batches = {}
  for _, b in engine.training_dataloader:epoch(1) do batches[#batches + 1] = b end
  for i = 1, steps * 2 do
    local loss = engine:forward(batches[i])
    losses[#losses + 1] = loss:item()
    engine:backward(loss)
    engine:step()
    if engine.micro_steps % 2 == 0 then lrs[#lrs + 1] = engine:get_lr()[1] end
  end
  engine:destroy()
  return engine, losses, lrs
end

local read_lines = H.read

local function events_in(dir)
  local p = io.popen('ls ' .. dir .. '/events.out.tfevents.* 2>/dev/null')
  local files = {}
  for l in p:lines() do files[#files + 1] = l end
  p:close()
  return files
end

-- {tag = {{step, value}...}} from one event file, every CRC checked
local function scalars(path)
  local out, version = {}, nil
  for _, e in ipairs(core.tfevents.read(path)) do
    if e.file_version then version = e.file_version
    else
      out[e.tag] = out[e.tag] or {}
      table.insert(out[e.tag], { e.step, e.value })
    end
  end
  return out, version
end

-- a Python that has TensorBoard (DSLUA_TB_PYTHON, else python3), or nil
local function tensorboard_python()
  local py = os.getenv('DSLUA_TB_PYTHON') or 'python3'
  local _, status = H.run(py .. ' -c "import tensorboard"')
  return status == 0 and py or nil
end

describe('monitors', function()
  it('writes csv_monitor and tensorboard as DeepSpeed does: output_path/job_name, Train/Samples/*', function()
    local dir = H.tmpdir()
    local _, losses, lrs = train({
      csv_monitor = { enabled = true, output_path = dir .. '/csv', job_name = 'run1' },
      tensorboard = { enabled = true, output_path = dir .. '/tb/', job_name = 'run1' },
    }, 3)
    -- csv: one file per event, `step,<last part>` header, \r\n rows (Python's csv.writer)
    local text = read_lines(dir .. '/csv/run1/Train_Samples_train_loss.csv')
    local rows = {}
    for step, v in text:gmatch('(%d+),([^\r]+)\r\n') do rows[#rows + 1] = { tonumber(step), tonumber(v) } end
    assert.are.equal('step,train_loss\r\n', text:match('^[^\n]*\n'))
    assert.are.equal(3, #rows)
    for i, r in ipairs(rows) do
      assert.are.equal(8 * (i - 1), r[1])        -- the samples before the step
      H.assert_close(r[2], (losses[2 * i - 1] + losses[2 * i]) / 2, H.tol.f64, 'window mean loss')
    end
    text = read_lines(dir .. '/csv/run1/Train_Samples_lr.csv')
    assert.are.equal('step,lr\r\n', text:match('^[^\n]*\n'))
    local i = 0
    for step, v in text:gmatch('(%d+),([^\r]+)\r\n') do
      i = i + 1
      assert.are.equal(8 * i, tonumber(step))   -- the samples after it
      assert.are.equal(lrs[i], tonumber(v))
    end
    assert.are.equal(3, i)
    assert.is_nil(io.open(dir .. '/csv/run1/Train_Samples_loss_scale.csv'))   -- fp16 only

    -- tensorboard: one event file, file_version first, the same scalars
    local files = events_in(dir .. '/tb/run1')
    assert.are.equal(1, #files)
    local s, version = scalars(files[1])
    assert.are.equal('brain.Event:2', version)
    assert.are.equal(3, #s['Train/Samples/train_loss'])
    for k, r in ipairs(s['Train/Samples/train_loss']) do
      assert.are.equal(8 * (k - 1), r[1])
      H.assert_close(r[2], (losses[2 * k - 1] + losses[2 * k]) / 2, H.tol.f32, 'float32 loss')
    end
    for k, r in ipairs(s['Train/Samples/lr']) do
      assert.are.equal(8 * k, r[1])
      H.assert_close(r[2], lrs[k], H.tol.f32, 'float32 lr')
    end
  end)

  it('adds Train/Samples/loss_scale with fp16', function()
    local dir = H.tmpdir()
    train({ fp16 = { enabled = true, initial_scale_power = 8 },
            csv_monitor = { enabled = true, output_path = dir, job_name = 'j' } }, 2)
    assert.are.equal('step,loss_scale\r\n8,256.0\r\n16,256.0\r\n', read_lines(dir .. '/j/Train_Samples_loss_scale.csv'))
  end)

  it('adds the elapsed_time_ms_* breakdown with wall_clock_breakdown', function()
    local dir = H.tmpdir()
    train({ wall_clock_breakdown = true, csv_monitor = { enabled = true, output_path = dir, job_name = 'j' } }, 2)
    for _, name in ipairs({ 'forward', 'backward', 'step' }) do
      local text = read_lines(dir .. '/j/Train_Samples_elapsed_time_ms_' .. name .. '.csv')
      assert.are.equal('step,elapsed_time_ms_' .. name .. '\r\n', text:match('^[^\n]*\n'))
      local n = 0
      for _, v in text:gmatch('(%d+),([^\r]+)\r\n') do
        n = n + 1
        assert.is_true(tonumber(v) >= 0 and tonumber(v) < 60000)
      end
      assert.are.equal(2, n)
    end
  end)

  it('reads its event files back with CRCs checked, and refuses a flipped byte', function()
    assert.are.equal(0xE3069283, core.tfevents.crc32c('123456789'))   -- CRC-32C's check value
    local dir = H.tmpdir()
    local w = core.tfevents.open(dir)
    w:scalar('a/b', 0.25, 7, 1234.5)
    local path = w:path()
    w:close()
    local ev, note = core.tfevents.read(path)
    assert.is_nil(note)
    assert.are.equal(2, #ev)
    assert.are.same({ wall_time = 1234.5, step = 7, tag = 'a/b', value = 0.25 }, ev[2])
    local bytes = read_lines(path)
    local at = #bytes - 6                         -- inside the last record's data
    H.write(path, bytes:sub(1, at - 1) .. string.char((bytes:byte(at) + 1) % 256) .. bytes:sub(at + 1))
    H.has(H.err(core.tfevents.read, path), 'data CRC mismatch')
    -- cut inside the last record (its writer stopped): read up to it, saying so
    local first = 16 + bytes:byte(1) + 256 * bytes:byte(2)     -- the file_version record's bytes
    for _, cut in ipairs({ 2, 10, #bytes - first - 4 }) do
      H.write(path, bytes:sub(1, #bytes - cut))
      local got, torn = core.tfevents.read(path)
      assert.are.same({ ev[1] }, got)
      H.has(torn, 'tfevents: ' .. path .. ': the file ends inside the record at byte ' .. first
            .. ' (its writer stopped mid-write): read up to it')
    end
    H.has(H.err(core.tfevents.open, dir .. '/missing'), dir .. '/missing/events.out.tfevents.')
  end)

  it('writes event files that TensorBoard\'s own reader loads', function()
    local py = tensorboard_python()
    if not py then
      return pending('no Python with the tensorboard package (pip install tensorboard, or set DSLUA_TB_PYTHON)')
    end
    local dir = H.tmpdir()
    local _, losses = train({ tensorboard = { enabled = true, output_path = dir, job_name = 'tb' } }, 2)
    local script = H.write(dir .. '/read.py', [[
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1])
ea.Reload()
for tag in sorted(ea.Tags()['scalars']):
    for s in ea.Scalars(tag):
        print(tag, s.step, repr(s.value))
]])
    local out, status = H.run(py .. ' ' .. script .. ' ' .. dir .. '/tb 2>/dev/null')
    assert.are.equal(0, status, out)
    local got = {}
    for tag, step, v in out:gmatch('(Train/Samples/%S+) (%d+) (%S+)') do
      got[#got + 1] = { tag, tonumber(step), tonumber(v) }
    end
    assert.are.equal(4, #got, out)
    assert.are.same({ 'Train/Samples/lr', 8 }, { got[1][1], got[1][2] })
    assert.are.same({ 'Train/Samples/train_loss', 0 }, { got[3][1], got[3][2] })
    H.assert_close(got[3][3], (losses[1] + losses[2]) / 2, H.tol.f32, 'train_loss read by TensorBoard')
  end)

  it('writes wandb and comet metrics as TensorBoard events and says once how to upload them', function()
    local dir = H.tmpdir()
    local script = H.write(dir .. '/run.lua', string.format([[
local ds = require 'dslua'
local m = ds.nn.Linear(2, 1)
local e = ds.initialize { model = m, config = {
  train_batch_size = 2, steps_per_print = 100, optimizer = { type = 'SGD', params = { lr = 0.1 } },
  wandb = { enabled = true, project = 'proj', team = 'me' }, comet = { enabled = true } } }
for _ = 1, 3 do
  local loss = ds.mse_loss(m(ds.ones(2, 2)), ds.zeros(2, 1))
  e:backward(loss)
  e:step()
end
e:destroy()
]]))
    local out, status = H.run(string.format('cd %s && WANDB_DIR=%s/w %s %s', dir, dir, H.bin(), script))
    assert.are.equal(0, status, out)
    H.has(out, 'wandb sync --sync-tensorboard --project proj --entity me ' .. dir .. '/w/wandb/proj')
    H.has(out, 'TensorBoard events in comet/deepspeed')
    local _, n = out:gsub('wandb sync', '')
    assert.are.equal(1, n)
    for _, d in ipairs({ dir .. '/w/wandb/proj', dir .. '/comet/deepspeed' }) do
      local files = events_in(d)
      assert.are.equal(1, #files)
      assert.are.equal(3, #scalars(files[1])['Train/Samples/train_loss'])
    end
  end)

  it('refuses bad output paths at initialize and under --check-config, naming the key and the path', function()
    local dir = H.tmpdir()
    local file = H.write(dir .. '/plain', 'x')
    local base = { train_batch_size = 2, optimizer = { type = 'SGD', params = { lr = 0.1 } } }
    local function init(extra)
      local cfg = {}
      for k, v in pairs(base) do cfg[k] = v end
      for k, v in pairs(extra) do cfg[k] = v end
      return ds.initialize { model = ds.nn.Linear(2, 1), config = cfg }
    end
    local e = H.err(init, { csv_monitor = { enabled = true, output_path = file, job_name = 'j' } })
    H.has(e, 'config: csv_monitor.output_path: cannot create "' .. file .. '/j": ' .. file
             .. ' is not a directory this process can write')
    e = H.err(init, { tensorboard = { enabled = true, output_path = file .. '/x' } })
    H.has(e, 'config: tensorboard.output_path: cannot create "' .. file .. '/x/DeepSpeedJobName"')
    local json = H.write(dir .. '/ds.json', ds.json.encode({ train_batch_size = 2, csv_monitor = {
      enabled = true, output_path = file, job_name = 'j' } }))
    local out, status = H.run(H.bin() .. ' --check-config ' .. json)
    assert.are.equal(1, status)
    H.has(out, json .. ': csv_monitor.output_path: cannot create "' .. file .. '/j"')
    H.has(H.err(init, { tensorboard = { enabled = true, outputpath = dir } }),
          "tensorboard.outputpath: unknown key, did you mean 'output_path'")
    H.has(H.err(init, { csv_monitor = { enabled = true, output_path = 3 } }),
          'csv_monitor.output_path: must be a string, got 3')
  end)

  it('does not append through links another user planted in its folder', function()
    if H.run('id -u') ~= '0\n' then return pending('needs root to make links of another user') end
    local dir, victims = H.tmpdir(), H.tmpdir()
    os.execute('mkdir -p ' .. dir .. '/csv/run1 && chmod 700 ' .. victims)
    H.write(victims .. '/secret', 'root only\n')
    os.execute('chmod 600 ' .. victims .. '/secret')
    local lr_csv, loss_csv = dir .. '/csv/run1/Train_Samples_lr.csv', dir .. '/csv/run1/Train_Samples_train_loss.csv'
    local cfg = { csv_monitor = { enabled = true, output_path = dir .. '/csv', job_name = 'run1' } }
    -- to a root 0600 file, and dangling into a root-only folder
    for _, case in ipairs({ { lr_csv, victims .. '/secret' }, { loss_csv, victims .. '/created.csv' } }) do
      os.execute('rm -f ' .. dir .. '/csv/run1/*.csv; ln -s ' .. case[2] .. ' ' .. case[1] .. ' && chown -h nobody '
                 .. case[1])
      local e = H.err(train, cfg, 1)
      H.has(e, "csv_monitor: '" .. case[1] .. "' is a link owned by another user (uid 65534): dslua does not follow it")
    end
    assert.are.equal('root only\n', read_lines(victims .. '/secret'))
    assert.are.equal('secret\n', (H.run('ls -A ' .. victims)))
  end)

  it('refuses an output folder others may write into', function()
    local dir = H.tmpdir()
    os.execute('mkdir -p ' .. dir .. '/csv && chmod 777 ' .. dir .. '/csv')
    local e = H.err(train, { csv_monitor = { enabled = true, output_path = dir .. '/csv', job_name = 'run1' } }, 1)
    H.has(e, "csv_monitor.output_path")
    H.has(e, "the directory '" .. dir .. "/csv' is writable by group or others without the sticky bit (mode 777")
  end)

  it('prints the resolved config and the engine state after initialize with dump_state', function()
    local dir = H.tmpdir()
    local script = H.write(dir .. '/run.lua', [[
local ds = require 'dslua'
ds.initialize { model = ds.nn.Linear(2, 1), config = { train_batch_size = 2, dump_state = true,
                                                        optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
]])
    local out, status = H.run(string.format('cd %s && %s %s', dir, H.bin(), script))
    assert.are.equal(0, status, out)
    H.has(out, 'DeepSpeedEngine configuration:\n')
    H.has(out, '  train_batch_size ............. 2\n')
    H.has(out, '  optimizer .................... {"params":{"lr":0.1},"type":"SGD"}\n')
    H.has(out, 'DeepSpeedEngine:\n')
    H.has(out, '  global_steps ................. 0\n')
    H.has(out, '  zero_stage ................... 0\n')
  end)

  it('writes nothing on ranks other than 0 or when no monitor is enabled', function()
    local cfg = ds.config.load({ train_batch_size = 2, csv_monitor = { enabled = true, output_path = '/nonexistent/x' } })
    assert.is_nil(require('dslua.io.monitor').new(cfg, 1))
    assert.is_nil(require('dslua.io.monitor').new(ds.config.load({ train_batch_size = 2 }), 0))
  end)
end)
