-- Shared spec helpers: closeness with a useful message, finite-difference
-- gradient checks, and PyTorch fixtures.
local ds = require 'dslua'
local luassert = require 'luassert'

local H = { ds = ds }

-- Tolerances per dtype, against references computed in float64 or by
-- PyTorch in the same dtype (which sums in another order).
H.tol = {
  f64 = { rtol = 1e-9, atol = 1e-10 },
  f32 = { rtol = 1e-4, atol = 1e-5 },
  bf16 = { rtol = 1.6e-2, atol = 1e-2 },
  f16 = { rtol = 2e-3, atol = 1e-3 },
}

local function flatten(v, out)
  if type(v) == 'table' then for i = 1, #v do flatten(v[i], out) end
  else out[#out + 1] = v end
  return out
end

local function values(x)
  if ds.is_tensor(x) then
    if x:dim() == 0 then return { x:item() } end
    return flatten(x:totable(), {})
  end
  if type(x) == 'table' then return flatten(x, {}) end
  return { x }
end

-- Asserts every element of actual is within atol + rtol*|expected|;
-- the message names the first element that is not.
function H.assert_close(actual, expected, tol, what)
  tol = tol or H.tol[ds.is_tensor(actual) and actual:dtype() or 'f32'] or H.tol.f32
  if ds.is_tensor(actual) and ds.is_tensor(expected) then
    assert(table.concat(actual:size(), 'x') == table.concat(expected:size(), 'x'),
           string.format('%sshape %s, expected %s', what and (what .. ': ') or '',
                         table.concat(actual:size(), 'x'), table.concat(expected:size(), 'x')))
  end
  local a, e = values(actual), values(expected)
  assert(#a == #e, string.format('%s%d elements, expected %d', what and (what .. ': ') or '', #a, #e))
  for i = 1, #a do
    local x, y = tonumber(a[i]) or (a[i] and 1 or 0), tonumber(e[i]) or (e[i] and 1 or 0)
    local ok = (x == y) or (x ~= x and y ~= y) or math.abs(x - y) <= tol.atol + tol.rtol * math.abs(y)
    if not ok then
      error(string.format('%selement %d is %.9g, expected %.9g (atol %g, rtol %g)',
                          what and (what .. ': ') or '', i, x, y, tol.atol, tol.rtol), 2)
    end
  end
  return true
end

-- ||a - b|| / ||b|| of two lists of numbers of one length (weights
-- trained two ways, as the rank scripts write them).
function H.rel_diff(a, b)
  assert(#a == #b, string.format('%d values, expected %d', #a, #b))
  local d, n = 0, 0
  for i = 1, #b do
    d = d + (a[i] - b[i]) ^ 2
    n = n + b[i] ^ 2
  end
  return math.sqrt(d) / math.sqrt(n)
end

-- Asserts actual equals expected element by element, exactly (a NaN
-- matches only a NaN); the message names the first element that does not.
function H.assert_same(actual, expected, what)
  local a, e = actual:to('f64'):view(-1):totable(), expected:to('f64'):view(-1):totable()
  assert(#a == #e, string.format('%s: %d elements, expected %d', what, #a, #e))
  for i = 1, #e do
    local both_nan = a[i] ~= a[i] and e[i] ~= e[i]
    if a[i] ~= e[i] and not both_nan then
      error(string.format('%s: element %d is %.9g, expected %.9g', what, i, a[i], e[i]), 2)
    end
  end
end

-- Checks the gradients of fn(inputs...) against central differences, in
-- f64. The output is projected on fixed random weights, so every output
-- element's gradient matters. inputs: f64 tensors; those that should be
-- checked have requires_grad set.
function H.gradcheck(fn, inputs, opts)
  opts = opts or {}
  local eps, rtol, atol = opts.eps or 1e-6, opts.rtol or 1e-5, opts.atol or 1e-7
  local out = fn(unpack(inputs))
  local w = ds.randn(out:size(), 'f64')
  local function objective()
    return ds.no_grad(function() return (fn(unpack(inputs)) * w):sum():item() end)
  end
  for _, x in ipairs(inputs) do if ds.is_tensor(x) then x.grad = nil end end
  ;(fn(unpack(inputs)) * w):sum():backward()
  for k, x in ipairs(inputs) do
    if ds.is_tensor(x) and x.requires_grad then
      local analytic = x.grad and values(x.grad) or {}
      for i = 1, x:numel() do
        local flat = x:view(-1)
        local orig = flat:narrow(1, i, 1):item()
        ds.no_grad(function() flat:narrow(1, i, 1):fill_(orig + eps) end)
        local up = objective()
        ds.no_grad(function() flat:narrow(1, i, 1):fill_(orig - eps) end)
        local down = objective()
        ds.no_grad(function() flat:narrow(1, i, 1):fill_(orig) end)
        local numeric = (up - down) / (2 * eps)
        local got = analytic[i] or 0
        if math.abs(got - numeric) > atol + rtol * math.abs(numeric) then
          error(string.format('gradcheck: input %d element %d: analytic %.9g, numeric %.9g', k, i, got, numeric), 2)
        end
      end
    end
  end
  return true
end

-- A module class `name` for training specs: fc1 (n_in -> hidden), the
-- activation act (a tensor method's name), fc2 (hidden -> n_out), its
-- forward the mean squared error of a batch {x, y}; without sizes
-- Linear(6, 8), tanh, Linear(8, 2).
function H.two_layer(name, n_in, hidden, n_out, act)
  n_in, hidden, n_out, act = n_in or 6, hidden or 8, n_out or 2, act or 'tanh'
  local M = ds.nn.Module:extend(name)
  function M:init()
    self.fc1 = ds.nn.Linear(n_in, hidden)
    self.fc2 = ds.nn.Linear(hidden, n_out)
  end
  function M:forward(batch)
    local h = self.fc1(batch.x)
    return ds.mse_loss(self.fc2(h[act](h)), batch.y)
  end
  return M
end

-- Runs PyTorch fixture case c (named name): its inputs x1.. (the first n,
-- default all) as leaves, out = run(xs), then out and the input gradients
-- of out projected on c.w against the case's. Returns the inputs.
function H.against_torch(c, name, run, tol, n)
  local xs = {}
  while (n and #xs < n) or (not n and c['x' .. (#xs + 1)]) do
    xs[#xs + 1] = H.tensor(c['x' .. (#xs + 1)]):requires_grad_()
  end
  local out = run(xs)
  H.assert_close(out, H.tensor(c.out), tol, name .. ' forward')
  ;(out * H.tensor(c.w)):sum():backward()
  for k = 1, #xs do
    H.assert_close(xs[k].grad, H.tensor(c['g' .. k]), tol, name .. ' grad ' .. k)
  end
  return xs
end

-- A tensor from a fixture record {shape=..., dtype=..., data=...}.
function H.tensor(rec)
  local t = ds.tensor(rec.data, rec.dtype == 'bool' and 'u8' or rec.dtype)
  if rec.dtype == 'bool' then t = t:to('bool') end
  return t:reshape(rec.shape)
end

-- Loads spec/fixtures/<name>.lua, written by spec/fixtures/gen_<name>.py.
-- x and y [B, T] (i64, on dev or the CPU) from windows of T + 1 tokens, flat
-- (the models fixtures' batches).
function H.token_batch(flat, B, T, dev)
  local x, y = {}, {}
  for b = 1, B do
    x[b], y[b] = {}, {}
    for t = 1, T do
      x[b][t] = flat[(b - 1) * (T + 1) + t]
      y[b][t] = flat[(b - 1) * (T + 1) + t + 1]
    end
  end
  return { x = ds.tensor(x, 'i64'):to(dev or 'cpu'), y = ds.tensor(y, 'i64'):to(dev or 'cpu') }
end

-- A copy of an example's ds.json with edit(config) applied, in a temp file.
function H.edited_config(path, edit)
  local f = assert(io.open(path, 'rb'))
  local cfg = ds.json.decode(f:read('*a'), path)
  f:close()
  edit(cfg)
  local out = os.tmpname()
  f = assert(io.open(out, 'w'))
  f:write(ds.json.encode(cfg, 2))
  f:close()
  return out
end

function H.fixture(name)
  local path = 'spec/fixtures/' .. name .. '.lua'
  local chunk = assert(loadfile(path), 'missing fixture ' .. path .. ' (run spec/fixtures/generate.sh)')
  return chunk()
end

-- The dslua binary running these specs (absolute path, however the specs
-- were started), for specs that start child processes: $DSLUA_BIN, else
-- this very process when it is a dslua binary, else arg[-1] (under busted,
-- the interpreter busted runs in; maybe relative, maybe a bare name found
-- on PATH).
function H.bin()
  local env = os.getenv('DSLUA_BIN')
  if env and env ~= '' then return env end
  local stat = io.open('/proc/self/stat')
  if stat then
    local pid = stat:read('*l'):match('^(%d+)')
    stat:close()
    local p = io.popen('readlink /proc/' .. pid .. '/exe')
    local exe = p:read('*l')
    p:close()
    if exe and exe:match('dslua[^/]*$') then return exe end
  end
  local b = assert(arg and arg[-1], 'cannot tell the dslua binary: set DSLUA_BIN')
  if not b:find('/') then
    local p = io.popen('command -v ' .. b)
    b = p:read('*l') or b
    p:close()
  end
  if b:sub(1, 1) ~= '/' then b = os.getenv('PWD') .. '/' .. b end
  return b
end

-- Runs a shell command; returns its output and exit status.
function H.run(cmd)
  local f = io.popen(cmd .. ' 2>&1; echo "exit:$?"')
  local out = f:read('*a')
  f:close()
  local status = tonumber(out:match('exit:(%d+)%s*$'))
  return out:gsub('exit:%d+%s*$', ''), status
end

-- A fresh temporary folder.
function H.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute('mkdir -p ' .. d) == 0)
  return d
end

-- A maker of fresh temporary folders, and the function that removes every
-- one it has made so far (for a teardown or an after_each).
function H.tmpdirs()
  local dirs = {}
  local function make()
    dirs[#dirs + 1] = H.tmpdir()
    return dirs[#dirs]
  end
  local function remove()
    for _, d in ipairs(dirs) do os.execute('rm -rf ' .. d) end
    dirs = {}
  end
  return make, remove
end

-- The whole of the file at path, as bytes.
function H.read(path)
  local f = assert(io.open(path, 'rb'))
  local text = f:read('*a')
  f:close()
  return text
end

-- Writes text to path and returns the path.
function H.write(path, text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
  return path
end

local function raised(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, 'expected an error')
  return e
end

-- The message fn(...) raises; fails the spec if it does not raise.
function H.err(fn, ...)
  return tostring(raised(fn, ...))
end

-- The message fn(...) raises, which must be a string (not an error
-- object); fails the spec if it does not raise.
function H.errmsg(fn, ...)
  local e = raised(fn, ...)
  assert(type(e) == 'string', 'error message is a ' .. type(e))
  return e
end

-- Asserts that fn(...) raises an error matching the Lua pattern; returns
-- the message.
function H.fails(pattern, fn, ...)
  local ok, e = pcall(fn, ...)
  luassert.is_false(ok, 'expected an error matching ' .. pattern)
  luassert.matches(pattern, tostring(e))
  return tostring(e)
end

-- The same with piece found verbatim, not as a pattern.
function H.fails_plain(piece, fn, ...)
  local ok, e = pcall(fn, ...)
  luassert.is_false(ok, 'expected an error matching ' .. piece)
  luassert.is_truthy(tostring(e):find(piece, 1, true), 'error was: ' .. tostring(e))
  return tostring(e)
end

-- Asserts that text contains piece, verbatim.
function H.has(text, piece)
  assert(text:find(piece, 1, true), string.format('expected %q in:\n%s', piece, text))
end

-- Open MPI's session directory for the mpiruns of this spec process: a
-- fresh folder, so that jobs of another process on this machine (another
-- suite, another user) never meet ours under the shared temporary folder
-- (Open MPI names its folders by host and job family: two mpiruns can
-- collide with "File exists"). H.mpi_cleanup removes it (a spec file's
-- teardown); the next mpirun makes a new one.
local session
function H.mpi_env()
  session = session or H.tmpdir()
  return 'OMPI_MCA_orte_tmpdir_base=' .. session .. ' '
end

function H.mpi_cleanup()
  if session then os.execute('rm -rf ' .. session) end
  session = nil
end

-- mpirun on np ranks of this machine, in its own session directory,
-- forwarding the variables named in vars (a list) to every rank; append
-- the program and its arguments.
function H.mpirun(np, vars)
  local x = {}
  for i, v in ipairs(vars or {}) do x[i] = '-x ' .. v .. ' ' end
  return H.mpi_env() .. 'mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader '
    .. table.concat(x) .. '-np ' .. np
end

-- The device the multi-rank specs' ranks use: the CPU, or the value of
-- DSLUA_SPEC_DEVICE (spec/gpu/multirank_spec.lua runs those specs again
-- with cuda, the ranks sharing the GPU).
function H.rank_device()
  local d = os.getenv('DSLUA_SPEC_DEVICE')
  return d and d ~= '' and d or 'cpu'
end

-- A shallow copy of table t with the keys of extra set over it.
function H.with(t, extra)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  for k, v in pairs(extra) do out[k] = v end
  return out
end

-- The command that runs the dslua binary on np ranks (np 1: no mpirun)
-- of H.rank_device(), one thread each, collectives checked for matching
-- calls (the default) and timing out after 60 s; append the script and its
-- arguments. DSLUA_DEVICE=cpu by default: on a GPU machine too these are
-- CPU ranks. DSLUA_COMM_BACKEND goes to the ranks when set, and
-- DSLUA_SPEC_PRELOAD (a library, the NCCL test double) is preloaded into
-- them. vars: more variables to forward to the ranks.
function H.ranks_cmd(np, vars)
  local env = 'DSLUA_DEVICE=' .. H.rank_device() .. ' DSLUA_NUM_THREADS=1 DSLUA_COMM_TIMEOUT=60 '
  if np == 1 then return env .. H.bin() end
  local preload = os.getenv('DSLUA_SPEC_PRELOAD')
  local all = { 'DSLUA_DEVICE', 'DSLUA_NUM_THREADS', 'DSLUA_COMM_TIMEOUT' }
  if os.getenv('DSLUA_COMM_BACKEND') then all[#all + 1] = 'DSLUA_COMM_BACKEND' end
  if preload and preload ~= '' then all[#all + 1] = 'LD_PRELOAD=' .. preload end
  for _, v in ipairs(vars or {}) do all[#all + 1] = v end
  return env .. H.mpirun(np, all) .. ' ' .. H.bin()
end

-- How many times pattern matches in text.
function H.count(text, pattern)
  local k = 0
  for _ in text:gmatch(pattern) do k = k + 1 end
  return k
end

-- spec/comm/primitives.lua's outputs of np ranks under dir (mpirun's
-- --output-filename): no FAIL, at least min PASS lines per rank, and rank
-- 0's DONE line counting them all.
function H.primitives_passed(dir, np, min)
  local total = 0
  for q = 0, np - 1 do
    local text = H.read(dir .. '/1/rank.' .. q .. '/stdout')
    assert(H.count(text, 'FAIL') == 0, text)
    local passes = H.count(text, 'PASS ')
    assert(passes >= min, string.format('%d PASS lines on rank %d, expected at least %d:\n%s', passes, q, min, text))
    total = total + passes
  end
  H.has(H.read(dir .. '/1/rank.0/stdout'), 'DONE checks=' .. total .. ' failures=0')
end

-- Runs cmd, which must succeed and write JSON to json_path: the decoded
-- table and the command's output.
function H.run_json(cmd, json_path)
  local out, status = H.run(cmd)
  if status ~= 0 then error(string.format('exit status %s from %s:\n%s', tostring(status), cmd, out), 2) end
  local f = assert(io.open(json_path))
  local t = ds.json.decode(f:read('*a'))
  f:close()
  return t, out
end

-- run(np) for a block of multi-rank specs: the first call for each np
-- runs command(np, json_path), a command that writes JSON to json_path (in
-- dir), and every call returns the decoded table and the command's output
-- (see H.run_json).
function H.runs_by_np(dir, command)
  local runs, outputs = {}, {}
  return function(np)
    if not runs[np] then
      local json = dir .. '/' .. np .. '.json'
      runs[np], outputs[np] = H.run_json(command(np, json), json)
    end
    return runs[np], outputs[np]
  end
end

-- Whether mpirun is on PATH (multi-rank specs skip without it).
function H.have_mpirun()
  local out, status = H.run('command -v mpirun')
  return status == 0 and out ~= ''
end

-- In a describe block of multi-rank specs: without mpirun, a pending
-- spec saying so and true (the block returns); with it, false, and the
-- block's teardown removes its Open MPI session directory.
function H.skip_without_mpirun()
  local spec = getfenv(2)      -- busted's functions live in the spec file's environment
  if not H.have_mpirun() then
    spec.pending('mpirun is not on PATH')
    return true
  end
  spec.teardown(H.mpi_cleanup)
  return false
end

-- The folder of shared data sets, or nil and why not (the test then calls
-- pending with it).
function H.shared_data(sub)
  local dir = os.getenv('DSLUA_DATA') or '../shared/data'
  local f = io.open(dir .. '/' .. sub, 'rb')
  if not f then return nil, string.format('%s/%s is absent', dir, sub) end
  f:close()
  return dir
end

-- Two runs of spec/ranks/lm.lua (their JSON) alike: other's losses
-- (relative; maybe only the last steps') and whole weights (absolute)
-- within 1e-5 in f32 of one's, and every rank's weights rank 0's. what:
-- the case, for messages. Returns how many weights it compared.
function H.same_training(one, other, what)
  local skip = #one.losses - #other.losses
  for i = 1, #other.losses do
    local l = one.losses[skip + i]
    assert(math.abs(other.losses[i] - l) <= 1e-5 * math.abs(l),
           string.format('%s, step %d: %.9g vs %.9g', what, skip + i, other.losses[i], l))
  end
  local n = 0
  for name, w in pairs(one.weights) do
    local v = assert(other.weights[name], what .. ': no ' .. name)
    for i = 1, #w do assert(math.abs(v[i] - w[i]) <= 1e-5, string.format('%s: %s[%d]', what, name, i)) end
    n = n + 1
  end
  assert(other.spread == 0, what .. ": the ranks' weights differ by " .. tostring(other.spread))
  return n
end

-- bench/fp8.lua run by cmd (the dslua binary, with its environment) for
-- steps on tiny Shakespeare in the shared folder data: bf16 learnt (its
-- last 50 steps' loss 1 below its first 10's) and fp8's last 50 steps
-- within 1% of bf16's. Callers pend where H.shared_data finds no text: the
-- binary's own, its Lua sources, moves with every edit, and 300 steps of
-- a small model on it landed anywhere from -0.5% to +2%.
function H.fp8_follows_bf16(cmd, steps, data)
  local dir = H.tmpdir()
  local ok, c = pcall(H.run_json, cmd .. ' bench/fp8.lua ' .. dir .. '/curve.json steps=' .. steps
                      .. ' text=' .. data .. '/tinyshakespeare/input.txt', dir .. '/curve.json')
  os.execute('rm -rf ' .. dir)
  if not ok then error(c, 2) end
  local b, f = c.last50.bf16, c.last50.fp8
  assert(b < c.first10.bf16 - 1, string.format('bf16 did not learn: %.4f from %.4f', b, c.first10.bf16))
  assert(math.abs(f - b) <= 0.01 * b, string.format('fp8 %.4f against bf16 %.4f', f, b))
end

-- Every tensor of two checkpoints the same, to the bit, whatever degrees
-- saved them: fp32 weights, optimizer buffers, module buffers, and the
-- optimizer's steps. Returns how many tensors it compared.
function H.same_checkpoints(dir_a, tag_a, dir_b, tag_b)
  local a, b = ds.checkpoint.read_full(dir_a, tag_a, true), ds.checkpoint.read_full(dir_b, tag_b, true)
  local n = 0
  for kind, tensors in pairs(a.states) do
    for name, t in pairs(tensors) do
      local u = assert(b.states[kind][name], kind .. '/' .. name .. ' missing')
      assert(table.concat(t:size(), 'x') == table.concat(u:size(), 'x'), kind .. '/' .. name .. ': shapes differ')
      local d = (t - u):abs():amax():item()
      assert(d == 0, string.format('%s/%s differs by %g', kind, name, d))
      n = n + 1
    end
  end
  for g, grp in ipairs(a.manifest.optimizer.param_groups) do
    assert(grp.step == b.manifest.optimizer.param_groups[g].step, 'param group ' .. g .. ': steps differ')
  end
  return n
end

-- Whether this binary sees a GPU (GPU specs skip with one line without).
function H.has_cuda()
  return ds.cuda ~= nil and ds.cuda.is_available()
end

return H
