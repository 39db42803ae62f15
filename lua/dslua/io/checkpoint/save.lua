-- Saving a checkpoint (ds.checkpoint.save, engine:save_checkpoint): every
-- rank's file, then rank 0's manifest and the atomic renames (init.lua
-- says how a save survives a kill).
local ds = require 'dslua'
local json = require 'dslua.base.json'
local core = require 'dslua.core'
local C = core.ckpt
local common = require 'dslua.io.checkpoint.common'
local FORMAT, FORMAT_VERSION, MANIFEST = common.FORMAT, common.FORMAT_VERSION, common.MANIFEST
local fail, excerpt, nranks = common.fail, common.excerpt, common.nranks
local named_parameters, state_entries = common.named_parameters, common.state_entries
local engine_layout_str, file_name, ceil_div = common.engine_layout_str, common.file_name, common.ceil_div
local shard_range, jsonable, gather_strings = common.shard_range, common.jsonable, common.gather_strings
local everywhere, kill_point, maybe_kill = common.everywhere, common.kill_point, common.maybe_kill
local engine_layout, onebit_lamb, read_buffers = common.engine_layout, common.onebit_lamb, common.read_buffers
local hyperparams, module_tensors, code_hashes = common.hyperparams, common.module_tensors, common.code_hashes
local split_client = common.split_client

local M = {}

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

-- This rank's own state, and its sampler's plan of the current epoch
-- (sampler:saved_plan: an order's description, else tensors).
local function rank_state(engine, tensors)
  local l = engine.training_dataloader
  -- which rank, layout and step the file holds, checked at load against
  -- the manifest: a file swapped in from another rank or run is refused
  local st = { rank = engine.rank, world_size = nranks(engine), layout = engine_layout_str(engine),
               global_steps = engine.global_steps, rng = ds.get_rng_state() }
  if l and l.position then
    local pos = l.position
    st.loader = { epoch = pos.epoch, step = pos.step, samples = pos.samples,
                  steps = engine.sampler and engine.sampler:steps() or #l }
    -- an epoch resumed on another world size reads its own order (the
    -- rest): an order's description, or a list as a tensor
    if ds.data.is_order(pos.order) then
      st.loader.order = pos.order:describe()
    elseif pos.order then
      st.loader.order = true
      tensors[#tensors + 1] = { 'loader/order', ds.tensor(pos.order, 'i64') }
    end
  end
  local sm = engine.sampler
  if sm then
    st.sampler = jsonable(sm:state_dict())
    local rec, plan_tensors = sm:saved_plan()
    st.plan = rec
    for _, e in ipairs(plan_tensors or {}) do tensors[#tensors + 1] = e end
  end
  return st
end

-- The parameters whose shards this rank's file starts (shard 0, so each
-- once), as the manifest lists them: with the ranks whose files hold their
-- shards (the data group's: a pipeline stage's, a tensor rank's), a
-- tensor-parallel piece with its split and the whole shape.
local function saved_params(L)
  local out = {}
  if L.part ~= 0 then return json.array(out) end
  for _, p in ipairs(L.params) do
    if p.owned then
      out[#out + 1] = { name = p.name, shape = json.array(p.shape), numel = p.numel, group = p.group,
                        shard = ceil_div(p.numel, L.parts), ranks = L.ranks and json.array(L.ranks),
                        tp = p.tp, full = p.tp and json.array(p.full) or nil }
    end
  end
  return json.array(out)
end

-- The fp8 recipe's state over every rank's layers (under common.fp8_names),
-- from the reports: a pipeline stage registers only its own layers (a
-- replica's are the same, the first rank's kept).
local function fp8_state(reports)
  local out
  for _, rep in ipairs(reports) do
    if rep.fp8 then
      out = out or { recipe = rep.fp8.recipe, format = rep.fp8.format, layers = {} }
      for name, s in pairs(rep.fp8.layers) do out.layers[name] = out.layers[name] or s end
    end
  end
  return out
end

-- The manifest rank 0 writes (see the top of this file), from every rank's
-- report: its parameters, module tensors and fp8 layers.
local function build_manifest(engine, L, steps, tag, files, reports, client)
  local z = engine.steps.zero
  local params, module = {}, {}
  for _, rep in ipairs(reports) do
    for _, p in ipairs(rep.params) do params[#params + 1] = p end
    for _, e in ipairs(rep.module) do module[#module + 1] = e end
  end
  local onebit
  for k, rep in ipairs(reports) do
    if rep.onebit then
      onebit = onebit or {}
      onebit[rep.onebit] = k - 1
    end
  end
  local groups = {}
  for g, group in ipairs(L.groups) do
    local names, seen = {}, {}
    for _, p in ipairs(params) do      -- a tensor-parallel parameter once, not once a piece
      if p.group == g and not seen[p.name] then names[#names + 1], seen[p.name] = p.name, true end
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
    device = engine.device, parameters = params, module = json.array(module), aliases = aliases, onebit = onebit,
    pipeline = L.pipeline,
    optimizer = { type = L.optimizer.name, param_groups = groups },
    engine = engine:counters(),
    lr_scheduler = engine.lr_scheduler and jsonable(engine.lr_scheduler:state_dict()) or nil,
    loss_scaler = engine.scaler and jsonable(engine.scaler:state_dict()) or nil,
    fp8 = fp8_state(reports),
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
  if L.part == 0 and L.tensor_rank == 0 then
    for _, e in ipairs(module_tensors(engine, L)) do
      if e[3] then
        extra[#extra + 1] = { 'module/' .. e[1], e[2] }
        module[#module + 1] = { name = e[1], dtype = e[2]:dtype(), shape = json.array(e[2]:size()), rank = r }
      end
    end
  end
  -- OneBitLamb's own state: the first data-parallel rank of each stage and tensor rank
  local onebit = L.part == 0 and onebit_lamb(engine, L) and common.split_position(engine, L) or nil
  if onebit then
    for g = 1, #L.groups do
      local fresh_v, pieces = engine.steps.onebit:lamb_state(g)
      extra[#extra + 1] = { 'onebit/' .. g .. '/fresh_v', fresh_v }
      extra[#extra + 1] = { 'onebit/' .. g .. '/pieces', pieces }
    end
  end
  if r == 0 and client_state ~= nil then client = split_client(client_state, '', extra, {}) end
  local report = everywhere(W, 'save_checkpoint', function()
    local state = rank_state(engine, extra)
    local rep = write_rank_file(engine, L, bufs, partial .. '/' .. file_name(r), extra, state)
    rep.params, rep.module, rep.onebit = saved_params(L), json.array(module), onebit
    if engine.fp8 then
      local st = jsonable(engine.fp8:state_dict())
      local layers = {}
      for name, mine in pairs(common.fp8_names(engine)) do layers[name] = st.layers[mine] end
      st.layers, rep.fp8 = layers, st
    end
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
      local m = build_manifest(engine, L, steps, tag, files, reps, client)
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

M.check_tag = check_tag

return M
