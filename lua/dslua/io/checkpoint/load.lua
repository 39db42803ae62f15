-- Loading a checkpoint (ds.checkpoint.load, engine:load_checkpoint): the
-- files verified, each rank's element ranges read from whichever saved
-- shards cover them (another world size, stage, dtype or pipeline split
-- reshards), then the engine's counters, RNG and loader position.
local ds = require 'dslua'
local json = require 'dslua.base.json'
local core = require 'dslua.core'
local C = core.ckpt
local common = require 'dslua.io.checkpoint.common'
local MAX_LATEST, fail, read_text, excerpt = common.MAX_LATEST, common.fail, common.read_text, common.excerpt
local nranks, layout_str, engine_layout_str = common.nranks, common.layout_str, common.engine_layout_str
local shard_range, shape_str, everywhere = common.shard_range, common.shape_str, common.everywhere
local engine_layout, onebit_lamb = common.engine_layout, common.onebit_lamb
local module_tensors, code_hashes = common.module_tensors, common.code_hashes
local save = require 'dslua.io.checkpoint.save'
local check_tag = save.check_tag
local manifest = require 'dslua.io.checkpoint.manifest'
local load_options = manifest.load_options

local M = {}

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

-- The saved parameters by name, in the manifest's order: {name, full
-- (the whole shape), tp (the split of its pieces; nil: saved whole),
-- group, pieces = {[tensor rank] = manifest entry}}.
local function saved_by_name(m)
  local by, order = {}, {}
  for _, sp in ipairs(m.parameters) do
    local s = by[sp.name]
    if not s then
      s = { name = sp.name, full = sp.tp and sp.full or sp.shape, tp = sp.tp, group = sp.group, pieces = {} }
      by[sp.name], order[#order + 1] = s, s
    end
    s.pieces[sp.tp and sp.tp.rank or 0] = sp
  end
  return by, order
end

-- Elements [a, b) of kind ('fp32', 'exp_avg'...) of p, this rank's piece
-- of a parameter (p.tp: its split, nil: whole; p.full: the whole shape),
-- into dst (1-D) from element at, from the saved pieces of s however the
-- tensor degree cut them. Along the split axis the whole tensor is
-- [outer, stride, rows, inner] and a piece holds its cut of the rows of
-- each stride block: runs of whole inner rows are contiguous in both.
local function read_param(get, m, s, p, kind, a, b, dst, at)
  local mine, theirs = p.tp, s.tp
  if not mine and not theirs then return read_range(get, m, s.pieces[0], kind, a, b, dst, at) end
  local how = mine or theirs
  if mine and theirs and (mine.axis ~= theirs.axis or mine.stride ~= theirs.stride) then
    fail("load_checkpoint: parameter '%s' is split on axis %d (stride %d) in the checkpoint, on axis %d (stride %d) "
         .. 'in the model', s.name, theirs.axis, theirs.stride, mine.axis, mine.stride)
  end
  local F = s.full
  local outer, inner = how.stride, 1
  for d = 1, how.axis - 1 do outer = outer * F[d] end
  for d = how.axis + 1, #F do inner = inner * F[d] end
  local rows = F[how.axis] / how.stride
  local here, there = rows / (mine and mine.size or 1), rows / (theirs and theirs.size or 1)
  local first = (mine and mine.rank or 0) * here
  local k = a
  while k < b do
    local o = math.floor(k / (here * inner))
    local r = math.floor((k - o * here * inner) / inner)
    local i = k - (o * here + r) * inner
    local t = math.floor((first + r) / there)
    local rt = first + r - t * there
    local n = math.min(b - k, math.min(here - r, there - rt) * inner - i)
    local from = (o * there + rt) * inner + i
    read_range(get, m, s.pieces[t], kind, from, from + n, dst, at + (k - a))
    k = k + n
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

-- The parameters of the checkpoint against the engine's: names and whole
-- shapes (any tensor degree on either side).
local function match_params(engine, path, m, L, strict)
  local saved, order = saved_by_name(m)
  local missing, unexpected = {}, {}
  for _, p in ipairs(L.params) do
    local sp = saved[p.name]
    if not sp then
      missing[#missing + 1] = p.name
    elseif shape_str(sp.full) ~= shape_str(p.full) then
      fail("load_checkpoint: '%s': parameter '%s' is %s in the checkpoint, %s in the model", path, p.name,
           shape_str(sp.full), shape_str(p.full))
    end
  end
  for _, sp in ipairs(order) do
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
  local h = L.mode ~= 'streamed' and L.optimizer._h or nil
  local sd = L.mode == 'streamed' and L.optimizer:state_dict() or nil
  local groups = m.optimizer.param_groups
  ds.no_grad(function()
    for g = 1, #L.groups do
      local fp32 = sd and sd.state[g].master
                   or engine.steps:master(g)
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
          read_param(get, m, sp, p, 'fp32', piece.lo, piece.hi, fp32, piece.offset)
          for s, buf in pairs(states) do read_param(get, m, sp, p, s, piece.lo, piece.hi, buf, piece.offset) end
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
      engine.steps:masters_loaded(masters)
    else
      engine.steps:masters_loaded()
    end
  end)
end

-- OneBitLamb's averaged trust ratios and fresh variance, which its
-- compressed steps need beside the Lamb's state: the file of the rank that
-- saved this rank's place in the split (manifest.onebit; rank 0 before
-- that was kept), on the same pipeline stages. Without them (a checkpoint
-- of a Lamb run, another split) the first step past step 0 fails.
local function load_onebit(engine, L, m, get)
  if not onebit_lamb(engine, L) then return end
  local p, q = m.pipeline, L.pipeline
  if p and (p.stages ~= q.stages or table.concat(p.firsts, ',') ~= table.concat(q.firsts, ',')) then return end
  local r = (m.onebit or { ['0:0'] = 0 })[common.split_position(engine, L)]
  if not r then return end
  local f = get(r)
  for g = 1, #L.groups do
    local k = 'onebit/' .. g .. '/'
    if f:entry(k .. 'fresh_v') and f:entry(k .. 'pieces') then
      engine.steps.onebit:load_lamb_state(g, m.optimizer.param_groups[g].step, f:read(k .. 'fresh_v'), f:read(k .. 'pieces'))
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

-- The manifest's fp8 state as this rank's recipe names its layers: a
-- pipeline stage's own layers (the others are other stages'), every layer
-- otherwise.
local function fp8_state(engine, saved)
  if not engine.module.is_pipeline then return saved end
  local layers = {}
  for name, mine in pairs(common.fp8_names(engine)) do layers[mine] = saved.layers[name] end
  return { recipe = saved.recipe, format = saved.format, layers = layers }
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

-- A rank file's saved plan ({epoch, indices, micro_batch, note}), its
-- faults named with the file.
local function saved_plan(f, st)
  local ok, plan = pcall(require('samplers.policy').saved_plan_of, st.plan, function(name) return f:read(name) end)
  if not ok then
    fail("load_checkpoint: '%s': its sampler plan: %s", f:path(), (tostring(plan):gsub('^[^\n]-:%d+: ', '')))
  end
  return plan
end

-- The order a rank file describes (d: ds.data.order's options and n), its
-- faults named with the file.
local function order_of(f, d)
  local ok, o = pcall(ds.data.order, d.n, d)
  if not ok then fail("load_checkpoint: '%s': its order: %s", f:path(), (tostring(o):gsub('^[^\n]-:%d+: ', ''))) end
  return o
end

-- Saved rank r's order of the epoch as ds.data.order takes it, or nil where
-- it was kept as a list: its sampler plan, an order of its own (itself
-- resumed on another world size), else DeepSpeed's DistributedSampler of
-- the saved world size (on one rank the loader's own shuffle, the same
-- order).
local function saved_order(st, m, r, n)
  if st.plan then return st.plan.order end
  if st.loader.order then return type(st.loader.order) == 'table' and st.loader.order or nil end
  if st.sampler then return nil end
  local DS = require('samplers.distributed').new(n, { num_replicas = m.world_size, rank = r })
  return DS:order(st.loader.epoch):describe()
end

-- Saved rank r's list of the epoch's dataset indices.
local function saved_list(f, st, m, r, n)
  if st.plan then return saved_plan(f, st).indices:totable() end
  local d = saved_order(st, m, r, n)
  if d then return order_of(f, d):totable() end
  if st.loader.order then return f:read('loader/order'):totable() end
  return {}
end

-- The rest of the epoch as an order (samplers.policy's unread: nothing
-- per sample) when every saved rank's order of it is kept as one, else nil.
local function unread_order(m, get, epoch, n)
  local saved = {}
  for r = 0, m.world_size - 1 do
    local f = get(r)
    local st = decode_rank_state(f)
    local pos = st.loader
    if not (pos and pos.epoch == epoch) or (st.plan and st.plan.epoch ~= epoch) then return nil end
    local d = saved_order(st, m, r, n)
    if not d then return nil end
    saved[#saved + 1] = { order = order_of(f, d):describe(), samples = pos.samples }
  end
  return require('samplers.policy').unread(saved)
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
  local rest = unread_order(m, get, pos.epoch, n) or unread(m, get, pos.epoch, n)
  local steps
  if sm then
    sm:restore_plan(sm:plan_of(pos.epoch, rest))
    l:resume { epoch = pos.epoch, step = 0, samples = 0 }
    steps = sm:steps()
  else
    local P = nranks(engine)
    local DS = require('samplers.distributed').new(#rest, { num_replicas = P, rank = engine.rank, shuffle = false })
    local mine = require('samplers.policy').over(rest, DS:order(0))
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
  if sm and same and st.plan then sm:restore_plan(saved_plan(f, st)) end
  local l = engine.training_dataloader
  if not (l and st.loader and st.loader.epoch) then return end
  local pos = st.loader
  if same then
    local order = pos.order
    if type(order) == 'table' then
      order = order_of(f, order)
    elseif order then
      order = f:read('loader/order'):totable()
    end
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
  local m = everywhere(P, 'load_checkpoint', function() return manifest.read_manifest(path) end)
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
      engine:restore_counters(m.engine, (m.config or {}).gradient_accumulation_steps)
      if o.load_lr_scheduler_states and engine.lr_scheduler and m.lr_scheduler then
        engine.lr_scheduler:load_state_dict(m.lr_scheduler)
      end
      if engine.scaler and m.loss_scaler then engine.scaler:load_state_dict(m.loss_scaler) end
      if engine.fp8 and m.fp8 then engine.fp8:load_state_dict(fp8_state(engine, m.fp8)) end
      restore_rank_state(engine, m, get)
      compare_code(engine, m)
    end
    client = join_client(m.client_state, get)
  end)
  close()
  note(engine, 'loaded checkpoint %s (saved on %d ranks at ZeRO stage %d in %s; loaded on %d at stage %d in %s)%s',
       path, m.world_size, m.zero_stage, m.dtype, P, engine.steps.stage,
       engine.steps.dtype,
       L.pipeline and string.format(': saved as %s, loaded as %s', saved_layout, layout) or '')
  return path, client
end

M.opener = opener
M.read_param = read_param
M.saved_by_name = saved_by_name

return M
