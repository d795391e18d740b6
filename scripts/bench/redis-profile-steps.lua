-- Profiling steps for scripts/bench/redis-profile.sh: appended to Sluice's decision library
-- (lua/*.lua, in the order src/store/redis/library.rs concatenates them) so they reach its local
-- functions.
-- Each step does what the one before did plus one more part of a fixedWindow decision, so the
-- difference between two steps' µs per call is that part's cost inside Redis. Not part of the
-- product: nothing here is loaded by Sluice.
--
-- KEYS[i] a rule's key; ARGV[1] and ARGV[2] ignored (the decision's now and hold id: ""),
-- ARGV[2i + 1] the rule's parameter text, ARGV[2i + 2] its cost, as for `decide`
-- (lua/check.lua). Returns 1 + 5 integers per rule.

-- The commands alone: TIME, then per rule the HMGET a fixed window reads with and an HSET of a
-- constant count.
local function profile_commands(KEYS, ARGV)
  redis.call('TIME')
  local out = { 1 }
  for i = 1, #KEYS do
    redis.pcall('HMGET', KEYS[i], 'a', 'start', 'count', 'e')
    redis.call('HSET', KEYS[i], 'count', '5')
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4], out[#out + 5] = 1, 2, 3, 4, 5
  end
  return out
end

-- A step: `part(key, rule, cost, now)` replaces what profile_commands does per rule.
local function step(part)
  return function(KEYS, ARGV)
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local out = { 1 }
    for i = 1, #KEYS do
      local l = rule_params(ARGV[2 * i + 1])
      if l == nil then
        return redis.error_reply('profile: bad parameters for rule ' .. i)
      end
      local r1, r2, r3, r4 = part(KEYS[i], l, int(ARGV[2 * i + 2]), now)
      out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4], out[#out + 5] = 1, r1, r2, r3, r4
    end
    return out
  end
end

-- + parsing the rule's parameters and cost (cached text lookup, tonumber).
local profile_arguments = step(function(key)
  redis.pcall('HMGET', key, 'a', 'start', 'count', 'e')
  redis.call('HSET', key, 'count', '5')
  return 2, 3, 4, 5
end)

-- + reading the state through the module (field checks, numbers, the state table).
local profile_read = step(function(key, l)
  l.module.read(key)
  redis.call('HSET', key, 'count', '5')
  return 2, 3, 4, 5
end)

-- + deciding (the algorithm's arithmetic).
local profile_check = step(function(key, l, cost, now)
  local state = l.module.read(key)
  local _, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, cost)
  redis.call('HSET', key, 'count', '5')
  return remaining, reset_after, retry_after, delay
end)

-- + writing the real state (the module's consume: the new count, formatted; TTL when needed).
local profile_consume = step(function(key, l, cost, now)
  local state, ktype = l.module.read(key)
  local _, remaining, reset_after, retry_after, delay = l.module.check(l, state, now, cost)
  l.module.consume(key, ktype, state, l, now, cost, '')
  return remaining, reset_after, retry_after, delay
end)

redis.register_function('profile_commands', profile_commands)
redis.register_function('profile_arguments', profile_arguments)
redis.register_function('profile_read', profile_read)
redis.register_function('profile_check', profile_check)
redis.register_function('profile_consume', profile_consume)
-- The whole decision, as Sluice calls it: `decide` (adds the all-or-nothing phases, the reply).
redis.register_function('profile_decide', decide)
-- The yardstick of issue #14's quick proxy: a minimal one-command script.
redis.register_function('profile_incrby', function(KEYS)
  return redis.call('INCRBY', KEYS[1], 1)
end)
