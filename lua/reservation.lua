-- Holds against a rate algorithm: reservations of costs known only after the response (an LLM's
-- tokens; `sluice::algorithm::reservation`) and quota leases held by enforcers
-- (`sluice::algorithm::lease`). A rule that reserves (its parameters end in ":ttl_us") or is leased
-- (":L") is decided by its algorithm's module wrapped by `sluice.reserving(inner)`, with the
-- same read/check/consume interface, plus `settle` and, for leases, `grant`.
--
-- State: the algorithm's own state at the key, as for any rule (what settled costs consumed),
-- plus the live reservations in a hash at the reservation key (the state key with "}:" made
-- "}:r:", src/store/keys.rs `reservation_key`): field = the request's hold id, value =
-- "until_us:amount". A reservation counts while now < until.
--
-- Admission of `cost` (the estimate) is the algorithm's decision for reserved + cost; an admitted
-- request with a hold id adds its reservation and consumes nothing yet (without one it consumes
-- at once; a reservation of 0 holds nothing, and its settle is a `charge`). `settle` (check.lua) removes a live reservation and consumes its actual cost, even
-- past the limit (debt). TTL of the reservation key = the latest until − now.

-- The most holds of nothing (askers waiting while the bound is out in others' slices) one key
-- keeps: MAX_WAITING_HOLDS in `sluice::algorithm::lease`.
local MAX_WAITING_HOLDS = 32
-- The most live lease holds (slices and holds of nothing) one key keeps: MAX_LEASE_HOLDS there.
local MAX_LEASE_HOLDS = 256
-- The most live reservations one key keeps: MAX_RESERVATIONS in `sluice::algorithm::reservation`.
local MAX_RESERVATIONS = 1024

local function reservation_key(key)
  return (string.gsub(key, '}:', '}:r:', 1))
end

-- The reservations at `rkey`: a list of {id, until, amount} and the key's kind ('none', 'hash'
-- or 'other').
local function read_reservations(rkey)
  local flat = redis.pcall('HGETALL', rkey)
  if flat.err then
    return {}, 'other'
  end
  if #flat == 0 then
    return {}, 'none'
  end
  local holds = {}
  for i = 1, #flat, 2 do
    local until_, amount = string.match(flat[i + 1], '^(%d+):(%d+)$')
    if until_ ~= nil then
      holds[#holds + 1] = { id = flat[i], until_ = tonumber(until_), amount = tonumber(amount) }
    end
  end
  return holds, 'hash'
end

-- Adds `amount` under `hold` to the holds `s` read at s.rkey, ending at `until_` (a hold already
-- under that id keeps its end and adds the amount), drops the holds that ran out, and sets the
-- key's TTL to the latest end: `hold_units` in `sluice::algorithm::reservation`. Returns the live
-- holds after it, this one last.
local function add_hold(s, now, hold, amount, until_)
  if s.rtype == 'other' then
    redis.call('DEL', s.rkey)
  end
  local latest, live = until_, {}
  for _, h in ipairs(s.holds) do
    if h.until_ <= now then
      redis.call('HDEL', s.rkey, h.id)
    else
      if h.id == hold then
        amount, until_ = amount + h.amount, h.until_
      else
        live[#live + 1] = h
      end
      latest = math.max(latest, h.until_)
    end
  end
  amount = math.min(amount, MAX_COST)
  redis.call('HSET', s.rkey, hold, fmt(until_) .. ':' .. fmt(amount))
  redis.call('PEXPIRE', s.rkey, ttl_ms(latest, now))
  live[#live + 1] = { id = hold, until_ = until_, amount = amount }
  return live
end

-- Whether the holds `s` read have MAX_RESERVATIONS live ones, none of them `hold`'s (`full` in
-- Rust).
local function reservations_full(s, now, hold)
  local live = 0
  for _, h in ipairs(s.holds) do
    if h.until_ > now then
      if h.id == hold then
        return false
      end
      live = live + 1
    end
  end
  return live >= MAX_RESERVATIONS
end

local function capacity_of(l)
  if l.algo <= 3 then
    return l.burst -- tokenBucket, gcra, leakyBucket
  end
  return l.requests
end

local reserving_by_inner = {}

-- The reserving module around `inner` (one per algorithm, shared by its rules).
function sluice.reserving(inner)
  local m = reserving_by_inner[inner]
  if m ~= nil then
    return m
  end
  m = {}

  function m.read(key)
    local counted, ktype = inner.read(key)
    local rkey = reservation_key(key)
    local holds, rtype = read_reservations(rkey)
    return { counted = counted, holds = holds, rkey = rkey, rtype = rtype }, ktype
  end

  function m.check(l, s, now, cost)
    local reserved, last = 0, nil
    for _, h in ipairs(s.holds) do
      if h.until_ > now then
        reserved = reserved + h.amount
        if last == nil or h.until_ > last then
          last = h.until_
        end
      end
    end
    local ok, remaining, reset_after, retry_after = inner.check(l, s.counted, now, reserved + cost)
    if ok or reserved == 0 then
      return ok, remaining, reset_after, retry_after, 0
    end
    -- What is left once the reservations are taken. When the estimate cannot fit beside them:
    -- when the last one runs out, but at most one period, plus what the counted state alone
    -- still needs then (as in Rust).
    local left_ok, left = inner.check(l, s.counted, now, reserved)
    if retry_after < 0 and cost <= capacity_of(l) then
      local wait = math.min(last - now, l.per)
      local later_ok, _, _, later_retry = inner.check(l, s.counted, now + wait, cost)
      if later_ok or later_retry < 0 then
        later_retry = 0
      end
      retry_after = wait + later_retry
    end
    if not left_ok then
      left = 0
    end
    return false, left, reset_after, retry_after, 0
  end

  function m.consume(key, ktype, s, l, now, cost, hold)
    if hold == '' or l.ttl == nil or cost == 0 or reservations_full(s, now, hold) then
      -- Consumed at once without a hold id, or for a leased rule (its holds are leases, granted
      -- by `grant`). A reservation of 0 holds nothing (it would take no capacity, yet stay on the
      -- key for the whole ttl): its settle charges without one (`charge`), as
      -- `reservation::apply` in Rust. Past MAX_RESERVATIONS live holds, an admission is charged
      -- at once too.
      inner.consume(key, ktype, s.counted, l, now, cost, '')
      return
    end
    -- A second reservation under one hold (two rules on one key) adds to the first, keeping its end.
    add_hold(s, now, hold, cost, now + l.ttl)
  end

  -- Settles `hold`'s reservation at `key` to `actual`; returns 1 if it was live, else 0.
  function m.settle(key, l, now, hold, actual)
    local rkey = reservation_key(key)
    local v = redis.pcall('HGET', rkey, hold)
    if type(v) ~= 'string' then
      return 0
    end
    redis.call('HDEL', rkey, hold)
    local until_ = string.match(v, '^(%d+):')
    if until_ == nil or tonumber(until_) <= now then
      return 0
    end
    if actual > 0 then
      local counted, ktype = inner.read(key)
      inner.consume(key, ktype, counted, l, now, actual, '')
    end
    return 1
  end

  -- Charges `actual` for a reservation of 0 under `hold` at `key` (check.lua `settle`; mirrors
  -- `reservation::charge` in Rust): consumed at once, even past the limit, and a hold of that id
  -- left by an older version (which held reservations of 0) is dropped. Returns 1.
  function m.charge(key, l, now, hold, actual)
    redis.call('HDEL', reservation_key(key), hold)
    if actual > 0 then
      local counted, ktype = inner.read(key)
      inner.consume(key, ktype, counted, l, now, actual, '')
    end
    return 1
  end

  -- Grants a lease under `hold` at `key` (lua/check.lua `lease`; mirrors `grant` in
  -- `sluice::algorithm::lease`): what fits of `want`, within `cap` with the key's live holds and
  -- within what the algorithm admits beside them; a window lease ends with its window. Returns
  -- the amount granted (0: nothing written), how long the holder may spend it (µs from now, 0
  -- when none), the key's remaining and reset_after once granted, and its live holds.
  function m.grant(key, l, now, hold, want, cap, ttl)
    local s, ktype = m.read(key)
    -- The live holds: what they hold, how many, how many hold nothing, and whether one is this
    -- asker's.
    local outstanding, live, waiting, known = 0, 0, 0, false
    for _, h in ipairs(s.holds) do
      if h.until_ > now then
        outstanding = outstanding + h.amount
        live = live + 1
        if h.amount == 0 then
          waiting = waiting + 1
        end
        if h.id == hold then
          known = true
        end
      end
    end
    local room = math.min(math.max(cap - outstanding, 0), want)
    local ok, remaining, reset_after = m.check(l, s, now, 0)
    local amount = 0
    if ok then
      amount = math.min(room, remaining)
    end
    if amount > 0 and not m.check(l, s, now, amount) then
      amount = 0
    end
    -- The holder stops at `stop`; the store holds the units until `until_` (the window's end for
    -- the window algorithms, so a vanished holder's units never come back inside their window).
    local stop = now + ttl
    local until_ = stop
    if l.algo == 4 or l.algo == 6 then
      until_ = idiv(now, l.per) * l.per + l.per
      stop = math.min(stop, until_)
    end
    -- At most MAX_LEASE_HOLDS live holds per key (`sluice::algorithm::lease`): a new holder past
    -- that is granted nothing and not recorded.
    if hold == '' or stop <= now or (live >= MAX_LEASE_HOLDS and not known) then
      amount = -1
    end
    if amount <= 0 then
      -- Nothing granted. When the key has room but the bound is out in others' slices, the asker
      -- is counted as a holder (a hold of nothing), as in Rust.
      -- At most MAX_WAITING_HOLDS such holds per key (`sluice::algorithm::lease`): past that the
      -- asker is not recorded, so fresh hold ids cannot grow the hash every operation reads.
      if amount == 0 and room == 0 and ok and remaining > 0 and (known or waiting < MAX_WAITING_HOLDS) then
        return 0, 0, remaining, reset_after, #add_hold(s, now, hold, 0, until_)
      end
      return 0, 0, remaining, reset_after, live
    end
    -- A second grant under one id adds to the first, keeping its end (as in Rust).
    s.holds = add_hold(s, now, hold, amount, until_)
    local _, left, reset = m.check(l, s, now, 0)
    return amount, stop - now, left, reset, #s.holds
  end

  reserving_by_inner[inner] = m
  return m
end
