-- Sliding window log, exact. Mirrors src/algorithm/sliding_log.rs.
--
-- State: sorted set, one member per admitted microsecond: score = µs, member = "<µs>:<cost>".
-- Requests admitted in the same microsecond are merged into one member (as Rust merges them),
-- so members are unique and the cost of each entry is kept. An entry counts while
-- now < at + per, where now is never taken as earlier than the newest entry (a clock that steps
-- back counts as the newest entry's time). Rule fields used: requests, per.
-- Reading walks the live entries: O(entries) ≤ O(requests) per decision.
-- TTL = newest entry + per − now.

sluice.sliding_window_log = {}

local function swl_parse(member)
  local at, cost = string.match(member, '^(%d+):(%d+)$')
  if at == nil then
    return nil
  end
  return { at = tonumber(at), cost = tonumber(cost), member = member }
end

-- state = { newest = {at, cost, member} or nil, live = { {at, cost, member}, … oldest first } }
function sluice.sliding_window_log.read(key)
  local newest = redis.pcall('ZRANGE', key, -1, -1)
  if newest.err then
    return nil, 'other'
  end
  if #newest == 0 then
    return nil, 'none'
  end
  local n = swl_parse(newest[1])
  if n == nil then
    return nil, 'zset' -- not ours: another shape
  end
  return { newest = n, parse = swl_parse, key = key }, 'zset'
end

local function swl_now_eff(log, now)
  if log == nil then
    return now
  end
  return math.max(log.newest.at, now)
end

-- The live entries (at + per > now_eff), oldest first; nil when a member is not ours.
local function swl_live(log, l, now_eff)
  if log == nil then
    return {}
  end
  local members = redis.call('ZRANGEBYSCORE', log.key, '(' .. fmt(now_eff - l.per), '+inf')
  local live = {}
  for i, m in ipairs(members) do
    local e = log.parse(m)
    if e == nil then
      return nil
    end
    live[i] = e
  end
  return live
end

function sluice.sliding_window_log.check(l, log, now, cost)
  local now_eff = swl_now_eff(log, now)
  local live = swl_live(log, l, now_eff) or {}
  local used = 0
  for _, e in ipairs(live) do
    used = used + e.cost
  end
  local newest_expiry = now
  if #live > 0 then
    newest_expiry = live[#live].at + l.per
  end
  if used + cost <= l.requests then
    local reset_at = newest_expiry
    if cost > 0 then
      reset_at = now_eff + l.per
    end
    return true, l.requests - used - cost, reset_at - now, -1, 0
  end
  local retry_after = -1
  if cost <= l.requests then
    -- Walk out the oldest entries until the request fits.
    local still_used = used
    for _, e in ipairs(live) do
      still_used = still_used - e.cost
      if still_used + cost <= l.requests then
        retry_after = e.at + l.per - now
        break
      end
    end
  end
  return false, math.max(l.requests - used, 0), newest_expiry - now, retry_after, 0
end

function sluice.sliding_window_log.consume(key, ktype, log, l, now, cost)
  local now_eff = swl_now_eff(log, now)
  if log == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  local newest = nil
  if log ~= nil then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now_eff - l.per))
    if log.newest.at + l.per > now_eff then
      newest = log.newest
    end
  end
  if cost > 0 then
    if newest ~= nil and newest.at == now_eff then
      redis.call('ZREM', key, newest.member)
      cost = newest.cost + cost
    end
    redis.call('ZADD', key, fmt(now_eff), fmt(now_eff) .. ':' .. fmt(cost))
    newest = { at = now_eff }
  end
  if newest ~= nil then
    redis.call('PEXPIRE', key, ttl_ms(newest.at + l.per, now))
  end
end
