-- models/hf.lua through models.llama and models.gpt2: from_hf and save_hf
-- over Hugging Face's folders (config.json, model.safetensors or shards and
-- model.safetensors.index.json), f32/bf16/f16, tied embeddings, the layout's
-- rules, refusals by name, and transformers reading what dslua writes
-- where python3 has it.
local H = require 'helpers'
local ds = H.ds
local json = require 'dslua.base.json'
local core = require 'dslua.core'

local GPT = require 'models.gpt2'
local Llama = require 'models.llama'

-- TinyLlama's shape (grouped-query attention, 8 query heads per kv head),
-- small.
local TINY = { n_layer = 2, n_head = 8, n_kv_head = 1, n_embd = 32, intermediate_size = 88, vocab_size = 61,
               block_size = 16 }
local IDS = { 3, 1, 4, 1, 5, 9, 2, 6 }

local tmpdir, remove_tmpdirs = H.tmpdirs()

local function read_json(path) return json.decode(assert(require('dslua.base.file').read(path))) end

local function logits(m) return ds.no_grad(function() return m(ds.tensor({ IDS }, 'i64')) end) end

local function max_diff(a, b) return (a:to('f32') - b:to('f32')):abs():amax():item() end

-- Every parameter of b equal to a's rounded to dtype, bit for bit.
local function same_params(a, b, dtype)
  local pb = {}
  for _, e in ipairs(b:named_parameters()) do pb[e[1]] = e[2] end
  for _, e in ipairs(a:named_parameters()) do
    local want = e[2]:to(dtype or 'f32'):to('f32')
    assert(pb[e[1]], 'no parameter ' .. e[1])
    assert.are.equal(0, max_diff(want, pb[e[1]]), e[1])
  end
end

-- The JSON header of a safetensors file as written on disk (an 8-byte
-- little-endian length, then the JSON).
local function header(path)
  local f = assert(io.open(path, 'rb'))
  local b = { f:read(8):byte(1, 8) }
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + b[i] end
  local h = json.decode(f:read(n))
  f:close()
  return h
end

-- {name = {dtype, shape}} of every tensor in the folder's safetensors
-- files (the dtype string as written), and which file holds each.
local function files_of(dir)
  local out, where = {}, {}
  for name in H.run('ls ' .. dir):gmatch('[^\n]+') do
    if name:match('%.safetensors$') then
      for k, e in pairs(header(dir .. '/' .. name)) do
        if k ~= '__metadata__' then
          assert.is_nil(out[k], k .. ' is in two files')
          out[k], where[k] = { e.dtype, table.concat(e.shape, 'x') }, name
        end
      end
    end
  end
  return out, where
end

local function exists(path) return core.ckpt.exists(path) end

teardown(remove_tmpdirs)

describe('models.llama save_hf / from_hf', function()
  it('round-trips a TinyLlama-shaped model through one model.safetensors: bit-equal weights, same logits', function()
    ds.manual_seed(3)
    local m = Llama(TINY)
    local dir = tmpdir()
    Llama.save_hf(m, dir)
    assert.is_true(exists(dir .. '/model.safetensors'))
    assert.is_false(exists(dir .. '/model.safetensors.index.json'))
    local c = read_json(dir .. '/config.json')
    assert.are.same({ 'LlamaForCausalLM' }, c.architectures)
    assert.are.equal('llama', c.model_type)
    assert.are.equal(32, c.hidden_size)
    assert.are.equal(88, c.intermediate_size)
    assert.are.equal(2, c.num_hidden_layers)
    assert.are.equal(8, c.num_attention_heads)
    assert.are.equal(1, c.num_key_value_heads)
    assert.are.equal(61, c.vocab_size)
    assert.are.equal(16, c.max_position_embeddings)
    assert.are.equal(false, c.tie_word_embeddings)
    assert.are.equal('float32', c.torch_dtype)
    local files = files_of(dir)
    assert.are.same({ 'F32', '61x32' }, files['model.embed_tokens.weight'])
    assert.are.same({ 'F32', '4x32' }, files['model.layers.1.self_attn.k_proj.weight'])
    assert.are.same({ 'F32', '88x32' }, files['model.layers.0.mlp.gate_proj.weight'])
    assert.are.same({ 'F32', '61x32' }, files['lm_head.weight'])
    local back = Llama.from_hf(dir)
    same_params(m, back)
    assert.is_true(max_diff(logits(m), logits(back)) <= 1e-5)
  end)

  it('maps every config key both ways (rope_theta, rms_norm_eps, ... at values other than the defaults)', function()
    local cfg = { rope_theta = 500000, norm_eps = 1e-6, initializer_range = 0.01 }
    for k, v in pairs(TINY) do cfg[k] = v end
    local dir = tmpdir()
    Llama.save_hf(Llama(cfg), dir)
    local c = read_json(dir .. '/config.json')
    assert.are.same({ 500000, 1e-6, 0.01 }, { c.rope_theta, c.rms_norm_eps, c.initializer_range })
    local back = Llama.from_hf(dir).config
    for k, v in pairs(cfg) do assert.are.equal(v, back[k], k) end
  end)

  it('shards above max_shard_bytes with an index transformers reads (weight_map, metadata.total_size)', function()
    ds.manual_seed(4)
    local m = Llama(TINY)
    local dir = tmpdir()
    Llama.save_hf(m, dir, { max_shard_bytes = 16 * 1024 })
    assert.is_false(exists(dir .. '/model.safetensors'))
    local index = read_json(dir .. '/model.safetensors.index.json')
    local files, where = files_of(dir)
    local total, n_files, seen = 0, 0, {}
    for _, e in ipairs(m:named_parameters()) do
      local name, t = e[1], e[2]
      assert.are.equal(where[name], index.weight_map[name], name)
      assert.matches('^model%-%d%d%d%d%d%-of%-%d%d%d%d%d%.safetensors$', where[name])
      assert.are.equal(table.concat(t:size(), 'x'), files[name][2])
      total = total + 4 * t:numel()
      if not seen[where[name]] then n_files, seen[where[name]] = n_files + 1, true end
    end
    for name in pairs(index.weight_map) do assert.is_not_nil(files[name], name) end
    assert.are.equal(total, index.metadata.total_size)
    assert.is_true(n_files > 1)
    local back = Llama.from_hf(dir)
    same_params(m, back)
    assert.is_true(max_diff(logits(m), logits(back)) <= 1e-5)
    -- saved again whole: the index goes, so nothing reads the old shards
    Llama.save_hf(m, dir)
    assert.is_false(exists(dir .. '/model.safetensors.index.json'))
    same_params(m, Llama.from_hf(dir))
  end)

  for _, case in ipairs({ { 'bf16', 'BF16', 'bfloat16' }, { 'f16', 'F16', 'float16' } }) do
    local dtype, st, torch_name = case[1], case[2], case[3]
    it('writes and reads ' .. dtype .. ' weights (' .. st .. ', torch_dtype ' .. torch_name .. ')', function()
      ds.manual_seed(5)
      local m = Llama(TINY)
      local dir = tmpdir()
      Llama.save_hf(m, dir, { dtype = dtype, max_shard_bytes = 8 * 1024 })
      assert.are.equal(torch_name, read_json(dir .. '/config.json').torch_dtype)
      for name, f in pairs(files_of(dir)) do assert.are.equal(st, f[1], name) end
      same_params(m, Llama.from_hf(dir), dtype)
      local as_16 = Llama.from_hf(dir, { dtype = dtype })
      assert.are.equal(dtype, as_16.lm_head.weight:dtype())
    end)
  end

  it('writes a tied lm_head once, as the embedding, and ties it again on load', function()
    ds.manual_seed(6)
    local cfg = {}
    for k, v in pairs(TINY) do cfg[k] = v end
    cfg.tie_embeddings = true
    local m = Llama(cfg)
    local dir = tmpdir()
    Llama.save_hf(m, dir)
    assert.are.equal(true, read_json(dir .. '/config.json').tie_word_embeddings)
    assert.is_nil(files_of(dir)['lm_head.weight'])
    local back = Llama.from_hf(dir)
    assert.is_true(back.config.tie_embeddings)
    assert.are.equal(back.model.embed_tokens.weight, back.lm_head.weight)
    assert.is_true(max_diff(logits(m), logits(back)) <= 1e-5)
  end)

  it('reads files older transformers wrote, with rotary_emb.inv_freq buffers', function()
    ds.manual_seed(11)
    local m = Llama(TINY)
    local dir = tmpdir()
    Llama.save_hf(m, dir)
    local CK = require('dslua.io.checkpoint')
    local sd = CK.load_file(dir .. '/model.safetensors')
    sd['model.layers.0.self_attn.rotary_emb.inv_freq'] = ds.ones({ 2 })
    CK.save_file(dir .. '/model.safetensors', sd)
    same_params(m, Llama.from_hf(dir))
  end)

  describe('refuses', function()
    local dir
    before_each(function()
      ds.manual_seed(7)
      dir = tmpdir()
      Llama.save_hf(Llama(TINY), dir, { max_shard_bytes = 16 * 1024 })
    end)

    local function edit_config(fn)
      local c = read_json(dir .. '/config.json')
      fn(c)
      H.write(dir .. '/config.json', json.encode(c))
    end

    it('another architecture, by model_type', function()
      edit_config(function(c) c.model_type = 'mistral' end)
      H.has(H.err(Llama.from_hf, dir), "llama.from_hf: config.json's model_type is 'mistral', expected 'llama'")
    end)

    it('settings it does not implement, by key', function()
      edit_config(function(c) c.rope_scaling = { type = 'linear', factor = 2 } end)
      H.has(H.err(Llama.from_hf, dir), "config.json's rope_scaling = ")
      edit_config(function(c) c.rope_scaling, c.attention_bias = json.null, true end)
      H.has(H.err(Llama.from_hf, dir), "config.json's attention_bias = true is not supported")
      edit_config(function(c) c.attention_bias, c.head_dim = false, 8 end)
      H.has(H.err(Llama.from_hf, dir), "config.json's head_dim = 8 is not supported")
    end)

    it('a folder without config.json, naming the file', function()
      os.remove(dir .. '/config.json')
      H.has(H.err(Llama.from_hf, dir), "llama.from_hf: cannot read '" .. dir .. "/config.json'")
    end)

    it('an index that maps a tensor to a file without it, naming both', function()
      local index = read_json(dir .. '/model.safetensors.index.json')
      local first = index.weight_map['model.norm.weight']
      local other = index.weight_map['model.embed_tokens.weight']
      assert.are_not.equal(first, other)
      index.weight_map['model.norm.weight'] = other
      H.write(dir .. '/model.safetensors.index.json', json.encode(index))
      H.has(H.err(Llama.from_hf, dir), "'" .. dir .. '/' .. other .. "' has no tensor 'model.norm.weight'")
    end)

    it('an index naming a file outside the folder', function()
      local index = read_json(dir .. '/model.safetensors.index.json')
      index.weight_map['model.norm.weight'] = '../elsewhere.safetensors'
      H.write(dir .. '/model.safetensors.index.json', json.encode(index))
      H.has(H.err(Llama.from_hf, dir), "weight_map's 'model.norm.weight' names '../elsewhere.safetensors'")
    end)

    it('a missing tensor, by its name', function()
      local index = read_json(dir .. '/model.safetensors.index.json')
      index.weight_map['model.norm.weight'] = nil
      H.write(dir .. '/model.safetensors.index.json', json.encode(index))
      H.has(H.err(Llama.from_hf, dir), 'model.norm.weight')
    end)

    it('a folder without weights, naming the file it looked for', function()
      local empty = tmpdir()
      H.write(empty .. '/config.json', H.run('cat ' .. dir .. '/config.json'))
      H.has(H.err(Llama.from_hf, empty),
            "llama.from_hf: cannot read '" .. empty .. "/model.safetensors': No such file or directory")
    end)

    it('a dtype or shard size it cannot write', function()
      H.has(H.err(Llama.save_hf, Llama(TINY), tmpdir(), { dtype = 'f64' }),
            "llama.save_hf: dtype 'f64' is not one of f32, bf16, f16")
      H.has(H.err(Llama.save_hf, Llama(TINY), tmpdir(), { max_shard_bytes = 0 }),
            'llama.save_hf: max_shard_bytes must be a positive number, got 0')
    end)
  end)
end)

describe('models.gpt2 save_hf / from_hf', function()
  local CFG = { n_layer = 2, n_head = 2, n_embd = 16, vocab_size = 50, block_size = 16, padded_vocab_size = 64 }

  it('writes Hugging Face GPT-2 (Conv1D [in, out], wte cut to vocab_size, no lm_head) and reads it back', function()
    ds.manual_seed(8)
    local m = GPT(CFG)
    local dir = tmpdir()
    GPT.save_hf(m, dir, { max_shard_bytes = 4 * 1024 })
    local c = read_json(dir .. '/config.json')
    assert.are.same({ 'GPT2LMHeadModel' }, c.architectures)
    assert.are.same({ 16, 2, 2, 16, 50 }, { c.n_embd, c.n_layer, c.n_head, c.n_positions, c.vocab_size })
    assert.are.equal('gelu_new', c.activation_function)
    local files = files_of(dir)
    assert.are.same({ 'F32', '50x16' }, files['transformer.wte.weight'])
    assert.are.same({ 'F32', '16x48' }, files['transformer.h.0.attn.c_attn.weight'])
    assert.are.same({ 'F32', '64x16' }, files['transformer.h.1.mlp.c_proj.weight'])
    assert.is_nil(files['lm_head.weight'])
    assert.is_not_nil(read_json(dir .. '/model.safetensors.index.json').weight_map['transformer.ln_f.bias'])
    local back = GPT.from_hf(dir, { padded_vocab_size = 64 })
    assert.are.equal(0, back.transformer.wte.weight:narrow(1, 51, 14):abs():amax():item())
    assert.are.equal(0, max_diff(m.transformer.h[1].attn.c_attn.weight, back.transformer.h[1].attn.c_attn.weight))
    assert.is_true(max_diff(logits(m), logits(back)) <= 1e-5)
    local unpadded = GPT.from_hf(dir)
    assert.are.equal(50, unpadded.lm_head.weight:size(1))
    assert.is_true(max_diff(logits(m):narrow(3, 1, 50), logits(unpadded)) <= 1e-5)
  end)

  it('writes bf16 and reads it into an f32 model, weights rounded once', function()
    ds.manual_seed(9)
    local m = GPT(CFG)
    local dir = tmpdir()
    GPT.save_hf(m, dir, { dtype = 'bf16' })
    assert.are.same({ 'BF16', '16x16' }, files_of(dir)['transformer.h.0.attn.c_proj.weight'])
    local back = GPT.from_hf(dir, { padded_vocab_size = 64 })
    assert.are.equal(0, max_diff(m.transformer.h[2].mlp.c_fc.weight:to('bf16'), back.transformer.h[2].mlp.c_fc.weight))
  end)

  it('refuses settings GPT-2 here does not implement, by key, and a model Hugging Face cannot hold', function()
    local dir = tmpdir()
    GPT.save_hf(GPT(CFG), dir)
    local c = read_json(dir .. '/config.json')
    c.activation_function = 'relu'
    H.write(dir .. '/config.json', json.encode(c))
    H.has(H.err(GPT.from_hf, dir), "gpt2.from_hf: config.json's activation_function = \"relu\" is not supported")
    c.activation_function, c.model_type = 'gelu_new', 'gpt_neo'
    H.write(dir .. '/config.json', json.encode(c))
    H.has(H.err(GPT.from_hf, dir), "model_type is 'gpt_neo', expected 'gpt2'")
    local nobias = GPT({ n_layer = 1, n_head = 2, n_embd = 16, vocab_size = 50, block_size = 16, bias = false })
    H.has(H.err(GPT.save_hf, nobias, tmpdir()), 'gpt2.save_hf: Hugging Face\'s GPT-2 has biases')
  end)
end)

describe('through transformers', function()
  local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

  for _, case in ipairs({ { 'llama', Llama, TINY }, { 'gpt2', GPT, { n_layer = 2, n_head = 2, n_embd = 16,
                                                                      vocab_size = 50, block_size = 16 } } }) do
    local name, M, cfg = case[1], case[2], case[3]
    it(name .. ': dslua -> HF folder -> transformers (logits) -> save_pretrained sharded -> dslua', function()
      local _, status = H.run("/usr/bin/python3 -c 'import transformers, torch, safetensors'")
      if status ~= 0 then return pending('/usr/bin/python3 has no transformers, torch or safetensors') end
      ds.manual_seed(10)
      local m = M(cfg)
      local src, dst = tmpdir(), tmpdir() .. '/out'
      M.save_hf(m, src)
      local ids = table.concat(IDS, ',')
      local out, rc = H.run('/usr/bin/python3 spec/fixtures/hf_roundtrip.py ' .. shell_quote(src) .. ' '
                            .. shell_quote(dst) .. ' 20KB ' .. ids)
      assert.are.equal(0, rc, out)
      local theirs = require('dslua.io.checkpoint').load_file(dst .. '.logits.safetensors').logits
      assert.is_true(max_diff(logits(m), theirs) <= 1e-5, 'transformers\' logits')
      assert.is_true(exists(dst .. '/model.safetensors.index.json'))
      local back = M.from_hf(dst)
      same_params(m, back)
      assert.is_true(max_diff(logits(m), logits(back)) <= 1e-5)
    end)
  end
end)
