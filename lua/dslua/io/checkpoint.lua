-- Checkpoints: DeepSpeed's save_checkpoint / load_checkpoint, resumed
-- exactly on the same ranks, and on any world size, ZeRO stage, dtype or
-- device with no offline conversion.
--
-- A checkpoint is a folder <dir>/<tag> (tag: global_step<N> by default):
--   rank_00000.safetensors ...  one per rank, each written by its rank:
--       fp32/<name>      the rank's shard of the parameter's fp32 weights
--                        (the masters under bf16/fp16 or ZeRO)
--       <state>/<name>   its shard of each optimizer buffer (exp_avg, ...)
--       module/<name>    (rank 0) buffers and frozen parameters, whole
--       client/<key>     (rank 0) the tensors of client_state
--       onebit/<g>/fresh_v, onebit/<g>/pieces   (rank 0) OneBitLamb's own
--                        state of group g (the same on every rank)
--     and in its metadata ("dslua") the rank's own state: RNG, the data
--     loader's position, the sampler's epoch and policy state.
--   manifest.json   rank 0's: format, dslua version, config, ZeRO stage,
--     world size W, dtype, device, the shard layout (rank r holds elements
--     [r*s, min(n, (r+1)*s)) of a parameter of n elements, s = ceil(n / W),
--     whatever the stage), the optimizer's param groups and steps, the
--     engine's counters, LR scheduler, loss scaler, client_state, the
--     SHA-256 of the Lua schedule and sampler files, and the SHA-256 of
--     every file (with each tensor's CRC-32, which names the tensor a
--     damaged file changed).
-- and <dir>/latest names the newest complete tag.
--
-- A pipeline (ds.pipe.PipelineModule) names its tensors by layer as
-- DeepSpeed's layer_XX-model_states.pt files do: layer_05.weight, a tied
-- key's by its first layer, the same however the layers are split. Each
-- stage saves only its own layers (a tied weight once, by the stage of its
-- first layer), cut over the stage's data-parallel ranks instead of the
-- world: the manifest lists the ranks whose files hold each parameter's
-- shards, and its pipeline block the stages, data-parallel ranks and each
-- stage's first layer. A load reads by name, so another number of stages
-- or data ranks (one rank too) reshards; a pipeline's checkpoint does not
-- load into a model that is not one (nor with another number of layers).
--
-- A save is atomic: every rank writes its file into <tag>.partial (temp
-- name, fsync, rename); all ranks report (an all-gather, so the tag is
-- complete everywhere); rank 0 writes the manifest, puts the folder in
-- <tag>'s place in one rename (an exchange when the tag exists) and then
-- moves `latest` (temp, fsync, rename). Killed at any point, the previous
-- checkpoint stays whole and `latest` names it. With
-- checkpoint.use_node_local_storage each node's local rank 0 does rank 0's
-- part in its own folder.
--
-- A load reads the manifest, has every file's SHA-256 checked once (file
-- f by rank f mod P, in parallel), then each rank reads the element ranges
-- it holds now from whichever saved shards cover them: 4 ranks at stage 3
-- load on 2 ranks at stage 1 or 1 rank at stage 0, a bf16 run's masters
-- become an fp32 run's weights, tensors land on the engine's device.
--
-- DSLUA_CKPT_KILL=<rank>:<point> is a test hook: that rank kills itself
-- (SIGKILL) at the point of a save: write (before its file), half (half its
-- f32 tensor bytes written), written (file renamed, before the all-gather),
-- manifest (rank 0: manifest written, tag not in place), replaced (tag in
-- place, `latest` not moved), latest (`latest` moved).
local ds = require 'dslua'
local json = require 'dslua.base.json'
local file_io = require 'dslua.base.file'
local core = require 'dslua.core'
local C = core.ckpt

local M = {}

local FORMAT, FORMAT_VERSION = 'dslua-checkpoint', 1
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

-- Every rank writes a file: a pipeline engine's world_size counts only the
-- data-parallel ranks of its stage.
local function nranks(engine)
  return engine.module.is_pipeline and ds.comm.world_size() or engine.world_size
end

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
-- (read_buffers gives each group's flat f32 buffers), mode: 'flat' (fp32 stage 0: the optimizer's own buffers hold whole
-- parameters), 'masters' (this rank's shards back to back), 'nvme' (the
-- same, streamed through files: read with state_dict).
-- A checkpoint cuts each parameter into `parts` shards, rank `part`'s
-- file holding shard `part` of those it owns: the world's ranks, or in a
-- pipeline the data-parallel ranks of the stage that owns it (`ranks`).
local function engine_layout(engine)
  local names = {}
  for _, e in ipairs(named_parameters(engine)) do names[e[2]] = e end
  local L = { params = {}, pieces = {}, by_name = {} }
  local m = engine.module
  if m.is_pipeline then
    L.parts, L.part, L.pipeline, L.ranks = m.dp_size, m.dp_rank, m:layout(), {}
    for d = 0, m.dp_size - 1 do L.ranks[d + 1] = m.topology:get_rank(m.stage_id, d) end
  else
    L.parts, L.part = engine.world_size, engine.rank
  end
  local function add(p, g, lo, hi, offset)
    local i = #L.params + 1
    local e = names[p]
    if not e then fail('checkpoint: parameter %d of param group %d is not a parameter of the model', i, g) end
    local name = e[1]
    L.params[i] = { name = name, shape = p:size(), numel = p:numel(), group = g, owned = e[3] }
    L.pieces[i] = { lo = lo, hi = hi, offset = offset }
    L.by_name[name] = i
  end
  local z = engine.zero
  if not z then
    L.mode, L.optimizer = 'flat', engine.optimizer
    for g, group in ipairs(L.optimizer.param_groups) do
      local off = 0
      for _, p in ipairs(group.params) do
        add(p, g, 0, p:numel(), off)
        off = off + p:numel()
      end
    end
  else
    L.mode = z.offload == 'nvme' and 'nvme' or 'masters'
    L.optimizer = z.optimizer
    local r = z.parts > 1 and L.part or 0
    for g, group in ipairs(z.groups) do
      local off = 0
      for _, p in ipairs(group.params) do
        local s = z.engine:shard(z.index[p])
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

-- Does the engine step OneBitLamb, whose own state the checkpoint keeps?
local function onebit_lamb(engine, L)
  return engine.onebit ~= nil and L.optimizer.onebit ~= nil and L.optimizer.onebit.kind == 'OneBitLamb'
end

-- The optimizer's state as flat buffers per group: {fp32 = tensor, [name]
-- = tensor (only where it holds state)}, and each group's step.
local function read_buffers(engine, L)
  local out, steps = {}, {}
  if L.mode == 'nvme' then
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
    out[g] = { fp32 = L.mode == 'flat' and L.optimizer:flat_params(g) or engine.zero.engine:master(g) }
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

---------------------------------------------------------------- saving

local TAG_PATTERN = '^[%w_%-%.]+$'

local function check_tag(tag, who)
  if type(tag) ~= 'string' or not tag:match(TAG_PATTERN) or tag:match('^%.') or tag:match('%.partial$') then
    fail("%s: tag must be a name of letters, digits, '_', '-' and '.' (not starting with '.'), got %s", who,
         type(tag) == 'string' and excerpt(tag) or type(tag))
  end
end

-- DeepSpeed's _checkpoint_tag_validation: every rank must save the same tag.
local function validate_tag(engine, tag)
  local mode = engine.config.checkpoint.tag_validation
  if nranks(engine) == 1 or mode == 'IGNORE' then return end
  local tags = gather_strings(tag, nranks(engine))
  for r, t in ipairs(tags) do
    if t ~= tags[1] then
      local msg = string.format("checkpoint tag '%s' of rank %d differs from rank 0's '%s': all ranks must save "
                                .. 'the same tag', t, r - 1, tags[1])
      if mode == 'FAIL' then fail('save_checkpoint: %s', msg) end
      if engine.rank == 0 then io.stderr:write('[dslua] warning: ', msg, '\n') end
      return
    end
  end
end

-- Does this rank commit (manifest, folder, latest)?
local function is_leader(engine)
  if engine.config.checkpoint.use_node_local_storage then return ds.comm.local_rank() == 0 end
  return engine.rank == 0
end

-- This rank's file: its shards of the parameters it owns, and the whole
-- module tensors and client tensors it saves. Returns the report rank 0
-- puts in the manifest.
local function write_rank_file(engine, L, bufs, path, extra_tensors, rank_state)
  local W, part, r = L.parts, L.part, engine.rank
  local entries, saved_states = {}, {}
  for g = 1, #L.groups do
    saved_states[g] = {}
    for _, s in ipairs(L.state_names) do
      if bufs[g][s] then saved_states[g][#saved_states[g] + 1] = s end
    end
  end
  for i, p in ipairs(L.params) do
    local lo, hi = shard_range(p.numel, part, W)
    if hi > lo and p.owned then
      local piece = L.pieces[i]
      if lo < piece.lo or hi > piece.hi then
        fail('save_checkpoint: rank %d holds [%d, %d) of %s, not its shard [%d, %d)', r, piece.lo, piece.hi, p.name,
             lo, hi)
      end
      local at = piece.offset + (lo - piece.lo)
      local b = bufs[p.group]
      entries[#entries + 1] = { 'fp32/' .. p.name, b.fp32:narrow(1, at + 1, hi - lo) }
      for _, s in ipairs(saved_states[p.group]) do
        entries[#entries + 1] = { s .. '/' .. p.name, b[s]:narrow(1, at + 1, hi - lo) }
      end
    end
  end
  for _, e in ipairs(extra_tensors) do entries[#entries + 1] = e end
  local data = 0
  for _, e in ipairs(entries) do data = data + e[2]:numel() * (e[2]:dtype() == 'f32' and 4 or 0) end
  local kr, kp = kill_point()
  local kill_after = (kr == r and kp == 'half') and math.floor(data / 2) or nil
  maybe_kill(r, 'write')
  local bytes, sha, sums = C.save(path, entries, { format = 'pt', dslua = json.encode(rank_state) },
                                  { crc32 = true, kill_after = kill_after })
  local tensors = {}
  for k, e in ipairs(entries) do tensors[e[1]] = sums[k] end
  return { bytes = bytes, sha256 = sha, tensors = tensors, saved_states = saved_states }
end

-- This rank's own state, and its sampler's plan of the current epoch as
-- tensors (sampler/indices, sampler/micro_batch when a list).
local function rank_state(engine, tensors)
  local l = engine.training_dataloader
  -- which rank, layout and step the file holds, checked at load against
  -- the manifest: a file swapped in from another rank or run is refused
  local st = { rank = engine.rank, world_size = nranks(engine), layout = engine_layout_str(engine),
               global_steps = engine.global_steps, rng = ds.get_rng_state() }
  if l and l.position then
    local pos = l.position
    st.loader = { epoch = pos.epoch, step = pos.step, samples = pos.samples,
                  steps = engine.sampler and engine.sampler:steps() or #l, order = pos.order and true or nil }
    -- an epoch resumed on another world size reads its own order (the rest)
    if pos.order then tensors[#tensors + 1] = { 'loader/order', ds.tensor(pos.order, 'i64') } end
  end
  local sm = engine.sampler
  if sm then
    st.sampler = jsonable(sm:state_dict())
    local plan = sm.plans[sm.epoch]
    if plan and plan.count > 0 then
      local idx = ds.is_tensor(plan.indices) and plan.indices:to('i64') or ds.tensor(plan.indices, 'i64')
      tensors[#tensors + 1] = { 'sampler/indices', idx }
      local mb = plan.micro_batch
      if type(mb) == 'table' then tensors[#tensors + 1] = { 'sampler/micro_batch', ds.tensor(mb, 'i64') } end
      st.plan = { epoch = plan.epoch, note = plan.note, micro_batch = type(mb) == 'number' and mb or nil }
    end
  end
  return st
end

-- The parameters whose shards this rank's file starts (shard 0, so each
-- once), as the manifest lists them: a pipeline's with the ranks whose
-- files hold their shards (the owning stage's, by data index).
local function saved_params(L)
  local out = {}
  if L.part ~= 0 then return json.array(out) end
  for _, p in ipairs(L.params) do
    if p.owned then
      out[#out + 1] = { name = p.name, shape = json.array(p.shape), numel = p.numel, group = p.group,
                        shard = ceil_div(p.numel, L.parts), ranks = L.ranks and json.array(L.ranks) }
    end
  end
  return json.array(out)
end

-- The manifest rank 0 writes (see the top of this file), from every rank's
-- report: its parameters and module tensors.
local function manifest(engine, L, steps, tag, files, reports, client)
  local z = engine.zero
  local params, module = {}, {}
  for _, rep in ipairs(reports) do
    for _, p in ipairs(rep.params) do params[#params + 1] = p end
    for _, e in ipairs(rep.module) do module[#module + 1] = e end
  end
  local groups = {}
  for g, group in ipairs(L.groups) do
    local names = {}
    for _, p in ipairs(params) do
      if p.group == g then names[#names + 1] = p.name end
    end
    groups[g] = { hyperparameters = hyperparams(group), step = steps[g], params = json.array(names),
                  state = json.array(reports[1].saved_states[g]) }
  end
  -- state_dict names of trainable parameters under a second name (tied)
  local aliases, seen = {}, {}
  for _, e in ipairs(named_parameters(engine)) do seen[e[2]] = e[1] end
  for _, e in ipairs(state_entries(engine)) do
    local first = seen[e[2]]
    if first and first ~= e[1] and L.by_name[first] then aliases[e[1]] = first end
  end
  return {
    format = FORMAT, format_version = FORMAT_VERSION, dslua_version = core.version, tag = tag,
    world_size = nranks(engine), zero_stage = z and z.stage or 0, dtype = z and z.dtype or 'f32',
    device = engine.device, parameters = params, module = json.array(module), aliases = aliases,
    pipeline = L.pipeline,
    optimizer = { type = L.optimizer.name, param_groups = groups },
    engine = { global_steps = engine.global_steps, global_samples = engine.global_samples,
               micro_steps = engine.micro_steps, skipped_steps = engine.skipped_steps, epoch = engine.epoch },
    lr_scheduler = engine.lr_scheduler and jsonable(engine.lr_scheduler:state_dict()) or nil,
    loss_scaler = engine.scaler and jsonable(engine.scaler:state_dict()) or nil,
    client_state = client, code = code_hashes(engine), config = jsonable(engine.config),
    files = json.array(files),
  }
end

-- engine:save_checkpoint(dir [, tag [, client_state [, save_latest]]]) ->
-- true; save_latest = false leaves `latest` where it was (DeepSpeed's).
function M.save(engine, dir, tag, client_state, save_latest)
  if type(dir) ~= 'string' or dir == '' then fail('save_checkpoint: save_dir must be a path, got %s', type(dir)) end
  tag = tag or ('global_step' .. engine.global_steps)
  check_tag(tag, 'save_checkpoint')
  local gas = engine:gradient_accumulation_steps()
  if engine.micro_steps % gas ~= 0 then
    fail('save_checkpoint: micro step %d is inside a gradient accumulation window of %d (its gradients are not '
         .. 'saved): save after engine:step() at a boundary', engine.micro_steps, gas)
  end
  local W, r = nranks(engine), engine.rank
  local t0 = ds.wall_time()
  validate_tag(engine, tag)
  local final = dir .. '/' .. tag
  local partial = final .. '.partial'
  local leader = is_leader(engine)
  everywhere(W, 'save_checkpoint', function()
    if leader then
      C.mkdirs(dir)
      C.remove_tree(partial)      -- what a killed save left
      C.mkdirs(partial)
    end
  end)
  local L = engine_layout(engine)
  local bufs, steps = read_buffers(engine, L)
  local extra, client, module = {}, nil, {}
  if L.part == 0 then
    for _, e in ipairs(module_tensors(engine, L)) do
      if e[3] then
        extra[#extra + 1] = { 'module/' .. e[1], e[2] }
        module[#module + 1] = { name = e[1], dtype = e[2]:dtype(), shape = json.array(e[2]:size()), rank = r }
      end
    end
  end
  if r == 0 and onebit_lamb(engine, L) then
    for g = 1, #L.groups do
      local fresh_v, pieces = engine.onebit:lamb_state(g)
      extra[#extra + 1] = { 'onebit/' .. g .. '/fresh_v', fresh_v }
      extra[#extra + 1] = { 'onebit/' .. g .. '/pieces', pieces }
    end
  end
  if r == 0 and client_state ~= nil then client = split_client(client_state, '', extra, {}) end
  local report = everywhere(W, 'save_checkpoint', function()
    local state = rank_state(engine, extra)
    local rep = write_rank_file(engine, L, bufs, partial .. '/' .. file_name(r), extra, state)
    rep.params, rep.module = saved_params(L), json.array(module)
    maybe_kill(r, 'written')
    return rep
  end)
  local reports = gather_strings(json.encode(report), W)
  local ok, err = true, nil
  if leader then
    ok, err = pcall(function()
      C.fsync_dir(partial)
      local files, reps = {}, {}
      for k, text in ipairs(reports) do
        local rep = json.decode(text)
        files[k] = { file = file_name(k - 1), rank = k - 1, bytes = rep.bytes, sha256 = rep.sha256,
                     tensors = rep.tensors }
        reps[k] = rep
      end
      local m = manifest(engine, L, steps, tag, files, reps, client)
      core.file.write(partial .. '/' .. MANIFEST, json.encode(m, 1) .. '\n')
      maybe_kill(r, 'manifest')
      C.replace_dir(partial, final)
      maybe_kill(r, 'replaced')
      if save_latest ~= false then core.file.write(dir .. '/latest', tag) end
      maybe_kill(r, 'latest')
    end)
  end
  everywhere(W, 'save_checkpoint', function() if not ok then error(err, 0) end end)
  if r == 0 then
    local bytes = 0
    for _, text in ipairs(reports) do bytes = bytes + json.decode(text).bytes end
    local secs = ds.wall_time() - t0
    io.stdout:write(string.format('[Rank 0] saved checkpoint %s: %d files, %.1f MB in %.2f s (%.0f MB/s)\n', final, W,
                                  bytes / 1e6, secs, bytes / 1e6 / secs))
    io.stdout:flush()
  end
  return true
end

---------------------------------------------------------------- loading

local LOAD_OPTS = { load_optimizer_states = true, load_lr_scheduler_states = true, load_module_only = true,
                    load_module_strict = true, verify = true }

local function load_options(opts)
  local o = { load_optimizer_states = true, load_lr_scheduler_states = true, load_module_only = false,
              load_module_strict = true, verify = true }
  if opts == nil then return o end
  if type(opts) ~= 'table' then fail('load_checkpoint: options must be a table, got %s', type(opts)) end
  for k, v in pairs(opts) do
    if not LOAD_OPTS[k] then
      local names = {}
      for n in pairs(LOAD_OPTS) do names[#names + 1] = n end
      table.sort(names)
      fail("load_checkpoint: unknown option '%s' (%s)", tostring(k), table.concat(names, ', '))
    end
    if type(v) ~= 'boolean' then fail('load_checkpoint: %s must be true or false, got %s', k, tostring(v)) end
    o[k] = v
  end
  return o
end

local function is_int(v, lo) return type(v) == 'number' and v == math.floor(v) and v >= lo and v < 2 ^ 53 end

-- A manifest's value at key (a dotted path for messages) checked to be an
-- integer >= lo.
local function check_int(file, key, v, lo)
  if not is_int(v, lo) then
    fail("load_checkpoint: '%s': %s must be an integer >= %d, got %s: the manifest is corrupt", file, key, lo,
         type(v) == 'string' and excerpt(v) or tostring(v))
  end
end

-- The files a manifest lists, each a plain name in its folder (no '/',
-- no '..'), in rank order.
local function check_files(file, m)
  if type(m.files) ~= 'table' or #m.files ~= m.world_size then
    fail("load_checkpoint: '%s' lists %s files for %d ranks: the manifest is corrupt", file,
         type(m.files) == 'table' and #m.files or 'no', m.world_size)
  end
  for k, e in ipairs(m.files) do
    local name = type(e) == 'table' and e.file
    if type(name) ~= 'string' or name:find('/', 1, true) or name == '.' or name == '..' or name == '' then
      fail("load_checkpoint: '%s': files[%d] must name a file in the checkpoint's folder, got %s", file, k,
           type(name) == 'string' and excerpt(name) or type(name))
    end
    if e.rank ~= k - 1 then
      fail("load_checkpoint: '%s': files[%d] (%s) is listed as rank %s's, expected rank %d's: the manifest is corrupt",
           file, k, excerpt(name), tostring(e.rank), k - 1)
    end
  end
end

-- Each saved parameter's shard: its elements cut in as many pieces as
-- ranks hold it, so a changed shard cannot read another range.
local function check_params(file, m)
  if type(m.parameters) ~= 'table' then fail("load_checkpoint: '%s': parameters is not a list: the manifest is corrupt", file) end
  for k, sp in ipairs(m.parameters) do
    local key = string.format('parameters[%d]', k)
    if type(sp) ~= 'table' or type(sp.name) ~= 'string' or type(sp.shape) ~= 'table' then
      fail("load_checkpoint: '%s': %s is not {name, shape, numel, shard}: the manifest is corrupt", file, key)
    end
    check_int(file, key .. '.numel', sp.numel, 0)
    check_int(file, key .. '.shard', sp.shard, sp.numel > 0 and 1 or 0)
    local W = sp.ranks and #sp.ranks or m.world_size
    for i, r in ipairs(sp.ranks or {}) do
      check_int(file, string.format('%s.ranks[%d]', key, i), r, 0)
      if r >= m.world_size then
        fail("load_checkpoint: '%s': %s.ranks[%d] is %d, past the %d ranks: the manifest is corrupt", file, key, i, r,
             m.world_size)
      end
    end
    local want = ceil_div(sp.numel, W)
    if sp.shard ~= want then
      fail("load_checkpoint: '%s': %s (%s, %d elements on %d ranks) has shard %d, expected %d: the manifest is "
           .. 'corrupt', file, key, excerpt(sp.name), sp.numel, W, sp.shard, want)
    end
  end
end

-- The optimizer's groups, each parameter's shape and group, and the
-- module buffers, each of the type a load uses: refused by key, not met
-- as a Lua error deep in the load.
local function check_entries(file, m)
  local function corrupt(key, what) fail("load_checkpoint: '%s': %s %s: the manifest is corrupt", file, key, what) end
  local function list(v, key)
    if type(v) ~= 'table' then corrupt(key, 'is not a list') end
    return v
  end
  local function shape(v, key)
    for d, n in ipairs(list(v, key)) do check_int(file, string.format('%s[%d]', key, d), n, 0) end
  end
  local groups = list(list(m.optimizer, 'optimizer').param_groups, 'optimizer.param_groups')
  for g, grp in ipairs(groups) do
    local key = string.format('optimizer.param_groups[%d]', g)
    for i, st in ipairs(list(list(grp, key).state, key .. '.state')) do
      if type(st) ~= 'string' then corrupt(string.format('%s.state[%d]', key, i), 'is not a name') end
    end
  end
  for k, sp in ipairs(m.parameters) do
    local key = string.format('parameters[%d]', k)
    shape(sp.shape, key .. '.shape')
    check_int(file, key .. '.group', sp.group, 1)
    if not groups[sp.group] then corrupt(key .. '.group', string.format('is %d of %d groups', sp.group, #groups)) end
  end
  for k, e in ipairs(list(m.module, 'module')) do
    local key = string.format('module[%d]', k)
    if type(list(e, key).name) ~= 'string' then corrupt(key .. '.name', 'is not a name') end
    shape(e.shape, key .. '.shape')
    if e.rank ~= nil then
      check_int(file, key .. '.rank', e.rank, 0)
      if e.rank >= m.world_size then corrupt(key .. '.rank', string.format('is rank %d of %d', e.rank, m.world_size)) end
    end
  end
end

-- The manifest of a checkpoint folder, checked.
function M.read_manifest(path)
  local file = path .. '/' .. MANIFEST
  local text = read_text(file, MAX_MANIFEST, 'load_checkpoint')
  if not text then
    if not C.exists(path) then fail("load_checkpoint: '%s' does not exist", path) end
    fail("load_checkpoint: '%s' has no %s: not a dslua checkpoint", path, MANIFEST)
  end
  local ok, m = pcall(json.decode, text, file)
  if not ok then fail('load_checkpoint: %s: the manifest is corrupt', tostring(m):sub(1, 300)) end
  if type(m) ~= 'table' or m.format ~= FORMAT then fail("load_checkpoint: '%s' is not a dslua checkpoint manifest", file) end
  if type(m.format_version) ~= 'number' or m.format_version > FORMAT_VERSION then
    fail("load_checkpoint: '%s' has format version %s; this dslua (%s) reads up to %d", file,
         tostring(m.format_version):sub(1, SHOWN), core.version, FORMAT_VERSION)
  end
  for _, key in ipairs({ 'world_size', 'parameters', 'files', 'optimizer', 'module', 'engine' }) do
    if m[key] == nil then fail("load_checkpoint: '%s' has no '%s': the manifest is corrupt", file, key) end
  end
  check_int(file, 'world_size', m.world_size, 1)
  if type(m.engine) ~= 'table' then fail("load_checkpoint: '%s': engine is not an object: the manifest is corrupt", file) end
  check_int(file, 'engine.global_steps', m.engine.global_steps, 0)
  for _, key in ipairs({ 'global_samples', 'micro_steps', 'skipped_steps' }) do
    if m.engine[key] ~= nil then check_int(file, 'engine.' .. key, m.engine[key], 0) end
  end
  check_files(file, m)
  check_params(file, m)
  check_entries(file, m)
  return m
end

-- Every file's SHA-256 checked against the manifest, file f by rank f mod
-- P. A mismatch is pinned on the tensor whose bytes changed (its CRC-32)
-- when the header still reads.
local function verify_files(engine, path, m)
  local P = nranks(engine)
  everywhere(P, 'load_checkpoint', function()
    for k, entry in ipairs(m.files) do
      if (k - 1) % P == engine.rank then
        local file = path .. '/' .. entry.file
        if not C.exists(file) then fail("'%s' is missing", file) end
        if C.sha256_file(file) ~= entry.sha256 then
          local f = C.open(file)       -- a truncated or corrupt header raises, naming the tensor
          local names = {}
          for name in pairs(entry.tensors) do names[#names + 1] = name end
          table.sort(names)
          for _, name in ipairs(names) do
            if not f:entry(name) then
              fail("'%s' has no tensor '%s', which the manifest lists: the file is not this checkpoint's", file, name)
            end
            if f:crc32(name) ~= entry.tensors[name] then
              fail("'%s': tensor '%s' does not match its checksum in the manifest: the file is corrupt", file, name)
            end
          end
          f:close()
          fail("'%s' does not match its SHA-256 in the manifest (its tensors do): the header was changed", file)
        end
      end
    end
  end)
end

local function shown(v) return type(v) == 'string' and excerpt(v) or tostring(v) end

local RANK_KEYS = { 'rank', 'world_size', 'layout', 'global_steps' }
local warned_unchecked = {}

-- The file of rank r, opened, with its own record of the rank, layout and
-- step it holds checked against the manifest's. Files saved before they
-- held that record load with a warning (the rank they always held).
local function open_rank_file(path, m, r)
  local entry = m.files[r + 1]
  if not entry then fail("load_checkpoint: '%s': the manifest lists no file of rank %d", path, r) end
  local name = path .. '/' .. entry.file
  local f = C.open(name)
  local ok, st = pcall(json.decode, f:metadata().dslua or '')
  if not ok or type(st) ~= 'table' then
    f:close()
    fail("load_checkpoint: '%s' has no dslua state in its metadata", name)
  end
  local want = { rank = r, world_size = m.world_size, layout = layout_str(m.pipeline, m.world_size),
                 global_steps = m.engine.global_steps }
  local unchecked = {}
  for _, key in ipairs(RANK_KEYS) do
    if st[key] == nil and key ~= 'rank' then
      unchecked[#unchecked + 1] = key
    elseif st[key] ~= want[key] then
      f:close()
      fail("load_checkpoint: '%s' holds %s %s, the manifest expects %s for rank %d's file: the file is not this "
           .. "checkpoint's", name, key, shown(st[key]), shown(want[key]), r)
    end
  end
  if #unchecked > 0 and not warned_unchecked[path] then
    warned_unchecked[path] = true
    io.stderr:write(string.format("[dslua] warning: load_checkpoint: '%s' was saved before rank files recorded their "
                                  .. '%s: only their rank is checked\n', path, table.concat(unchecked, ', ')))
  end
  return f
end

-- Saved files, opened once each.
local function opener(path, m)
  local open = {}
  local function get(r)
    open[r] = open[r] or open_rank_file(path, m, r)
    return open[r]
  end
  local function close()
    for _, f in pairs(open) do f:close() end
  end
  return get, close
end

-- Elements [a, b) of the saved parameter sp's kind ('fp32', 'exp_avg'...)
-- into dst (1-D) from element at, from whichever shards hold them (shard
-- k in rank k's file, or a pipeline stage's k-th rank's).
local function read_range(get, m, sp, kind, a, b, dst, at)
  if b <= a then return end
  local s, W = sp.shard, sp.ranks and #sp.ranks or m.world_size
  local key = kind .. '/' .. sp.name
  for rs = math.floor(a / s), math.floor((b - 1) / s) do
    local f = get(sp.ranks and sp.ranks[rs + 1] or rs)
    local e = f:entry(key)
    local slo, shi = shard_range(sp.numel, rs, W)
    if not e then fail("load_checkpoint: '%s' has no tensor '%s'", f:path(), key) end
    if e.dtype ~= 'f32' or e.numel ~= shi - slo then
      fail("load_checkpoint: '%s': tensor '%s' is %s [%d], the manifest's layout needs f32 [%d]", f:path(), key,
           e.dtype, e.numel, shi - slo)
    end
    local lo, hi = math.max(a, slo), math.min(b, shi)
    f:read_into(key, lo - slo, hi - lo, dst, at + (lo - a))
  end
end

-- Whether a saved parameter belongs on this rank: any, or in a pipeline
-- those of this stage's layers.
local function on_this_stage(engine, name)
  local mod = engine.module
  if not mod.is_pipeline then return true end
  local index = tonumber(name:match('^layer_(%d+)%.'))
  local first, last = mod:stage_layers(mod.stage_id)
  return index ~= nil and index >= first and index <= last
end

-- The parameters of the checkpoint against the engine's: names and shapes.
local function match_params(engine, path, m, L, strict)
  local saved, missing, unexpected = {}, {}, {}
  for _, sp in ipairs(m.parameters) do saved[sp.name] = sp end
  for _, p in ipairs(L.params) do
    local sp = saved[p.name]
    if not sp then
      missing[#missing + 1] = p.name
    elseif shape_str(sp.shape) ~= shape_str(p.shape) then
      fail("load_checkpoint: '%s': parameter '%s' is %s in the checkpoint, %s in the model", path, p.name,
           shape_str(sp.shape), shape_str(p.shape))
    end
  end
  for _, sp in ipairs(m.parameters) do
    if not L.by_name[sp.name] and on_this_stage(engine, sp.name) then unexpected[#unexpected + 1] = sp.name end
  end
  if strict and (#missing > 0 or #unexpected > 0) then
    local lines = {}
    if #missing > 0 then lines[#lines + 1] = 'missing in the checkpoint: ' .. table.concat(missing, ', ') end
    if #unexpected > 0 then lines[#lines + 1] = 'not in the model: ' .. table.concat(unexpected, ', ') end
    fail("load_checkpoint: '%s': the parameters differ (%s); load with load_module_strict = false to load the "
         .. 'common ones', path, table.concat(lines, '; '))
  end
  return saved
end

-- The optimizer of the checkpoint against the engine's: kind and groups.
local function match_optimizer(path, m, L)
  local o = m.optimizer
  if o.type ~= L.optimizer.name then
    fail("load_checkpoint: '%s' holds %s state, this engine runs %s: load with load_optimizer_states = false", path,
         tostring(o.type), L.optimizer.name)
  end
  if #o.param_groups ~= #L.groups then
    fail("load_checkpoint: '%s' has %d param groups, this engine %d: load with load_optimizer_states = false", path,
         #o.param_groups, #L.groups)
  end
  for g, sg in ipairs(o.param_groups) do
    local mine = {}
    for _, p in ipairs(L.params) do
      if p.group == g then mine[#mine + 1] = p.name end
    end
    local same = table.concat(sg.params, '\n') == table.concat(mine, '\n')
    if L.pipeline then
      -- a stage's group holds its own layers' share of the saved group
      local saved = {}
      for _, name in ipairs(sg.params) do saved[name] = true end
      same = true
      for _, name in ipairs(mine) do same = same and saved[name] == true end
    end
    if not same then
      fail("load_checkpoint: '%s': param group %d holds other parameters than this engine's: load with "
           .. 'load_optimizer_states = false', path, g)
    end
  end
end

-- The fp32 weights and optimizer state this rank holds, read from the
-- saved shards, and the parameters made from them.
local function load_tensors(engine, L, path, m, saved, get, with_state)
  local h = L.mode ~= 'nvme' and L.optimizer._h or nil
  local sd = L.mode == 'nvme' and L.optimizer:state_dict() or nil
  local groups = m.optimizer.param_groups
  ds.no_grad(function()
    for g = 1, #L.groups do
      local fp32 = sd and sd.state[g].master
                   or (L.mode == 'flat' and L.optimizer:flat_params(g) or engine.zero.engine:master(g))
      local states, fresh = {}, {}
      if with_state then
        for k, v in pairs(groups[g].hyperparameters) do L.groups[g][k] = v end
        if h then h:reset_state(g, L.groups[g]) end
        for _, s in ipairs(groups[g].state) do
          if sd then
            sd.state[g][s] = sd.state[g][s] or ds.zeros({ fp32:numel() })
            states[s] = sd.state[g][s]
          elseif h:has_state(g, s) then
            states[s] = L.optimizer:flat_state(g, s)
          else
            states[s] = ds.zeros({ fp32:numel() })      -- handed over by load_state below
            fresh[s] = true
          end
        end
      end
      for i, p in ipairs(L.params) do
        local sp = saved[p.name]
        if p.group == g and sp then
          local piece = L.pieces[i]
          read_range(get, m, sp, 'fp32', piece.lo, piece.hi, fp32, piece.offset)
          for s, buf in pairs(states) do read_range(get, m, sp, s, piece.lo, piece.hi, buf, piece.offset) end
        end
      end
      if with_state and h then
        for s in pairs(fresh) do
          local off = 0
          for k, p in ipairs(L.groups[g].params) do
            h:load_state(g, k, s, states[s]:narrow(1, off + 1, p:numel()):view(p:size()))
            off = off + p:numel()
          end
        end
        h:steps(g, groups[g].step)
      end
      if sd and with_state then
        sd.state[g].step = groups[g].step
        sd.param_groups[g] = groups[g].hyperparameters
      end
    end
    if sd then
      L.optimizer:load_state_dict(sd)      -- into the streamed files
      local masters = {}
      for g = 1, #L.groups do masters[g] = sd.state[g].master end
      engine.zero.engine:refresh(masters)
    elseif L.mode == 'masters' then
      engine.zero.engine:sync_params()
    end
  end)
end

-- OneBitLamb's averaged trust ratios and fresh variance, which its
-- compressed steps need beside the Lamb's state: rank 0's file. Without
-- them (a checkpoint of a Lamb run) the first step past step 0 fails.
local function load_onebit(engine, L, m, get)
  if not onebit_lamb(engine, L) then return end
  local f = get(0)
  for g = 1, #L.groups do
    local k = 'onebit/' .. g .. '/'
    if f:entry(k .. 'fresh_v') and f:entry(k .. 'pieces') then
      engine.onebit:load_lamb_state(g, m.optimizer.param_groups[g].step, f:read(k .. 'fresh_v'), f:read(k .. 'pieces'))
    end
  end
end

-- Buffers and frozen parameters, whole: from rank 0's file (a pipeline
-- stage's first rank's).
local function load_module_tensors(engine, L, path, m, get, strict)
  local saved = {}
  for _, e in ipairs(m.module) do saved[e.name] = e end
  ds.no_grad(function()
    for _, e in ipairs(module_tensors(engine, L)) do
      local name, t = e[1], e[2]
      if saved[name] then
        local f = get(saved[name].rank or 0)
        local key = 'module/' .. name
        local got = f:entry(key)
        if not got then fail("load_checkpoint: '%s' has no tensor '%s'", f:path(), key) end
        if shape_str(got.shape) ~= shape_str(t:size()) then
          fail("load_checkpoint: '%s': tensor '%s' is %s, the model's is %s", f:path(), key, shape_str(got.shape),
               shape_str(t:size()))
        end
        t:copy_(f:read(key):view(t:size()))
      elseif strict then
        fail("load_checkpoint: '%s' has no '%s' (a buffer or frozen parameter of the model); load with "
             .. 'load_module_strict = false to keep the model\'s', path, name)
      end
    end
  end)
end

-- client_state back, its tensors read from rank 0's file.
local function join_client(v, get)
  if type(v) ~= 'table' then return v end
  if type(v.__tensor__) == 'string' then
    local f = get(0)
    local e = f:entry(v.__tensor__)
    if not e then fail("load_checkpoint: '%s' has no tensor '%s'", f:path(), v.__tensor__) end
    return f:read(v.__tensor__):view(#e.shape > 0 and e.shape or { 1 }):clone()
  end
  local out = {}
  for k, x in pairs(v) do out[k] = join_client(x, get) end
  return out
end

local function note(engine, fmt, ...)
  if engine.rank ~= 0 then return end
  require('dslua.io.progress').clear()
  io.stdout:write('[Rank 0] ', string.format(fmt, ...), '\n')
  io.stdout:flush()
end

-- The Lua files the saved run used, against this run's.
local function compare_code(engine, m)
  local saved = (m.code or {}).reload
  if engine.reload and saved then engine.reload:restore(saved) end
  local now = code_hashes(engine)
  for _, what in ipairs({ 'lr_scheduler', 'sampler' }) do
    local a, b = (m.code or {})[what], now[what]
    if a and b and a.sha256 ~= b.sha256 then
      note(engine, 'load_checkpoint: the %s file %s differs from the saved run\'s %s (SHA-256 %s, saved %s); '
           .. 'continuing with this code', what, tostring(b.path), tostring(a.path), tostring(b.sha256):sub(1, 12),
           tostring(a.sha256):sub(1, 12))
    end
  end
end

local function decode_rank_state(f)
  local ok, st = pcall(json.decode, f:metadata().dslua or '')
  if not ok or type(st) ~= 'table' then fail("load_checkpoint: '%s' has no dslua state in its metadata", f:path()) end
  return st
end

-- Saved rank r's list of the epoch's dataset indices: its sampler plan, an
-- order of its own (itself resumed on another world size), else DeepSpeed's
-- DistributedSampler of the saved world size (on one rank the loader's
-- own shuffle, the same order).
local function saved_list(f, st, m, r, n)
  if st.plan then return f:read('sampler/indices'):totable() end
  if st.loader.order then return f:read('loader/order'):totable() end
  if st.sampler then return {} end
  return require('samplers.distributed').new(n, { num_replicas = m.world_size, rank = r }):indices(st.loader.epoch)
end

-- The indices of the epoch no saved rank had read, each once, taken from
-- the ranks' lists in turn (DistributedSampler's order, from where it was).
local function unread(m, get, epoch, n)
  local lists, read, seen = {}, {}, {}
  for r = 0, m.world_size - 1 do
    local f = get(r)
    local st = decode_rank_state(f)
    local list, done = {}, 0
    if st.loader and st.loader.epoch == epoch then list, done = saved_list(f, st, m, r, n), st.loader.samples end
    for i = 1, math.min(done, #list) do seen[list[i]] = true end
    lists[#lists + 1], read[#lists + 1] = list, done
  end
  local rest, more, i = {}, true, 0
  while more do
    i, more = i + 1, false
    for k, list in ipairs(lists) do
      local v = list[read[k] + i]
      if v ~= nil then
        more = true
        if not seen[v] then seen[v], rest[#rest + 1] = true, v end
      end
    end
  end
  return rest
end

-- On another world size the epoch goes on with exactly the samples the
-- saved run had not read: the sampler plans them as a dataset of their
-- own, else this rank takes its DistributedSampler share of them (padded,
-- as PyTorch's, when the ranks do not divide them).
local function resume_unread(engine, m, get, pos)
  local l, sm = engine.training_dataloader, engine.sampler
  local n = sm and sm.dataset_len or ds.data.len(l.dataset)
  local rest = unread(m, get, pos.epoch, n)
  local steps
  if sm then
    sm:restore_plan(sm:plan_of(pos.epoch, rest))
    l:resume { epoch = pos.epoch, step = 0, samples = 0 }
    steps = sm:steps()
  else
    local P, mine = nranks(engine), rest
    if P > 1 then
      mine = {}
      local DS = require('samplers.distributed').new(#rest, { num_replicas = P, rank = engine.rank, shuffle = false })
      for i, k in ipairs(DS:indices(0)) do mine[i] = rest[k + 1] end
    end
    l:resume { epoch = pos.epoch, step = 0, samples = 0, order = mine }
    steps = math.ceil(#mine / l.batch_size)
  end
  note(engine, 'load_checkpoint: saved on %d ranks, loaded on %d: epoch %d goes on with the %d of its %d samples the '
       .. 'saved run had not read, %d steps here', m.world_size, nranks(engine), pos.epoch, #rest, n, steps)
end

-- This rank's state of the saved run: its own rank's, or rank 0's on a
-- new world size or pipeline layout.
local function restore_rank_state(engine, m, get)
  local same = layout_str(m.pipeline, m.world_size) == engine_layout_str(engine)
  local f = get(same and engine.rank or 0)
  local st = decode_rank_state(f)
  ds.set_rng_state(st.rng)
  local sm = engine.sampler
  if sm and st.sampler then sm:load_state_dict(st.sampler) end
  if sm and same and st.plan then
    local mb = st.plan.micro_batch or f:read('sampler/micro_batch'):totable()
    sm:restore_plan { epoch = st.plan.epoch, indices = f:read('sampler/indices'), micro_batch = mb, note = st.plan.note }
  end
  local l = engine.training_dataloader
  if not (l and st.loader and st.loader.epoch) then return end
  local pos = st.loader
  if same then
    local order = pos.order and f:read('loader/order'):totable() or nil
    return l:resume { epoch = pos.epoch, step = pos.step, samples = pos.samples, order = order }
  end
  if not m.pipeline then return resume_unread(engine, m, get, pos) end
  -- a pipeline's data ranks are not the saved files': the same fraction
  if sm then sm:set_epoch(pos.epoch) end
  local steps = sm and sm:steps() or #l
  local step = pos.steps > 0 and math.floor(pos.step / pos.steps * steps) or 0
  local samples = 0
  for j = 1, step do samples = samples + (sm and sm:batch_size(j) or l.batch_size) end
  note(engine, 'load_checkpoint: saved on %d ranks, loaded on %d: the data loader resumes epoch %d at step %d of '
       .. '%d (the saved run was at %d of %d on rank 0)', m.world_size, nranks(engine), pos.epoch, step, steps,
       pos.step, pos.steps)
  l:resume { epoch = pos.epoch, step = step, samples = samples }
end

-- engine:load_checkpoint(dir [, tag [, opts]]) -> path, client_state
function M.load(engine, dir, tag, opts)
  if type(dir) ~= 'string' or dir == '' then fail('load_checkpoint: load_dir must be a path, got %s', type(dir)) end
  local o = load_options(opts)
  if tag == nil then
    local text = read_text(dir .. '/latest', MAX_LATEST, 'load_checkpoint')
    if not text then
      note(engine, 'Unable to find latest file at %s/latest, if trying to load latest checkpoint please ensure this '
           .. 'file exists or pass an explicit checkpoint tag when loading a checkpoint.', dir)
      return nil, nil
    end
    tag = text:match('^%s*(.-)%s*$')
  end
  check_tag(tag, 'load_checkpoint')
  local path = dir .. '/' .. tag
  local P = nranks(engine)
  local m = everywhere(P, 'load_checkpoint', function() return M.read_manifest(path) end)
  local saved_layout, layout = layout_str(m.pipeline, m.world_size), engine_layout_str(engine)
  local L = engine_layout(engine)
  -- a pipeline's parameters are named by layer index: another number of
  -- stages or ranks reshards, another model (or none) cannot load
  if (m.pipeline == nil) ~= (L.pipeline == nil) or (m.pipeline and m.pipeline.layers ~= L.pipeline.layers) then
    fail("load_checkpoint: '%s' was saved from %s; this engine runs %s: its parameters are named otherwise", path,
         saved_layout, layout)
  end
  if o.verify then verify_files(engine, path, m) end
  local with_state = o.load_optimizer_states and not o.load_module_only
  local get, close = opener(path, m)
  local client
  everywhere(P, 'load_checkpoint', function()
    local saved = match_params(engine, path, m, L, o.load_module_strict)
    if with_state then match_optimizer(path, m, L) end
    load_tensors(engine, L, path, m, saved, get, with_state)
    if with_state then load_onebit(engine, L, m, get) end
    load_module_tensors(engine, L, path, m, get, o.load_module_strict)
    if not o.load_module_only then
      local e = m.engine
      engine.global_steps, engine.global_samples = e.global_steps, e.global_samples
      engine.skipped_steps, engine.epoch = e.skipped_steps, e.epoch
      -- saved at a boundary: as many accumulation windows, each of this
      -- run's length (another number of data-parallel ranks changes it)
      local gas = engine:gradient_accumulation_steps()
      local saved_gas = (m.config or {}).gradient_accumulation_steps or gas
      engine.micro_steps = math.floor(e.micro_steps / saved_gas) * gas
      engine.resumed_samples = e.global_samples
      engine.last_report = { busy = engine.busy_time, samples = e.global_samples }
      if o.load_lr_scheduler_states and engine.lr_scheduler and m.lr_scheduler then
        engine.lr_scheduler:load_state_dict(m.lr_scheduler)
      end
      if engine.scaler and m.loss_scaler then engine.scaler:load_state_dict(m.loss_scaler) end
      restore_rank_state(engine, m, get)
      compare_code(engine, m)
    end
    client = join_client(m.client_state, get)
  end)
  close()
  note(engine, 'loaded checkpoint %s (saved on %d ranks at ZeRO stage %d in %s; loaded on %d at stage %d in %s)%s',
       path, m.world_size, m.zero_stage, m.dtype, P, engine.zero and engine.zero.stage or 0,
       engine.zero and engine.zero.dtype or 'f32',
       L.pipeline and string.format(': saved as %s, loaded as %s', saved_layout, layout) or '')
  return path, client
end

---------------------------------------------------------------- whole models

-- ds.checkpoint.save_file(path, {name = tensor} or {{name, tensor}...} [,
-- metadata]) and load_file(path) -> {name = tensor}, metadata: one
-- safetensors file, as safetensors.torch's save_file and load_file.
function M.save_file(path, tensors, metadata)
  local entries = {}
  if tensors[1] ~= nil then
    entries = tensors
  else
    local names = {}
    for k in pairs(tensors) do names[#names + 1] = k end
    table.sort(names)
    for i, k in ipairs(names) do entries[i] = { k, tensors[k] } end
  end
  local meta = { format = 'pt' }
  for k, v in pairs(metadata or {}) do meta[k] = v end
  C.save(path, entries, meta)
  C.fsync_dir(path:match('^(.*)/[^/]*$') or '.')
end

function M.load_file(path)
  local f = C.open(path)
  local out = {}
  for _, e in ipairs(f:entries()) do
    local t = f:read(e.name)
    out[e.name] = #e.shape > 0 and t:view(e.shape) or t:view({}):clone()
  end
  local meta = f:metadata()
  f:close()
  return out, meta
end

-- Every parameter of a checkpoint whole, as f32 tensors by name, read in
-- this process; with states, each optimizer buffer too ({exp_avg = {name =
-- tensor}, ...}); module: the buffers and frozen parameters.
function M.read_full(dir, tag, with_states)
  if tag == nil then
    local text = read_text(dir .. '/latest', MAX_LATEST, 'zero_to_fp32')
    if not text then fail("zero_to_fp32: '%s/latest' is missing: pass the tag", dir) end
    tag = text:match('^%s*(.-)%s*$')
  end
  local path = dir .. '/' .. tag
  local m = M.read_manifest(path)
  local get, close = opener(path, m)
  local kinds = { 'fp32' }
  if with_states then
    local seen = {}
    for _, g in ipairs(m.optimizer.param_groups) do
      for _, s in ipairs(g.state) do
        if not seen[s] then seen[s] = true; kinds[#kinds + 1] = s end
      end
    end
  end
  local out, order = {}, {}
  for _, k in ipairs(kinds) do out[k] = {} end
  for i, sp in ipairs(m.parameters) do
    order[i] = sp.name
    for _, k in ipairs(kinds) do
      local held = k == 'fp32'
      for _, s in ipairs(m.optimizer.param_groups[sp.group].state) do held = held or s == k end
      if held then
        local t = ds.zeros({ sp.numel })
        read_range(get, m, sp, k, 0, sp.numel, t, 0)
        out[k][sp.name] = #sp.shape > 0 and t:view(sp.shape) or t:view({})
      end
    end
  end
  local module = {}
  for _, e in ipairs(m.module) do
    local t = get(e.rank or 0):read('module/' .. e.name)
    module[e.name] = #e.shape > 0 and t:view(e.shape) or t:view({})
  end
  close()
  return { fp32 = out.fp32, states = out, module = module, order = order, manifest = m, path = path }
end

-- DeepSpeed's zero_to_fp32: the fp32 model of a checkpoint (any world
-- size, stage, dtype) in one safetensors file, state_dict names (tied
-- weights under each of their names, nanoGPT's lm_head.weight too),
-- buffers in their dtype. dtype 'bf16' or 'f16' casts the weights.
function M.zero_to_fp32(dir, out_file, tag, dtype)
  local full = M.read_full(dir, tag, false)
  local entries = {}
  for _, name in ipairs(full.order) do entries[#entries + 1] = { name, full.fp32[name] } end
  for alias, name in pairs(full.manifest.aliases or {}) do entries[#entries + 1] = { alias, full.fp32[name] } end
  for name, t in pairs(full.module) do entries[#entries + 1] = { name, t } end
  table.sort(entries, function(a, b) return a[1] < b[1] end)
  if dtype and dtype ~= 'f32' then
    for _, e in ipairs(entries) do
      if e[2]:dtype() == 'f32' then e[2] = e[2]:to(dtype) end
    end
  end
  M.save_file(out_file, entries, { dslua_checkpoint = full.path })
  return out_file
end

-- A pipeline's entries on rank 0, in stage order: each stage's first rank
-- sends its own (the names and shapes first, in one all-gather).
local function gather_stages(engine, entries)
  local heads = {}
  for i, e in ipairs(entries) do heads[i] = { e[1], e[2]:dtype(), json.array(e[2]:size()) } end
  local lists = gather_strings(json.encode(json.array(heads)), nranks(engine))
  if engine.rank ~= 0 then
    for _, e in ipairs(entries) do ds.comm.send(e[2]:to(engine.device), 0) end
    return entries
  end
  local out = {}
  for r, text in ipairs(lists) do
    for i, h in ipairs(json.decode(text)) do
      out[#out + 1] = { h[1], r == 1 and entries[i][2]
                                or ds.comm.recv(ds.zeros(h[3], h[2]):to(engine.device), r - 1):to('cpu') }
    end
  end
  return out
end

-- The engine's whole model in one safetensors file (every rank calls;
-- rank 0 writes), state_dict names: the weights in the model's dtype
-- (DeepSpeed's save_16bit_model), or dtype = 'f32' for the fp32 masters
-- under bf16/fp16. Stage 3 gathers the parameters, which DeepSpeed allows
-- with stage3_gather_16bit_weights_on_model_save. A pipeline's layers come
-- from their stages, each once, under their checkpoint names
-- (layer_05.weight; models.gpt2.from_pipe_state_dict renames GPT-2's).
function M.save_model(engine, path, dtype)
  local z = engine.zero
  local pipe = engine.module.is_pipeline
  if z and z.stage == 3 and not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save then
    fail('save_16bit_model: zero_optimization.stage3_gather_16bit_weights_on_model_save is false: the stage 3 '
         .. 'weights stay partitioned (set it to gather them)')
  end
  local masters = {}
  if z and dtype == 'f32' then
    -- each parameter's fp32 master, whole: its shards from every rank
    local L = engine_layout(engine)
    local bufs = read_buffers(engine, L)
    for i, p in ipairs(L.params) do
      local piece = L.pieces[i]
      local s = z.parts > 1 and z.engine:shard(i) or p.numel
      local mine = ds.zeros({ s })
      if piece.hi > piece.lo then
        mine:narrow(1, 1, piece.hi - piece.lo):copy_(bufs[p.group].fp32:narrow(1, piece.offset + 1, piece.hi - piece.lo))
      end
      local whole = z.parts > 1 and ds.cat(ds.comm.all_gather(mine:to(engine.device), engine.module.dp_group)):to('cpu')
                    or mine
      masters[p.name] = whole:narrow(1, 1, p.numel):view(p.shape)
    end
  end
  if z and z.stage == 3 then z.engine:gather_all() end
  local entries = {}
  local ok, err = pcall(function()
    local names = {}
    for _, e in ipairs(named_parameters(engine)) do names[e[2]] = e[1] end
    for _, e in ipairs(state_entries(engine)) do
      -- a pipeline stage's first rank: the layers this stage owns
      if e[3] and not (pipe and engine.module.dp_rank > 0) then
        local t = masters[names[e[2]] or ''] or e[2]:detach():to('cpu'):clone()
        if dtype and t:dtype() ~= dtype and (t:dtype() == 'f32' or t:dtype() == 'bf16' or t:dtype() == 'f16') then
          t = t:to(dtype)
        end
        entries[#entries + 1] = { e[1], t }
      end
    end
  end)
  if z and z.stage == 3 then z.engine:release_all() end
  everywhere(nranks(engine), 'save_16bit_model', function() if not ok then error(err, 0) end end)
  if pipe then entries = gather_stages(engine, entries) end
  everywhere(nranks(engine), 'save_16bit_model', function()
    if engine.rank == 0 then
      C.mkdirs(path:match('^(.*)/[^/]*$') or '.')
      M.save_file(path, entries)
    end
  end)
  return true
end

return M
