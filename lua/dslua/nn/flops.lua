-- DeepSpeed's flops_profiler (deepspeed/profiling/flops_profiler): at
-- profile_step, on rank 0, the summary (params, MACs and FLOPs of the
-- forward, forward/backward/step latency, FLOPS, samples/s), the top
-- modules per depth and the per-module tree to module_depth, printed or
-- written to output_file.
--
-- MACs come from the ops that carry the arithmetic (ds.linear, ds.gelu_mlp,
-- ds.matmul, ds.mm, ds.bmm, ds.conv2d, ds.scaled_dot_product_attention,
-- ds.qkv_attention), counted from
-- their shapes while the step runs, charged to the innermost module
-- running; a module's MACs are its own and its children's (containers
-- that are never called, like ModuleList, still sum their children). Element-wise ops and ops called as tensor methods
-- (x:matmul(y)) are not counted. FLOPs = 2 * MACs, backward = 2 * forward
-- (DeepSpeed's convention). Latencies are wall clock: on a GPU they
-- include waiting for the kernels only where an op waits.
local ds = require 'dslua'
local file = require('dslua.core').file

local M = {}

local Profiler = {}
Profiler.__index = Profiler

local now = ds.wall_time

-- DeepSpeed's number_to_string: two decimals, %g, a unit prefix
local function num(v, unit)
  local mags = { { 1e12, 'T' }, { 1e9, 'G' }, { 1e6, 'M' }, { 1e3, 'K' } }
  local mag, prefix = 1, ''
  for _, m in ipairs(mags) do
    if v >= m[1] then mag, prefix = m[1], m[2]; break end
  end
  if mag == 1 and v > 0 and v < 1e-3 then mag, prefix = 1e-6, 'u'
  elseif mag == 1 and v > 0 and v < 1 then mag, prefix = 1e-3, 'm' end
  local r = math.floor(v / mag * 100 + 0.5) / 100
  return (string.format('%g %s%s', r, prefix, unit or ''):gsub(' $', ''))
end

local function numel_out(t) return ds.is_tensor(t) and t:numel() or 0 end
local function last(t) local s = t:size(); return s[#s] end

-- op name -> MACs from its arguments and result
local COUNTERS = {
  linear = function(out, x, w) return numel_out(out) * w:size()[2] end,
  -- its two linears: rows x in x hidden, then rows x hidden x out
  gelu_mlp = function(out, x, w1, b1, w2)
    local hidden = w1:size()[1]
    return numel_out(out) / w2:size()[1] * hidden * w1:size()[2] + numel_out(out) * hidden
  end,
  matmul = function(out, a) return numel_out(out) * last(a) end,
  mm = function(out, a) return numel_out(out) * last(a) end,
  bmm = function(out, a) return numel_out(out) * last(a) end,
  conv2d = function(out, x, w) return numel_out(out) * (w:numel() / w:size()[1]) end,
  scaled_dot_product_attention = function(out, q, k) return 2 * q:numel() * k:size()[#k:size() - 1] end,
  -- q k^T and p v over the heads of qkv [B, T, 3C]: 2 * (B T C) * T
  qkv_attention = function(out, qkv) return 2 * out:numel() * qkv:size(2) end,
}

-- new(engine) -> a profiler, or nil when off or off rank 0; the output
-- file is checked now, not when the profile is due
function M.new(engine)
  local cfg = engine.config.flops_profiler
  if not cfg.enabled or engine.rank ~= 0 then return nil end
  if cfg.output_file then
    local ok, why = pcall(file.append, cfg.output_file, '')
    if not ok then error(string.format('initialize: flops_profiler.output_file: cannot write "%s": %s',
                                       cfg.output_file, why), 0) end
  end
  local self = setmetatable({ cfg = cfg, engine = engine }, Profiler)
  if engine.global_steps + 1 == self.cfg.profile_step then self:_arm() end
  return self
end

local function new_stat(name, class, depth)
  return { name = name, class = class, depth = depth, own = 0, time = 0, children = {} }
end

function Profiler:_arm()
  local e, stack, stats = self.engine, {}, {}
  self.stack, self.saved, self.wrapped = stack, {}, {}
  -- the module tree, each module's forward timed and put on the stack
  local function walk(m, name, depth)
    local st = new_stat(name, m.__name, depth)
    st.params = m:num_parameters()
    stats[m] = st
    for _, c in ipairs(m:named_children()) do st.children[#st.children + 1] = walk(c[2], c[1], depth + 1) end
    local forward = m.forward
    rawset(m, 'forward', function(mod, ...)
      stack[#stack + 1] = st
      local t0 = now()
      local r = { forward(mod, ...) }
      st.time = st.time + (now() - t0)
      stack[#stack] = nil
      return unpack(r)
    end)
    self.wrapped[#self.wrapped + 1] = m
    return st
  end
  self.root = walk(e.module, '', 0)
  for name, count in pairs(COUNTERS) do
    local fn = ds[name]
    self.saved[name] = fn
    ds[name] = function(...)
      local out = fn(...)
      local top = stack[#stack]
      if top then top.own = top.own + count(out, ...) end
      return out
    end
  end
  -- the engine's verbs for this step, timed on this instance only
  self.times = { forward = 0, backward = 0, step = 0 }
  for _, verb in ipairs({ 'forward', 'backward', 'step' }) do
    local fn = getmetatable(e)[verb]
    rawset(e, verb, function(eng, ...)
      local t0 = now()
      local r = { fn(eng, ...) }
      self.times[verb] = self.times[verb] + (now() - t0)
      if verb == 'step' and eng.global_steps == self.cfg.profile_step then   -- the profiled step is over
        self:_disarm()
        self:_print()
      end
      return unpack(r)
    end)
  end
  self.samples0 = e.global_samples
end

function Profiler:_disarm()
  for name, fn in pairs(self.saved) do ds[name] = fn end
  for _, m in ipairs(self.wrapped) do rawset(m, 'forward', nil) end
  for _, verb in ipairs({ 'forward', 'backward', 'step' }) do rawset(self.engine, verb, nil) end
  self.saved, self.wrapped = nil, nil
  local function total(st)
    st.macs = st.own
    for _, c in ipairs(st.children) do st.macs = st.macs + total(c) end
    return st.macs
  end
  total(self.root)
end

-- at every optimizer step (engine:_report): armed for profile_step (the
-- engine's step wrapper reports and disarms when it is over)
function Profiler:boundary()
  if not self.saved and self.engine.global_steps + 1 == self.cfg.profile_step then self:_arm() end
end

-- Python's repr of a {name: 'value'} dict, DeepSpeed's top-modules lines
local function dict(pairs_list)
  local parts = {}
  for i, p in ipairs(pairs_list) do parts[i] = string.format("'%s': '%s'", p[1], p[2]) end
  return '{' .. table.concat(parts, ', ') .. '}'
end

function Profiler:_print()
  local e, cfg, root, t = self.engine, self.cfg, self.root, self.times
  local lines = {}
  local function add(fmt, ...) lines[#lines + 1] = string.format(fmt, ...) end
  local function kv(k, v) add('%-60s  %s', k .. ':', v) end
  local fwd_flops, iter = 2 * root.macs, t.forward + t.backward + t.step
  local samples = e.global_samples - self.samples0
  local function rate(flops, secs) return secs > 0 and num(flops / secs, 'FLOPS') or '-' end
  add('%s DeepSpeed Flops Profiler %s', string.rep('-', 26), string.rep('-', 26))
  add('Profile Summary at step %d:', cfg.profile_step)
  add('Notations:')
  add('data parallel size (dp_size), model parallel size(mp_size),')
  add('number of parameters (params), number of multiply-accumulate operations(MACs),')
  add('number of floating-point operations (flops), floating-point operations per second (FLOPS),')
  add('fwd latency (forward propagation latency), bwd latency (backward propagation latency),')
  add('step (weights update latency), iter latency (sum of fwd, bwd and step latency)')
  add('')
  kv('world size', e.world_size)
  kv('data parallel size', e.world_size)
  kv('model parallel size', 1)
  kv('batch size per GPU', e:train_micro_batch_size_per_gpu())
  kv('params per GPU', num(root.params))
  kv('params of model = params per GPU * mp_size', num(root.params))
  kv('fwd MACs per GPU', num(root.macs, 'MACs'))
  kv('fwd flops per GPU', num(fwd_flops))
  kv('fwd flops of model = fwd flops per GPU * mp_size', num(fwd_flops))
  kv('fwd latency', num(t.forward, 's'))
  kv('fwd FLOPS per GPU = fwd flops per GPU / fwd latency', rate(fwd_flops, t.forward))
  kv('bwd latency', num(t.backward, 's'))
  kv('bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency', rate(2 * fwd_flops, t.backward))
  kv('fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency)',
     rate(3 * fwd_flops, t.forward + t.backward))
  kv('step latency', num(t.step, 's'))
  kv('iter latency', num(iter, 's'))
  kv('FLOPS per GPU = 3 * fwd flops per GPU / iter latency', rate(3 * fwd_flops, iter))
  kv('samples/second', iter > 0 and string.format('%.2f', samples / iter) or '-')
  add('')

  -- every module by depth, for the top modules and the tree's depth limit
  local by_depth, max_depth = {}, 0
  local function collect(st)
    by_depth[st.depth] = by_depth[st.depth] or {}
    table.insert(by_depth[st.depth], st)
    if st.depth > max_depth then max_depth = st.depth end
    for _, c in ipairs(st.children) do collect(c) end
  end
  collect(root)
  local depth_limit = cfg.module_depth < 0 and max_depth or math.min(cfg.module_depth, max_depth)
  add('%s Aggregated Profile per GPU %s', string.rep('-', 29), string.rep('-', 29))
  add('Top %d modules in terms of params, MACs or fwd latency at different model depths:', cfg.top_modules)
  for d = 0, depth_limit do
    -- DeepSpeed aggregates by module class at each depth
    local agg, order = {}, {}
    for _, st in ipairs(by_depth[d]) do
      local a = agg[st.class]
      if not a then
        a = { class = st.class, params = 0, macs = 0, time = 0 }
        agg[st.class], order[#order + 1] = a, a
      end
      a.params, a.macs, a.time = a.params + st.params, a.macs + st.macs, a.time + st.time
    end
    add('depth %d:', d)
    for _, col in ipairs({ { 'params', 'params', '' }, { 'MACs', 'macs', 'MACs' }, { 'fwd latency', 'time', 's' } }) do
      local sorted = { unpack(order) }
      table.sort(sorted, function(a, b) return a[col[2]] > b[col[2]] end)
      local top = {}
      for i = 1, math.min(cfg.top_modules, #sorted) do top[i] = { sorted[i].class, num(sorted[i][col[2]], col[3]) } end
      add('    %-11s - %s', col[1], dict(top))
    end
  end

  if cfg.detailed then
    add('')
    add('%s Detailed Profile per GPU %s', string.rep('-', 30), string.rep('-', 30))
    add('Each module profile is listed after its name in the following order:')
    add('params, percentage of total params, MACs, percentage of total MACs, fwd latency, '
        .. 'percentage of total fwd latency, fwd FLOPS')
    add('')
    local function pct(a, b) return string.format('%.2f%%', b > 0 and 100 * a / b or 0) end
    local function tree(st, indent)
      local head = indent .. (st.depth > 0 and '(' .. st.name .. '): ' or '') .. st.class .. '('
      local stats = string.format('%s = %s Params, %s = %s MACs, %s = %s latency, %s',
                                  num(st.params), pct(st.params, root.params), num(st.macs, 'MACs'),
                                  pct(st.macs, root.macs), num(st.time, 's'), pct(st.time, root.time),
                                  rate(2 * st.macs, st.time))
      if #st.children == 0 or st.depth >= depth_limit then
        add('%s%s)', head, stats)
        return
      end
      add('%s', head)
      add('%s  %s,', indent, stats)
      for _, c in ipairs(st.children) do tree(c, indent .. '  ') end
      add('%s)', indent)
    end
    tree(root, '')
  end
  add('%s', string.rep('-', 78))
  local text = table.concat(lines, '\n') .. '\n'
  if cfg.output_file then
    local ok, why = pcall(file.write, cfg.output_file, text)
    if not ok then error('flops_profiler.output_file: ' .. why, 0) end
  else
    io.stdout:write(text)
    io.stdout:flush()
  end
end

return M
