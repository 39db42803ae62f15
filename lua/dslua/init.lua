-- dslua: tensors and autograd from the C core, with the Lua conveniences
-- on top. `local ds = require 'dslua'`.
local C = require 'dslua.core'

local ds = {}
for k, v in pairs(C) do ds[k] = v end
-- registered before the modules below load, so they may require 'dslua'
package.loaded.dslua = ds

require('dslua.base.tensor').install(C)

local function with_grad(enabled, fn, ...)
  local prev = C.set_grad_enabled(enabled)
  local res = { pcall(fn, ...) }
  C.set_grad_enabled(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Runs fn(...) with autograd off and returns its results; the previous
-- mode comes back even when fn raises.
function ds.no_grad(fn, ...) return with_grad(false, fn, ...) end

function ds.enable_grad(fn, ...) return with_grad(true, fn, ...) end

-- ds.crossings(fn, ...) -> n, fn's results: how often the Lua-C boundary
-- was crossed while fn ran: calls of C functions (the binding's and Lua's
-- own built-ins) made from Lua and calls of Lua functions made from C (a
-- C function that C calls, as each binding function is called through the
-- one that names its errors, crosses nothing). The JIT is off meanwhile,
-- since compiled code runs no hooks; for specs and benchmarks.
function ds.crossings(fn, ...)
  local n = 0
  local function count()
    local caller = debug.getinfo(3, 'S')
    if (debug.getinfo(2, 'S').what == 'C') ~= (caller ~= nil and caller.what == 'C') then n = n + 1 end
  end
  jit.flush()
  jit.off()
  debug.sethook(count, 'c')
  local res = { pcall(fn, ...) }
  debug.sethook()
  jit.on()
  if not res[1] then error(res[2], 0) end
  return n, unpack(res, 2, table.maxn(res))
end

-- the library's modules
ds.nn = require 'dslua.nn'
ds.lr = require 'dslua.optim.lr'
ds.data = require 'dslua.io.data'
ds.optim = require 'dslua.optim'
ds.json = require 'dslua.base.json'
ds.config = require 'dslua.config'
ds.args = require 'dslua.base.args'
-- ds.device(): this rank's device, the --device flag first (core/cuda/ds_rank_device.h)
local device_of = C.device
function ds.device(t)
  if t == nil then return device_of(ds.args.device) end
  return device_of(t)
end
ds.comm = require 'dslua.parallel.comm'
ds.reload = require 'dslua.live.reload'
ds.checkpoint = require 'dslua.io.checkpoint'
ds.checkpointing = require 'dslua.nn.checkpointing'
ds.fp8 = require 'dslua.nn.fp8'
-- ds.checkpoint(fn, ...) is activation checkpointing; ds.checkpoint.save and
-- the rest stay the checkpoint files' module
setmetatable(ds.checkpoint, { __call = function(_, ...) return ds.checkpointing.checkpoint(...) end })
ds.pipe = require 'dslua.parallel.pipe'

-- PyTorch's TF32 switches: ds.backends.cuda.matmul.allow_tf32 (f32 GEMMs
-- through cuBLASLt) and ds.backends.cudnn.allow_tf32 (convolutions), both
-- off until set; ds.cuda.allow_tf32 underneath
local function tf32_switch(name, use)
  local function check(k)
    if k ~= 'allow_tf32' then error(string.format("%s has allow_tf32 only, not '%s'", name, tostring(k)), 3) end
  end
  return setmetatable({}, {
    __index = function(_, k) check(k); return C.cuda.allow_tf32(nil, use) end,
    __newindex = function(_, k, v)
      check(k)
      if type(v) ~= 'boolean' then error(name .. '.allow_tf32: expected a boolean, got ' .. type(v), 2) end
      C.cuda.allow_tf32(v, use)
    end,
  })
end
ds.backends = { cuda = { matmul = tf32_switch('ds.backends.cuda.matmul', 'matmul') },
                cudnn = tf32_switch('ds.backends.cudnn', 'cudnn') }
ds.topology = require 'dslua.parallel.topology'
ds.sequence = require 'dslua.parallel.sequence'
ds.nn.parallel = require 'dslua.parallel.tensor'   -- tensor parallelism; its layers join ds.nn too
-- ds.zero.Init(config, fn): a model built partitioned for ZeRO stage 3
-- (lua/dslua/engine/zinit.lua)
ds.zero = require 'dslua.engine.zinit'
-- ds.initialize{model, config, ...} -> engine, optimizer, loader, scheduler:
-- deepspeed.initialize (lua/dslua/engine/init.lua), loaded when first called.
ds.initialize = function(...) return require('dslua.engine').initialize(...) end

return ds
