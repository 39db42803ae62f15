-- For multi-rank spec children: writes value as JSON to path (the file
-- the parent spec reads back with H.run_json).
local ds = require 'dslua'

return function(path, value)
  local f = assert(io.open(path, 'w'))
  f:write(ds.json.encode(value))
  f:close()
end
