-- The join protocol of the sampler block's uneven ranks: a rank whose
-- data has run out takes part in each step of the others (its pending
-- window, if any, then nothing), so the collectives match and its weights
-- stay the same as theirs. When all have run out, a window some rank left
-- unfinished is stepped with what it has (samplers/weighting.lua's
-- join_round counts the ranks and samples left).
--
-- It drives the engine through a narrow set of moves:
--   engine.steps:reduces(false)          does a micro step inside a window reduce?
--   engine:is_gradient_accumulation_boundary()
--   engine:_shadow_loss()                a loss of zero weight (nil below stage 3)
--   engine:_idle_micro_step(loss)        a micro step's backward of it, no step
--   engine:_join_step(loss, f)           the window's gradients times f, its last backward and the step
--   engine:_drop_window()                nothing pending anywhere: the window's micro steps go
local M = {}

-- Every rank calls it, any number of times, once its data has run out.
function M.join(engine, window)
  window:forget()
  -- from stage 2 every micro step reduces: the window's other micro steps too
  local every = engine.steps:reduces(false)
  while true do
    while every and not engine:is_gradient_accumulation_boundary() do
      engine:_idle_micro_step(engine:_shadow_loss())
    end
    local loss = engine:_shadow_loss()
    local G, active, f = window:join_round()
    if G == 0 then
      engine:_drop_window()
      return
    end
    engine:_join_step(loss, f)
    if active == 0 then return end
  end
end

-- An epoch of the engine's loader over a sampler: each step's batch size
-- noted for the weighting, and the end joining the ranks still running.
-- it: the loader's own iterator; step: the steps already read (resumed).
function M.epoch(engine, window, sampler, it, step)
  local ended = false
  return function()
    if ended then return nil end
    local s, batch = it()
    if s == nil then
      ended = true
      engine:join()
      return nil
    end
    step = step + 1
    window:loader_batch(sampler:batch_size(step))
    return s, batch
  end
end

return M
