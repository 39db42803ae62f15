local H = require 'helpers'

local bin, tmpdir, write = H.bin(), H.tmpdir, H.write

describe('the dslua command', function()
  it('runs a script with arg and varargs set as lua does', function()
    local d = tmpdir()
    write(d .. '/s.lua', 'print(arg[0], arg[1], arg[2], arg[3], select("#", ...), ...)')
    local out, status = H.run(bin .. ' ' .. d .. '/s.lua a b c')
    assert.are.equal(0, status)
    assert.are.equal(d .. '/s.lua\ta\tb\tc\t3\ta\tb\tc\n', out)
  end)

  it('runs -e code and prints the version and help', function()
    local out, status = H.run(bin .. " -e 'print(6 * 7)'")
    assert.are.equal(0, status)
    assert.are.equal('42\n', out)
    out = H.run(bin .. ' -v')
    assert.matches('^dslua %d+%.%d+%.%d+ %(LuaJIT 2%.1', out)
    assert.are.equal(H.run(bin .. ' --version'), out)
    out, status = H.run(bin .. ' --help')
    assert.are.equal(0, status)
    assert.matches('usage: dslua %[options%] %[script %[args%.%.%.%]%]', out)
    assert.are.equal((H.run(bin .. ' -h')), out)
  end)

  it('fails on unknown options with the usage', function()
    local out, status = H.run(bin .. ' --bogus')
    assert.are.equal(1, status)
    assert.matches("unknown option '%-%-bogus'", out)
  end)

  it('reports an error with a traceback and exits non-zero', function()
    local d = tmpdir()
    write(d .. '/bad.lua', 'local function inner() error("boom") end\nlocal function outer() inner() end\nouter()\n')
    local out, status = H.run(bin .. ' ' .. d .. '/bad.lua')
    assert.are.equal(1, status)
    assert.matches('bad.lua:1: boom', out)
    assert.matches('stack traceback:', out)
    assert.matches("in function 'inner'", out)
    out, status = H.run(bin .. ' ' .. d .. '/missing.lua')
    assert.are.equal(1, status)
    assert.matches('cannot open .*missing.lua', out)
  end)

  it('erases a progress bar drawn on the terminal before the error, so the error has a line of its own', function()
    local d = tmpdir()
    write(d .. '/bar.lua', "local p = require('dslua.io.progress').new { total = 10, label = 'epoch 1', tty = true }\n"
                           .. "p:update(4)\nerror('stopped mid-epoch')\n")
    local out, status = H.run(bin .. ' ' .. d .. '/bar.lua')
    assert.are.equal(1, status)
    H.has(out, '\27[K\r\27[Kdslua: ' .. d .. '/bar.lua:3: stopped mid-epoch')
  end)

  it('carries its library: require "dslua" works from any directory', function()
    local d = tmpdir()
    write(d .. '/t.lua', 'local ds = require "dslua"; print(ds.tensor{1,2,3}:sum():item())')
    local out, status = H.run('cd / && ' .. bin .. ' ' .. d .. '/t.lua')
    assert.are.equal(0, status)
    assert.are.equal('6\n', out)
  end)

  it('finds a user module next to the script and through package.path', function()
    local d = tmpdir()
    assert(os.execute('mkdir -p ' .. d .. '/lib') == 0)
    write(d .. '/helper.lua', 'return { answer = 41 }')
    write(d .. '/lib/other.lua', 'return { extra = 1 }')
    write(d .. '/main.lua', 'package.path = package.path .. ";' .. d .. '/lib/?.lua"\n' ..
                            'print(require("helper").answer + require("other").extra)')
    local out, status = H.run('cd / && ' .. bin .. ' ' .. d .. '/main.lua')
    assert.are.equal(0, status)
    assert.are.equal('42\n', out)
  end)

  it('runs standard input as a script when it is not a terminal', function()
    local out, status = H.run("echo 'print(require(\"dslua\").ones(3):sum():item())' | " .. bin)
    assert.are.equal(0, status)
    assert.are.equal('3\n', out)
    out = H.run("echo 'print(...)' | " .. bin .. ' - x y')
    assert.are.equal('x\ty\n', out)
  end)
end)

describe('the REPL', function()
  local repl = require 'dslua.live.repl'

  local function capture(fn)
    local old = repl.print
    local lines = {}
    repl.print = function(s) lines[#lines + 1] = s end
    local ok, r = pcall(fn)
    repl.print = old
    assert(ok, r)
    return table.concat(lines, '\n'), r
  end

  it('prints expression results, and a trailing ; suppresses them', function()
    repl.init()
    local out = capture(function() return repl.step('1 + 2') end)
    assert.are.equal('3', out)
    out = capture(function() return repl.step('x_repl_spec = 5;') end)
    assert.are.equal('', out)
    out = capture(function() return repl.step('x_repl_spec, "s"') end)
    assert.are.equal('5\n"s"', out)
  end)

  it('asks for more input while a statement is incomplete', function()
    local _, more = capture(function() return repl.step('function f_repl_spec()') end)
    assert.is_true(more)
    _, more = capture(function() return repl.step('function f_repl_spec()\n return 7\nend') end)
    assert.is_false(more)
    assert.are.equal('7', (capture(function() return repl.step('f_repl_spec()') end)))
  end)

  it('shows tensors as a summary with values when small', function()
    local out = capture(function() return repl.step('ds.tensor{{1,2},{3,4}}') end)
    assert.are.equal('tensor 2x2 f32 cpu\n[[1.0000, 2.0000],\n [3.0000, 4.0000]]', out)
    out = capture(function() return repl.step('ds.zeros(100, 100)') end)
    assert.matches('^tensor 100x100 f32 cpu  min 0  max 0  mean 0', out)
  end)

  it('completes globals, table fields and tensor methods', function()
    assert.are.same({ 'ds.zero', 'ds.zeros' }, repl.complete('ds.zer'))
    local t = repl.complete('string.fo')
    assert.are.same({ 'string.format' }, t)
    _G.t_repl_spec = H.ds.zeros(2)
    local m = repl.complete('t_repl_spec:siz')
    assert.are.same({ 't_repl_spec:size' }, m)
    assert.are.same({}, repl.complete('nosuchthing.x'))
  end)
end)
