-- ds.comm: collectives between ranks, as torch.distributed and
-- deepspeed.comm name them. Ranks are 0-based (MPI's and DeepSpeed's);
-- src/dst are world ranks, also inside a group.
--
--   ds.comm.all_reduce(t [, op] [, opts])    op: 'sum' (default), 'avg', 'max', 'min', 'prod'
--   opts: { async = true, group = g, tag = n, log_name = 'name', prof = true } or a group g
--
-- With async, a primitive returns a work: work:wait() gives what the
-- blocking call returns, work:is_completed() polls. Without mpirun there
-- is one rank and every primitive is a local no-op or copy.
--
-- The comms logger (DeepSpeed's `comms_logger` block) times every
-- collective: ds.comm.configure_logger{enabled = true, verbose, prof_all,
-- prof_ops, debug}, then ds.comm.log_summary() prints DeepSpeed's table.
local C = require 'dslua.core'
local K = C._comm

local M = {}

M.ReduceOp = { SUM = 'sum', AVG = 'avg', MAX = 'max', MIN = 'min', PRODUCT = 'prod', PROD = 'prod' }

local DTYPE_BYTES = { f32 = 4, f64 = 8, bf16 = 2, f16 = 2, i32 = 4, i64 = 8, u8 = 1, bool = 1 }

local function nbytes(t) return t:numel() * DTYPE_BYTES[t:dtype()] end

---------------------------------------------------------------- ranks

function M.rank(group) return K.rank(group) end
function M.world_size(group) return K.size(group) end
M.get_rank, M.get_world_size = M.rank, M.world_size
function M.local_rank() return K.local_rank() end
function M.local_size() return K.local_size() end
-- true under mpirun (MPI is started here if it was not yet)
function M.is_initialized() return K.is_initialized() end
function M.launched() return K.launched() end
function M.set_timeout(seconds) K.set_timeout(seconds) end
function M.get_timeout() return K.timeout() end
-- the agreement before every collective (on unless DSLUA_COMM_CHECK=0);
-- every rank must set the same
function M.set_check(on) K.set_check(on) end
function M.check_enabled() return K.check_enabled() end
-- The backend of device tensors: 'nccl', or 'mpi' (through page-locked
-- host memory; where ranks share a GPU by default). set_backend takes
-- DeepSpeed's dist_backend names: nccl, mpi, gloo (as mpi), auto.
function M.backend() return K.backend() end
function M.set_backend(name, source) K.set_backend(name, source) end
-- deepspeed.init_distributed(dist_backend=...): MPI starts by itself under
-- mpirun; what is left to choose is the backend of device tensors
function M.init_distributed(o)
  local name = type(o) == 'table' and o.dist_backend or o
  if name ~= nil then K.set_backend(name, 'init_distributed: dist_backend') end
end
-- this rank's last collectives, oldest first: {what, group, state, age, seconds}
function M.flight_record() return K.flight_record() end
function M.abort(code) K.abort(code or 1) end
-- polls every async work in flight once (lets MPI move them along)
function M.progress() K.progress() end

-- new_group(ranks) -> group; every rank calls it with the same list.
-- group:rank() (-1 when not a member), group:size(), group:ranks().
function M.new_group(ranks)
  if type(ranks) ~= 'table' then error('new_group: expected a list of ranks, got ' .. type(ranks), 2) end
  return K.new_group(ranks)
end

---------------------------------------------------------------- printing

local function prefixed(text)
  local p = string.format('[rank %d] ', K.rank())
  return p .. tostring(text):gsub('\n', '\n' .. p)
end

-- print(...) with a `[rank N] ` prefix on every line, flushed at once.
function M.print(...)
  local parts = {}
  for i = 1, select('#', ...) do parts[i] = tostring((select(i, ...))) end
  io.stdout:write(prefixed(table.concat(parts, '\t')), '\n')
  io.stdout:flush()
end

function M.printf(fmt, ...) M.print(string.format(fmt, ...)) end

-- print on rank 0 only (still prefixed)
function M.print0(...) if K.rank() == 0 then M.print(...) end end

---------------------------------------------------------------- comms logger

local logger = { enabled = false, verbose = false, prof_all = true, prof_ops = {}, debug = false,
                 records = {}, order = {} }

-- configure_logger(block): DeepSpeed's comms_logger config block.
function M.configure_logger(cfg)
  cfg = cfg or {}
  logger.enabled = cfg.enabled and true or false
  if cfg.verbose ~= nil then logger.verbose = cfg.verbose and true or false end
  if cfg.prof_all ~= nil then logger.prof_all = cfg.prof_all and true or false end
  if cfg.debug ~= nil then logger.debug = cfg.debug and true or false end
  if cfg.prof_ops ~= nil then
    logger.prof_ops = {}
    for _, name in ipairs(cfg.prof_ops) do logger.prof_ops[name] = true end
  end
end

function M.reset_logger()
  logger.records, logger.order = {}, {}
end

-- DeepSpeed's calc_bw_log: Gbps from bytes and milliseconds; n ranks.
local function bandwidth(name, size, ms, n)
  if ms <= 0 then return 0, 0 end
  local tput, busbw
  if name == 'all_gather' or name == 'reduce_scatter' then
    size = size * n
    tput = size / ms
    busbw = tput * ((n - 1) / n)
  elseif name == 'all_reduce' then
    tput = size * 2 / ms
    busbw = size / ms * (2 * (n - 1) / n)
  elseif name == 'all_to_all' then
    tput = size / ms
    busbw = tput * ((n - 1) / n)
  else
    tput = size / ms
    busbw = tput
  end
  return tput * 8 / 1e6, busbw * 8 / 1e6
end
M.bandwidth = bandwidth

-- Python's str(round(x, 2))
local function pyround2(x)
  local s = string.format('%.2f', x):gsub('0$', '')
  return s
end

-- DeepSpeed's convert_size: "40.0 B", "4.0 KB", "1.5 MB"
local function convert_size(n)
  if n == 0 then return '0B' end
  local names = { 'B', 'KB', 'MB', 'GB', 'TB', 'PB' }
  local i = math.min(math.floor(math.log(n) / math.log(1024)), #names - 1)
  return pyround2(n / 1024 ^ i) .. ' ' .. names[i + 1]
end
M.convert_size = convert_size

-- Python's round(): halves go to the even neighbour
local function round_even(x)
  local f = math.floor(x)
  local d = x - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then return f + 1 end
  return f
end

-- DeepSpeed's trim_mean(data, 0.1)
local function trim_mean(data, p)
  local n = #data
  if n == 0 then return 0 end
  local s = {}
  for i = 1, n do s[i] = data[i] end
  table.sort(s)
  local k = round_even(n * p)
  local sum = 0
  for i = k + 1, n - k do sum = sum + s[i] end
  return sum / (n - 2 * k)
end

local function record(rec_name, name, size, ms, group)
  local algbw, busbw = bandwidth(name, size, ms, K.size(group))
  local by_size = logger.records[rec_name]
  if not by_size then
    by_size = {}
    logger.records[rec_name] = by_size
    logger.order[#logger.order + 1] = rec_name
  end
  local r = by_size[size]
  if not r then
    r = { count = 0, lat = {}, algbw = {}, busbw = {} }
    by_size[size] = r
  end
  r.count = r.count + 1
  r.lat[#r.lat + 1], r.algbw[#r.algbw + 1], r.busbw[#r.busbw + 1] = ms, algbw, busbw
  if logger.verbose and K.rank() == 0 then
    M.print(string.format('comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f',
                          rec_name, ms, convert_size(size), algbw, busbw))
  end
end

-- the function that called ds.comm (DeepSpeed's get_caller_func): the
-- first frame outside this file; '<module>' for a script's main chunk
local function caller()
  local here = debug.getinfo(1, 'S').source
  for level = 2, 20 do
    local info = debug.getinfo(level, 'Sn')
    if not info then break end
    if info.source ~= here then
      return info.what == 'main' and '<module>' or info.name or '?'
    end
  end
  return '?'
end

-- the name this call is logged under, or nil when it is not profiled
local function profiled(name, o)
  if not logger.enabled then return nil end
  local opts = type(o) == 'table' and o or {}
  local rec = opts.log_name or name
  if not (logger.prof_all or opts.prof or logger.prof_ops[rec]) then return nil end
  if logger.debug then rec = rec .. ' | [Caller Func: ' .. caller() .. ']' end
  return rec
end

-- log_summary([{print = false}]) -> lines of DeepSpeed's summary table,
-- printed by rank 0 between two barriers (so every rank calls it).
function M.log_summary(opts)
  opts = opts or {}
  local many = K.size() > 1
  if many then K.barrier() end
  local col = '%-20s%-20s%-20s%-20s%-20s%-20s%-20s'
  local lines = { string.format(col, 'Comm. Op', 'Message Size', 'Count', 'Total Latency(ms)', 'Avg Latency(ms)',
                                'tput_avg (Gbps)', 'busbw_avg (Gbps)') }
  for _, rec_name in ipairs(logger.order) do
    lines[#lines + 1] = rec_name
    local sizes = {}
    for size in pairs(logger.records[rec_name]) do sizes[#sizes + 1] = size end
    table.sort(sizes)
    for _, size in ipairs(sizes) do
      local r = logger.records[rec_name][size]
      local total = 0
      for _, v in ipairs(r.lat) do total = total + v end
      lines[#lines + 1] = string.format('%-20s%-20s%-20d%-20.2f%-20.2f%-20.2f%-20.2f', ' ', convert_size(size), r.count,
                                        total, trim_mean(r.lat, 0.1), trim_mean(r.algbw, 0.1),
                                        trim_mean(r.busbw, 0.1))
    end
  end
  if opts.print ~= false and K.rank() == 0 then
    io.stdout:write(table.concat(lines, '\n'), '\n')
    io.stdout:flush()
  end
  if many then K.barrier() end
  return lines
end

-- the raw records: {name = {[bytes] = {count =, lat = {ms...}, algbw =, busbw =}}}
function M.logger_records() return logger.records end

-- Whether collectives are logged now, and a record of one that C ran on
-- the world (the step engine's buckets and gathers, logged under the
-- names DeepSpeed gives them).
function M.logging() return logger.enabled end

function M.log_collective(name, bytes, ms)
  local rec = profiled(name, { log_name = name })
  if rec then record(rec, (name:gsub('^zero3?_', '')), bytes, ms, nil) end
end

---------------------------------------------------------------- primitives

local function options(o, what)
  if o == nil then return nil, false, 0 end
  if K.is_group(o) then return o, false, 0 end
  if type(o) ~= 'table' then error(string.format('%s: options must be a table or a group, got %s', what, type(o)), 3) end
  if o.group ~= nil and not K.is_group(o.group) then
    error(string.format('%s: opts.group must be a group from ds.comm.new_group', what), 3)
  end
  return o.group, o.async and true or false, o.tag or 0
end

local function check_tensor(t, what)
  if not C.is_tensor(t) then error(string.format('%s: expected a tensor, got %s', what, type(t)), 3) end
end

local function check_rank(r, what, arg)
  if type(r) ~= 'number' or r ~= math.floor(r) or r < 0 then
    error(string.format('%s: %s must be a rank (an integer >= 0), got %s', what, arg, tostring(r)), 3)
  end
end

-- an optional op before the options
local function op_and_opts(op, o)
  if op ~= nil and type(op) ~= 'string' then return nil, op end
  return op, o
end

local Work = {}
Work.__index = Work

function Work:wait()
  if not self.done then
    local r = self.w:wait()
    self.done = true
    if self.ret ~= nil then r = self.ret end
    self.result = r
    if self.rec then
      local size = type(self.bytes) == 'function' and self.bytes(r) or self.bytes
      record(self.rec, self.name, size, (C.wall_time() - self.t0) * 1000, self.group)
    end
  end
  return self.result
end

function Work:is_completed()
  if self.done then return true end
  if self.w:is_completed() then
    self:wait()
    return true
  end
  return false
end

-- Runs K[name](args...) (async flag included) and logs it. ret: what the
-- call returns instead of K's results (the tensor of an in-place call);
-- bytes: the message size, or a function of the results.
local function call(name, o, group, async, ret, bytes, ...)
  local rec = profiled(name, o)
  local t0 = C.wall_time()
  local r = K[name](...)
  if async then
    return setmetatable({ w = r, ret = ret, rec = rec, name = name, bytes = bytes, group = group, t0 = t0 }, Work)
  end
  if ret ~= nil then r = ret end
  if rec then record(rec, name, type(bytes) == 'function' and bytes(r) or bytes, (C.wall_time() - t0) * 1000, group) end
  return r
end

function M.barrier(o)
  local group, async = options(o, 'barrier')
  return call('barrier', o, group, async, nil, 0, group, async)
end

-- send(t, dst [, opts]); opts.tag (default 0) matches a recv's
function M.send(t, dst, o)
  check_tensor(t, 'send')
  check_rank(dst, 'send', 'dst')
  local group, async, tag = options(o, 'send')
  return call('send', o, group, async, nil, nbytes(t), t, dst, tag, group, async)
end

-- recv(t, src [, opts]) -> t, filled
function M.recv(t, src, o)
  check_tensor(t, 'recv')
  check_rank(src, 'recv', 'src')
  local group, async, tag = options(o, 'recv')
  return call('recv', o, group, async, t, nbytes(t), t, src, tag, group, async)
end

local function with_async(o)
  if o == nil or K.is_group(o) then return { group = o, async = true } end
  local c = {}
  for k, v in pairs(o) do c[k] = v end
  c.async = true
  return c
end

function M.isend(t, dst, o) return M.send(t, dst, with_async(o)) end
function M.irecv(t, src, o) return M.recv(t, src, with_async(o)) end

-- broadcast(t, src [, opts]) -> t, src's values on every rank
function M.broadcast(t, src, o)
  check_tensor(t, 'broadcast')
  check_rank(src, 'broadcast', 'src')
  local group, async = options(o, 'broadcast')
  return call('broadcast', o, group, async, t, nbytes(t), t, src, group, async)
end

-- reduce(t, dst [, op] [, opts]) -> t; the reduction lands in t on dst only
function M.reduce(t, dst, op, o)
  op, o = op_and_opts(op, o)
  check_tensor(t, 'reduce')
  check_rank(dst, 'reduce', 'dst')
  local group, async = options(o, 'reduce')
  return call('reduce', o, group, async, t, nbytes(t), t, dst, op, group, async)
end

-- all_reduce(t [, op] [, opts]) -> t, in place on every rank
function M.all_reduce(t, op, o)
  op, o = op_and_opts(op, o)
  check_tensor(t, 'all_reduce')
  local group, async = options(o, 'all_reduce')
  return call('all_reduce', o, group, async, t, nbytes(t), t, op, group, async)
end

-- gather(t, dst [, opts]) -> list of every rank's t on dst (rank order), nil elsewhere
function M.gather(t, dst, o)
  check_tensor(t, 'gather')
  check_rank(dst, 'gather', 'dst')
  local group, async = options(o, 'gather')
  return call('gather', o, group, async, nil, nbytes(t), t, dst, group, async)
end

-- scatter(list_or_nil, src [, opts]) -> this rank's tensor of src's list
function M.scatter(list, src, o)
  if list ~= nil and type(list) ~= 'table' then error('scatter: expected a list of tensors or nil, got ' .. type(list), 2) end
  check_rank(src, 'scatter', 'src')
  local group, async = options(o, 'scatter')
  return call('scatter', o, group, async, nil, nbytes, list, src, group, async)
end

-- all_gather(t [, opts]) -> list of every rank's t; first dims may differ
function M.all_gather(t, o)
  check_tensor(t, 'all_gather')
  local group, async = options(o, 'all_gather')
  return call('all_gather', o, group, async, nil, nbytes(t), t, group, async)
end

-- reduce_scatter(list [, op] [, opts]) -> the reduction of every rank's list[rank + 1]
function M.reduce_scatter(list, op, o)
  op, o = op_and_opts(op, o)
  if type(list) ~= 'table' then error('reduce_scatter: expected a list of tensors, got ' .. type(list), 2) end
  local group, async = options(o, 'reduce_scatter')
  return call('reduce_scatter', o, group, async, nil, nbytes, list, op, group, async)
end

-- all_to_all(t [, opts]) -> t's shape: piece j (of world size equal
-- pieces of its elements) is rank j's piece for this rank (torch's
-- all_to_all_single)
function M.all_to_all(t, o)
  check_tensor(t, 'all_to_all')
  local group, async = options(o, 'all_to_all')
  return call('all_to_all', o, group, async, nil, nbytes(t), t, group, async)
end

return M
