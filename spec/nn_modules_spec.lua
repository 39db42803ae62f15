-- ds.nn: the Module base (registration order, names, state_dict, modes),
-- PyTorch's initial distributions, each layer against the functional op it
-- wraps, gradients in f64 and the errors of bad constructions.
local H = require 'helpers'
local ds = H.ds
local nn = ds.nn

local fails = H.fails

local function names(list)
  local out = {}
  for i, e in ipairs(list) do out[i] = e[1] end
  return table.concat(out, ' ')
end

local function shape(t) return table.concat(t:size(), 'x') end

local function max_diff(a, b) return (a:to('f64') - b:to('f64')):abs():amax():item() end

-- mean, variance, min and max of a tensor's values
local function moments(t)
  local f = t:detach():to('f64')
  return f:mean():item(), f:var():item(), f:amin():item(), f:amax():item()
end

local Net = nn.Module:extend('Net')
function Net:init()
  self.fc1 = nn.Linear(4, 8)
  self.act = nn.ReLU()
  self.scale = nn.parameter(ds.ones({ 8 }))
  self.fc2 = nn.Linear(8, 3, false)
end
function Net:forward(x) return self.fc2(self.act(self.fc1(x)) * self.scale) end

describe('nn.Module', function()
  it('registers parameters and children in assignment order, with torch names', function()
    local net = Net()
    assert.are.equal('scale fc1.weight fc1.bias fc2.weight', names(net:named_parameters()))
    assert.are.equal(' fc1 act fc2', names(net:named_modules()))
    assert.are.equal('fc1 act fc2', names(net:named_children()))
    assert.are.equal(4, #net:parameters())
    assert.are.equal(8 + 32 + 8 + 24, net:num_parameters())
    local p = net:named_parameters()[2]
    assert.are.equal('fc1.weight', p.name)
    assert.is_true(rawequal(p.tensor, net.fc1.weight))
    for _, t in ipairs(net:parameters()) do
      assert.is_true(t.requires_grad)
      assert.is_true(t.is_leaf)
    end
  end)

  it('leaves computed tensors and other values as plain fields', function()
    local m = nn.Module()
    m.w = nn.parameter(ds.ones({ 2 }))
    m.cache = m.w * 2
    m.frozen = ds.ones({ 2 })
    m.size = 3
    assert.are.equal('w', names(m:named_parameters()))
    assert.are.equal('w', table.concat(m:state_keys(), ' '))
  end)

  it('names list entries from 0 as ModuleList and Sequential do', function()
    local seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert.are.equal('0.weight 0.bias 2.weight 2.bias', names(seq:named_parameters()))
    local list = nn.ModuleList({ nn.Linear(2, 2) }):append(nn.LayerNorm(2))
    assert.are.equal('0.weight 0.bias 1.weight 1.bias', names(list:named_parameters()))
    local outer = nn.Module()
    outer.h = list
    assert.are.equal('h.0.weight h.0.bias h.1.weight h.1.bias', names(outer:named_parameters()))
    local n = 0
    for i, m in ipairs(list) do n = n + 1; assert.are.equal(i == 1 and 'Linear' or 'LayerNorm', m.__name) end
    assert.are.equal(2, n)
  end)

  it('counts parameters as parameter memory', function()
    local before = ds.memory_stats().current.parameters
    local lin = nn.Linear(100, 50)
    assert.are.equal(before + (100 * 50 + 50) * 4, ds.memory_stats().current.parameters)
    assert.is_not_nil(lin)
  end)

  it('calls forward through __call', function()
    local net = Net()
    local x = ds.randn({ 5, 4 })
    assert.are.equal(0, max_diff(net(x), net:forward(x)))
    assert.are.equal('5x3', shape(net(x)))
  end)

  it('lists a tied tensor once in named_parameters and under both names in state_dict', function()
    local m = nn.Module()
    m.emb = nn.Embedding(10, 4)
    m.head = nn.Linear(4, 10, false)
    m.head.weight = m.emb.weight
    assert.are.equal('emb.weight', names(m:named_parameters()))
    local sd, keys = m:state_dict(), m:state_keys()
    assert.are.equal('emb.weight head.weight', table.concat(keys, ' '))
    assert.are.equal(0, max_diff(sd['emb.weight'], sd['head.weight']))
  end)

  it('state_dict shares memory with the parameters and has no autograd', function()
    local lin = nn.Linear(3, 2)
    local sd = lin:state_dict()
    assert.is_false(sd.weight.requires_grad)
    ds.no_grad(function() sd.weight:fill_(0.5) end)
    assert.are.equal(0.5, lin.weight:amax():item())
  end)

  it('load_state_dict round-trips between two modules', function()
    local a, b = Net(), Net()
    b:load_state_dict(a:state_dict())
    local x = ds.randn({ 3, 4 })
    assert.are.equal(0, max_diff(a(x), b(x)))
    assert.is_true(b.fc1.weight.requires_grad)
  end)

  it('load_state_dict accepts a missing name whose tensor is tied to a present one', function()
    local function tied()
      local m = nn.Module()
      m.emb = nn.Embedding(10, 4)
      m.head = nn.Linear(4, 10, false)
      m.head.weight = m.emb.weight
      return m
    end
    local a, b = tied(), tied()
    b:load_state_dict({ ['emb.weight'] = a.emb.weight })
    assert.are.equal(0, max_diff(b.head.weight, a.emb.weight))
  end)

  it('load_state_dict reports every problem at once and copies nothing then', function()
    local net = Net()
    local before = net.fc1.weight:clone()
    local sd = net:state_dict()
    sd['fc1.weight'] = ds.zeros({ 9, 9 })
    sd['fc2.weight'] = nil
    sd['fc3.weight'] = ds.zeros({ 1 })
    sd['scale'] = 'oops'
    local ok, err = pcall(net.load_state_dict, net, sd)
    assert.is_false(ok)
    assert.matches('Error%(s%) in loading state_dict for Net', err)
    assert.matches('Missing key%(s%) in state_dict: fc2.weight', err)
    assert.matches('Unexpected key%(s%) in state_dict: fc3.weight', err)
    assert.matches('size mismatch for fc1.weight: copying a param with shape %[9x9%] from checkpoint, '
                   .. 'the shape in current model is %[8x4%]', err)
    assert.matches('scale: expected a tensor, got string', err)
    assert.are.equal(0, max_diff(net.fc1.weight, before))
  end)

  it('load_state_dict with strict = false returns missing and unexpected keys', function()
    local net = Net()
    local sd = net:state_dict()
    sd['fc2.weight'] = nil
    sd['extra'] = ds.zeros({ 1 })
    local missing, unexpected = net:load_state_dict(sd, false)
    assert.are.same({ 'fc2.weight' }, missing)
    assert.are.same({ 'extra' }, unexpected)
    fails('load_state_dict expects a table', net.load_state_dict, net, 42)
  end)

  it('keeps non-persistent buffers out of state_dict and persistent ones in', function()
    local m = nn.Module()
    m:register_buffer('table', ds.ones({ 3 }), false)
    m:register_buffer('count', ds.zeros({ 1 }))
    local keys = m:state_keys()
    assert.are.equal('count', table.concat(keys, ' '))
    assert.are.equal('table count', names(m:named_buffers()))
    assert.are.equal(0, #m:parameters())
  end)

  it('train() and eval() reach every descendant and switch Dropout', function()
    local seq = nn.Sequential(nn.Linear(50, 50), nn.Dropout(0.5))
    assert.is_true(seq.training and seq[2].training)
    local x = ds.ones({ 4, 50 })
    local a = seq(x)
    seq:eval()
    assert.is_false(seq[1].training or seq[2].training)
    assert.are.equal(0, max_diff(seq(x), seq[1](x)))
    seq:train()
    assert.is_true(seq[2].training)
    assert.is_true(max_diff(a, seq[1](x)) > 0)
  end)

  it('zero_grad zeroes gradients in place, or drops them with set_to_none', function()
    local net = Net()
    net(ds.randn({ 2, 4 })):sum():backward()
    local g = net.fc1.weight.grad
    assert.is_true(g:abs():amax():item() > 0)
    net:zero_grad()
    assert.are.equal(0, net.fc1.weight.grad:abs():amax():item())
    assert.are.equal(0, g:abs():amax():item())
    net:zero_grad(true)
    assert.is_nil(net.fc1.weight.grad)
  end)

  it('to() converts every tensor, keeps ties and requires_grad', function()
    local m = nn.Module()
    m.emb = nn.Embedding(10, 4)
    m.head = nn.Linear(4, 10)
    m.head.weight = m.emb.weight
    m:register_buffer('buf', ds.zeros({ 2 }))
    local w = m.emb.weight:clone()
    local old_bias = m.head.bias
    local _, moved = m:to('f64')
    assert.is_true(rawequal(moved[old_bias], m.head.bias))
    assert.are.equal('f64', m.emb.weight:dtype())
    assert.are.equal('f64', m.head.bias:dtype())
    assert.are.equal('f64', m.buf:dtype())
    assert.is_true(rawequal(m.emb.weight, m.head.weight))
    assert.is_true(m.emb.weight.requires_grad and m.emb.weight.is_leaf)
    assert.are.equal(0, max_diff(m.emb.weight, w))
    assert.are.equal('emb.weight head.bias', names(m:named_parameters()))
  end)

  it('apply visits children before parents', function()
    local seen = {}
    Net():apply(function(m) seen[#seen + 1] = m.__name end)
    assert.are.equal('Linear ReLU Linear Net', table.concat(seen, ' '))
  end)

  it('weight_decay_groups splits matrices from vectors as nanoGPT does', function()
    local groups = Net():weight_decay_groups(0.1)
    assert.are.equal(2, #groups[1].params)
    assert.are.equal(2, #groups[2].params)
    assert.are.equal(0.1, groups[1].weight_decay)
    assert.are.equal(0, groups[2].weight_decay)
  end)

  it('prints as torch prints modules, children numbered as Lua indexes them', function()
    local s = tostring(nn.Sequential(nn.Linear(2, 3), nn.GELU('tanh')))
    assert.are.equal("Sequential(\n  (1): Linear(in_features=2, out_features=3, bias=true)\n"
                     .. "  (2): GELU(approximate='tanh')\n)", s)
  end)

  it('raises for a container without forward and for clashing registrations', function()
    fails('Module: forward is not implemented', function() return nn.Module()(ds.ones({ 1 })) end)
    local m = nn.Module()
    m.a = nn.Linear(1, 1)
    fails("'a' is already registered as a module", m.register_parameter, m, 'a', ds.ones({ 1 }))
    fails("register_parameter 'b' expects a tensor or nil, got number", m.register_parameter, m, 'b', 3)
    fails("add_module 'c' expects a module, got table", m.add_module, m, 'c', {})
  end)
end)

describe('nn initialisation', function()
  ds.manual_seed(7)

  it('Linear: weight and bias uniform in +-1/sqrt(in_features)', function()
    local lin = nn.Linear(400, 300)
    local b = 1 / math.sqrt(400)
    local mean, var, lo, hi = moments(lin.weight)
    assert.is_true(lo >= -b and hi <= b)
    assert.is_true(math.abs(mean) < 0.02 * b)
    assert.is_true(math.abs(var / (b * b / 3) - 1) < 0.02)
    mean, var, lo, hi = moments(lin.bias)
    assert.is_true(lo >= -b and hi <= b and hi > 0.8 * b and lo < -0.8 * b)
  end)

  it('Conv2d: bound 1/sqrt(in_channels/groups * kh * kw)', function()
    local conv = nn.Conv2d(8, 64, 3, { groups = 2 })
    assert.are.equal('64x4x3x3', shape(conv.weight))
    local b = 1 / math.sqrt(4 * 9)
    local _, var, lo, hi = moments(conv.weight)
    assert.is_true(lo >= -b and hi <= b)
    assert.is_true(math.abs(var / (b * b / 3) - 1) < 0.06)
  end)

  it('Embedding: N(0, 1)', function()
    local mean, var = moments(nn.Embedding(200, 100).weight)
    assert.is_true(math.abs(mean) < 0.02)
    assert.is_true(math.abs(var - 1) < 0.03)
  end)

  it('LayerNorm and RMSNorm: ones and zeros', function()
    local ln = nn.LayerNorm(6)
    assert.are.same({ 1, 1, 1, 1, 1, 1 }, ln.weight:totable())
    assert.are.same({ 0, 0, 0, 0, 0, 0 }, ln.bias:totable())
    assert.is_nil(nn.LayerNorm(6, { bias = false }).bias)
    assert.are.equal(0, #nn.LayerNorm(6, { elementwise_affine = false }):parameters())
    assert.are.same({ 1, 1, 1 }, nn.RMSNorm(3).weight:totable())
  end)

  it('nn.init fillers and skip_init', function()
    local t = ds.zeros({ 1000 })
    nn.init.normal_(t, 2, 0.5)
    local mean, var = moments(t)
    assert.is_true(math.abs(mean - 2) < 0.05 and math.abs(var - 0.25) < 0.03)
    nn.init.kaiming_uniform_(t:view({ 10, 100 }), math.sqrt(5))
    local _, _, lo, hi = moments(t)
    assert.is_true(lo >= -0.1 and hi <= 0.1)
    local lin = nn.skip_init(nn.Linear, 3, 2)
    assert.are.equal(0, lin.weight:abs():amax():item())
    assert.is_true(lin.weight.requires_grad)
    assert.is_true(nn.Linear(3, 2).weight:abs():amax():item() > 0)
  end)
end)

describe('nn layers', function()
  it('Linear, Conv2d, pools and Embedding compute their functional op', function()
    local x = ds.randn({ 2, 3, 8, 8 })
    local conv = nn.Conv2d(3, 4, { 3, 3 }, { stride = 2, padding = 1 })
    assert.are.equal(0, max_diff(conv(x), ds.conv2d(x, conv.weight, conv.bias, { stride = 2, padding = 1 })))
    assert.is_nil(nn.Conv2d(3, 4, 3, { bias = false }).bias)
    assert.are.equal(0, max_diff(nn.MaxPool2d(2)(x), ds.max_pool2d(x, 2)))
    assert.are.equal(0, max_diff(nn.MaxPool2d(3, { stride = 1, padding = 1 })(x),
                                 ds.max_pool2d(x, 3, { stride = 1, padding = 1 })))
    assert.are.equal(0, max_diff(nn.AvgPool2d(2, { count_include_pad = false })(x), ds.avg_pool2d(x, 2)))
    local lin = nn.Linear(8, 5)
    assert.are.equal(0, max_diff(lin(x), ds.linear(x, lin.weight, lin.bias)))
    local emb = nn.Embedding(10, 3)
    local ids = ds.tensor({ { 0, 9 }, { 3, 3 } }, 'i64')
    assert.are.equal(0, max_diff(emb(ids), ds.embedding(emb.weight, ids)))
  end)

  it('norms and activations compute their functional op', function()
    local x = ds.randn({ 3, 5 })
    local ln = nn.LayerNorm(5, { eps = 1e-3 })
    assert.are.equal(0, max_diff(ln(x), ds.layer_norm(x, ln.weight, ln.bias, 1e-3)))
    local rms = nn.RMSNorm({ 5 }, { eps = 1e-6 })
    assert.are.equal(0, max_diff(rms(x), ds.rms_norm(x, rms.weight, 1e-6)))
    assert.are.equal(0, max_diff(nn.RMSNorm(5)(x), ds.rms_norm(x, ds.ones({ 5 }))))
    assert.are.equal(0, max_diff(nn.ReLU()(x), x:relu()))
    assert.are.equal(0, max_diff(nn.SiLU()(x), x:silu()))
    assert.are.equal(0, max_diff(nn.GELU()(x), ds.gelu(x)))
    assert.are.equal(0, max_diff(nn.GELU { approximate = 'tanh' }(x), ds.gelu(x, 'tanh')))
    assert.are.equal(0, max_diff(nn.Tanh()(x), x:tanh()))
    assert.are.equal(0, max_diff(nn.Identity()(x), x))
  end)

  it('Flatten keeps the batch dim by default', function()
    local x = ds.randn({ 2, 3, 4, 5 })
    assert.are.equal('2x60', shape(nn.Flatten()(x)))
    assert.are.equal('6x4x5', shape(nn.Flatten(1, 2)(x)))
    assert.are.equal('2x3x20', shape(nn.Flatten(-2)(x)))
    fails('Flatten: dims 4..2 out of range for input %[2x3x4x5%]', function() return nn.Flatten(4, 2)(x) end)
  end)

  it('Dropout scales kept values by 1/(1-p) and zeroes about p of them', function()
    local d = nn.Dropout(0.25)
    local y = d(ds.ones({ 20000 }))
    local kept = y:gt(0):to('f64'):mean():item()
    assert.is_true(math.abs(kept - 0.75) < 0.02)
    assert.is_true(math.abs(y:amax():item() - 1 / 0.75) < 1e-6)
    assert.are.equal(0, max_diff(nn.Dropout(0)(y), y))
  end)

  it('CausalSelfAttention matches attention written out from its weights', function()
    local attn = nn.CausalSelfAttention { n_embd = 12, n_head = 3, dtype = 'f64' }
    local x = ds.randn({ 2, 5, 12 }, 'f64')
    local qkv = ds.linear(x, attn.c_attn.weight, attn.c_attn.bias)
    local heads = {}
    for h = 1, 3 do
      local q = qkv:narrow(3, (h - 1) * 4 + 1, 4)
      local k = qkv:narrow(3, 12 + (h - 1) * 4 + 1, 4)
      local v = qkv:narrow(3, 24 + (h - 1) * 4 + 1, 4)
      local att = ds.matmul(q, k:transpose(2, 3)) * 0.5
      local pos = ds.arange(5)
      att = ds.where(pos:view({ 5, 1 }):ge(pos:view({ 1, 5 })), att, -math.huge):softmax(-1)
      heads[h] = ds.matmul(att, v)
    end
    local want = ds.linear(ds.cat(heads, 3), attn.c_proj.weight, attn.c_proj.bias)
    assert.is_true(max_diff(attn(x), want) < 1e-12)
  end)

  it('CausalSelfAttention gives the same output on either attention backend', function()
    local attn = nn.CausalSelfAttention { n_embd = 12, n_head = 3, dtype = 'f64' }
    local math_ = nn.CausalSelfAttention { n_embd = 12, n_head = 3, dtype = 'f64', attention_backend = 'math' }
    math_:load_state_dict(attn:state_dict())
    local x = ds.randn({ 2, 5, 12 }, 'f64')
    assert.is_true(max_diff(attn(x), math_(x)) < 1e-12)
  end)

  it('CausalSelfAttention with attention dropout forms the same scores explicitly', function()
    local attn = nn.CausalSelfAttention { n_embd = 8, n_head = 2, dropout = 0.1, dtype = 'f64' }
    local x = ds.randn({ 2, 6, 8 }, 'f64')
    attn:eval()
    local fused = attn(x)
    attn:train()
    local dropout = ds.dropout
    ds.dropout = function(t) return t end     -- the explicit path with its dropout masks off
    local ok, explicit = pcall(attn, x)
    ds.dropout = dropout
    assert.is_true(ok, explicit)
    assert.is_true(max_diff(fused, explicit) < 1e-12)
    assert.is_true(max_diff(attn(x), fused) > 0)
  end)

  it('gradients of a small network agree with finite differences (f64)', function()
    local net = nn.Sequential(nn.Linear(3, 4, { dtype = 'f64' }), nn.LayerNorm(4, { dtype = 'f64' }),
                              nn.GELU('tanh'), nn.Linear(4, 2, { dtype = 'f64' }))
    local inputs = { ds.randn({ 2, 3 }, 'f64'):requires_grad_() }
    for _, p in ipairs(net:parameters()) do inputs[#inputs + 1] = p end
    assert.is_true(H.gradcheck(function(x) return net(x) end, inputs))
  end)

  it('CausalSelfAttention gradients agree with finite differences (f64)', function()
    local attn = nn.CausalSelfAttention { n_embd = 4, n_head = 2, dtype = 'f64' }
    local inputs = { ds.randn({ 1, 3, 4 }, 'f64'):requires_grad_() }
    for _, p in ipairs(attn:parameters()) do inputs[#inputs + 1] = p end
    assert.is_true(H.gradcheck(function(x) return attn(x) end, inputs))
  end)
end)

describe('nn errors', function()
  it('name the module and the bad value', function()
    fails('Linear: in_features must be an integer >= 1, got 0', nn.Linear, 0, 3)
    fails('Linear: out_features must be an integer >= 1, got 2.5', nn.Linear, 3, 2.5)
    fails("Linear: unknown option 'bais' %(expected bias, device, dtype%)", nn.Linear, 3, 2, { bais = false })
    fails('Conv2d: in_channels 3 and out_channels 4 must both be divisible by groups 2', nn.Conv2d, 3, 4, 3, { groups = 2 })
    fails('Conv2d: kernel_size must be an integer or {h, w}', nn.Conv2d, 3, 4, { 1, 2, 3 })
    fails('Conv2d: expected an options table, got number', nn.Conv2d, 3, 4, 3, 1)
    fails('Dropout: p must be a number in %[0, 1%], got 1.5', nn.Dropout, 1.5)
    fails("GELU: approximate must be 'none' or 'tanh', got fast", nn.GELU, 'fast')
    fails('LayerNorm: normalized_shape must be an integer or a list of integers', nn.LayerNorm, 'x')
    fails('CausalSelfAttention: n_embd 10 is not divisible by n_head 3', nn.CausalSelfAttention, { n_embd = 10, n_head = 3 })
    fails("CausalSelfAttention: attention_backend must be 'auto', 'fused' or 'math', got flash",
          nn.CausalSelfAttention, { n_embd = 8, n_head = 2, attention_backend = 'flash' })
    fails('Sequential: element 2 is a number, expected a module', nn.Sequential, nn.ReLU(), 3)
    fails('CausalSelfAttention: expected x %[B, T, 8%], got %[2x8%]',
          function() return nn.CausalSelfAttention { n_embd = 8, n_head = 2 }(ds.zeros({ 2, 8 })) end)
  end)

  it('pass the core ops\' shape errors through', function()
    fails('linear', function() return nn.Linear(3, 2)(ds.zeros({ 4, 5 })) end)
    fails('layer_norm: normalized_shape %[4%] does not match the last dims of input',
          function() return nn.LayerNorm(4)(ds.zeros({ 2, 5 })) end)
    fails('embedding', function() return nn.Embedding(4, 2)(ds.tensor({ 4 }, 'i64')) end)
  end)
end)
