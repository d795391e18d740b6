-- Sluice decision function: decides EVERY rule a request matched in one atomic call. Loaded
-- with the modules as a Redis Functions library and called by FCALL (src/store/redis.rs
-- registers `decide` under a name carrying the library's hash); on a Redis without Functions
-- (before 7.0) the same source runs as an EVALSHA script that calls `decide(KEYS, ARGV)`.
--
-- KEYS[i]  the state key of rule i (src/store/keys.rs). All keys share one hash tag, hence one
--          cluster slot.
-- ARGV[1]  now in µs since the Unix epoch, or "" to use the server's clock (redis.call('TIME')).
--          Production always passes ""; tests pass a time.
-- ARGV[2i], ARGV[2i + 1]  for rule i: its parameters as one text
--          "algorithm:requests:per_us:burst:interval_us:max_delay_us:enforce" (algorithm 1
--          tokenBucket, 2 gcra, 3 leakyBucket, 4 fixedWindow, 5 slidingWindowLog,
--          6 slidingWindowCounter; interval = per/requests rounded up; max_delay -1 when not
--          shaping; enforce 1, or 0 for shadow), then the request's cost for it, decimal.
--
-- Returns an array of integers: { allowed, then for each rule i: allowed, remaining,
--          reset_after_us, retry_after_us (-1 = never / not applicable), delay_us }.
--
-- All-or-nothing: phase 1 decides every rule without writing. The request is allowed when every
-- enforcing rule allowed it (shadow rules never deny). Only then does phase 2 consume, in each
-- rule whose own decision allowed; a denial writes nothing anywhere, and every rule then reports
-- its unchanged state. Every key written gets a PEXPIRE equal to the time until its state is
-- pristine, in this same call, so no key can be left without a TTL. No TYPE probe: each
-- algorithm reads its state with one command that also tells a missing key or another type.

local modules = {
  sluice.token_bucket,
  sluice.gcra,
  sluice.gcra, -- leakyBucket: GCRA, shaping when max_delay >= 0
  sluice.fixed_window,
  sluice.sliding_window_log,
  sluice.sliding_window_counter,
}

-- Parsed rule parameters by their text. A rule's parameters change only with its policy, so a
-- library call (which keeps this table between calls, until the library is loaded again) parses
-- each rule once instead of on every decision. Bounded: emptied when it holds too many.
local params_by_text, params_count = {}, 0
local PARAMS_MAX = 4096

local function rule_params(text)
  local l = params_by_text[text]
  if l ~= nil then
    return l
  end
  if type(text) ~= 'string' then
    return nil
  end
  local algo, requests, per, burst, interval, max_delay, enforce =
    string.match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%-?%d+):([01])$')
  if algo == nil then
    return nil
  end
  l = {
    algo = tonumber(algo),
    requests = tonumber(requests),
    per = tonumber(per),
    burst = tonumber(burst),
    interval = tonumber(interval),
    max_delay = tonumber(max_delay),
    enforce = enforce == '1',
  }
  l.module = modules[l.algo]
  if l.module == nil or l.requests < 1 or l.per < 1000 or l.burst < 1 or l.interval < 1 then
    return nil
  end
  if params_count >= PARAMS_MAX then
    params_by_text, params_count = {}, 0
  end
  params_by_text[text] = l
  params_count = params_count + 1
  return l
end

local function decide(KEYS, ARGV)
  local n = #KEYS
  if #ARGV ~= 1 + 2 * n then
    return redis.error_reply('sluice: expected ' .. (1 + 2 * n) .. ' arguments for ' .. n .. ' keys, got ' .. #ARGV)
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

  if n == 1 then
    -- One rule, the common case: no per-rule arrays. Its own decision is the request's (a shadow
    -- rule admits the request either way), and it consumes only when it admitted.
    local l, cost, key = rule_params(ARGV[2]), int(ARGV[3]), KEYS[1]
    if l == nil or cost == nil then
      return redis.error_reply('sluice: bad arguments for rule 1')
    end
    local state, ktype = l.module.read(key)
    local ok, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, cost)
    if ok then
      l.module.consume(key, ktype, state, l, now, cost)
    end
    return { (ok or not l.enforce) and 1 or 0, ok and 1 or 0, remaining, reset_after, retry_after, delay }
  end

  local rules, costs = {}, {}
  for i = 1, n do
    local l = rule_params(ARGV[2 * i])
    local cost = int(ARGV[2 * i + 1])
    if l == nil or cost == nil then
      return redis.error_reply('sluice: bad arguments for rule ' .. i)
    end
    rules[i], costs[i] = l, cost
  end

  -- Phase 1: decide, read-only. The reply is filled as we go: { allowed, then per rule five
  -- integers } (see the contract above).
  local reply = { 1 }
  local ktypes, states = {}, {}
  local allowed = true
  for i = 1, n do
    local l, key = rules[i], KEYS[i]
    local state, ktype = l.module.read(key)
    ktypes[i], states[i] = ktype, state
    local ok, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, costs[i])
    local b = 5 * i - 3
    reply[b], reply[b + 1], reply[b + 2], reply[b + 3], reply[b + 4] =
      ok and 1 or 0, remaining, reset_after, retry_after, delay
    if l.enforce and not ok then
      allowed = false
    end
  end

  if not allowed then
    -- Nothing will be consumed: a rule that had room reports its state as it stands, not as it
    -- would have been after this request.
    reply[1] = 0
    for i = 1, n do
      local b = 5 * i - 3
      if reply[b] == 1 then
        local l = rules[i]
        local ok, remaining, reset_after, retry_after, delay = l.module.check(l, states[i], now, 0)
        reply[b], reply[b + 1], reply[b + 2], reply[b + 3], reply[b + 4] =
          ok and 1 or 0, remaining, reset_after, retry_after, delay
      end
    end
    return reply
  end

  -- Phase 2: consume, the whole request being admitted, in each rule whose own decision allowed.
  local written = nil
  for i = 1, n do
    if reply[5 * i - 3] == 1 then
      local l, key = rules[i], KEYS[i]
      local ktype, state = ktypes[i], states[i]
      if written ~= nil and written[key] then
        -- The same key twice in one request: consume on top of the first write, as the memory
        -- store does.
        state, ktype = l.module.read(key)
      end
      l.module.consume(key, ktype, state, l, now, costs[i])
      if n > 1 then
        written = written or {}
        written[key] = true
      end
    end
  end
  return reply
end
