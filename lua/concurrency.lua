-- Concurrency: at most `requests` requests in progress per key. Mirrors
-- `sluice::algorithm::concurrency`.
--
-- State: sorted set, one member per request holding a slot: member = its hold id (decimal),
-- score = when its lease runs out (µs). A lease counts while now < until. A request holds at most
-- one slot per key whatever its cost (0 asks without holding). Rule fields used: requests, per
-- (the lease). Released by `settle` (check.lua), or by its lease running out.
-- TTL = the latest lease's end − now.

sluice.concurrency = {}

-- state = { key, latest = the highest lease end in the set }
function sluice.concurrency.read(key)
  local latest = redis.pcall('ZRANGE', key, -1, -1, 'WITHSCORES')
  if latest.err then
    return nil, 'other'
  end
  if #latest == 0 then
    return nil, 'none'
  end
  if not string.match(latest[1], '^%d+$') then
    return nil, 'zset' -- not ours: a sliding log's entries
  end
  return { key = key, latest = tonumber(latest[2]) }, 'zset'
end

function sluice.concurrency.check(l, state, now, cost)
  local used, latest = 0, nil
  if state ~= nil and state.latest > now then
    used = redis.call('ZCOUNT', state.key, '(' .. fmt(now), '+inf')
    latest = state.latest
  end
  local wanted = 0
  if cost > 0 then
    wanted = 1
  end
  if used + wanted <= l.requests then
    local reset_at = latest or now
    if wanted > 0 then
      reset_at = math.max(now + l.per, reset_at)
    end
    return true, l.requests - used - wanted, reset_at - now, -1, 0
  end
  local reset_after = 0
  if latest ~= nil then
    reset_after = latest - now
  end
  return false, math.max(l.requests - used, 0), reset_after, -1, 0
end

function sluice.concurrency.consume(key, ktype, state, l, now, cost, hold)
  if state == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  if state ~= nil then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
  end
  if cost > 0 and hold ~= '' then
    local until_ = now + l.per
    local held = redis.call('ZSCORE', key, hold)
    if held then
      until_ = math.max(until_, tonumber(held))
    end
    redis.call('ZADD', key, fmt(until_), hold)
  end
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #latest > 0 then
    redis.call('PEXPIRE', key, ttl_ms(tonumber(latest[2]), now))
  end
end
