-- Sliding window log, exact. Mirrors `sluice::algorithm::sliding_log`.
--
-- State: sorted set, one member per admitted microsecond: score = µs, member = "<µs>:<cost>".
-- Requests admitted in the same microsecond are merged into one member (as Rust merges them),
-- so members are unique and the cost of each entry is kept. An entry counts while
-- now < at + per, where now is never taken as earlier than the newest entry (a clock that steps
-- back counts as the newest entry's time). Rule fields used: requests, per.
-- One more member, "sum" at score -1 - total, holds the summed cost of every entry in the set
-- (a negative score: below every entry, outside every range of times), so a decision reads only
-- the entries that expired since the last write (each is read and removed once), not the whole
-- log: a log of 1000 entries costs what a log of one does. A set written before that member
-- existed gets it at its first write (summed once, by walking it).
-- TTL = newest entry + per − now.

sluice.sliding_window_log = {}

local SWL_SUM = 'sum'

local function swl_parse(member)
  local at, cost = string.match(member, '^(%d+):(%d+)$')
  if at == nil then
    return nil
  end
  return { at = tonumber(at), cost = tonumber(cost), member = member }
end

-- state = { newest = {at, cost, member}, total = summed cost of every entry in the set,
--           stored_total = the total the "sum" member holds, or nil (a set written before it
--           existed), key }
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
    return nil, 'zset' -- not ours: another shape (or only a sum, which a write never leaves)
  end
  local log = { newest = n, key = key, total = 0 }
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first[1] == SWL_SUM then
    log.total = -1 - tonumber(first[2])
    log.stored_total = log.total
    return log, 'zset'
  end
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local e = swl_parse(m)
    if e == nil then
      return nil, 'zset'
    end
    log.total = log.total + e.cost
  end
  return log, 'zset'
end

local function swl_now_eff(log, now)
  if log == nil then
    return now
  end
  return math.max(log.newest.at, now)
end

-- The summed cost of the entries that no longer count at now_eff (still in the set until the
-- next write), and how many they are; kept on the state, so the decision and the write that
-- follows it read them once.
local function swl_expired(log, l, now_eff)
  local seen = log.expired
  if seen ~= nil and seen.now_eff == now_eff and seen.per == l.per then
    return seen.cost, seen.count
  end
  local members = redis.call('ZRANGEBYSCORE', log.key, 0, fmt(now_eff - l.per))
  local cost = 0
  for _, m in ipairs(members) do
    local e = swl_parse(m)
    if e ~= nil then
      cost = cost + e.cost
    end
  end
  log.expired = { now_eff = now_eff, per = l.per, cost = cost, count = #members }
  return cost, #members
end

-- The oldest live entry at which the log, walked out oldest first, has room for `cost`:
-- its time + per is when the request fits. Reads the live entries in pages, from the oldest,
-- only as far as needed.
local function swl_fits_after(log, l, now_eff, used, cost)
  local page, offset = 64, 0
  local still_used = used
  while true do
    local members =
      redis.call('ZRANGEBYSCORE', log.key, '(' .. fmt(now_eff - l.per), '+inf', 'LIMIT', offset, page)
    for _, m in ipairs(members) do
      local e = swl_parse(m)
      if e ~= nil then
        still_used = still_used - e.cost
        if still_used + cost <= l.requests then
          return e
        end
      end
    end
    if #members < page then
      return nil
    end
    offset = offset + page
  end
end

function sluice.sliding_window_log.check(l, log, now, cost)
  local now_eff = swl_now_eff(log, now)
  local used = 0
  local newest_expiry = now
  if log ~= nil and log.newest.at + l.per > now_eff then
    used = log.total - swl_expired(log, l, now_eff)
    newest_expiry = log.newest.at + l.per
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
    local e = swl_fits_after(log, l, now_eff, used, cost)
    if e ~= nil then
      retry_after = e.at + l.per - now
    end
  end
  return false, math.max(l.requests - used, 0), newest_expiry - now, retry_after, 0
end

function sluice.sliding_window_log.consume(key, ktype, log, l, now, cost)
  local now_eff = swl_now_eff(log, now)
  if log == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  local newest, total = nil, 0
  if log ~= nil then
    local expired_cost, expired = swl_expired(log, l, now_eff)
    total = log.total - expired_cost
    if expired > 0 then
      redis.call('ZREMRANGEBYSCORE', key, 0, fmt(now_eff - l.per))
    end
    if log.newest.at + l.per > now_eff then
      newest = log.newest
    end
  end
  if cost > 0 then
    if newest ~= nil and newest.at == now_eff then
      redis.call('ZREM', key, newest.member)
      total = total - newest.cost
      cost = newest.cost + cost
    end
    redis.call('ZADD', key, fmt(now_eff), fmt(now_eff) .. ':' .. fmt(cost))
    total = total + cost
    newest = { at = now_eff }
  end
  if newest ~= nil then
    if log == nil or log.stored_total ~= total then
      redis.call('ZADD', key, fmt(-1 - total), SWL_SUM)
    end
    redis.call('PEXPIRE', key, ttl_ms(newest.at + l.per, now))
  elseif log ~= nil then
    -- No entry counts any more: the set holds at most expired entries and the sum; gone with it.
    redis.call('DEL', key)
  end
end
