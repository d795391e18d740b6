-- Fixed window, windows aligned to multiples of `per` since the Unix epoch.
-- Mirrors `sluice::algorithm::fixed_window`.
--
-- State: hash {a = "fw", start = the window's start in µs (a multiple of per), count = admitted
-- cost in it, e = the instant (µs) the key's TTL was last set to end at}. The start, not an
-- index, so an edit of `per` cannot misread an old window.
-- Rule fields used: requests, per. A clock behind the stored window stays in that window.
-- TTL = end of the window − now. A window going on keeps its end, so its TTL is set once, when
-- `e` differs from the end: a new window, an edited `per`, or a write by a settle that does
-- not keep `e` (it sets the TTL itself, and leaves a stale `e` that cannot match).

sluice.fixed_window = {}

function sluice.fixed_window.read(key)
  local v, ktype = read_hash(key, 'a', 'start', 'count', 'e')
  if v == nil then
    return nil, ktype
  end
  local start, count = int(v[2]), int(v[3])
  if v[1] ~= 'fw' or start == nil or count == nil then
    return nil, ktype
  end
  return { start = start, count = count, e = int(v[4]) }, ktype
end

local function fw_current(l, w, now)
  local start = idiv(now, l.per) * l.per
  if w ~= nil and w.start >= start then
    return w.start, w.count
  end
  return start, 0
end

function sluice.fixed_window.check(l, w, now, cost)
  local start, count = fw_current(l, w, now)
  local reset_after = math.max(start + l.per - now, 0)
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
  local start, count = fw_current(l, w, now)
  -- The count saturates at MAX_EXACT (debt far past any limit), as in Rust.
  local total = math.min(count + cost, MAX_EXACT)
  local pristine_at = start + l.per
  if not worth_writing(ktype, pristine_at, now) then
    return
  end
  if w == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  if w ~= nil and w.start == start then
    -- The stored window goes on: only its count changes, and its TTL when not yet set to its end.
    if w.e == pristine_at then
      redis.call('HSET', key, 'count', fmt(total))
      return
    end
    redis.call('HSET', key, 'count', fmt(total), 'e', fmt(pristine_at))
  else
    redis.call('HSET', key, 'a', 'fw', 'start', fmt(start), 'count', fmt(total), 'e', fmt(pristine_at))
  end
  redis.call('PEXPIRE', key, ttl_ms(pristine_at, now))
end
