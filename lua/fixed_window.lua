-- Fixed window, windows aligned to multiples of `per` since the Unix epoch.
-- Mirrors src/algorithm/fixed_window.rs.
--
-- State: hash {a = "fw", index = floor(now / per) of the window, count = admitted cost in it}.
-- Rule fields used: requests, per. A clock behind the stored window stays in that window.
-- TTL = end of the window − now.

sluice.fixed_window = {}

function sluice.fixed_window.read(key, ktype)
  if ktype ~= 'hash' then
    return nil
  end
  local v = redis.call('HMGET', key, 'a', 'index', 'count')
  local index, count = int(v[2]), int(v[3])
  if v[1] ~= 'fw' or index == nil or count == nil then
    return nil
  end
  return { index = index, count = count }
end

local function fw_current(l, w, now)
  local index = idiv(now, l.per)
  if w ~= nil and w.index >= index then
    return w.index, w.count
  end
  return index, 0
end

function sluice.fixed_window.check(l, w, now, cost)
  local index, count = fw_current(l, w, now)
  local reset_after = math.max((index + 1) * l.per - now, 0)
  if count + cost <= l.requests then
    return true, l.requests - count - cost, reset_after, -1, 0
  end
  local retry_after = -1
  if cost <= l.requests then
    retry_after = reset_after
  end
  return false, math.max(l.requests - count, 0), reset_after, retry_after, 0
end

function sluice.fixed_window.consume(key, ktype, w, l, now, cost)
  local index, count = fw_current(l, w, now)
  local pristine_at = (index + 1) * l.per
  if not worth_writing(ktype, pristine_at, now) then
    return
  end
  if w == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  redis.call('HSET', key, 'a', 'fw', 'index', fmt(index), 'count', fmt(count + cost))
  redis.call('PEXPIRE', key, ttl_ms(pristine_at, now))
end
