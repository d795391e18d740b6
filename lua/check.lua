-- Sluice decision function: decides EVERY rule a request matched in one atomic call. Loaded
-- with the modules as a Redis Functions library and called by FCALL (src/store/redis/mod.rs
-- registers `decide` under a name carrying the library's hash, and `decide_many`, below, which
-- decides several requests in one call, under that name with `_many`); on a Redis without
-- Functions (before 7.0) the same source runs as an EVALSHA script that calls `decide(KEYS, ARGV)`.
--
-- KEYS[i]  the state key of rule i (src/store/keys.rs). All keys share one hash tag, hence one
--          cluster slot.
-- ARGV[1]  now in µs since the Unix epoch, or "" to use the server's clock (redis.call('TIME')).
--          Production always passes ""; tests pass a time.
-- ARGV[2]  the request's hold id (decimal), for the rules whose admission holds capacity until
--          settled (concurrency slots, reservations: see `settle` below), or "".
-- ARGV[2i + 1], ARGV[2i + 2]  for rule i: its parameters as one text
--          "algorithm:requests:per_us:burst:interval_us:max_delay_us:enforce" (algorithm 1
--          tokenBucket, 2 gcra, 3 leakyBucket, 4 fixedWindow, 5 slidingWindowLog,
--          6 slidingWindowCounter, 7 concurrency; interval = per/requests rounded up; max_delay -1
--          when not shaping; enforce 1, or 0 for shadow), followed by ":ttl_us" for a rule whose
--          cost is known after the response (lua/reservation.lua: the cost is its estimate,
--          reserved under the hold id), or by ":L" for a rule whose enforcers may hold quota
--          leases (the live leases count against the limit: `lease` below), then the request's
--          cost for it, decimal (a cost above MAX_COST, 2^32 − 1, is taken as MAX_COST, as in
--          Rust).
--
-- Returns an array of integers: { allowed, then for each rule i: allowed, remaining,
--          reset_after_us, retry_after_us (-1 = never / not applicable), delay_us, then the
--          decision's now (µs) }: a shaped admission's slot ends at now + reset_after_us, which
--          is what `cancel` below gives back.
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
  sluice.concurrency,
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
  local algo, requests, per, burst, interval, max_delay, enforce, ttl =
    string.match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%-?%d+):([01]):(%d+)$')
  local leased = false
  if algo == nil then
    algo, requests, per, burst, interval, max_delay, enforce =
      string.match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%-?%d+):([01]):L$')
    leased = algo ~= nil
  end
  if algo == nil then
    algo, requests, per, burst, interval, max_delay, enforce =
      string.match(text, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%-?%d+):([01])$')
  end
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
    ttl = ttl and tonumber(ttl),
    leased = leased,
  }
  l.module = modules[l.algo]
  if l.module == nil or l.requests < 1 or l.per < 1000 or l.burst < 1 or l.interval < 1 then
    return nil
  end
  if l.ttl ~= nil then
    -- A reservation: only for the counting algorithms, never shaping (Limit::reserving).
    if l.ttl < 1000000 or l.algo == 5 or l.algo == 7 or l.max_delay >= 0 then
      return nil
    end
    l.module = sluice.reserving(l.module)
  end
  if leased then
    -- Quota leases: only for the counting algorithms, never shaping (Limit::leasing).
    if l.algo == 5 or l.algo == 7 or l.max_delay >= 0 then
      return nil
    end
    l.module = sluice.reserving(l.module)
  end
  if params_count >= PARAMS_MAX then
    params_by_text, params_count = {}, 0
  end
  params_by_text[text] = l
  params_count = params_count + 1
  return l
end

-- Per-rule arrays of `decide_request`, reused by every request instead of allocated for each
-- (Redis runs one call at a time, and a request is decided to its end before the next).
local scratch_rules, scratch_costs, scratch_ktypes, scratch_states = {}, {}, {}, {}

-- Decides one request's n rules: rule i's key is KEYS[k0 + i], its parameters ARGV[a0 + 2i] and
-- its cost ARGV[a0 + 2i + 1]; `hold` is the request's hold id ('' for none). Writes its reply
-- (allowed, then five integers per rule, then now) to out[base + 1 .. base + 5n + 2]. Returns an
-- error text instead when an argument is malformed (nothing written, in `out` or in Redis, then).
local function decide_request(KEYS, ARGV, k0, a0, n, now, hold, out, base)
  if n == 1 then
    -- One rule, the common case: no per-rule arrays. Its own decision is the request's (a shadow
    -- rule admits the request either way), and it consumes only when it admitted.
    local l, cost, key = rule_params(ARGV[a0 + 2]), amount(ARGV[a0 + 3]), KEYS[k0 + 1]
    if l == nil or cost == nil then
      return 'sluice: bad arguments for rule 1'
    end
    local state, ktype = l.module.read(key)
    local ok, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, cost)
    if ok then
      l.module.consume(key, ktype, state, l, now, cost, hold)
    end
    out[base + 1], out[base + 2], out[base + 3], out[base + 4], out[base + 5], out[base + 6], out[base + 7] =
      (ok or not l.enforce) and 1 or 0, ok and 1 or 0, remaining, reset_after, retry_after, delay, now
    return nil
  end

  -- Entries past n are an earlier request's, never read.
  local rules, costs, ktypes, states = scratch_rules, scratch_costs, scratch_ktypes, scratch_states
  for i = 1, n do
    local l = rule_params(ARGV[a0 + 2 * i])
    local cost = amount(ARGV[a0 + 2 * i + 1])
    if l == nil or cost == nil then
      return 'sluice: bad arguments for rule ' .. i
    end
    rules[i], costs[i] = l, cost
  end

  -- Phase 1: decide, read-only. The reply is filled as we go: { allowed, then per rule five
  -- integers, then now } (see the contract above).
  out[base + 1] = 1
  out[base + 5 * n + 2] = now
  local allowed = true
  for i = 1, n do
    local l, key = rules[i], KEYS[k0 + i]
    local state, ktype = l.module.read(key)
    ktypes[i], states[i] = ktype, state
    local ok, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, costs[i])
    local b = base + 5 * i - 3
    out[b], out[b + 1], out[b + 2], out[b + 3], out[b + 4] = ok and 1 or 0, remaining, reset_after, retry_after, delay
    if l.enforce and not ok then
      allowed = false
    end
  end

  if not allowed then
    -- Nothing will be consumed: a rule that had room reports its state as it stands, not as it
    -- would have been after this request.
    out[base + 1] = 0
    for i = 1, n do
      local b = base + 5 * i - 3
      if out[b] == 1 then
        local l = rules[i]
        local ok, remaining, reset_after, retry_after, delay = l.module.check(l, states[i], now, 0)
        out[b], out[b + 1], out[b + 2], out[b + 3], out[b + 4] = ok and 1 or 0, remaining, reset_after, retry_after, delay
      end
    end
    return nil
  end

  -- Phase 2: consume, the whole request being admitted, in each rule whose own decision allowed.
  -- The same key twice in one request consumes on top of the first write, as the memory store
  -- does: found by scanning the keys before it, or, past a few rules, in a set of those written
  -- (the scan allocates nothing; the set bounds the work of a request with many rules).
  local written = n > 8 and {} or nil
  for i = 1, n do
    if out[base + 5 * i - 3] == 1 then
      local l, key = rules[i], KEYS[k0 + i]
      local ktype, state = ktypes[i], states[i]
      local again = false
      if written ~= nil then
        again = written[key] == true
        written[key] = true
      else
        for j = 1, i - 1 do
          if KEYS[k0 + j] == key and out[base + 5 * j - 3] == 1 then
            again = true
            break
          end
        end
      end
      if again then
        state, ktype = l.module.read(key)
      end
      l.module.consume(key, ktype, state, l, now, costs[i], hold)
    end
  end
  return nil
end

-- Redis's clock, in µs since the Unix epoch: the one clock every replica decides by.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The decision instant from a `now` argument: "" is the server's clock, read once per call
-- (`clock`, when given, caches it for a call deciding several requests), else a non-negative
-- integer (µs). nil for anything else.
local function instant(text, clock)
  if text == '' then
    if clock == nil then
      return server_now()
    end
    if clock.now == nil then
      clock.now = server_now()
    end
    return clock.now
  end
  return int(text)
end

-- A hold id: '' (none) or decimal digits; nil for anything else.
local function hold_id(text)
  if text == '' or (type(text) == 'string' and string.match(text, '^%d+$')) then
    return text
  end
  return nil
end

-- `decide`'s reply table, reused by every call (Redis turns it into the reply as the call
-- returns, before the next call can run): filling a table that already has its slots costs less
-- than growing a new one. Entries past the reply's end are cleared, as Redis reads to the first
-- nil.
local reply, reply_len = {}, 0

local function decide(KEYS, ARGV)
  local n = #KEYS
  if #ARGV ~= 2 + 2 * n then
    return redis.error_reply('sluice: expected ' .. (2 + 2 * n) .. ' arguments for ' .. n .. ' keys, got ' .. #ARGV)
  end
  local now = instant(ARGV[1])
  if now == nil then
    return redis.error_reply('sluice: now must be a non-negative integer')
  end
  local hold = hold_id(ARGV[2])
  if hold == nil then
    return redis.error_reply('sluice: the hold id must be empty or decimal digits')
  end
  -- Counted before it is filled: a call stopped part-way (a Lua error in a write, FUNCTION KILL
  -- during the read-only phase) leaves what it filled for the next shorter reply to clear.
  local len = 5 * n + 2
  if len > reply_len then
    reply_len = len
  end
  local err = decide_request(KEYS, ARGV, 0, 1, n, now, hold, reply, 0)
  if err ~= nil then
    return redis.error_reply(err)
  end
  for i = len + 1, reply_len do
    reply[i] = nil
  end
  reply_len = len
  return reply
end

-- Several requests in one call, decided one after the other exactly as that many `decide` calls
-- in a row (each all-or-nothing on its own; a later request sees an earlier one's writes).
--
-- ARGV[1]  the number of requests m; then per request: its now ("" for the server's clock, read
--          once for the whole call), its hold id ("" for none), its number of rules n, then its
--          2n parameter and cost arguments as for `decide`. KEYS: every request's keys, in order.
-- Returns the m replies of `decide` concatenated (2 + 5n integers each).
-- Every argument is checked before anything is decided, so a malformed call writes nothing.
local function decide_many(KEYS, ARGV)
  local m = int(ARGV[1])
  if m == nil then
    return redis.error_reply('sluice: the number of requests must be a non-negative integer')
  end
  local a, k = 2, 0
  for j = 1, m do
    local n = int(ARGV[a + 2])
    if n == nil or n < 1 then
      return redis.error_reply('sluice: request ' .. j .. ' has no rule count')
    end
    for i = 1, n do
      if rule_params(ARGV[a + 1 + 2 * i]) == nil or amount(ARGV[a + 2 + 2 * i]) == nil then
        return redis.error_reply('sluice: bad arguments for rule ' .. i .. ' of request ' .. j)
      end
    end
    if ARGV[a] ~= '' and int(ARGV[a]) == nil then
      return redis.error_reply('sluice: now of request ' .. j .. ' must be a non-negative integer')
    end
    if hold_id(ARGV[a + 1]) == nil then
      return redis.error_reply('sluice: the hold id of request ' .. j .. ' must be empty or decimal digits')
    end
    a, k = a + 3 + 2 * n, k + n
  end
  if a - 1 ~= #ARGV or k ~= #KEYS then
    return redis.error_reply('sluice: ' .. m .. ' requests need ' .. k .. ' keys and ' .. (a - 1) .. ' arguments, got ' .. #KEYS .. ' and ' .. #ARGV)
  end
  local out, clock = {}, {}
  a, k = 2, 0
  for _ = 1, m do
    local n = int(ARGV[a + 2])
    decide_request(KEYS, ARGV, k, a + 1, n, instant(ARGV[a], clock), ARGV[a + 1], out, #out)
    a, k = a + 3 + 2 * n, k + n
  end
  return out
end

-- Settles a request's holds (hold ARGV[2], decimal) at ARGV[1] ("" for the server's clock).
-- KEYS[i]  the state key of the request's rule i that holds (src/store/keys.rs).
-- ARGV[3i], ARGV[3i + 1], ARGV[3i + 2]  rule i's parameters as for `decide`, the estimate the
--          request reserved under it at admission (its lease says; ignored for a concurrency
--          slot), and the cost it settles to (at most MAX_COST, as for `decide`).
-- A concurrency slot is given back (its cost ignored); a reservation is replaced by its actual
-- cost (lua/reservation.lua), consumed even past the limit. Idempotent: a hold already gone
-- (settled, or run out) is left alone, and nothing is charged for it. A reservation of 0 held
-- nothing (`consume` in lua/reservation.lua), so its cost is charged at once, each time it is
-- settled, and it counts as found. A key of another shape is left alone. Every argument is
-- checked before anything is written.
-- Returns the number of holds found.
local function settle(KEYS, ARGV)
  local now = instant(ARGV[1], {})
  local hold = hold_id(ARGV[2])
  if now == nil or hold == nil or hold == '' or #ARGV ~= 2 + 3 * #KEYS then
    return redis.error_reply('sluice: settle takes now ("" or µs), a hold id (decimal digits), then per key its rule parameters, the estimate reserved and the cost')
  end
  local rules, reserved, costs = {}, {}, {}
  for i = 1, #KEYS do
    rules[i], reserved[i], costs[i] = rule_params(ARGV[3 * i]), amount(ARGV[3 * i + 1]), amount(ARGV[3 * i + 2])
    if rules[i] == nil or reserved[i] == nil or costs[i] == nil then
      return redis.error_reply('sluice: bad arguments for key ' .. i)
    end
  end
  local found = 0
  for i, key in ipairs(KEYS) do
    local l = rules[i]
    if l.algo == 7 then
      local until_ = redis.pcall('ZSCORE', key, hold)
      if type(until_) == 'string' then
        -- Only in a set that held this request's slot: a concurrency set, whatever the rule is now.
        redis.call('ZREM', key, hold)
        redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
        if tonumber(until_) > now then
          found = found + 1
        end
      end
    elseif l.ttl ~= nil and reserved[i] == 0 then
      found = found + l.module.charge(key, l, now, hold, costs[i])
    elseif l.ttl ~= nil then
      found = found + l.module.settle(key, l, now, hold, costs[i])
    end
  end
  return found
end

-- Gives back the slots of a request that shaping rules (leaky bucket with maxDelay) admitted with
-- a delay, whose caller went away before it departed (`sluice::algorithm::give_back`), at ARGV[1]
-- ("" for the server's clock).
-- KEYS[i]  the state key of the request's shaping rule i (src/store/keys.rs).
-- ARGV[3i − 1], ARGV[3i], ARGV[3i + 1]  rule i's parameters as for `decide`, the cost the
--          request took, and the TAT its admission set (µs: that decision's now plus its
--          reset_after_us).
-- Only the last slot taken goes back (its departure then goes to the next request); a slot with
-- later ones behind it, one already departed, or a key of another shape is left alone. Every
-- argument is checked before anything is written.
-- Returns the number of slots given back.
local function cancel(KEYS, ARGV)
  local now = instant(ARGV[1], {})
  if now == nil or #ARGV ~= 1 + 3 * #KEYS then
    return redis.error_reply('sluice: cancel takes now ("" or µs), then per key its rule parameters, the cost and the TAT its admission set')
  end
  local rules, costs, untils = {}, {}, {}
  for i = 1, #KEYS do
    rules[i], costs[i], untils[i] = rule_params(ARGV[3 * i - 1]), amount(ARGV[3 * i]), int(ARGV[3 * i + 1])
    if rules[i] == nil or costs[i] == nil or untils[i] == nil then
      return redis.error_reply('sluice: bad arguments for key ' .. i)
    end
  end
  local given = 0
  for i, key in ipairs(KEYS) do
    if rules[i].module == sluice.gcra then
      given = given + sluice.gcra.give_back(key, rules[i], now, untils[i], costs[i])
    end
  end
  return given
end

-- Quota leases for one holder (`sluice::algorithm::lease`; src/store/mod.rs `LeaseOp`), at ARGV[1]
-- ("" for the server's clock). Per key i (KEYS[i], the state key of a leased rule) seven
-- arguments from ARGV[7i - 5]: the rule's parameters as for `decide` (ending in ":L"), the hold
-- id of the lease to settle ("" for none), the units spent from it, the hold id of the lease to
-- grant ("" for none), the units wanted, the cap on the key's live holds (the rule's overshoot
-- bound) and the lease's longest life in µs. Settles first (as `settle` does: idempotent, a
-- lease already settled or ended charges nothing), then grants what fits. Each key on its own:
-- keys need not share a slot's request, only the call's slot. Every argument is checked before
-- anything is written.
-- Returns five integers per key: units granted (0: none), how long the holder may spend them
-- (µs from now; 0 when none), the key's remaining and reset_after_us once granted, and how many
-- live holds (holders) the key has.
local function lease(KEYS, ARGV)
  local now = instant(ARGV[1], {})
  if now == nil or #ARGV ~= 1 + 7 * #KEYS then
    return redis.error_reply('sluice: lease takes now ("" or µs), then per key seven arguments (rule parameters, settle hold, spent, grant hold, want, cap, ttl_us)')
  end
  local ops = {}
  for i = 1, #KEYS do
    local a = 7 * i - 5
    local op = {
      l = rule_params(ARGV[a]),
      settle = hold_id(ARGV[a + 1]),
      used = amount(ARGV[a + 2]),
      grant = hold_id(ARGV[a + 3]),
      want = amount(ARGV[a + 4]),
      cap = amount(ARGV[a + 5]),
      ttl = int(ARGV[a + 6]),
    }
    if op.l == nil or not op.l.leased or op.settle == nil or op.used == nil or op.grant == nil or op.want == nil
      or op.cap == nil or op.ttl == nil then
      return redis.error_reply('sluice: bad lease arguments for key ' .. i)
    end
    ops[i] = op
  end
  local out = {}
  for i, key in ipairs(KEYS) do
    local op = ops[i]
    if op.settle ~= '' then
      op.l.module.settle(key, op.l, now, op.settle, op.used)
    end
    local amount, lasts, remaining, reset_after, holders =
      op.l.module.grant(key, op.l, now, op.grant, op.want, op.cap, op.ttl)
    local b = #out
    out[b + 1], out[b + 2], out[b + 3], out[b + 4], out[b + 5] = amount, lasts, remaining, reset_after, holders
  end
  return out
end
