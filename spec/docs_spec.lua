-- The README and docs/ stay true to the tree: every relative link names a
-- file (and heading) that exists, and the module written in
-- docs/models.md runs and prints what the page shows.
local H = require 'helpers'

local read = H.read

local function pages()
  local list = { 'README.md' }
  local p = io.popen('ls docs/*.md')
  for name in p:lines() do list[#list + 1] = name end
  p:close()
  return list
end

-- The text outside ``` fences and `code`, where links are links.
local function prose(text)
  return (text:gsub('\n```.-\n```', '\n'):gsub('`[^`\n]*`', ''))
end

-- GitHub's anchor of a heading: lower case, punctuation dropped, spaces
-- to hyphens.
local function anchors(text)
  local set = {}
  for title in prose('\n' .. text):gmatch('\n#+ ([^\n]+)') do
    set[(title:lower():gsub('[^%w _%-]', ''):gsub(' ', '-'))] = true
  end
  return set
end

local function dir_of(path) return path:match('^(.*)/') or '.' end

-- a/b/../c -> a/c
local function normal(path)
  local parts = {}
  for part in path:gmatch('[^/]+') do
    if part == '..' and #parts > 0 and parts[#parts] ~= '..' then
      parts[#parts] = nil
    elseif part ~= '.' then
      parts[#parts + 1] = part
    end
  end
  return table.concat(parts, '/')
end

local function exists(path)
  local f = io.open(path)
  if f then f:close() end
  return f ~= nil
end

describe('docs', function()
  it('links to files and headings that exist', function()
    local bad, seen = {}, 0
    for _, page in ipairs(pages()) do
      local text = read(page)
      for target in prose(text):gmatch('%]%(([^)%s]+)%)') do
        if not target:match('^%a+:') then
          seen = seen + 1
          local file, anchor = target:match('^([^#]*)#?(.*)$')
          local path = file == '' and page or normal(dir_of(page) .. '/' .. file)
          if not exists(path) then
            bad[#bad + 1] = page .. ': ' .. target .. ' (no ' .. path .. ')'
          elseif anchor ~= '' and not anchors(read(path))[anchor] then
            bad[#bad + 1] = page .. ': ' .. target .. ' (no heading #' .. anchor .. ' in ' .. path .. ')'
          end
        end
      end
    end
    assert.is_true(seen > 20, 'expected the README and docs/ to link to each other')
    assert.are.same({}, bad)
  end)

  it('models.md: the module of "Writing your own module" prints what the page shows', function()
    local text = read('docs/models.md')
    local section = assert(text:match('\n## Writing your own module\n(.-)\n## '), 'no "Writing your own module" section')
    local code = assert(section:match('\n```lua\n(.-\n)```'), 'no Lua block in the section')
    local shown = assert(section:match('```lua\n.-\n```.-```\n(.-\n)```'), 'no output block after the Lua block')
    local dir = H.tmpdir()
    finally(function() os.execute('rm -rf ' .. dir) end)
    local out, status = H.run(H.bin() .. ' ' .. H.write(dir .. '/block.lua', code))
    assert.are.equal(0, status, out)
    -- the losses depend on the BLAS kernels' order of sums: the page's are
    -- from one machine, so here only their form and their fall are checked
    local function split(s)
      local lines, losses = {}, {}
      for line in s:gmatch('([^\n]*)\n') do
        local step, loss = line:match('^step (%d+) loss (%d+%.%d+)$')
        if step then losses[#losses + 1] = tonumber(loss) else lines[#lines + 1] = line end
      end
      return lines, losses
    end
    local got_lines, got_losses = split(out)
    local shown_lines, shown_losses = split(shown)
    assert.are.same(shown_lines, got_lines)
    assert.are.equal(#shown_losses, #got_losses)
    assert.is_true(got_losses[#got_losses] < got_losses[1], out)
  end)
end)
