-- `dslua plot`: loss and lr curves as a PNG from csv_monitor or
-- tensorboard output (dslua/io/plot.lua, core/io/ds_plot.c).
local H = require 'helpers'
local core = require 'dslua.core'

-- width, height from a PNG's IHDR, or nil when it is not a PNG
local function png_size(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local b = f:read(24)
  f:close()
  if not b or b:sub(1, 8) ~= '\137PNG\r\n\26\n' or b:sub(13, 16) ~= 'IHDR' then return nil end
  local function u32(i) return ((b:byte(i) * 256 + b:byte(i + 1)) * 256 + b:byte(i + 2)) * 256 + b:byte(i + 3) end
  return u32(17), u32(21)
end

local function plot(args)
  return H.run(H.bin() .. ' plot ' .. args)
end

describe('dslua plot', function()
  local dir
  before_each(function() dir = H.tmpdir() end)

  it('draws loss and lr from a csv_monitor file and its sibling', function()
    local loss, lr = { 'step,train_loss\r\n' }, { 'step,lr\r\n' }
    for i = 0, 20 do
      loss[#loss + 1] = string.format('%d,%.6f\r\n', 8 * i, 3 / (1 + i))
      lr[#lr + 1] = string.format('%d,%.6f\r\n', 8 * (i + 1), 1e-3 * i / 20)
    end
    H.write(dir .. '/Train_Samples_train_loss.csv', table.concat(loss))
    H.write(dir .. '/Train_Samples_lr.csv', table.concat(lr))
    local out, status = plot(dir .. '/Train_Samples_lr.csv -o ' .. dir .. '/c.png')
    assert.are.equal(0, status, out)
    H.has(out, 'dslua plot: wrote ' .. dir .. '/c.png (train_loss: 21 points, lr: 21 points)')
    assert.are.same({ 900, 640 }, { png_size(dir .. '/c.png') })
    out, status = plot(dir .. ' -o ' .. dir .. '/d.png')    -- the csv_monitor directory
    assert.are.equal(0, status, out)
    H.has(out, '(train_loss: 21 points, lr: 21 points)')
  end)

  it('draws the curves of a directory of event files', function()
    local w = core.tfevents.open(dir)
    for i = 1, 30 do
      w:scalar('Train/Samples/train_loss', 2 / i, 4 * i)
      w:scalar('Train/Samples/lr', 0.01, 4 * i)
    end
    w:close()
    local out, status = plot(dir .. ' -o ' .. dir .. '/e.png')
    assert.are.equal(0, status, out)
    H.has(out, '(train_loss: 30 points, lr: 30 points)')
    assert.are.same({ 900, 640 }, { png_size(dir .. '/e.png') })
  end)

  it('draws an event file whose writer stopped mid-record up to that record, and says so', function()
    local w = core.tfevents.open(dir)
    for i = 1, 10 do w:scalar('Train/Samples/train_loss', 2 / i, 4 * i) end
    local path = w:path()
    w:close()
    local f = assert(io.open(path, 'rb'))
    local bytes = f:read('*a')
    f:close()
    H.write(path, bytes:sub(1, #bytes - 3))
    local out, status = plot(dir .. ' -o ' .. dir .. '/t.png')
    assert.are.equal(0, status, out)
    H.has(out, 'dslua plot: warning: tfevents: ' .. path .. ': the file ends inside the record at byte ')
    H.has(out, '(train_loss: 9 points)')
  end)

  it('draws each run written to a folder as its own labelled curve, not one joined zig-zag', function()
    for _, n in ipairs({ 30, 10, 10 }) do            -- three runs, each from step 4
      local w = core.tfevents.open(dir)
      for i = 1, n do w:scalar('Train/Samples/train_loss', 2 / i, 4 * i) end
      w:close()
    end
    local out, status = plot(dir .. ' -o ' .. dir .. '/runs.png')
    assert.are.equal(0, status, out)
    H.has(out, '(train_loss: 3 runs of 30, 10, 10 points)')
    local runs = require('dslua.io.plot').load(dir)['Train/Samples/train_loss']
    for k, n in ipairs({ 30, 10, 10 }) do
      assert.are.equal(n, #runs[k].x)
      for i = 2, n do assert.is_true(runs[k].x[i] > runs[k].x[i - 1]) end
      assert.matches('^events%.out%.tfevents%.', runs[k].label)
    end
    -- csv_monitor appends each run after its own header
    H.write(dir .. '/Train_Samples_lr.csv', 'step,lr\r\n8,0.1\r\n16,0.2\r\nstep,lr\r\n8,0.3\r\n')
    out, status = plot(dir .. '/Train_Samples_lr.csv -o ' .. dir .. '/lr.png')
    assert.are.equal(0, status, out)
    H.has(out, '(lr: 2 runs of 2, 1 points)')
  end)

  it('says what is wrong with its input', function()
    local out, status = plot('')
    assert.are.equal(2, status)
    H.has(out, 'usage: dslua plot <csv file or event dir> [-o curves.png]')
    out, status = plot(dir .. '/missing.csv')
    assert.are.equal(1, status)
    H.has(out, 'dslua plot: ' .. dir .. '/missing.csv: No such file or directory')
    out, status = plot(dir)
    assert.are.equal(1, status)
    H.has(out, 'dslua plot: no curves in ' .. dir)
    H.write(dir .. '/x.csv', 'step,loss\n1,abc\n')
    out = plot(dir .. '/x.csv -o ' .. dir .. '/x.png')
    H.has(out, dir .. '/x.csv: not a `step,value` row: 1,abc')
    H.write(dir .. '/y.csv', 'step,loss\n1,2\n')
    out, status = plot(dir .. '/y.csv -o ' .. dir .. '/no/such/dir.png')
    assert.are.equal(1, status)
    H.has(out, 'plot: cannot write ' .. dir .. '/no/such/dir.png')
  end)

  it('replaces a link at -o instead of writing through it, and refuses FIFOs and devices', function()
    H.write(dir .. '/y.csv', 'step,loss\n1,2\n2,1\n')
    H.write(dir .. '/precious', 'keep me')
    os.execute('ln -s ' .. dir .. '/precious ' .. dir .. '/out.png')
    local out, status = plot(dir .. '/y.csv -o ' .. dir .. '/out.png')
    assert.are.equal(0, status, out)
    assert.are.equal('keep me', H.run('cat ' .. dir .. '/precious'))
    assert.are.same({ 900, 320 }, { png_size(dir .. '/out.png') })
    assert.are.equal('regular file\n', H.run('stat -c %F ' .. dir .. '/out.png'))
    assert(os.execute('mkfifo ' .. dir .. '/fifo.csv') == 0)
    for _, input in ipairs({ dir .. '/fifo.csv', '/dev/zero' }) do
      out, status = H.run('timeout 20 ' .. H.bin() .. ' plot ' .. input .. ' -o ' .. dir .. '/z.png')
      assert.are.equal(1, status, out)
      H.has(out, 'dslua plot: ' .. input .. ': is a ' .. (input == '/dev/zero' and 'device' or 'FIFO')
            .. ', expected a regular file')
    end
  end)
end)
