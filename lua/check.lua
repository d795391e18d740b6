-- Sluice decision script: decides EVERY rule a request matched in one atomic call.
--
-- KEYS[i]  the state key of rule i (src/store/keys.rs). All keys share one hash tag, hence one
--          cluster slot.
-- ARGV[1]  now in µs since the Unix epoch, or "" to use the server's clock (redis.call('TIME')).
--          Production always passes ""; tests pass a time.
-- ARGV[2 + 8(i-1) ...] eight fields per rule i, all decimal integers:
--          algorithm (1 tokenBucket, 2 gcra, 3 leakyBucket, 4 fixedWindow, 5 slidingWindowLog,
--          6 slidingWindowCounter), requests, per_us, burst, interval_us (per/requests rounded
--          up), max_delay_us or -1, cost, enforce (1 enforce, 0 shadow).
--
-- Returns an array of integers: { allowed, then for each rule i: allowed, remaining,
--          reset_after_us, retry_after_us (-1 = never / not applicable), delay_us }.
--
-- All-or-nothing: phase 1 decides every rule without writing. The request is allowed when every
-- enforcing rule allowed it (shadow rules never deny). Only then does phase 2 consume, in each
-- rule whose own decision allowed; a denial writes nothing anywhere, and every rule then reports
-- its unchanged state. Every key written gets a
-- PEXPIRE equal to the time until its state is pristine, in this same script, so no key can be
-- left without a TTL.

-- Before Redis 7, scripts that read TIME and then write must ask for effects replication.
if redis.replicate_commands then
  redis.replicate_commands()
end

local FIELDS = 8
if #ARGV ~= 1 + FIELDS * #KEYS then
  return redis.error_reply('sluice: expected ' .. (1 + FIELDS * #KEYS) .. ' arguments for '
    .. #KEYS .. ' keys, got ' .. #ARGV)
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = int(ARGV[1])
  if now == nil then
    return redis.error_reply('sluice: now must be a non-negative integer')
  end
end

local modules = {
  sluice.token_bucket,
  sluice.gcra,
  sluice.gcra, -- leakyBucket: GCRA, shaping when max_delay >= 0
  sluice.fixed_window,
  sluice.sliding_window_log,
  sluice.sliding_window_counter,
}

local rules = {}
for i = 1, #KEYS do
  local b = 1 + FIELDS * (i - 1)
  local max_delay = tonumber(ARGV[b + 6])
  local r = {
    algo = int(ARGV[b + 1]),
    requests = int(ARGV[b + 2]),
    per = int(ARGV[b + 3]),
    burst = int(ARGV[b + 4]),
    interval = int(ARGV[b + 5]),
    max_delay = max_delay,
    cost = int(ARGV[b + 7]),
    enforce = ARGV[b + 8] == '1',
  }
  if r.algo == nil or modules[r.algo] == nil or r.requests == nil or r.requests < 1
    or r.per == nil or r.per < 1000 or r.burst == nil or r.burst < 1 or r.interval == nil
    or r.interval < 1 or max_delay == nil or r.cost == nil then
    return redis.error_reply('sluice: bad arguments for rule ' .. i)
  end
  r.module = modules[r.algo]
  rules[i] = r
end

-- Phase 1: decide, read-only.
local ktypes, states, decisions = {}, {}, {}
local allowed = true
for i, key in ipairs(KEYS) do
  local r = rules[i]
  local ktype = redis.call('TYPE', key)['ok']
  local state = r.module.read(key, ktype)
  ktypes[i], states[i] = ktype, state
  local ok, remaining, reset_after, retry_after, delay = r.module.check(r, state, now, r.cost)
  decisions[i] = { ok, remaining, reset_after, retry_after, delay }
  if r.enforce and not ok then
    allowed = false
  end
end

-- Nothing will be consumed: a rule that had room reports its state as it stands, not as it
-- would have been after this request.
if not allowed then
  for i = 1, #KEYS do
    if decisions[i][1] then
      local r = rules[i]
      local ok, remaining, reset_after, retry_after, delay = r.module.check(r, states[i], now, 0)
      decisions[i] = { ok, remaining, reset_after, retry_after, delay }
    end
  end
end

-- Phase 2: consume, only when the whole request is admitted.
if allowed then
  local written = {}
  for i, key in ipairs(KEYS) do
    if decisions[i][1] then
      local r = rules[i]
      local ktype, state = ktypes[i], states[i]
      if written[key] then
        -- The same key twice in one request: consume on top of the first write, as the memory
        -- store does.
        ktype = redis.call('TYPE', key)['ok']
        state = r.module.read(key, ktype)
      end
      r.module.consume(key, ktype, state, r, now, r.cost)
      written[key] = true
    end
  end
end

local reply = { allowed and 1 or 0 }
for i = 1, #KEYS do
  local d = decisions[i]
  reply[#reply + 1] = d[1] and 1 or 0
  reply[#reply + 1] = d[2]
  reply[#reply + 1] = d[3]
  reply[#reply + 1] = d[4]
  reply[#reply + 1] = d[5]
end
return reply
