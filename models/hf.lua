-- Hugging Face's model folder, read and written for models/llama.lua and
-- models/gpt2.lua: config.json next to either one model.safetensors or
-- shards model-00001-of-0000N.safetensors listed by
-- model.safetensors.index.json ({"metadata": {"total_size": bytes},
-- "weight_map": {name: file}}), as transformers' save_pretrained writes
-- them and from_pretrained reads them.
local json = require 'dslua.base.json'
local file_io = require 'dslua.base.file'
local core = require 'dslua.core'
local checkpoint = require 'dslua.io.checkpoint'
local ds = require 'dslua'
local zinit = require 'dslua.engine.zinit'

local M = {}

local SINGLE, INDEX, CONFIG = 'model.safetensors', 'model.safetensors.index.json', 'config.json'
M.MAX_SHARD_BYTES = 5 * 1024 ^ 3      -- save_pretrained's default max_shard_size, "5GB"

local TORCH_DTYPE = { f32 = 'float32', bf16 = 'bfloat16', f16 = 'float16' }
local BYTES = { f32 = 4, bf16 = 2, f16 = 2 }

local function fail(fmt, ...) error(string.format(fmt, ...), 0) end

local function read_json(path, who, text)
  local why
  if not text then text, why = file_io.text(path) end
  if not text then fail("%s: cannot read '%s': %s", who, path, why) end
  local ok, v = pcall(json.decode, text, path)
  if not ok or type(v) ~= 'table' then fail("%s: '%s' is not a JSON object: %s", who, path, tostring(v)) end
  return v
end

---------------------------------------------------------------- entries read later

-- Inside ds.zero.Init a model is built partitioned and each rank reads
-- only its shard's range of each tensor: load gives entries that say
-- where a tensor is, with the few methods from_hf uses on the tensors
-- (size, dim, transpose, contiguous), and load_state_dict reads them.
local Entry = {}
Entry.__index = Entry

local function entry(path, name, shape, dtype)
  return setmetatable({ path = path, name = name, shape = shape, file_dtype = dtype, transposed = false }, Entry)
end

-- the shape as the model sees it
function Entry:size(d)
  local s = self.shape
  if self.transposed then s = { s[2], s[1] } end
  if d then return s[d] end
  return s
end

function Entry:dim() return #self.shape end
function Entry:dtype() return self.file_dtype end
function Entry:contiguous() return self end

-- the [in, out] Conv1D weights of GPT-2 files, read as [out, in]
function Entry:transpose(a, b)
  if #self.shape ~= 2 or a + b ~= 3 then error('hf: only a matrix entry transposes (dims 1 and 2)', 2) end
  local t = setmetatable({}, Entry)
  for k, v in pairs(self) do t[k] = v end
  t.transposed = not self.transposed
  return t
end

-- Elements [lo, lo + n) of the entry as the model sees it, flat, into
-- dst's first n elements (converted to dst's dtype): a plain range is one
-- read; a transposed one reads the out-columns it spans, row by row of
-- the file, and transposes that block.
function Entry:read_range(f, lo, n, dst)
  if n == 0 then return end
  if not self.transposed then return f:read_into(self.name, lo, n, dst, 0) end
  local rows, cols = self.shape[1], self.shape[2]     -- the file's [in, out]; the model's element k is
  local c0 = math.floor(lo / rows)                     -- (out k // in, in k % in)
  local w = math.floor((lo + n - 1) / rows) - c0 + 1
  local block = ds.zeros({ rows, w }, dst:dtype())
  for i = 0, rows - 1 do f:read_into(self.name, i * cols + c0, w, block, i * w) end
  local flat = block:transpose(1, 2):contiguous():reshape({ rows * w })
  ds.no_grad(function() dst:narrow(1, 1, n):copy_(flat:narrow(1, lo - c0 * rows + 1, n)) end)
end

-- The whole entry as a tensor of the model's shape.
function Entry:read(f)
  local t = f:read(self.name)
  t = #self.shape > 0 and t:view(self.shape) or t:view({}):clone()
  return self.transposed and t:transpose(1, 2):contiguous() or t
end

-- Every tensor of the files named, each file opened once: {name = tensor},
-- or {name = entry} when lazy. by_file: {file = {names...}}, or {file =
-- true} for all of a file's.
local function read_files(dir, by_file, who, lazy)
  local out = {}
  for name, wanted in pairs(by_file) do
    local path = dir and dir .. '/' .. name or name
    local ok, f = pcall(core.ckpt.open, path)
    if not ok then fail("%s: cannot read '%s': %s", who, path, file_io.reason(f, path)) end
    local shapes, dtypes = {}, {}
    for _, e in ipairs(f:entries()) do shapes[e.name], dtypes[e.name] = e.shape, e.dtype end
    local names = wanted
    if wanted == true then
      names = {}
      for k in pairs(shapes) do names[#names + 1] = k end
    end
    for _, k in ipairs(names) do
      if not shapes[k] then
        f:close()
        fail("%s: '%s' has no tensor '%s' (the index maps it there)", who, path, k)
      end
      out[k] = entry(path, k, shapes[k], dtypes[k])
      if not lazy then out[k] = out[k]:read(f) end
    end
    f:close()
  end
  return out
end

-- load(path, who) -> config (nil for a bare file), {name = tensor}: path a
-- folder (config.json, then the index or the single file) or one
-- .safetensors file. Inside ds.zero.Init the values are entries, read by
-- M.load_state_dict.
function M.load(path, who)
  local lazy = zinit.active()
  if path:match('%.safetensors$') then return nil, read_files(nil, { [path] = true }, who, lazy) end
  local config = read_json(path .. '/' .. CONFIG, who)
  local index_path = path .. '/' .. INDEX
  local text = file_io.read(index_path)
  if not text then return config, read_files(path, { [SINGLE] = true }, who, lazy) end
  local index = read_json(index_path, who, text)
  if type(index.weight_map) ~= 'table' then fail("%s: '%s' has no weight_map", who, index_path) end
  local by_file = {}
  for name, file in pairs(index.weight_map) do
    if type(file) ~= 'string' or file:find('/', 1, true) or file == '..' or file == '.' then
      fail("%s: '%s': weight_map's '%s' names '%s', not a file of this folder", who, index_path, name, tostring(file))
    end
    by_file[file] = by_file[file] or {}
    table.insert(by_file[file], name)
  end
  return config, read_files(path, by_file, who, lazy)
end

-- from_hf's overrides without its own key: partitioned = true asks for
-- the load into shards, which only ds.zero.Init's scope gives.
function M.overrides(overrides, who)
  local out = {}
  for k, v in pairs(overrides or {}) do out[k] = v end
  if out.partitioned and not zinit.active() then
    fail('%s: partitioned = true loads into the shards of a model built inside ds.zero.Init(config, function() '
         .. '... end): call it there', who)
  end
  if zinit.active() and out.padded_vocab_size then
    fail('%s: padded_vocab_size pads the embedding after reading it whole: not with ds.zero.Init', who)
  end
  if zinit.active() and (out.tp or out.topology) then
    fail('%s: tp splits the weights after reading them whole: not with ds.zero.Init', who)
  end
  out.partitioned = nil
  return out
end

-- model:load_state_dict(sd), or for sd of entries (M.load inside
-- ds.zero.Init) each parameter built partitioned gets its shard's range of
-- the files and every other tensor is read whole; the names and shapes
-- checked first, as load_state_dict checks them.
function M.load_state_dict(model, sd, who)
  if not zinit.active() then return model:load_state_dict(sd) end
  local shards = {}
  for _, e in ipairs(zinit.shards_of(model)) do shards[e[1]] = e[2] end
  local entries, expected, problems = model:state_entries(), {}, {}
  for _, e in ipairs(entries) do
    local name, t = e[1], e[2]
    expected[name] = true
    local v = sd[name]
    if v == nil then
      problems[#problems + 1] = 'missing ' .. name
    elseif table.concat(v:size(), 'x') ~= table.concat(t:size(), 'x') then
      problems[#problems + 1] = string.format('%s is [%s] in the files, [%s] in the model', name,
                                              table.concat(v:size(), 'x'), table.concat(t:size(), 'x'))
    end
  end
  for k in pairs(sd) do
    if not expected[k] then problems[#problems + 1] = 'unexpected ' .. k end
  end
  if #problems > 0 then fail('%s: the files do not fit the model: %s', who, table.concat(problems, '; ')) end
  local files = {}
  local function file(path)
    if not files[path] then files[path] = core.ckpt.open(path) end
    return files[path]
  end
  local ok, err = pcall(ds.no_grad, function()
    for _, e in ipairs(entries) do
      local src, rec = sd[e[1]], shards[e[1]]
      -- released without a shard of its own: tied to a parameter that has one
      if rec then src:read_range(file(src.path), rec.lo, rec.len, rec.shard)
      elseif not core._zero.is_released(e[2]) then e[2]:copy_(src:read(file(src.path))) end
    end
  end)
  for _, f in pairs(files) do f:close() end
  if not ok then fail('%s: %s', who, tostring(err)) end
end

-- config[key] checked against the values dslua builds (nil or absent
-- always allowed): refuses a setting the model would silently ignore.
function M.require_values(config, rules, who)
  for key, allowed in pairs(rules) do
    local v = config[key]
    if v ~= nil and v ~= json.null then
      local ok = false
      for _, a in ipairs(allowed) do ok = ok or v == a end
      if not ok then fail("%s: config.json's %s = %s is not supported", who, key, json.encode(v)) end
    end
  end
end

-- The model's architecture from config.json's model_type, refused by name
-- when it is not the one expected.
function M.check_type(config, model_type, who)
  if config.model_type ~= model_type then
    fail("%s: config.json's model_type is '%s', expected '%s'", who, tostring(config.model_type), model_type)
  end
end

-- Shards of at most max_bytes of dtype (a tensor larger than that alone in
-- its own), in the order of entries; and the bytes of all.
local function split(entries, dtype, max_bytes)
  local shards, size, total = { {} }, 0, 0
  for _, e in ipairs(entries) do
    local n = e[2]:numel() * BYTES[dtype]
    if size > 0 and size + n > max_bytes then shards[#shards + 1], size = {}, 0 end
    table.insert(shards[#shards], e)
    size, total = size + n, total + n
  end
  return shards, total
end

-- A shard's tensors as written: dtype, on the host, contiguous (one shard
-- converted at a time, so a save holds at most one shard's copy).
local function converted(shard, dtype)
  local out = {}
  for i, e in ipairs(shard) do out[i] = { e[1], e[2]:detach():to(dtype):to('cpu'):contiguous() } end
  return out
end

-- save(dir, config, entries {{name, tensor}...}, opts): config.json and the
-- tensors in opts.dtype ('f32', 'bf16', 'f16'; the first tensor's by
-- default), one file, or shards and the index above opts.max_shard_bytes.
-- The other layout's files left by an earlier save are removed, so that
-- transformers cannot read stale weights.
function M.save(dir, config, entries, opts, who)
  opts = opts or {}
  local dtype = opts.dtype or entries[1][2]:dtype()
  if not TORCH_DTYPE[dtype] then fail("%s: dtype '%s' is not one of f32, bf16, f16", who, tostring(dtype)) end
  local max = opts.max_shard_bytes or M.MAX_SHARD_BYTES
  if type(max) ~= 'number' or max <= 0 then
    fail('%s: max_shard_bytes must be a positive number, got %s', who, tostring(max))
  end
  config.torch_dtype = TORCH_DTYPE[dtype]
  core.ckpt.mkdirs(dir)
  local shards, total = split(entries, dtype, max)
  if #shards == 1 then
    checkpoint.save_file(dir .. '/' .. SINGLE, converted(shards[1], dtype))
    os.remove(dir .. '/' .. INDEX)
  else
    local map = {}
    for i, shard in ipairs(shards) do
      local name = string.format('model-%05d-of-%05d.safetensors', i, #shards)
      checkpoint.save_file(dir .. '/' .. name, converted(shard, dtype))
      for _, e in ipairs(shard) do map[e[1]] = name end
    end
    core.file.write(dir .. '/' .. INDEX, json.encode({ metadata = { total_size = total }, weight_map = map }, 2) .. '\n')
    os.remove(dir .. '/' .. SINGLE)
  end
  core.file.write(dir .. '/' .. CONFIG, json.encode(config, 2) .. '\n')
end

return M
