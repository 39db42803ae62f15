-- Whole files as strings, for the modules that read small text files
-- (manifests, `latest`, hostfiles, /proc entries, watched scripts).
local M = {}

-- The bytes of the file at path, or nil and the reason it cannot be read.
function M.read(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local text = f:read('*a')
  f:close()
  return text
end

return M
