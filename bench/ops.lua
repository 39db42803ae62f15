-- dslua side of the benchmarks: `dslua bench/ops.lua [quick]`, threads from
-- DSLUA_NUM_THREADS (bench/run.sh sets it). Prints one line per row, read
-- by bench/table.lua:
--   result  dslua  <op>  <shape>  <value>  <unit>      (unit: s per call, or gflops)
--   result  dslua  <op>  <shape>  missing  -           (op not in this build)
-- bench/ops_torch.py measures the same rows the same way.
local ds = require 'dslua'
local ffi = require 'ffi'

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk, bench_timespec *ts);
]]
local ts = ffi.new('bench_timespec')
local function now()
  ffi.C.clock_gettime(1, ts)   -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + 1e-9 * tonumber(ts.tv_nsec)
end

local quick = arg[1] == 'quick'
local SAMPLES = quick and 3 or 7
local SAMPLE_S = quick and 0.02 or 0.1   -- each sample runs the op this long at least

-- Seconds per call of fn: one call to size the samples, warm-up calls for
-- about one sample's time, then the median of SAMPLES samples of k calls.
local function time_per_call(fn)
  local t0 = now()
  fn()
  local k = math.max(1, math.floor(SAMPLE_S / math.max(now() - t0, 1e-9)))
  for _ = 1, math.max(2, k) do fn() end
  local t = {}
  for s = 1, SAMPLES do
    t0 = now()
    for _ = 1, k do fn() end
    t[s] = (now() - t0) / k
  end
  table.sort(t)
  return t[(SAMPLES + 1) / 2]
end

local function emit(op, shape, value, unit)
  print(string.format('result\tdslua\t%s\t%s\t%s\t%s', op, shape, value, unit))
  io.stdout:flush()
end

local function shape_str(s) return table.concat(s, 'x') end

-- Each row: op name, shape, the dslua function it needs, and a maker that
-- returns the call to time.
local rows = {}
local function row(op, shape, needs, make) rows[#rows + 1] = { op = op, shape = shape, needs = needs, make = make } end

local gemm_sizes = { 256, 512, 1024, 2048 }
local big_shapes = { { 4096, 768 }, { 8192, 1024 } }

for _, n in ipairs(gemm_sizes) do
  row('matmul', { n, n }, 'matmul', function()
    local a, b = ds.randn(n, n), ds.randn(n, n)
    return function() return ds.matmul(a, b) end, 2 * n * n * n
  end)
end
for _, s in ipairs(big_shapes) do
  row('add', s, 'add', function()
    local a, b = ds.randn(s), ds.randn(s)
    return function() return a + b end
  end)
end
-- the add kernel alone, without allocating the output
for _, s in ipairs(big_shapes) do
  row('add_', s, 'add_', function()
    local a, b = ds.randn(s), ds.randn(s)
    return function() return a:add_(b) end
  end)
end
for _, s in ipairs(big_shapes) do
  row('gelu_tanh', s, 'gelu', function()
    local x = ds.randn(s)
    return function() return x:gelu('tanh') end
  end)
end
for _, s in ipairs(big_shapes) do
  row('layer_norm', s, 'layer_norm', function()
    local x, w, b = ds.randn(s), ds.randn(s[2]), ds.randn(s[2])
    return function() return ds.layer_norm(x, w, b, 1e-5) end
  end)
end
for _, s in ipairs(big_shapes) do
  row('softmax', s, 'softmax', function()
    local x = ds.randn(s)
    return function() return ds.softmax(x, -1) end
  end)
end
row('small_add', { 16 }, 'add', function()
  local a, b = ds.randn(16), ds.randn(16)
  return function() return a + b end
end)

print(string.format('info\tdslua\tthreads\t%d', ds.num_threads()))
for _, r in ipairs(rows) do
  local shape = shape_str(r.shape)
  if not ds[r.needs] then
    emit(r.op, shape, 'missing', '-')
  else
    local fn, flops = r.make()
    local ok, res = pcall(fn)   -- a call that fails (API still moving) is reported, not fatal
    if not ok then
      io.stderr:write(string.format('bench/ops.lua: %s %s failed: %s\n', r.op, shape, tostring(res)))
      emit(r.op, shape, 'error', '-')
    else
      local t = time_per_call(fn)
      if flops then emit(r.op, shape, string.format('%.6g', flops / t * 1e-9), 'gflops')
      else emit(r.op, shape, string.format('%.6g', t), 's') end
    end
    collectgarbage()
  end
end
