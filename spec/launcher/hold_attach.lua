-- Run on 2 ranks by spec/launcher_spec.lua through the launcher: an engine
-- that serves `dslua attach` (its sockets under $DSLUA_ATTACH_DIR), then
-- <out>/ready.<rank>, then a wait until the job is killed.
local ds = require 'dslua'
local out = arg[1]:match('^%-%-out=(.*)$')
local model = require('models.mlp') { input_size = 2, hidden = { 2 }, num_classes = 2 }
local engine = ds.initialize { model = model, config = { train_batch_size = 2 * ds.comm.world_size(),
                                                        optimizer = { type = 'SGD', params = { lr = 0.1 } } } }
assert(engine.reload.server, 'not serving attach')
ds.comm.barrier()
assert(io.open(out .. '/ready.' .. ds.comm.rank(), 'w')):close()
while true do os.execute('sleep 1') end
