-- Whole files as strings, for the modules that read small text files
-- (manifests, `latest`, hostfiles, /proc entries, watched scripts), through
-- the guarded open (core/io/ds_file.h): no link another user could plant
-- is followed, a FIFO or a device is refused, the size is bounded.
local C = require('dslua.core').file

local M = {}

M.MAX_BYTES = 64 * 1024 * 1024

-- The bytes of the file at path (at most max_bytes, M.MAX_BYTES by
-- default), or nil and the reason when there is no file there; raises
-- when there is one dslua must not read.
function M.read(path, max_bytes)
  local ok, text = pcall(C.read, path, max_bytes or M.MAX_BYTES)
  if ok then return text end
  if text:find(': No such file or directory$') or text:find(': Not a directory$') then return nil, text end
  error(text, 0)
end

-- The bytes of the file at path, or nil and why not (there is none, or
-- dslua must not read it), without the path: for messages that name it.
function M.text(path, max_bytes)
  local ok, text, err = pcall(M.read, path, max_bytes)
  if ok and text then return text end
  return nil, M.reason(text or err, path)
end

-- err, a message of the guarded open about path, without the path where it
-- leads ("is a FIFO, expected a regular file"), for messages that name
-- the file already.
function M.reason(err, path)
  for _, head in ipairs({ "cannot open '" .. path .. "': ", "'" .. path .. "': ", "'" .. path .. "' " }) do
    if err:sub(1, #head) == head then return err:sub(#head + 1) end
  end
  return err
end

return M
