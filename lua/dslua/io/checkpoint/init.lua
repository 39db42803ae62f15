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
--       onebit/<g>/fresh_v, onebit/<g>/pieces   OneBitLamb's own state
--                        of group g (the same on every data-parallel rank):
--                        each pipeline stage's and tensor rank's first data
--                        rank (manifest.onebit: "stage:tensor rank" -> rank)
--     and in its metadata ("dslua") the rank's own state: RNG, the data
--     loader's position, the sampler's epoch and policy state.
--   manifest.json   rank 0's: format, dslua version, config, ZeRO stage,
--     world size W, dtype, device, the shard layout (rank r holds elements
--     [r*s, min(n, (r+1)*s)) of a parameter of n elements, s = ceil(n / W),
--     whatever the stage), the optimizer's param groups and steps, the
--     engine's counters, LR scheduler, loss scaler, fp8 recipe, client_state,
--     the SHA-256 of the Lua schedule and sampler files, and the SHA-256 of
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
--
-- The files: common.lua (names, layout, the engine's state), save.lua,
-- manifest.lua (the manifest's checks, before anything loads), load.lua
-- (verify, reshard, restore); this one the verbs and whole-model files.
local ds = require 'dslua'
local json = require 'dslua.base.json'
local core = require 'dslua.core'
local C = core.ckpt
local common = require 'dslua.io.checkpoint.common'
local MAX_LATEST, fail, read_text, nranks = common.MAX_LATEST, common.fail, common.read_text, common.nranks
local named_parameters, state_entries = common.named_parameters, common.state_entries
local gather_strings, everywhere = common.gather_strings, common.everywhere
local engine_layout, read_buffers = common.engine_layout, common.read_buffers
local manifest = require 'dslua.io.checkpoint.manifest'
local load = require 'dslua.io.checkpoint.load'
local opener, read_param, saved_by_name = load.opener, load.read_param, load.saved_by_name

local M = {}

-- DeepSpeed's save_checkpoint / load_checkpoint (the engine's verbs call these)
M.save = require('dslua.io.checkpoint.save').save
M.load = load.load
M.read_manifest = manifest.read_manifest

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
  local _, saved = saved_by_name(m)
  for i, sp in ipairs(saved) do
    order[i] = sp.name
    local whole = { full = sp.full }      -- the pieces of a tensor-parallel save joined
    local n = 1
    for _, d in ipairs(sp.full) do n = n * d end
    for _, k in ipairs(kinds) do
      local held = k == 'fp32'
      for _, s in ipairs(m.optimizer.param_groups[sp.group].state) do held = held or s == k end
      if held then
        local t = ds.zeros({ n })
        read_param(get, m, sp, whole, k, 0, n, t, 0)
        out[k][sp.name] = #sp.full > 0 and t:view(sp.full) or t:view({})
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
-- (layer_05.weight; models.gpt2.from_pipe_state_dict renames GPT-2's). A
-- tensor-parallel model's pieces are joined whole, so the file loads into
-- the unsplit model.
function M.save_model(engine, path, dtype)
  local z = engine.steps.zero
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
      local s = z.parts > 1 and z:shard(i) or p.numel
      local mine = ds.zeros({ s })
      if piece.hi > piece.lo then
        mine:narrow(1, 1, piece.hi - piece.lo):copy_(bufs[p.group].fp32:narrow(1, piece.offset + 1, piece.hi - piece.lo))
      end
      local whole = z.parts > 1 and ds.cat(ds.comm.all_gather(mine:to(engine.device), engine.module.dp_group)):to('cpu')
                    or mine
      masters[p.name] = whole:narrow(1, 1, p.numel):view(p.shape)
    end
  end
  local split = {}
  if engine.module.tensor_group then
    for _, e in ipairs(ds.nn.parallel.params(engine.module)) do
      if e.axis then split[e.tensor] = e end
    end
  end
  local entries, pieces = {}, {}
  local function collect()
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
        pieces[#entries] = split[e[2]]
      end
    end
  end
  local ok, err
  if z then ok, err = z:with_gathered(collect) else ok, err = pcall(collect) end
  everywhere(nranks(engine), 'save_16bit_model', function() if not ok then error(err, 0) end end)
  for i = 1, #entries do     -- every rank of each tensor group, in the same order
    local s = pieces[i]
    if s then
      local all = ds.comm.all_gather(entries[i][2]:to(engine.device), s.group)
      entries[i][2] = ds.nn.parallel.join(all, s.axis, s.stride):to('cpu')
    end
  end
  if pipe then
    -- a stage's pieces are whole on each of its tensor ranks: tensor rank 0's go
    if (engine.module.tensor_rank or 0) > 0 then entries = {} end
    entries = gather_stages(engine, entries)
  end
  everywhere(nranks(engine), 'save_16bit_model', function()
    if engine.rank == 0 then
      C.mkdirs(path:match('^(.*)/[^/]*$') or '.')
      M.save_file(path, entries)
    end
  end)
  return true
end

return M
