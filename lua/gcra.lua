-- GCRA, and the leaky bucket (policer; shaper when max_delay >= 0). Mirrors `sluice::algorithm::gcra`.
--
-- State: a string holding the theoretical arrival time (TAT) in µs since the epoch.
-- Rule fields used (see check.lua): burst, interval (µs, per/requests rounded up),
-- max_delay (µs, or -1 when not shaping), algo (3 = leakyBucket).
--   capacity = burst × interval; new_tat = max(tat, now) + cost × interval;
--   admitted when new_tat − now ≤ capacity (and, when shaping, the wait max(tat, now) − now ≤
--   max_delay, returned as the delay). TTL = new_tat − now.

sluice.gcra = {}

function sluice.gcra.read(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then
    return nil, 'other' -- an error reply: not a string
  end
  if not v then
    return nil, 'none'
  end
  return int(v), 'string'
end

function sluice.gcra.check(l, tat, now, cost)
  local interval = l.interval
  local capacity = l.burst * interval
  local base = math.max(tat or now, now)
  local backlog = base - now
  local free_now = idiv(math.max(capacity - backlog, 0), interval)
  if cost > l.burst then
    return false, free_now, backlog, -1, 0
  end
  local new_tat = base + cost * interval
  local fits = new_tat - now <= capacity
  local shaping = l.algo == 3 and l.max_delay >= 0
  local within_delay = (not shaping) or backlog <= l.max_delay
  if fits and within_delay then
    local delay = 0
    if shaping then
      delay = backlog
    end
    return true, idiv(capacity - (new_tat - now), interval), new_tat - now, -1, delay
  end
  local until_fits = math.max(new_tat - now - capacity, 0)
  local until_short_wait = 0
  if shaping then
    until_short_wait = math.max(backlog - l.max_delay, 0)
  end
  return false, free_now, backlog, math.max(until_fits, until_short_wait), 0
end

function sluice.gcra.consume(key, ktype, tat, l, now, cost)
  -- A debt saturates the TAT at MAX_EXACT µs since the epoch, as in Rust.
  local base = math.max(tat or now, now)
  local new_tat = math.min(base + cost * l.interval, math.max(MAX_EXACT, base))
  if worth_writing(ktype, new_tat, now) then
    -- SET replaces a key of any type, so another algorithm's state needs no DEL.
    redis.call('SET', key, fmt(new_tat), 'PX', ttl_ms(new_tat, now))
  end
end

-- Gives back the slot of a shaped admission whose caller went away before it departed
-- (`sluice::algorithm::give_back`): only the last slot taken, while the key's TAT still equals
-- `until_` (what that admission set) and its departure, until_ − cost × interval, is ahead.
-- Returns 1 when it went back, else 0.
function sluice.gcra.give_back(key, l, now, until_, cost)
  if l.algo ~= 3 or l.max_delay < 0 then
    return 0
  end
  local tat, ktype = sluice.gcra.read(key)
  if ktype ~= 'string' or tat ~= until_ then
    return 0
  end
  local departure = until_ - cost * l.interval
  if departure <= now then
    return 0
  end
  redis.call('SET', key, fmt(departure), 'PX', ttl_ms(departure, now))
  return 1
end
