-- Deferred writes (`deferIfLimited`): one rule's queue of limited writes as a Redis stream,
-- delivered by the workload's sidecars through a consumer group. Loaded with check.lua in the
-- same library (it uses `instant`, `int` and `fmt`) and registered as `deferred` (FCALL name:
-- the library's name with `_deferred`); before Redis 7.0, run as a script.
--
-- KEYS[1]  the rule's queue: a stream `sl1:{<tag>}:q:<rule>` (src/store/keys.rs), consumer
--          group `d`. Each entry's status is the hash `KEYS[1]:s:<id>`; an idempotency value's
--          entry id is `KEYS[1]:i:<len(key)>:<key><value>` (same hash tag: same slot).
-- KEYS[2]  the queue's per-key counts: a hash, fields `n:<key>` (entries) and `b:<key>` (bytes).
-- KEYS[3]  the namespace's totals over all its queues: a hash, fields `n` and `b`.
-- KEYS[4]  the rule's dead letters: a stream, trimmed to about 1000 entries.
-- ARGV[1]  the operation: put, claim, done or status. ARGV[2]  now in µs, or "" (Redis's clock).
--
-- put     ARGV[3] key, [4] idempotency value or "", [5] most entries per key, [6] most bytes
--         per key, [7] most entries in the namespace, [8] most bytes in the namespace, [9] the
--         request: method, [10] path, [11] host, [12] the checked headers, [13] the replayed
--         headers (both opaque text), [14] client IP, [15] body, [16] the entry's status token
--         (random: only who holds it reads the status).
--         Returns {1, id, entries of the key, token} accepted; {2, id, entries, token} the
--         idempotency value was seen (nothing written: the first entry's id and token);
--         {0, 'key' or 'namespace', entries of the key} full.
-- claim   ARGV[3] consumer, [4] retry interval (ms), [5] most entries, [6] most attempts,
--         [7] how long an ended entry's status is kept (ms), ARGV[8..] ids the consumer still
--         holds (their idle time restarts). First entries idle for a retry interval and due
--         (another consumer's that died, or a failed delivery whose backoff is over; the
--         pending list is walked past entries still in backoff, at most 1000 a call), then new
--         ones; each counts an attempt, and one past the most attempts is dead-lettered
--         instead. Returns { { {id, attempts, field, value, …}, … }, {ids still held} }: a held
--         id missing from the second list was taken by another consumer (it had been idle a
--         retry interval) and is no longer this one's to deliver.
-- done    ARGV[3] id, [4] 'delivered' or 'failed', [5] the application's status (0 for none),
--         [6] most attempts, [7] retry interval (ms), [8] status kept (ms), [9] the consumer.
--         Returns 0 (no such queued entry, or another consumer holds it now), 1 delivered,
--         2 dead-lettered, 3 to be retried.
-- status  ARGV[3] id, [4] its token. Returns the status hash as {field, value, …} ({} when
--         unknown, gone, or the token is not the entry's).
-- stats   Returns {entries queued, entries a consumer holds, the oldest entry's id or '',
--         dead letters}; consumers idle an hour with nothing pending are deleted.
--
-- Accounting: an entry's bytes are its fields' lengths; per key and per namespace counts rise
-- at put and fall when the entry is delivered or dead-lettered, in the same call as the stream.

local GROUP = 'd'

local function status_key(queue, id)
  return queue .. ':s:' .. id
end

local function count_down(KEYS, key, size)
  if redis.call('HINCRBY', KEYS[2], 'n:' .. key, -1) <= 0 then
    redis.call('HDEL', KEYS[2], 'n:' .. key, 'b:' .. key)
  else
    redis.call('HINCRBY', KEYS[2], 'b:' .. key, -size)
  end
  if redis.call('HINCRBY', KEYS[3], 'n', -1) <= 0 then
    redis.call('DEL', KEYS[3])
  else
    redis.call('HINCRBY', KEYS[3], 'b', -size)
  end
end

-- Ends entry `id` as `state` ('delivered' or 'dead'): out of the stream and the counts, its
-- status kept for `keep_ms` and its idempotency value as long.
local function finish(KEYS, id, state, code, now_ms, keep_ms)
  local st = status_key(KEYS[1], id)
  local fields = redis.call('HMGET', st, 'k', 'sz', 'i')
  if state == 'dead' then
    local entry = redis.call('XRANGE', KEYS[1], id, id)
    if entry[1] then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', '1000', '*', 'id', id, unpack(entry[1][2]))
    end
  end
  redis.call('XACK', KEYS[1], GROUP, id)
  redis.call('XDEL', KEYS[1], id)
  count_down(KEYS, fields[1] or '', tonumber(fields[2]) or 0)
  redis.call('HSET', st, 'state', state, 'code', code, 'ended', fmt(now_ms))
  redis.call('PEXPIRE', st, keep_ms)
  if fields[3] and fields[3] ~= '' then
    redis.call('PEXPIRE', fields[3], keep_ms)
  end
end

local function put(KEYS, ARGV, now_ms)
  local key, idem = ARGV[3], ARGV[4]
  local idem_key = ''
  if idem ~= '' then
    idem_key = KEYS[1] .. ':i:' .. #key .. ':' .. key .. idem
    local seen = redis.call('GET', idem_key)
    if seen then
      local token = redis.call('HGET', status_key(KEYS[1], seen), 'tok') or ''
      return { 2, seen, tonumber(redis.call('HGET', KEYS[2], 'n:' .. key)) or 0, token }
    end
  end
  local size = 0
  for i = 9, 15 do
    size = size + #ARGV[i]
  end
  local counts = redis.call('HMGET', KEYS[2], 'n:' .. key, 'b:' .. key)
  local n, b = tonumber(counts[1]) or 0, tonumber(counts[2]) or 0
  if n + 1 > int(ARGV[5]) or b + size > int(ARGV[6]) then
    return { 0, 'key', n }
  end
  local totals = redis.call('HMGET', KEYS[3], 'n', 'b')
  if (tonumber(totals[1]) or 0) + 1 > int(ARGV[7]) or (tonumber(totals[2]) or 0) + size > int(ARGV[8]) then
    return { 0, 'namespace', n }
  end
  local id = redis.call('XADD', KEYS[1], '*', 'k', key, 'm', ARGV[9], 'p', ARGV[10], 'h', ARGV[11],
    'c', ARGV[12], 'f', ARGV[13], 'ip', ARGV[14], 'b', ARGV[15], 't', fmt(now_ms))
  redis.call('HINCRBY', KEYS[2], 'n:' .. key, 1)
  redis.call('HINCRBY', KEYS[2], 'b:' .. key, size)
  redis.call('HINCRBY', KEYS[3], 'n', 1)
  redis.call('HINCRBY', KEYS[3], 'b', size)
  -- Kept while queued; finish() gives it (and the idempotency value) its lifetime.
  redis.call('HSET', status_key(KEYS[1], id), 'state', 'queued', 'k', key, 'm', ARGV[9], 'p', ARGV[10],
    'accepted', fmt(now_ms), 'a', '0', 'sz', fmt(size), 'i', idem_key, 'tok', ARGV[16])
  if idem_key ~= '' then
    redis.call('SET', idem_key, id)
  end
  return { 1, id, n + 1, ARGV[16] }
end

-- Counts an attempt at `entry` ({id, fields}) and adds it to `out`, or dead-letters it when
-- it has had its attempts.
local function take(KEYS, entry, out, max_attempts, now_ms, keep_ms)
  local id = entry[1]
  local attempts = redis.call('HINCRBY', status_key(KEYS[1], id), 'a', 1)
  if attempts > max_attempts then
    finish(KEYS, id, 'dead', '0', now_ms, keep_ms)
    return
  end
  local item = { id, attempts }
  for _, v in ipairs(entry[2]) do
    item[#item + 1] = v
  end
  out[#out + 1] = item
end

local function claim(KEYS, ARGV, now_ms)
  local consumer, idle, most = ARGV[3], int(ARGV[4]), int(ARGV[5])
  local max_attempts, keep_ms = int(ARGV[6]), int(ARGV[7])
  if redis.call('EXISTS', KEYS[1]) == 0 then
    return { {}, {} }
  end
  local made = redis.pcall('XGROUP', 'CREATE', KEYS[1], GROUP, '0')
  if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP', 1, true) then
    return redis.error_reply(made.err)
  end
  -- What the consumer holds stays its own, unless another took it meanwhile (it was idle a
  -- retry interval): then the consumer is told to let it go.
  local kept = {}
  for i = 8, #ARGV do
    local pending = redis.call('XPENDING', KEYS[1], GROUP, ARGV[i], ARGV[i], 1)
    if pending[1] and pending[1][2] == consumer then
      redis.call('XCLAIM', KEYS[1], GROUP, consumer, 0, ARGV[i], 'JUSTID')
      kept[#kept + 1] = ARGV[i]
    end
  end
  local out = {}
  if most == 0 then
    return { out, kept }
  end
  -- Entries idle a retry interval, walked in pages past those still in backoff (which stay
  -- their holder's, idle, until due): another consumer's that died, or a failed delivery
  -- whose backoff is over.
  local start, scanned = '-', 0
  while #out < most and scanned < 1000 do
    local page = redis.call('XPENDING', KEYS[1], GROUP, 'IDLE', idle, start, '+', 100)
    for _, p in ipairs(page) do
      if #out >= most then
        break
      end
      local not_before = tonumber(redis.call('HGET', status_key(KEYS[1], p[1]), 'nb')) or 0
      if not_before <= now_ms then
        local taken = redis.call('XCLAIM', KEYS[1], GROUP, consumer, idle, p[1])
        -- A deleted entry comes back without fields (or not at all): nothing to deliver.
        if taken[1] and taken[1][2] then
          take(KEYS, taken[1], out, max_attempts, now_ms, keep_ms)
        end
      end
    end
    scanned = scanned + #page
    if #page < 100 then
      break
    end
    start = '(' .. page[#page][1]
  end
  if #out < most then
    local fresh = redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', most - #out, 'STREAMS', KEYS[1], '>')
    if fresh and fresh[1] then
      for _, entry in ipairs(fresh[1][2]) do
        take(KEYS, entry, out, max_attempts, now_ms, keep_ms)
      end
    end
  end
  return { out, kept }
end

local function done(KEYS, ARGV, now_ms)
  local id, outcome, code = ARGV[3], ARGV[4], ARGV[5]
  local max_attempts, interval, keep_ms = int(ARGV[6]), int(ARGV[7]), int(ARGV[8])
  local st = status_key(KEYS[1], id)
  local fields = redis.call('HMGET', st, 'state', 'a')
  if fields[1] ~= 'queued' then
    return 0
  end
  -- Only its holder ends it: one that lost it (too slow, taken by another) is not heard.
  local pending = redis.call('XPENDING', KEYS[1], GROUP, id, id, 1)
  if not pending[1] or pending[1][2] ~= ARGV[9] then
    return 0
  end
  if outcome == 'delivered' then
    finish(KEYS, id, 'delivered', code, now_ms, keep_ms)
    return 1
  end
  local attempts = tonumber(fields[2]) or 1
  if attempts >= max_attempts then
    finish(KEYS, id, 'dead', code, now_ms, keep_ms)
    return 2
  end
  -- Backoff doubles per attempt: the entry is claimed again once idle for an interval and due.
  local wait = interval * 2 ^ (math.min(attempts, 20) - 1)
  redis.call('HSET', st, 'code', code, 'nb', fmt(now_ms + wait))
  return 3
end

local function deferred(KEYS, ARGV)
  local now = instant(ARGV[2], {})
  if now == nil or #KEYS ~= 4 then
    return redis.error_reply('ERR sluice deferred: bad arguments')
  end
  local now_ms = math.floor(now / 1000)
  local op = ARGV[1]
  if op == 'put' and #ARGV == 16 then
    return put(KEYS, ARGV, now_ms)
  elseif op == 'claim' and #ARGV >= 7 then
    return claim(KEYS, ARGV, now_ms)
  elseif op == 'done' and #ARGV == 9 then
    return done(KEYS, ARGV, now_ms)
  elseif op == 'stats' and #ARGV == 2 then
    local held = 0
    local pending = redis.pcall('XPENDING', KEYS[1], GROUP)
    if type(pending) == 'table' and not pending.err then
      held = pending[1]
      -- Every sidecar start is a new consumer: the idle ones holding nothing go.
      for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], GROUP)) do
        local info = {}
        for i = 1, #c, 2 do
          info[c[i]] = c[i + 1]
        end
        if info['pending'] == 0 and (info['idle'] or 0) > 3600000 then
          redis.call('XGROUP', 'DELCONSUMER', KEYS[1], GROUP, info['name'])
        end
      end
    end
    local oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
    return { redis.call('XLEN', KEYS[1]), held, oldest[1] and oldest[1][1] or '', redis.call('XLEN', KEYS[4]) }
  elseif op == 'status' and #ARGV == 4 then
    local st = status_key(KEYS[1], ARGV[3])
    local token = redis.call('HGET', st, 'tok')
    if not token or token ~= ARGV[4] then
      return {}
    end
    return redis.call('HGETALL', st)
  end
  return redis.error_reply('ERR sluice deferred: unknown operation or argument count')
end
