-- A streamed optimizer for ZeRO's offload_optimizer.device = "nvme": the
-- fp32 master shard and the optimizer state of each param group live in
-- files (<nvme_path>/rank<r>/group<g>.<buffer>.bin, one per buffer so their
-- transfers run side by side) and pass through memory in pieces of
-- sub_group_size elements. A step is DeepSpeed's pipelined swap: while
-- piece i is stepped (ds.optim.apply), the pieces after it are read in and
-- piece i-1 is written back, through buffer_count sets of piece buffers
-- (at least 3: one stepping, one writing, the rest reading ahead).
--
--   local opt = nvme.optimizer{name = 'AdamW', path = nvme_path, rank = r,
--     sub_group_size = n, buffer_count = 4,
--     groups = {{numel = S, init = master_shard, lr = ..., betas = ...}, ...}}
--   opt.param_groups[g].lr = ...         -- schedulers assign as with ds.optim
--   opt:step(grads, out)                 -- grads[g]: 1-D f32, S elements;
--                                        -- out[g] receives the new master
local C = require 'dslua.core'
local optim = require 'dslua.optim'

local M = {}

local KEY = 'zero_optimization.offload_optimizer.nvme_path'
local F32 = 4    -- bytes per element of every buffer

local Streamed = {}
Streamed.__index = Streamed

local function fail(fmt, ...) error('nvme: ' .. string.format(fmt, ...), 3) end

local function is_count(v, least) return type(v) == 'number' and v >= least and v == math.floor(v) end

local function describe(t)
  return string.format('%s [%s]', t:dtype(), table.concat(t:size(), ','))
end

-- Raises optim's complaint about group g's hyperparameters, naming g.
local function check_group(name, g, pg)
  local ok, err = pcall(optim.check_group, name, pg)
  if not ok then fail('group %d: %s', g, tostring(err)) end
end

-- The group's hyperparameters over the kind's defaults; numel and init are
-- the streamed optimizer's own.
local function hyperparams(name, g, spec)
  local pg = optim.defaults(name)
  for k, v in pairs(spec) do
    if k ~= 'numel' and k ~= 'init' then
      if pg[k] == nil then
        local keys = {}
        for key in pairs(pg) do keys[#keys + 1] = key end
        table.sort(keys)
        fail("group %d: unknown option '%s' for %s (options: numel, init, %s)", g, tostring(k), name,
             table.concat(keys, ', '))
      end
      pg[k] = type(v) == 'table' and { unpack(v) } or v
    end
  end
  check_group(name, g, pg)
  return pg
end

-- Waits for every request in list and empties it.
local function wait_all(list)
  for i = 1, #list do
    local r = list[i]
    list[i] = nil
    r:wait()
  end
end

-- After an error: lets every transfer finish, errors dropped, so no request
-- outlives the step that made it.
local function drain(self)
  for _, s in ipairs(self._sets) do
    for _, list in ipairs({ s.reads, s.writes }) do
      for i = 1, #list do
        pcall(list[i].wait, list[i])
        list[i] = nil
      end
    end
  end
end

local function open_files(self, dir, g, numel)
  local files = {}
  for _, b in ipairs(self._buffers) do
    local path = string.format('%s/group%d.%s.bin', dir, g, b)
    local ok, f = pcall(C.aio.open, path, numel * F32)
    if not ok then error(string.format('%s: %s', KEY, f), 3) end
    files[b] = f
  end
  return files
end

-- nvme.optimizer{name, groups, path, rank, sub_group_size, buffer_count}
function M.optimizer(opts)
  if type(opts) ~= 'table' then fail('expected an options table, got %s', type(opts)) end
  local name = opts.name
  if name == 'Lamb' then
    fail("Lamb cannot be streamed: its trust ratio needs whole parameters (use Adam, AdamW, SGD, Adagrad or Lion)")
  end
  if not pcall(optim.defaults, name) then fail("unknown optimizer '%s' (Adam, AdamW, SGD, Adagrad, Lion)", tostring(name)) end
  if type(opts.path) ~= 'string' or opts.path == '' then
    error(string.format('%s: expected a directory path, got %s', KEY, tostring(opts.path)), 2)
  end
  local rank = opts.rank or 0
  local sub = opts.sub_group_size or 1e9
  local nbuf = opts.buffer_count or 4
  if not is_count(rank, 0) then fail('rank must be an integer >= 0, got %s', tostring(rank)) end
  if not is_count(sub, 1) then fail('sub_group_size must be an integer >= 1, got %s', tostring(sub)) end
  if not is_count(nbuf, 3) then
    fail('buffer_count must be an integer >= 3 (stepping, writing back, reading ahead), got %s', tostring(nbuf))
  end
  if type(opts.groups) ~= 'table' or #opts.groups == 0 then fail('groups must be a non-empty list of tables') end

  local self = setmetatable({ name = name, param_groups = {}, sub_group_size = sub, buffer_count = nbuf,
                              _numel = {}, _steps = {}, _started = {}, _files = {}, _sets = {}, _pieces = {} },
                            Streamed)
  self._slots = optim.state_names(name)
  self._buffers = { 'master', unpack(self._slots) }
  local inits, largest = {}, 0
  for g, spec in ipairs(opts.groups) do
    if type(spec) ~= 'table' then fail('group %d is a %s, not a table', g, type(spec)) end
    local n = spec.numel
    if not is_count(n, 0) then fail('group %d: numel must be an integer >= 0, got %s', g, tostring(n)) end
    if not C.is_tensor(spec.init) or spec.init:numel() ~= n then
      fail('group %d: init must be a tensor of numel = %d elements, got %s', g, n,
           C.is_tensor(spec.init) and describe(spec.init) or type(spec.init))
    end
    self.param_groups[g] = hyperparams(name, g, spec)
    self._numel[g], self._steps[g], self._started[g] = n, 0, false
    inits[g] = spec.init:to('f32'):contiguous():view(-1)
    largest = math.max(largest, n)
  end

  local dir = string.format('%s/rank%d', opts.path, rank)
  local ok, err = C.aio.mkdir(dir)
  if not ok then error(string.format('%s: %s', KEY, err), 2) end
  for g, n in ipairs(self._numel) do
    self._files[g] = open_files(self, dir, g, n)
    for off = 0, n - 1, sub do self._pieces[#self._pieces + 1] = { g = g, off = off, len = math.min(sub, n - off) } end
  end

  self._chunk = math.min(sub, largest)
  for i = 1, nbuf do
    local s = { reads = {}, writes = {} }
    for _, b in ipairs(self._buffers) do
      s[b] = C.zeros({ self._chunk })
      s[b]:set_category('optimizer_state')
    end
    self._sets[i] = s
  end

  -- the files start as the masters and the state's initial values (zeros
  -- from truncation, except Adagrad's accumulator)
  local pending = {}
  for g, f in ipairs(self._files) do pending[#pending + 1] = f.master:write(inits[g], 0) end
  wait_all(pending)
  if name == 'Adagrad' then
    local fill = self._sets[1].sum
    for _, p in ipairs(self._pieces) do
      local acc = self.param_groups[p.g].initial_accumulator_value
      if acc ~= 0 then
        local v = fill:narrow(1, 1, p.len)
        v:fill_(acc)
        self._files[p.g].sum:write(v, p.off * F32):wait()    -- one fill buffer, so one write at a time
      end
    end
  end
  return self
end

-- The piece buffers held in memory, in bytes.
function Streamed:bytes_in_memory()
  return self.buffer_count * #self._buffers * self._chunk * F32
end

-- The path of group g's file for buffer b ('master' or a state name).
function Streamed:file_path(g, b)
  return self._files[g][b or 'master']:path()
end

function Streamed:state_names() return { unpack(self._slots) } end

local function check_list(self, list, what, need_f32)
  if type(list) ~= 'table' or #list ~= #self._numel then
    fail('step: %s must be a list of %d tensors, one per group', what, #self._numel)
  end
  for g, t in ipairs(list) do
    local n = self._numel[g]
    local ok = C.is_tensor(t) and t:dim() == 1 and t:numel() == n and t:is_contiguous()
    if ok and need_f32 then ok = t:dtype() == 'f32' end
    if not ok then
      fail('step: %s[%d] is %s; expected a contiguous 1-D %stensor of %d elements', what, g,
           C.is_tensor(t) and describe(t) or type(t), need_f32 and 'f32 ' or 'float ', n)
    end
  end
end

local function run(self, grads, out)
  local sets, pieces, files, buffers = self._sets, self._pieces, self._files, self._buffers
  local nbuf, np = self.buffer_count, #pieces
  local name, groups, steps, started = self.name, self.param_groups, self._steps, self._started
  local function set_of(j) return sets[(j - 1) % nbuf + 1] end
  -- piece j into its set, once the set's last write-back is done
  local function prefetch(j)
    local s, p = set_of(j), pieces[j]
    wait_all(s.writes)
    for k, b in ipairs(buffers) do s.reads[k] = files[p.g][b]:read(s[b]:narrow(1, 1, p.len), p.off * F32) end
  end
  for j = 1, math.min(nbuf - 2, np) do prefetch(j) end
  for i = 1, np do
    if i + nbuf - 2 <= np then prefetch(i + nbuf - 2) end
    local s, p = set_of(i), pieces[i]
    wait_all(s.reads)
    local views = {}
    for k, b in ipairs(buffers) do views[k] = s[b]:narrow(1, 1, p.len) end
    local master = views[1]
    optim.apply(name, groups[p.g], steps[p.g] + 1, master, grads[p.g]:narrow(1, p.off + 1, p.len),
                { unpack(views, 2) }, not started[p.g])
    if out then out[p.g]:narrow(1, p.off + 1, p.len):copy_(master) end
    for k, b in ipairs(buffers) do s.writes[k] = files[p.g][b]:write(views[k], p.off * F32) end
  end
  for _, s in ipairs(sets) do wait_all(s.writes) end
end

-- One step of every group: grads[g] is the group's reduced fp32 gradient
-- shard; out[g] (optional, any float dtype) receives the updated master.
-- Hyperparameters are read from param_groups now; all are checked before
-- any piece moves.
function Streamed:step(grads, out)
  check_list(self, grads, 'grads', true)
  if out ~= nil then check_list(self, out, 'out', false) end
  for g, pg in ipairs(self.param_groups) do check_group(self.name, g, pg) end
  local prev = C.set_grad_enabled(false)
  local ok, err = pcall(run, self, grads, out)
  C.set_grad_enabled(prev)
  if not ok then
    drain(self)
    error(err, 0)
  end
  for g, pg in ipairs(self.param_groups) do
    self._steps[g] = self._steps[g] + 1
    if self.name == 'SGD' and pg.momentum ~= 0 then self._started[g] = true end
  end
end

-- Reads all of group g's buffer b into a new tensor.
local function read_whole(self, g, b)
  local t = C.zeros({ self._numel[g] })
  self._files[g][b]:read(t, 0):wait()
  return t
end

-- {param_groups = {hyperparameters...}, state = {[g] = {step = n, master =
-- tensor, <state name> = tensor...}}}: whole groups read back from the
-- files (tensors of S elements), SGD's momentum only once it started.
function Streamed:state_dict()
  local groups, state = {}, {}
  for g, pg in ipairs(self.param_groups) do
    local copy = {}
    for k, v in pairs(pg) do copy[k] = type(v) == 'table' and { unpack(v) } or v end
    groups[g] = copy
    local st = { step = self._steps[g], master = read_whole(self, g, 'master') }
    if self.name ~= 'SGD' or self._started[g] then
      for _, b in ipairs(self._slots) do st[b] = read_whole(self, g, b) end
    end
    state[g] = st
  end
  return { param_groups = groups, state = state }
end

-- Writes a state_dict's buffers back into the files and takes its steps
-- and hyperparameters; stepping then continues exactly.
function Streamed:load_state_dict(sd)
  if type(sd) ~= 'table' or type(sd.param_groups) ~= 'table' or type(sd.state) ~= 'table' then
    fail('load_state_dict: expected a table with param_groups and state')
  end
  if #sd.param_groups ~= #self.param_groups then
    fail('load_state_dict: the state has %d groups, the optimizer %d', #sd.param_groups, #self.param_groups)
  end
  local loaded = {}
  for g = 1, #self.param_groups do
    local st = sd.state[g]
    if type(st) ~= 'table' or not is_count(st.step, 0) then fail('load_state_dict: state[%d] has no step', g) end
    loaded[g] = {}
    for _, b in ipairs(self._buffers) do
      local t = st[b]
      if t ~= nil then
        if not C.is_tensor(t) or t:numel() ~= self._numel[g] then
          fail('load_state_dict: state[%d].%s must be a tensor of %d elements, got %s', g, b, self._numel[g],
               C.is_tensor(t) and describe(t) or type(t))
        end
        loaded[g][b] = t:to('f32'):contiguous():view(-1)
      elseif b == 'master' or self.name ~= 'SGD' then
        fail('load_state_dict: state[%d] has no %s', g, b)
      end
    end
    hyperparams(self.name, g, sd.param_groups[g])
  end
  for g = 1, #self.param_groups do
    local pending = {}
    for b, t in pairs(loaded[g]) do pending[#pending + 1] = self._files[g][b]:write(t, 0) end
    wait_all(pending)
    self.param_groups[g] = hyperparams(self.name, g, sd.param_groups[g])
    self._steps[g] = sd.state[g].step
    self._started[g] = self.name == 'SGD' and loaded[g].momentum_buffer ~= nil
  end
end

-- Closes the files (they stay on disk, as DeepSpeed's swap files do).
function Streamed:close()
  drain(self)
  for _, files in ipairs(self._files) do
    for _, f in pairs(files) do f:close() end
  end
end

function Streamed:__tostring()
  return string.format('nvme.%s (%d groups, %d pieces of up to %d elements, %d buffer sets)', self.name,
                       #self.param_groups, #self._pieces, self._chunk, self.buffer_count)
end

return M
