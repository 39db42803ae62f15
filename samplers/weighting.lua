-- An accumulation window's samples, as the engine weights its gradients.
-- Without a sampler block each micro step's loss is divided by
-- gradient_accumulation_steps and the window only counts what it read.
-- With one (weighted) each rank reads its own number of samples: micro
-- steps inside a window leave the sum of their samples' gradients (loss *
-- b); the boundary learns the global count G and scales what is there and
-- its own loss by world_size / G, so after the reduction's average the
-- gradient is the mean over the G samples. A rank out of data joins:
-- join_round tells it whether any rank still has a window to step.
local ds = require 'dslua'

local M = {}

local Window = {}
Window.__index = Window

function M.new(world_size, weighted)
  return setmetatable({ world_size = world_size, weighted = weighted, samples = 0, seconds = 0 }, Window)
end

-- The coming micro step's samples: of the batch forward saw (nil: not
-- known), or of the loader's step; forget() drops both.
function Window:batch(b) self.micro = b end
function Window:loader_batch(b) self.loader = b end
function Window:forget() self.micro, self.loader = nil, nil end

-- Compute time spent in this window (the auto policy measures it).
function Window:time(seconds) self.seconds = self.seconds + seconds end

-- {this rank's window samples, 1 if it still has data} summed over ranks.
function Window:_count(samples, active)
  if self.world_size == 1 then return samples, active end
  local t = ds.tensor({ samples, active }, 'f64')
  ds.comm.all_reduce(t, 'sum')
  local v = t:totable()
  return v[1], v[2]
end

-- A micro step's backward, unweighted: its samples counted (the micro
-- batch size when forward saw none).
function Window:add(default)
  self.samples = self.samples + (self.micro or default)
  self.micro = nil
end

-- A micro step's backward, weighted -> the factor for its loss and the
-- factor for the gradients accumulated before it (1: leave them), or nil
-- when its number of samples is not known.
function Window:weigh(boundary)
  local b = self.micro or self.loader
  self:forget()
  if not b then return nil end
  local earlier = self.samples
  self.samples = earlier + b
  if not boundary then return b, 1 end
  local G = self:_count(self.samples, 1)
  self.step_samples = G
  local f = self.world_size / G
  return b * f, earlier > 0 and f or 1
end

-- A joined rank's round -> G (0: nothing pending on any rank), the
-- number of ranks still with data, and the factor for its pending
-- gradients (1: leave them).
function Window:join_round()
  local pending = self.samples
  local G, active = self:_count(pending, 0)
  if G == 0 then return 0, active, 1 end
  self.step_samples = G
  return G, active, pending > 0 and self.world_size / G or 1
end

-- The boundary's step is done -> the samples it stepped on every rank
-- (weighted); the window starts again. The auto policy (sampler) gets
-- every rank's window.
function Window:stepped(sampler)
  if sampler and sampler:observing() then sampler:exchange(self.samples, self.seconds) end
  local G = self.step_samples or 0
  self.step_samples, self.samples, self.seconds = nil, 0, 0
  return G
end

return M
