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
  -- read_hash and int, inlined: this runs for every fixed-window rule of every decision, and
  -- the calls cost more than the checks (scripts/bench/redis-profile.sh). The state is HMGET's
  -- own reply, its fields turned into numbers in place: {'fw', start, count, e}.
  local v = redis.pcall('HMGET', key, 'a', 'start', 'count', 'e')
  if v.err then
    return nil, 'other'
  end
  if v[1] == 'fw' then
    local start, count = tonumber(v[2]), tonumber(v[3])
    if start == nil or count == nil or start < 0 or count < 0 or start % 1 ~= 0 or count % 1 ~= 0 then
      return nil, 'hash'
    end
    v[2], v[3], v[4] = start, count, tonumber(v[4])
    return v, 'hash'
  end
  if v[1] or v[2] or v[3] or v[4] then
    return nil, 'hash'
  end
  return nil, 'none'
end

local function fw_current(l, w, now)
  local start = idiv(now, l.per) * l.per
  if w ~= nil and w[2] >= start then
    return w[2], w[3]
  end
  return start, 0
end

function sluice.fixed_window.check(l, w, now, cost)
  local start, count = fw_current(l, w, now)
  local reset_after = start + l.per - now
  if reset_after < 0 then
    reset_after = 0
  end
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
  local total = count + cost
  if total > MAX_EXACT then
    total = MAX_EXACT
  end
  local pristine_at = start + l.per
  if w ~= nil and w[2] == start and w[4] == pristine_at then
    -- The common case first: the stored window goes on and its TTL is already its end.
    redis.call('HSET', key, 'count', fmt(total))
    return
  end
  if not worth_writing(ktype, pristine_at, now) then
    return
  end
  if w == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  if w ~= nil and w[2] == start then
    -- The stored window goes on, its TTL not yet set to its end.
    redis.call('HSET', key, 'count', fmt(total), 'e', fmt(pristine_at))
  else
    redis.call('HSET', key, 'a', 'fw', 'start', fmt(start), 'count', fmt(total), 'e', fmt(pristine_at))
  end
  redis.call('PEXPIRE', key, ttl_ms(pristine_at, now))
end
