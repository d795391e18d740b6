-- Sliding window counter: estimate = previous × (per − elapsed) / per + current, admitted when
-- floor(estimate) + cost ≤ requests. Mirrors `sluice::algorithm::sliding_counter`, including its
-- whole-millisecond weights (previous × per_ms stays below 2^53, so the floor is exact here too).
--
-- State: hash {a = "swc", start = the current window's start in µs, previous, current, e = the
-- instant (µs) the key's TTL was last set to end at: a write whose pristine instant is `e` leaves
-- the TTL alone, as in fixed_window.lua}. Counts
-- are capped when read at the largest count whose previous × per_ms stays below 2^53 (exact, after
-- any edit of `requests`); validation keeps that above `requests`, so debt stays visible.
-- Rule fields used: requests, per. A clock behind the stored window stays in it.
-- TTL: end of the next window when current > 0, else end of this window when previous > 0.

sluice.sliding_window_counter = {}

local U32_MAX = 4294967295

function sluice.sliding_window_counter.read(key)
  local v, ktype = read_hash(key, 'a', 'start', 'previous', 'current', 'e')
  if v == nil then
    return nil, ktype
  end
  local start, previous, current = int(v[2]), int(v[3]), int(v[4])
  if v[1] ~= 'swc' or start == nil or previous == nil or current == nil then
    return nil, ktype
  end
  return { start = start, previous = previous, current = current, e = int(v[5]) }, ktype
end

local function swc_roll(l, c, now)
  local start = idiv(now, l.per) * l.per
  -- Counts are kept up to the largest whose previous × per_ms is exact (`count_cap` in Rust),
  -- above `requests`, so a count in debt still refuses (even a cost of 0).
  local most = idiv(MAX_EXACT, idiv(l.per, 1000))
  if c ~= nil and c.start >= start then
    return { start = c.start, previous = math.min(c.previous, most), current = math.min(c.current, most) }
  end
  if c ~= nil and c.start + l.per == start then
    return { start = start, previous = math.min(c.current, most), current = 0 }
  end
  return { start = start, previous = 0, current = 0 }
end

local function weighted_previous(previous, per_ms, elapsed_ms)
  return idiv(previous * (per_ms - math.min(elapsed_ms, per_ms)), per_ms)
end

-- Smallest elapsed (ms) into a window at which floor(previous × (per − e) / per) ≤ allowance.
local function first_fit_ms(previous, per_ms, allowance)
  if previous == 0 then
    return 0
  end
  return math.max(per_ms - idiv((allowance + 1) * per_ms - 1, previous), 0)
end

local function swc_pristine_at(l, start, previous, current, now)
  if current > 0 then
    return start + 2 * l.per
  elseif previous > 0 then
    return start + l.per
  end
  return now
end

function sluice.sliding_window_counter.check(l, counts, now, cost)
  local c = swc_roll(l, counts, now)
  local per_ms = idiv(l.per, 1000)
  local start = c.start
  local elapsed_ms = idiv(math.max(now - start, 0), 1000)
  local estimate = weighted_previous(c.previous, per_ms, elapsed_ms) + c.current
  if estimate + cost <= l.requests then
    local reset_at = swc_pristine_at(l, start, c.previous, c.current + cost, now)
    return true, l.requests - estimate - cost, math.max(reset_at - now, 0), -1, 0
  end
  local retry_after = -1
  if cost <= l.requests then
    -- This window, if the current count leaves room; else the next, whose previous count is
    -- this window's current; else the one after, which starts empty.
    local at = nil
    if c.current + cost <= l.requests then
      local e = first_fit_ms(c.previous, per_ms, l.requests - c.current - cost)
      if e < per_ms then
        at = start + e * 1000
      end
    end
    if at == nil then
      local e = first_fit_ms(c.current, per_ms, l.requests - cost)
      if e < per_ms then
        at = start + l.per + e * 1000
      end
    end
    if at == nil then
      at = start + 2 * l.per
    end
    retry_after = math.max(at - now, 0)
  end
  local reset_at = swc_pristine_at(l, start, c.previous, c.current, now)
  return false, math.max(l.requests - estimate, 0), math.max(reset_at - now, 0), retry_after, 0
end

function sluice.sliding_window_counter.consume(key, ktype, counts, l, now, cost)
  local c = swc_roll(l, counts, now)
  local current = math.min(c.current + cost, U32_MAX)
  local pristine_at = swc_pristine_at(l, c.start, c.previous, c.current + cost, now)
  if not worth_writing(ktype, pristine_at, now) then
    return
  end
  if counts == nil and ktype ~= 'none' then
    redis.call('DEL', key)
  end
  if counts ~= nil and counts.start == c.start and counts.e == pristine_at then
    -- The same window, its TTL already ending where this state is pristine.
    redis.call('HSET', key, 'previous', fmt(c.previous), 'current', fmt(current))
    return
  end
  redis.call('HSET', key, 'a', 'swc', 'start', fmt(c.start), 'previous', fmt(c.previous),
    'current', fmt(current), 'e', fmt(pristine_at))
  redis.call('PEXPIRE', key, ttl_ms(pristine_at, now))
end
