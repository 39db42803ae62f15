-- ds.checkpointing: activation checkpointing, as deepspeed.checkpointing.
--
--   y = ds.checkpoint(fn, x, ...)       -- or ds.checkpointing.checkpoint
--
-- runs fn(x, ...) with autograd off, so none of its intermediate
-- activations are kept, and records one node from the tensor arguments that
-- need grad to y. Backward runs fn again with autograd on, from the saved
-- arguments and the random-number states fn first saw, the tracker's too
-- (dropout draws the same masks), and backpropagates through that copy:
-- parameters fn uses get their gradients there, the arguments' gradients
-- go on down the graph.
-- fn returns one tensor; other arguments (numbers, tables, tensors that need
-- no grad) are passed through as they are, both times.
local C = require 'dslua.core'
local fp8 = require 'dslua.nn.fp8'

local M = {}

-- the activation_checkpointing config block (ds.config's filled copy)
M.config = nil

function M.configure(block) M.config = block end

-- deepspeed.checkpointing.is_configured
function M.is_configured() return M.config ~= nil end

-- The model-parallel random states (Megatron's and DeepSpeed's RNG
-- tracker): named generator states kept apart from the default one.
-- tracker:fork(name, fn, ...) runs fn with the default generator set to
-- the named state and saves where it left it. Dropout on an activation
-- split across a tensor group runs forked (a different state on each
-- tensor rank); on a replicated activation it draws from the default
-- generator, the same on every rank of the group.
local tracker = { states = {} }

function tracker:add(name, seed)
  if self.states[name] then error(string.format("rng tracker: state '%s' exists already", name), 2) end
  local saved = C.get_rng_state()
  C.manual_seed(seed)
  self.states[name] = C.get_rng_state()
  C.set_rng_state(saved)
end

function tracker:reset() self.states = {} end
function tracker:get_states()
  local out = {}
  for k, v in pairs(self.states) do out[k] = v end
  return out
end
function tracker:set_states(states) self.states = states end

function tracker:fork(name, fn, ...)
  local state = self.states[name]
  if not state then
    error(string.format("rng tracker: no state '%s' (model_parallel_manual_seed makes it)", name), 2)
  end
  local saved = C.get_rng_state()
  C.set_rng_state(state)
  local res = { pcall(fn, ...) }
  self.states[name] = C.get_rng_state()
  C.set_rng_state(saved)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

M.MODEL_PARALLEL_RNG = 'model-parallel-rng'
function M.get_rng_tracker() return tracker end

-- Megatron's model_parallel_cuda_manual_seed: the default generator from
-- seed (the same on a tensor group's ranks), the model-parallel state
-- from seed + 2718 + tensor_rank.
function M.model_parallel_manual_seed(seed, tensor_rank)
  C.manual_seed(seed)
  tracker:reset()
  tracker:add(M.MODEL_PARALLEL_RNG, seed + 2718 + (tensor_rank or 0))
end

local function run_with_grad(fn, args, n)
  local prev = C.set_grad_enabled(true)
  local ok, y = pcall(fn, unpack(args, 1, n))
  C.set_grad_enabled(prev)
  if not ok then error(y, 0) end
  return y
end

function M.checkpoint(fn, ...)
  if type(fn) ~= 'function' and not (type(fn) == 'table' and getmetatable(fn) and getmetatable(fn).__call) then
    error('ds.checkpoint: expected a function to run, got a ' .. type(fn), 2)
  end
  local n = select('#', ...)
  local args = { ... }
  -- the tensors that need grad become the node's inputs; the rest is kept as is
  local slots, inputs = {}, {}
  for i = 1, n do
    local a = args[i]
    if C.is_tensor(a) and a.requires_grad then
      slots[#slots + 1] = i
      inputs[#inputs + 1] = a
    end
  end
  local rng, states = C.get_rng_state(), tracker:get_states()
  local recipe = fp8.active()     -- recomputed in the same fp8 scope, so the same casts and codes
  local prev = C.set_grad_enabled(false)
  local ok, out = pcall(fn, ...)
  C.set_grad_enabled(prev)
  if not ok then error(out, 0) end
  -- fn's intermediates are unreachable now, but Lua holds their bytes until
  -- its collector runs: collect here, or checkpointing saves nothing
  collectgarbage()
  if not C.is_tensor(out) then
    error('ds.checkpoint: fn must return one tensor, it returned a ' .. type(out), 2)
  end
  if not prev then return out end
  -- with no argument needing grad, fn's parameters still need the node: a
  -- stand-in leaf (its gradient stays nil) makes autograd record it
  if #inputs == 0 then inputs[1] = C.zeros({}):requires_grad_(true) end
  local template = args
  for _, i in ipairs(slots) do template[i] = nil end   -- the node saves those
  local function backward(grad, ...)
    local call = {}
    for i = 1, n do call[i] = template[i] end
    local xs = {}
    for k, i in ipairs(slots) do
      local x = select(k, ...):detach()
      x:requires_grad_(true)
      xs[k] = x
      call[i] = x
    end
    local now, now_states = C.get_rng_state(), tracker:get_states()
    C.set_rng_state(rng)
    tracker:set_states(states)
    local ok2, y
    if recipe then
      ok2, y = pcall(fp8.autocast, recipe, run_with_grad, fn, call, n)
    else
      ok2, y = pcall(run_with_grad, fn, call, n)
    end
    C.set_rng_state(now)
    tracker:set_states(now_states)
    if not ok2 then error('ds.checkpoint: recomputing in backward: ' .. tostring(y), 0) end
    if not C.is_tensor(y) then error('ds.checkpoint: recomputing in backward, fn returned a ' .. type(y), 0) end
    if y.requires_grad then y:backward(grad) end
    local grads = {}
    for k = 1, #slots do grads[k] = xs[k].grad end
    y, call, xs = nil, nil, nil
    collectgarbage()   -- the recomputed activations, before the next segment's
    return unpack(grads, 1, #inputs)
  end
  return C.function_node(out, backward, unpack(inputs))
end

-- A model's `checkpoint` option: false (off), true (every block) or k
-- (segments of k blocks). Returns the segment length, 0 for off.
function M.interval(model, v)
  if v == false or v == nil then return 0 end
  if v == true then return 1 end
  if type(v) ~= 'number' or v < 1 or v % 1 ~= 0 then
    error(string.format('%s: checkpoint must be false, true or a positive number of blocks per segment, got %s',
                        model, tostring(v)), 0)
  end
  return v
end

-- How f takes a residual still to be added, from its class's
-- residual_kind: 'block' (f(x, ..., res), res a tensor or false, returns
-- h, r, f's output being h + r, res added to x by its first norm), 'norm'
-- (f(x, res) returns norm(x + res) first; f(x, false) norm(x)), or nil (a
-- plain tensor in, the sum made before it).
local function residual_kind(f)
  return type(f) == 'table' and f.residual_kind or nil
end

-- x through the blocks of list (a ModuleList or an array) in turn, a
-- block called as block(x, ...); returns h, r, the result being h + r (r
-- nil when nothing is left to add). Blocks and norms that take a residual
-- (residual_kind) pass the last residual add on: each block hands its r
-- to the next block's first norm or to the norm after it, and one that
-- takes a plain tensor gets the sum made first. With every > 0 the blocks
-- run in checkpointed segments of `every`, each taking and returning one
-- tensor (its r added at its end).
function M.residual_sequential(list, every, x, ...)
  local blocks, kinds = {}, {}
  for i, b in ipairs(list) do blocks[i], kinds[i] = b, residual_kind(b) end
  local n = #blocks
  local function run(first, last, h, ...)
    local r, args, k = nil, { h, ... }, select('#', ...) + 2
    for i = first, last do
      local f, kind = blocks[i], kinds[i]
      if kind == 'block' then
        args[1], args[k] = h, r or false
        h, r = f(unpack(args, 1, k))
      elseif kind == 'norm' then
        h, r = (f(h, r or false)), nil
      else
        if r then h, r = h + r, nil end
        h = f(h, ...)
      end
    end
    return h, r
  end
  if every == 0 then return run(1, n, x, ...) end
  for first = 1, n, every do
    local last = math.min(first + every - 1, n)
    x = M.checkpoint(function(h, ...)
      local y, r = run(first, last, h, ...)
      if r then y = y + r end
      return y
    end, x, ...)
  end
  return x, nil
end

-- The same, the result as one tensor (the last residual added): what a
-- pipeline stage hands the next.
function M.sequential(list, every, x, ...)
  local h, r = M.residual_sequential(list, every, x, ...)
  if r then h = h + r end
  return h
end

return M
