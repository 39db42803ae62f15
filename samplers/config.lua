-- The sampler block's checker (dslua's own block; samplers/policy.lua runs
-- it), beside the policies it names; ds.config calls it with the rest of
-- the config (M.check) and policies check their block alone (ds.config.check_sampler).
local json = require 'dslua.base.json'
local suggest = require 'dslua.base.suggest'
local S = require 'dslua.base.schema'
local describe, join, unknown, problem, note = S.describe, S.join, S.unknown, S.problem, S.note
local field, bool, int, is_list, is_object = S.field, S.bool, S.int, S.is_list, S.is_object
local finite, check_value, sorted_keys = S.finite, S.check_value, S.sorted_keys
local lua_file = S.lua_file

local M = {}

-- The sampler block (dslua's own; samplers/policy.lua runs it): which
-- policy gives each rank its indices and micro batch. Checked here with
-- the world size; the batch triple then resolves from the per-rank micro
-- batches (resolve_sampler_batch).
--
--   policy                    "uneven" (default), "auto", "distributed", or
--                             a path to a Lua file (tried as given, then
--                             next to the config file); a Lua config may
--                             give the policy table itself
--   micro_batch_per_rank      one positive integer per rank (default: every
--                             rank train_micro_batch_size_per_gpu)
--   data_share                one number > 0 per rank, summing to 1 within
--                             1e-6 (default: micro_batch_per_rank / its sum)
--   shuffle, seed, drop_last  true, 0, false
--   auto only: max_micro_batch_per_rank (a number or one per rank; default
--   no cap), measure_steps (10, at most 256), skip_steps (1)
--   custom policies only: params (an object handed to the policy)

M.sampler_policies = { 'auto', 'distributed', 'uneven' }
M.share_tolerance = 1e-6     -- how far from 1 the shares may sum

local SAMPLER_KEYS = { 'policy', 'micro_batch_per_rank', 'data_share', 'shuffle', 'seed', 'drop_last' }
local SAMPLER_OWN = { max_micro_batch_per_rank = 'auto', measure_steps = 'auto', skip_steps = 'auto',
                      params = 'custom' }

-- The policy's kind ('uneven', 'auto', 'distributed' or 'custom') and the
-- value to keep, or nil after recording a problem.
local function check_policy(ctx, path, v)
  if type(v) == 'table' and type(v.plan) == 'function' then return 'custom', v end
  if type(v) ~= 'string' then
    return problem(ctx, path, 'must be a policy name (' .. table.concat(M.sampler_policies, ', ')
                   .. ') or the path of a Lua file, got ' .. describe(v))
  end
  for _, name in ipairs(M.sampler_policies) do
    if v == name then return name, v end
  end
  if not (v:find('/', 1, true) or v:match('%.lua$')) then
    local s = suggest.did_you_mean(v, M.sampler_policies)
    return problem(ctx, path, 'unknown policy ' .. describe(v) .. (s and ', ' .. s or '')
                   .. ' (built in: ' .. table.concat(M.sampler_policies, ', ') .. '; or the path of a .lua file)')
  end
  local found = lua_file(ctx, path, v, 'policy')
  if found then return 'custom', found end
end

-- A list of one value per rank; check(x, p) -> x or nil after a problem.
-- Its length is checked by check_counts, against the data-parallel ranks.
local function per_rank(ctx, path, v, what, check)
  local ws = ctx.world_size or 1
  if not is_list(v) or #v == 0 then
    return problem(ctx, path, string.format('must be a list of %d %s (one per rank), got %s', ws, what, describe(v)))
  end
  local out, ok = json.array({}), true
  for i, x in ipairs(v) do
    out[i] = check(x, join(path, i - 1))
    if out[i] == nil then ok = false end
  end
  return ok and out or nil
end

-- Problems for the per-rank lists of s whose length is not ctx.world_size
-- (the ranks that read batches) -> whether there were any.
local function wrong_counts(ctx, s)
  local ws, bad = ctx.world_size or 1, false
  for _, key in ipairs({ 'micro_batch_per_rank', 'data_share', 'max_micro_batch_per_rank' }) do
    local v = s[key]
    if is_list(v) and #v ~= ws then
      problem(ctx, 'sampler.' .. key, string.format('has %d entr%s, the world size is %d (one per rank)', #v,
                                                    #v == 1 and 'y' or 'ies', ws))
      bad = true
    end
  end
  return bad
end

local function positive_int(ctx)
  return function(x, p)
    if finite(x) and x == math.floor(x) and x >= 1 then return x end
    problem(ctx, p, 'must be a positive integer, got ' .. describe(x))
  end
end

local function all_equal(list)
  for _, x in ipairs(list) do
    if x ~= list[1] then return false end
  end
  return true
end

local function check_sampler(ctx, path, v)
  if v == json.null then return nil end
  if not is_object(v) then return problem(ctx, path, 'must be an object, got ' .. describe(v)) end
  ctx.sampler_sets_batch = v.micro_batch_per_rank ~= nil
  local kind, policy = 'uneven', 'uneven'
  if v.policy ~= nil then
    kind, policy = check_policy(ctx, join(path, 'policy'), v.policy)
    if not kind then return nil end
  end
  local known, common = {}, {}
  for _, k in ipairs(SAMPLER_KEYS) do known[#known + 1], common[k] = k, true end
  for k, owner in pairs(SAMPLER_OWN) do
    if owner == kind then known[#known + 1] = k end
  end
  local out, ok = { policy = policy }, true
  for _, key in ipairs(sorted_keys(v)) do
    local kp = join(path, tostring(key))
    local owner = SAMPLER_OWN[key]
    if type(key) ~= 'string' then
      problem(ctx, kp, 'keys must be strings, got ' .. describe(key))
      ok = false
    elseif owner and owner ~= kind then
      problem(ctx, kp, owner == 'custom' and 'only a policy loaded from a Lua file reads it'
                       or "only the '" .. owner .. "' policy reads it")
      ok = false
    elseif not owner and not common[key] then
      problem(ctx, kp, unknown(key, known) .. (kind == 'custom' and " (a custom policy's own settings go in "
                                                .. join(path, 'params') .. ')' or ''))
      ok = false
    end
  end
  local function get(key, f)
    if v[key] == nil then return f.default end
    local x = check_value(ctx, join(path, key), v[key], f)
    if x == nil then ok = false end
    return x
  end
  out.shuffle = get('shuffle', bool(true))
  out.seed = get('seed', int(0, 0))
  out.drop_last = get('drop_last', bool(false))
  local mp, sp = join(path, 'micro_batch_per_rank'), join(path, 'data_share')
  if v.micro_batch_per_rank ~= nil then
    out.micro_batch_per_rank = per_rank(ctx, mp, v.micro_batch_per_rank, 'positive integers', positive_int(ctx))
    if not out.micro_batch_per_rank then
      ok = false
    elseif kind == 'distributed' and not all_equal(out.micro_batch_per_rank) then
      problem(ctx, mp, "the distributed policy gives every rank the same micro batch, got "
                       .. table.concat(out.micro_batch_per_rank, ', ') .. " (policy 'uneven' takes one per rank)")
      ok = false
    end
  end
  if v.data_share ~= nil then
    out.data_share = per_rank(ctx, sp, v.data_share, 'numbers > 0', function(x, p)
      if finite(x) and x > 0 then return x end
      problem(ctx, p, 'must be a number > 0 (every rank takes a share), got ' .. describe(x))
    end)
    if out.data_share then
      local sum = 0
      for _, x in ipairs(out.data_share) do sum = sum + x end
      if math.abs(sum - 1) > M.share_tolerance then
        problem(ctx, sp, string.format('the shares sum to %s, they must sum to 1 (within %s)', json.number(sum),
                                       (string.format('%.0e', M.share_tolerance):gsub('e%-0*', 'e-'))))
        out.data_share = nil
      elseif kind == 'distributed' and not all_equal(out.data_share) then
        problem(ctx, sp, "the distributed policy gives every rank an equal share (policy 'uneven' takes one per rank)")
        out.data_share = nil
      end
    end
    if not out.data_share then ok = false end
  end
  if kind == 'auto' then
    out.measure_steps = get('measure_steps', int(10, 1, { max = 256 }))   -- samplers/auto.lua keeps 256
    out.skip_steps = get('skip_steps', int(1, 0))
    local cp = join(path, 'max_micro_batch_per_rank')
    local cap = v.max_micro_batch_per_rank
    if finite(cap) then
      out.max_micro_batch_per_rank = positive_int(ctx)(cap, cp)     -- a list once the ranks are known
    elseif cap ~= nil then
      out.max_micro_batch_per_rank = per_rank(ctx, cp, cap, 'positive integers', positive_int(ctx))
    end
    if cap ~= nil and not out.max_micro_batch_per_rank then ok = false end
  elseif kind == 'custom' then
    local pp = join(path, 'params')
    out.params = v.params == nil and {} or check_value(ctx, pp, v.params, field('object'))
    if out.params == nil then
      ok = false
    else
      for _, k in ipairs(sorted_keys(out.params)) do
        if common[k] or SAMPLER_OWN[k] then
          problem(ctx, join(pp, tostring(k)), 'is a key of the sampler block itself; set it at ' .. join(path, tostring(k)))
          ok = false
        end
      end
    end
  end
  if not ok then wrong_counts(ctx, v) end      -- with the block's other problems
  return ok and out or nil
end

-- The uneven policy steps every rank together, so the rank that needs the
-- most steps for its share (share / micro batch largest) sets how many;
-- a rank whose share is thinner fills only part of its micro batch each
-- step, and the batch is not the train_batch_size the config reads. An
-- error per such rank, with shares and micro batches that agree. -> ok
local function check_layout(ctx, micro, share)
  local most, by = 0, 1
  for r, m in ipairs(micro) do
    if share[r] / m > most then most, by = share[r] / m, r end
  end
  local fit, prop, sum = {}, {}, 0
  for _, m in ipairs(micro) do sum = sum + m end
  for r, m in ipairs(micro) do
    fit[r] = math.max(1, math.floor(share[r] / most + 0.5))
    prop[r] = json.number(m / sum)
  end
  local ok = true
  for r, m in ipairs(micro) do
    local batch = share[r] / most
    if batch < m * (1 - M.share_tolerance) then
      ok = false
      problem(ctx, string.format('sampler.data_share[%d]', r - 1), string.format(
        'rank %d: its share %s fills about %s of its micro batch %d each step (rank %d, share %s in micro '
        .. 'batches of %d, sets the number of steps), so its batch would be cut; give shares in proportion to '
        .. 'the micro batches (%s) or micro_batch_per_rank %s', r - 1, json.number(share[r]),
        json.number(math.floor(batch * 100 + 0.5) / 100), m, by - 1, json.number(share[by]), micro[by],
        table.concat(prop, ', '), table.concat(fit, ', ')))
    end
  end
  return ok
end

-- The per-rank micro batches set the batch: train_batch_size =
-- sum(micro_batch_per_rank) * gradient_accumulation_steps (DeepSpeed's
-- micro * accumulation * world size when the micro batches are equal).
-- train_micro_batch_size_per_gpu resolves to the largest micro batch (the
-- most one rank holds); given, it must be that.
-- Returns false when the sampler block does not set the micro batches
-- (true when it tried and failed: its problem is recorded already).
-- The sampler block's per-rank lists against the data-parallel ranks,
-- which the config resolves after checking the block (the world over the
-- tensor and sequence degrees); a cap given as one number made a list.
-- A list of another length drops the block, as any problem in it does.
local function check_counts(ctx, cfg)
  local s = cfg.sampler
  if type(s.max_micro_batch_per_rank) == 'number' then
    local cap = s.max_micro_batch_per_rank
    s.max_micro_batch_per_rank = json.array({})
    for r = 1, ctx.world_size or 1 do s.max_micro_batch_per_rank[r] = cap end
  end
  if wrong_counts(ctx, s) then cfg.sampler = nil end
  return cfg.sampler
end

local function resolve_sampler_batch(ctx, cfg)
  local s = type(cfg.sampler) == 'table' and check_counts(ctx, cfg)
  if type(s) ~= 'table' or not s.micro_batch_per_rank then return ctx.sampler_sets_batch == true end
  local micro = s.micro_batch_per_rank
  local sum, largest = 0, 0
  for _, m in ipairs(micro) do sum, largest = sum + m, math.max(largest, m) end
  local tb, mb, ga = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
  local mp = 'sampler.micro_batch_per_rank'
  if ga and ga <= 0 then
    return true, problem(ctx, 'gradient_accumulation_steps',
                         string.format('Gradient accumulation steps: %d has to be greater than 0', ga))
  end
  if tb and tb <= 0 then
    return true, problem(ctx, 'train_batch_size', string.format('Train batch size: %d has to be greater than 0', tb))
  end
  if mb ~= nil and mb ~= largest then
    return true, problem(ctx, 'train_micro_batch_size_per_gpu', string.format(
      'is %d, but %s gives each rank its own (%s): leave it out, or give the largest (%d)', mb, mp,
      table.concat(micro, ', '), largest))
  end
  local how = ''
  if not ga then
    if tb then
      if tb % sum ~= 0 then
        return true, problem(ctx, 'train_batch_size', string.format(
          '%d is not a multiple of sum(%s) = %d (train_batch_size = sum(micro_batch_per_rank) '
          .. '* gradient_accumulation_steps)', tb, mp, sum))
      end
      ga = tb / sum
      how = string.format(' (gradient_accumulation_steps = %d / %d)', tb, sum)
    else
      ga = 1
    end
  end
  if tb and tb ~= sum * ga then
    return true, problem(ctx, 'train_batch_size', string.format(
      '%d != sum(%s) * gradient_accumulation_steps = %d * %d', tb, mp, sum, ga))
  end
  if s.policy == 'uneven' and s.data_share and not check_layout(ctx, micro, s.data_share) then return true end
  cfg.train_batch_size, cfg.gradient_accumulation_steps = sum * ga, ga
  cfg.train_micro_batch_size_per_gpu = largest
  note(ctx, 'train_batch_size', string.format('%d = sum(%s) * gradient_accumulation_steps = (%s) * %d%s',
                                              sum * ga, mp, table.concat(micro, ' + '), ga, how))
  return true
end

-- Defaults that depend on the resolved batch: the micro batches (every
-- rank train_micro_batch_size_per_gpu), the shares (in proportion to the
-- micro batches), and the auto policy's caps against its micro batches.
local function finish_sampler(ctx, cfg)
  local s = type(cfg.sampler) == 'table' and check_counts(ctx, cfg)
  if not s then return end
  local ws = ctx.world_size or 1
  local mp = 'sampler.micro_batch_per_rank'
  if not s.micro_batch_per_rank then
    local mb = cfg.train_micro_batch_size_per_gpu
    if not mb then
      return problem(ctx, mp, 'missing: needed when train_micro_batch_size_per_gpu does not set the micro batch')
    end
    s.micro_batch_per_rank = json.array({})
    for r = 1, ws do s.micro_batch_per_rank[r] = mb end
  end
  local micro = s.micro_batch_per_rank
  if not micro then return end
  if not s.data_share then
    local sum = 0
    for _, m in ipairs(micro) do sum = sum + m end
    s.data_share = json.array({})
    for r, m in ipairs(micro) do s.data_share[r] = m / sum end
  end
  if s.max_micro_batch_per_rank then
    for r, cap in ipairs(s.max_micro_batch_per_rank) do
      if micro[r] and cap < micro[r] then
        problem(ctx, 'sampler.max_micro_batch_per_rank[' .. (r - 1) .. ']', string.format(
          '%d is below %s[%d] = %d (the cap bounds the micro batch)', cap, mp, r - 1, micro[r]))
      end
    end
  end
end

-- check_sampler(block [, {world_size = 1, micro_batch = n, source = config
-- path}]) -> the resolved sampler block, or nil and the
-- problems (lines naming sampler.<key>). micro_batch stands for
-- train_micro_batch_size_per_gpu when the block has no micro_batch_per_rank.
function M.check_sampler(v, opts)
  opts = opts or {}
  local ctx = { problems = {}, notes = {}, bad = {}, autos = {}, given = {}, source = opts.source,
                world_size = opts.world_size or 1 }
  local s = check_sampler(ctx, 'sampler', v)
  if s then finish_sampler(ctx, { sampler = s, train_micro_batch_size_per_gpu = opts.micro_batch }) end
  if #ctx.problems > 0 or not s then
    local lines = {}
    for i, p in ipairs(ctx.problems) do
      lines[i] = (opts.source and opts.source .. ': ' or '') .. p.path .. ': ' .. p.msg
    end
    return nil, lines
  end
  return s, {}
end

M.check = check_sampler
M.resolve_batch = resolve_sampler_batch
M.finish = finish_sampler

return M
