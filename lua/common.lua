-- Shared prelude of the Sluice decision script (see check.lua for the script's contract).
--
-- The Rust side concatenates common.lua, one file per algorithm and check.lua into ONE Redis
-- Functions library (src/store/redis/library.rs, include_str!): loaded once per server, so a decision
-- (FCALL) runs only check.lua's function, not the definitions. Each algorithm file adds a table to
-- `sluice` with the same three functions:
--
--   read(key)                        -> state or nil (nil: missing, or another algorithm's
--                                       shape), and the key's kind: 'none' (missing), its type
--                                       ('hash', 'string', 'zset'), or 'other' (another type).
--                                       One read command, no TYPE probe.
--   check(l, state, now, cost)       -> allowed, remaining, reset_after_us, retry_after_us (-1 =
--                                       none), delay_us; read-only
--   consume(key, ktype, state, l, now, cost) -> writes the state after admitting `cost`, with a
--                                       PEXPIRE equal to the time until it is pristine again
--
-- They mirror the Rust `algorithm` modules line by line. Lua numbers are doubles: every value here is an
-- integer below 2^53 (Limit::new guarantees it for the limits; amounts are taken as at most
-- MAX_COST, and what a debt adds to a stored count or instant saturates at MAX_EXACT, as in Rust),
-- where + - * and comparisons are exact; division goes through idiv, which corrects the one
-- rounding a double quotient can make.

local sluice = {}

-- floor(a / b) for non-negative integers a, b > 0, exact: the double quotient may round up to
-- the next integer when the true quotient is just below it, so check it against the product.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

-- The largest integer a double holds exactly (MAX_EXACT in `sluice::algorithm`): every count
-- and instant written saturates here, as in Rust.
local MAX_EXACT = 9007199254740991
-- The largest cost, estimate or settled amount taken (MAX_COST in `sluice::algorithm`): a larger
-- argument is taken as this much.
local MAX_COST = 4294967295

-- Integers as command arguments: tostring() would give "1e+15" for large doubles. Saturates at
-- MAX_EXACT: past 2^53 a double is not the integer meant, and past 2^63 '%d' wraps it negative
-- (a count read back as nothing, a fresh window).
local function fmt(x)
  if x > MAX_EXACT then
    x = MAX_EXACT
  end
  return string.format('%d', x)
end

-- A non-negative decimal integer stored by this script, or nil for anything else.
local function int(s)
  if type(s) ~= 'string' then
    return nil
  end
  -- tonumber and two comparisons instead of a pattern match: this runs for every argument and
  -- every stored field of every decision. (It also takes forms such as " 7" or "0x7" that this
  -- code never writes.)
  local n = tonumber(s)
  if n == nil or n < 0 or n % 1 ~= 0 then
    return nil
  end
  return n
end

-- A cost, estimate or settled amount argument: a non-negative integer (nil for anything else)
-- taken as at most MAX_COST, as the algorithms take it in Rust (`clamp_cost`).
local function amount(s)
  local n = int(s)
  if n ~= nil and n > MAX_COST then
    return MAX_COST
  end
  return n
end

-- Milliseconds until `pristine_at`, rounded up so a key never expires before its state is
-- pristine, and at least 1 (PEXPIRE 0 would delete at once).
local function ttl_ms(pristine_at, now)
  local us = pristine_at - now
  if us <= 1000 then
    return 1
  end
  return idiv(us + 999, 1000)
end

-- Reads `...` (field names) of the hash at `key` in one command: the values (nil when the key is
-- missing) and the key's kind, 'none', 'hash' or 'other' (not a hash: HMGET fails on it, and a
-- write must DEL it first).
local function read_hash(key, ...)
  local v = redis.pcall('HMGET', key, ...)
  if v.err then
    return nil, 'other'
  end
  for i = 1, select('#', ...) do
    if v[i] then
      return v, 'hash'
    end
  end
  return nil, 'none'
end

-- Whether a consume should write at all: a key that did not exist and would be pristine at once
-- (a zero-cost request) is not created, as the memory store does not keep such an entry.
local function worth_writing(ktype, pristine_at, now)
  return ktype ~= 'none' or pristine_at > now
end
