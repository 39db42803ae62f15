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

-- Every tensor of the files named, each file opened once: {name = tensor}.
-- by_file: {file = {names...}}, or {file = true} for all of a file's.
local function read_files(dir, by_file, who)
  local out = {}
  for name, wanted in pairs(by_file) do
    local path = dir and dir .. '/' .. name or name
    local ok, f = pcall(core.ckpt.open, path)
    if not ok then fail("%s: cannot read '%s': %s", who, path, file_io.reason(f, path)) end
    local shapes = {}
    for _, e in ipairs(f:entries()) do shapes[e.name] = e.shape end
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
      local t = f:read(k)
      out[k] = #shapes[k] > 0 and t:view(shapes[k]) or t:view({}):clone()
    end
    f:close()
  end
  return out
end

-- load(path, who) -> config (nil for a bare file), {name = tensor}: path a
-- folder (config.json, then the index or the single file) or one
-- .safetensors file.
function M.load(path, who)
  if path:match('%.safetensors$') then return nil, read_files(nil, { [path] = true }, who) end
  local config = read_json(path .. '/' .. CONFIG, who)
  local index_path = path .. '/' .. INDEX
  local text = file_io.read(index_path)
  if not text then return config, read_files(path, { [SINGLE] = true }, who) end
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
  return config, read_files(path, by_file, who)
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
