-- What a checkpoint's save and load share: its names and layout, messages,
-- steps every rank takes together, the kill test hook, and the engine's
-- state as the checkpoint sees it (what is saved, by name).
local ds = require 'dslua'
local json = require 'dslua.base.json'
local file_io = require 'dslua.base.file'
local core = require 'dslua.core'
local C = core.ckpt

local M = {}

-- version 2: a sampler's plan may be kept as its order's description (the
-- rank state's plan.order) in place of the sampler/indices tensor
local FORMAT, FORMAT_VERSION = 'dslua-checkpoint', 2
local MANIFEST = 'manifest.json'
local MAX_LATEST, MAX_MANIFEST = 4096, 2 ^ 30     -- bytes
local SHOWN = 80           -- bytes of a file's text a message may quote

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

-- The text of a small file through the guarded open (dslua/base/file.lua), nil
-- when there is none; a FIFO, a device, a planted link or a file over
-- max_bytes raises, naming who asked.
local function read_text(path, max_bytes, who)
  local ok, text, err = pcall(file_io.read, path, max_bytes)
  if not ok then fail('%s: %s', who, text) end
  return text, err
end

-- s quoted for a message: at most SHOWN bytes of it, control bytes escaped.
local function excerpt(s)
  local q = string.format('%q', s:sub(1, SHOWN)):gsub('\\\n', '\\n')
  return #s > SHOWN and q .. string.format(' (%d bytes)', #s) or q
end

-- Every rank writes a file (an engine's world_size counts only the batch's
-- replicas: a pipeline's data-parallel ranks of a stage, a sequence-parallel
-- model's data indices).
local function nranks() return ds.comm.world_size() end

-- {name, tensor, owned} for a list of {state_dict name, tensor}: a
-- pipeline's under its checkpoint names (layer_05.weight, the same on any
-- split), owned where this stage saves them; every name owned otherwise.
local function named(engine, list)
  local m = engine.module
  local out = {}
  for i, e in ipairs(list) do
    if m.is_pipeline then
      local name, owned = m:checkpoint_name(e[1])
      out[i] = { name, e[2], owned }
    else
      out[i] = { e[1], e[2], true }
    end
  end
  return out
end

local function named_parameters(engine) return named(engine, engine.module:named_parameters()) end

-- fp8 recipe layer names (a Linear's module name) as a checkpoint keeps
-- them: a pipeline's by layer as its weight's (layer_02.fc), the same on
-- any split; {checkpoint name = this rank's name}.
local function fp8_names(engine)
  local out, m = {}, engine.module
  for _, st in ipairs(engine.fp8.layers) do
    local name = st.name
    if m.is_pipeline then name = m:checkpoint_name(name .. '.weight'):gsub('%.weight$', '') end
    out[name] = st.name
  end
  return out
end
local function state_entries(engine) return named(engine, engine.module:state_entries()) end

-- A layout in words, for messages: a manifest's pipeline block (nil: not a
-- pipeline) on `world` ranks.
local function layout_str(p, world)
  if not p then return string.format('a model on %d ranks, not a pipeline', world) end
  local stages = {}
  for s = 1, p.stages do stages[s] = string.format('%d..%d', p.firsts[s], (p.firsts[s + 1] or p.layers) - 1) end
  return string.format('a pipeline of %d layers in %d stage%s (layers %s) x %d data parallel', p.layers, p.stages,
                       p.stages > 1 and 's' or '', table.concat(stages, ' | '), p.data_parallel)
end

local function engine_layout_str(engine)
  return layout_str(engine.module.is_pipeline and engine.module:layout() or nil, nranks(engine))
end

local function file_name(r) return string.format('rank_%05d.safetensors', r) end

local function ceil_div(a, b) return math.floor((a + b - 1) / b) end

-- Element range [lo, hi) of shard r of n elements cut into W shards.
local function shard_range(n, r, W)
  local s = ceil_div(n, W)
  local lo = math.min(n, r * s)
  return lo, math.min(n, lo + s)
end

local function shape_str(shape) return '[' .. table.concat(shape, ',') .. ']' end

-- A copy that JSON can hold: functions and userdata (a policy table's
-- code, say) become their names.
local function jsonable(v)
  if v == json.null then return v end
  local t = type(v)
  if t == 'table' then
    local out = {}
    for k, x in pairs(v) do out[k] = jsonable(x) end
    if json.is_array(v) then json.array(out) end
    return out
  end
  if t == 'number' and (v ~= v or v == math.huge or v == -math.huge) then return tostring(v) end
  if t == 'string' or t == 'number' or t == 'boolean' then return v end
  return tostring(v)
end

---------------------------------------------------------------- across ranks

-- Every rank's string, on every rank (one all-gather of bytes).
local function gather_strings(s, W)
  if W == 1 then return { s } end
  local bytes = { s:byte(1, -1) }
  if #bytes == 0 then bytes = { 0 } end       -- an empty message travels as one NUL
  local parts = ds.comm.all_gather(ds.tensor(bytes, 'u8'))
  local out = {}
  for r, t in ipairs(parts) do
    local v = t:totable()
    local chunks = {}
    for i = 1, #v, 4096 do chunks[#chunks + 1] = string.char(unpack(v, i, math.min(#v, i + 4095))) end
    out[r] = table.concat(chunks):gsub('^%z$', '')
  end
  return out
end

-- Runs fn on every rank; if it failed anywhere, every rank raises the
-- failures, each naming its rank.
local function everywhere(W, what, fn)
  local ok, res = pcall(fn)
  local reports = gather_strings(ok and '' or tostring(res), W)
  local errs = {}
  for r, msg in ipairs(reports) do
    if msg ~= '' then
      if msg:sub(1, #what + 2) == what .. ': ' then msg = msg:sub(#what + 3) end
      errs[#errs + 1] = W > 1 and string.format('rank %d: %s', r - 1, msg) or msg
    end
  end
  if #errs > 0 then fail('%s: %s', what, table.concat(errs, '\n')) end
  return res
end

---------------------------------------------------------------- the test hook

local function kill_point()
  local v = os.getenv('DSLUA_CKPT_KILL')
  if not v or v == '' then return nil end
  local r, point = v:match('^(%d+):(%a+)$')
  if not r then fail("DSLUA_CKPT_KILL: expected <rank>:<point>, got '%s'", v) end
  return tonumber(r), point
end

local function maybe_kill(rank, point)
  local r, p = kill_point()
  if r == rank and p == point then C.kill_self() end
end

---------------------------------------------------------------- the engine's state

-- What this engine holds, the same way for every mode:
--   params[i] = {name, shape, numel, group}, every trainable parameter once
--     (groups back to back, each group in its order)
--   pieces[i] = {lo, hi, offset}: this rank holds elements [lo, hi) of
--     parameter i at `offset` of its group's flat buffers
--   groups[g] = the optimizer's param group (hyperparameters)
-- (read_buffers gives each group's flat f32 buffers), mode: what holds
-- them, as the step says (engine.steps:holds()): 'flat' (fp32 stage 0: the
-- optimizer's own buffers hold whole parameters), 'masters' (this rank's
-- shards back to back), 'streamed' (the same, through the nvme optimizer's
-- files: read with state_dict).
-- A checkpoint cuts each parameter into `parts` shards, rank `part`'s
-- file holding shard `part` of those it owns: the world's ranks, or the
-- ranks of the model's data group (`ranks`: a pipeline stage's, a tensor
-- rank's; data x sequence). A parameter split across a tensor group is
-- saved as its pieces, each with its split (`tp`: {axis, stride, size,
-- rank}, ds.nn.parallel's) and the whole shape (`full`); a replicated one
-- by tensor rank 0 alone (`tensor_rank`: this rank's).
local function engine_layout(engine)
  local names = {}
  for _, e in ipairs(named_parameters(engine)) do names[e[2]] = e end
  local L = { params = {}, pieces = {}, by_name = {}, tensor_rank = 0 }
  local m = engine.module
  if m.is_pipeline then
    L.parts, L.part, L.pipeline, L.ranks = m.dp_size, m.dp_rank, m:layout(), {}
    for d = 0, m.dp_size - 1 do L.ranks[d + 1] = m.topology:get_rank(m.stage_id, d) end
  elseif m.dp_group then
    L.parts, L.part, L.ranks = m.dp_group:size(), m.dp_group:rank(), m.dp_group:ranks()
  else
    L.parts, L.part = engine.reduce_size, engine.rank
  end
  local splits, T = {}, m.tensor_group and m.tensor_group:size() or 1
  if T > 1 then
    L.tensor_rank = m.tensor_group:rank()
    for _, e in ipairs(ds.nn.parallel.params(m)) do
      if e.axis then splits[e.tensor] = { axis = e.axis, stride = e.stride, size = T, rank = L.tensor_rank } end
    end
  end
  local function add(p, g, lo, hi, offset)
    local i = #L.params + 1
    local e = names[p]
    if not e then fail('checkpoint: parameter %d of param group %d is not a parameter of the model', i, g) end
    local name, tp = e[1], splits[p]
    local full = p:size()
    if tp then full[tp.axis] = full[tp.axis] * T end
    L.params[i] = { name = name, shape = p:size(), full = full, tp = tp, numel = p:numel(), group = g,
                    owned = e[3] and (tp ~= nil or L.tensor_rank == 0) }
    L.pieces[i] = { lo = lo, hi = hi, offset = offset }
    L.by_name[name] = i
  end
  local z = engine.steps.zero
  L.mode = engine.steps:holds()
  if not z then
    L.optimizer = engine.optimizer
    for g, group in ipairs(L.optimizer.param_groups) do
      local off = 0
      for _, p in ipairs(group.params) do
        add(p, g, 0, p:numel(), off)
        off = off + p:numel()
      end
    end
  else
    L.optimizer = z.optimizer
    local r = z.parts > 1 and L.part or 0
    for g, group in ipairs(z.groups) do
      local off = 0
      for _, p in ipairs(group.params) do
        local s = z:shard(z.index[p])
        local n = p:numel()
        local lo = math.min(n, r * s)
        add(p, g, lo, math.min(n, lo + s), off)
        off = off + s
      end
    end
  end
  L.groups = L.optimizer.param_groups
  L.state_names = L.optimizer:state_names()
  return L
end

-- Where this rank sits in the model's split, "stage:tensor rank" ("0:0"
-- unsplit): state of the split's pieces that every data-parallel rank
-- holds alike (OneBitLamb's) is saved and loaded by it.
local function split_position(engine, L)
  local m = engine.module
  return string.format('%d:%d', m.is_pipeline and m.stage_id or 0, L.tensor_rank)
end

-- Does the engine step OneBitLamb, whose own state the checkpoint keeps?
local function onebit_lamb(engine, L)
  return engine.steps.onebit ~= nil and L.optimizer.onebit ~= nil and L.optimizer.onebit.kind == 'OneBitLamb'
end

-- The optimizer's state as flat buffers per group: {fp32 = tensor, [name]
-- = tensor (only where it holds state)}, and each group's step.
local function read_buffers(engine, L)
  local out, steps = {}, {}
  if L.mode == 'streamed' then
    local sd = L.optimizer:state_dict()
    for g = 1, #L.groups do
      local st = sd.state[g]
      out[g] = { fp32 = st.master }
      for _, s in ipairs(L.state_names) do out[g][s] = st[s] end
      steps[g] = st.step
    end
    return out, steps
  end
  local h = L.optimizer._h
  for g = 1, #L.groups do
    out[g] = { fp32 = engine.steps:master(g) }
    for _, s in ipairs(L.state_names) do
      if h:has_state(g, s) then out[g][s] = L.optimizer:flat_state(g, s) end
    end
    steps[g] = h:steps(g)
  end
  return out, steps
end

-- Hyperparameters of a param group, as JSON holds them.
local function hyperparams(group)
  local out = {}
  for k, v in pairs(group) do
    if k ~= 'params' then out[k] = jsonable(v) end
  end
  return out
end

-- Model tensors that are not trainable parameters (buffers, frozen
-- parameters), {name, tensor, owned}: rank 0 (a pipeline stage's first
-- rank) saves them whole.
local function module_tensors(engine, L)
  local trainable = {}
  for _, e in ipairs(named_parameters(engine)) do
    if L.by_name[e[1]] then trainable[e[2]] = true end
  end
  local out = {}
  for _, e in ipairs(state_entries(engine)) do
    if not trainable[e[2]] then out[#out + 1] = e end
  end
  return out
end

-- The SHA-256 of a Lua file the run depends on (schedule, sampler policy).
local function code_entry(path, extra)
  local text = path and read_text(path, file_io.MAX_BYTES, 'save_checkpoint')
  local e = extra or {}
  e.path = path
  e.sha256 = text and C.sha256(text) or nil
  return e
end

local function code_hashes(engine)
  local out = {}
  local s = engine.config.scheduler
  if s and s.type == 'lua' and s.params then out.lr_scheduler = code_entry(s.params.path) end
  local sm = engine.sampler
  if sm then out.sampler = code_entry(sm.policy_info.path, { name = sm.policy_info.name }) end
  -- live reload's running versions (with their text), which a resume reruns
  if engine.reload then out.reload = engine.reload:state_dict() end
  return out
end

-- client_state: JSON values, tensors anywhere inside (saved in rank 0's file).
-- open: the tables being split, by their key path (a table inside itself
-- is a cycle JSON cannot hold).
local function split_client(v, path, tensors, open)
  if ds.is_tensor(v) then
    tensors[#tensors + 1] = { 'client/' .. path, v }
    return { __tensor__ = 'client/' .. path }
  end
  if type(v) ~= 'table' then return jsonable(v) end
  local function named(p) return p == '' and 'client_state' or 'client_state.' .. p end
  if open[v] then
    fail('save_checkpoint: %s is %s, a table inside itself: a cycle cannot be saved', named(path), named(open[v]))
  end
  open[v] = path
  local out = {}
  for k, x in pairs(v) do
    out[k] = split_client(x, path == '' and tostring(k) or path .. '.' .. tostring(k), tensors, open)
  end
  open[v] = nil
  if json.is_array(v) then json.array(out) end
  return out
end

M.FORMAT = FORMAT
M.FORMAT_VERSION = FORMAT_VERSION
M.MANIFEST = MANIFEST
M.MAX_LATEST = MAX_LATEST
M.MAX_MANIFEST = MAX_MANIFEST
M.SHOWN = SHOWN
M.ceil_div = ceil_div
M.code_hashes = code_hashes
M.engine_layout = engine_layout
M.engine_layout_str = engine_layout_str
M.everywhere = everywhere
M.excerpt = excerpt
M.fail = fail
M.file_name = file_name
M.fp8_names = fp8_names
M.gather_strings = gather_strings
M.hyperparams = hyperparams
M.jsonable = jsonable
M.kill_point = kill_point
M.layout_str = layout_str
M.maybe_kill = maybe_kill
M.module_tensors = module_tensors
M.named_parameters = named_parameters
M.nranks = nranks
M.onebit_lamb = onebit_lamb
M.read_buffers = read_buffers
M.read_text = read_text
M.shape_str = shape_str
M.shard_range = shard_range
M.split_position = split_position
M.split_client = split_client
M.state_entries = state_entries

return M
