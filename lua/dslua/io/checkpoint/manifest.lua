-- A checkpoint's manifest.json read and checked before anything loads:
-- every key a load trusts (counts, shapes, ranges, file names) has the
-- kind and bounds the rest of the load assumes; and the load options.
local json = require 'dslua.base.json'
local core = require 'dslua.core'
local C = core.ckpt
local common = require 'dslua.io.checkpoint.common'
local FORMAT, FORMAT_VERSION, MANIFEST = common.FORMAT, common.FORMAT_VERSION, common.MANIFEST
local MAX_MANIFEST, SHOWN, fail, read_text = common.MAX_MANIFEST, common.SHOWN, common.fail, common.read_text
local excerpt, ceil_div, shape_str = common.excerpt, common.ceil_div, common.shape_str

local M = {}

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

-- A tensor-parallel piece's split and whole shape: the piece is its
-- rank's cut of the whole along the axis, and a name's pieces are one of
-- each rank of the same split (a whole parameter is listed once).
local function check_pieces(file, m)
  local function corrupt(key, what) fail("load_checkpoint: '%s': %s %s: the manifest is corrupt", file, key, what) end
  local first = {}
  for k, sp in ipairs(m.parameters) do
    local key, tp = string.format('parameters[%d]', k), sp.tp
    local prev = first[sp.name]
    if tp == nil then
      if prev then corrupt(key, string.format('lists %s a second time', excerpt(sp.name))) end
    else
      if type(tp) ~= 'table' or type(sp.full) ~= 'table' or #sp.full ~= #sp.shape then
        corrupt(key, 'has a split without the whole shape')
      end
      check_int(file, key .. '.tp.size', tp.size, 1)
      check_int(file, key .. '.tp.rank', tp.rank, 0)
      check_int(file, key .. '.tp.stride', tp.stride, 1)
      check_int(file, key .. '.tp.axis', tp.axis, 1)
      if tp.rank >= tp.size or tp.axis > #sp.shape or sp.shape[tp.axis] % tp.stride ~= 0 then
        corrupt(key .. '.tp', string.format('(axis %d, stride %d, rank %d of %d) does not fit shape %s', tp.axis,
                                            tp.stride, tp.rank, tp.size, shape_str(sp.shape)))
      end
      for d, n in ipairs(sp.full) do
        if n ~= sp.shape[d] * (d == tp.axis and tp.size or 1) then
          corrupt(key .. '.full', string.format('%s is not %d pieces of %s on axis %d', shape_str(sp.full), tp.size,
                                                shape_str(sp.shape), tp.axis))
        end
      end
      if prev and (prev.tp == nil or prev.tp.axis ~= tp.axis or prev.tp.stride ~= tp.stride or prev.tp.size ~= tp.size
                   or shape_str(prev.full) ~= shape_str(sp.full) or prev.ranks[tp.rank]) then
        corrupt(key, string.format('does not match the other pieces of %s', excerpt(sp.name)))
      end
    end
    prev = prev or { tp = tp, full = sp.full, ranks = {}, n = 0 }
    prev.ranks[tp and tp.rank or 0], prev.n = true, prev.n + 1
    first[sp.name] = prev
  end
  for name, e in pairs(first) do
    if e.tp and e.n ~= e.tp.size then
      fail("load_checkpoint: '%s': %s has %d of its %d tensor-parallel pieces: the manifest is corrupt", file,
           excerpt(name), e.n, e.tp.size)
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
  check_pieces(file, m)
  return m
end

M.load_options = load_options

return M
