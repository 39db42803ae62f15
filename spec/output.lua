-- busted output: the plain terminal report, then one closing line
-- "specs: N passed, N failed, N skipped" that CI reads.
return function(options)
  local busted = require 'busted'
  local handler = require('busted.outputHandlers.plainTerminal')(options)
  busted.subscribe({ 'suite', 'end' }, function()
    io.write(string.format('specs: %d passed, %d failed, %d skipped\n', handler.successesCount,
                           handler.failuresCount + handler.errorsCount, handler.pendingsCount))
    io.flush()
    return nil, true
  end)
  return handler
end
