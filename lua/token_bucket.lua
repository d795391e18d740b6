-- Token bucket with continuous refill. Mirrors `sluice::algorithm::token_bucket`.
--
-- State: hash {a = "tb", credit = µs of emission (one token = one interval), updated = µs}.
-- Rule fields used: burst, interval. capacity = burst × interval; the level at `now` is
-- min(credit + max(now − updated, 0), capacity) (a clock behind `updated` refills nothing).
-- TTL = updated + (capacity − credit) − now after consuming. A debt puts `updated` past now
-- (at most to MAX_EXACT), and a bucket in debt refuses even a cost of 0.

sluice.token_bucket = {}

function sluice.token_bucket.read(key)
  local v, ktype = read_hash(key, 'a', 'credit', 'updated')
  if v == nil then
    return nil, ktype
  end
  local credit, updated = int(v[2]), int(v[3])
  if v[1] ~= 'tb' or credit == nil or updated == nil then
    return nil, ktype
  end
  return { credit = credit, updated = updated }, ktype
end

local function tb_level(l, b, now)
  local capacity = l.burst * l.interval
  if b == nil then
    return capacity
  end
  return math.min(b.credit + math.max(now - b.updated, 0), capacity)
end

function sluice.token_bucket.check(l, b, now, cost)
  local interval = l.interval
  local capacity = l.burst * interval
  local level = tb_level(l, b, now)
  -- Nothing refills before `updated`: a debt (a settled cost above its reservation) or a clock
  -- behind the last write.
  local waiting = 0
  if b ~= nil then
    waiting = math.max(b.updated - now, 0)
  end
  if cost > l.burst then
    return false, idiv(level, interval), capacity - level + waiting, -1, 0
  end
  local needed = cost * interval
  -- A bucket in debt (empty, nothing refilling before `updated`) refuses even a cost of 0, as in
  -- Rust; an empty bucket out of debt admits it.
  local in_debt = level == 0 and waiting > 0
  if level >= needed and not in_debt then
    local left = level - needed
    return true, idiv(left, interval), capacity - left + waiting, -1, 0
  end
  return false, idiv(level, interval), capacity - level + waiting, needed - level + waiting, 0
end

function sluice.token_bucket.consume(key, ktype, b, l, now, cost)
  local capacity = l.burst * l.interval
  local level = tb_level(l, b, now)
  local needed = cost * l.interval
  local updated = now
  if b ~= nil then
    updated = math.max(b.updated, now)
  end
  -- More than the bucket holds (a settled cost above its reservation) is debt: `updated` moves
  -- past now by the shortfall, and nothing refills until the clock passes it.
  -- The debt saturates at MAX_EXACT µs since the epoch, as in Rust.
  local credit = level - needed
  if credit < 0 then
    updated = math.min(updated - credit, math.max(MAX_EXACT, updated))
    credit = 0
  end
  local pristine_at = updated + (capacity - credit)
  if not worth_writing(ktype, pristine_at, now) then
    return
  end
  if b == nil and ktype ~= 'none' then
    redis.call('DEL', key) -- another algorithm's state: start over, as Rust replaces it
  end
  if b ~= nil then
    redis.call('HSET', key, 'credit', fmt(credit), 'updated', fmt(updated)) -- already a 'tb' state
  else
    redis.call('HSET', key, 'a', 'tb', 'credit', fmt(credit), 'updated', fmt(updated))
  end
  redis.call('PEXPIRE', key, ttl_ms(pristine_at, now))
end
