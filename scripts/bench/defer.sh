#!/usr/bin/env bash
# Writes that degrade instead of failing (issue 43, benchmark part a; docs/degradation.md): an
# application behind three `sluice sidecar`s, each asking its own `sluice serve` replica, all on
# one Redis with AOF (`appendfsync always`), and a rule letting LIMIT writes a second through with
# `deferIfLimited` (and `onStoreFailure: deny`). Writers offer RATE (10 × LIMIT) writes a second
# for DURATION seconds, each with its own Idempotency-Key. While the queue drains, one sidecar is
# killed (-9) and started again, then Redis is killed (-9) and started again from its AOF.
# Prints: writes answered live, queued, refused; every accepted write delivered (lost: must be 0) and how many twice (what at
# least once allows after a crash); the most delivered in any second against the limit; the
# queue age at delivery (p50, p99); the drain time after the last write.
#
#   scripts/bench/defer.sh
#   LIMIT=50 DURATION=30 scripts/bench/defer.sh
#
# Env: LIMIT (100), RATE (10 × LIMIT), DURATION (30 s), CHAOS (1: the kills; 0: none),
# SLUICE_BIN. A write that fails (no answer, a status other than 201, 202 or 429), a write lost,
# or a second with more deliveries than the rule allows fails the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then
    DURATION="${DURATION:-2}" LIMIT="${LIMIT:-20}"
fi
LIMIT="${LIMIT:-100}"
RATE="${RATE:-$((LIMIT * 10))}"
DURATION="${DURATION:-30}"
CHAOS="${CHAOS:-1}"

install_missing python3:python3 curl:curl redis-server:redis-server
SLUICE="${SLUICE_BIN:-}"
if [ -z "$SLUICE" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice"
fi
DRIVER="$ROOT/scripts/bench/defer.py"
work="$(mktemp -d)"
pids=()
cleanup() {
    ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null
    [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/redis"
redis_port="$(free_port)"
redis_up() { start_redis "$redis_port" 0 --appendonly yes --appendfsync always --dir "$work/redis"; }
redis_up

app="$(free_port)"
python3 "$DRIVER" app "$app" &
pids+=($!)
wait_for_port "$app" "the application"

cat >"$work/policy.yaml" <<YAML
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders, namespace: shop}
spec:
  rules:
  - name: writes
    match: {methods: [POST], paths: [{prefix: /orders}]}
    algorithm: gcra
    limit: {requests: $LIMIT, per: 1s, burst: 1}
    # Strict while Redis is away: no replica admits on its own (a local fallback would let each
    # admit its share, and the second after Redis returns both), so replays pause instead.
    onStoreFailure: deny
    deferIfLimited:
      headers: [idempotency-key]
      idempotencyHeader: Idempotency-Key
      maxQueued: 100000
      maxQueuedBytes: 67108864
      maxAttempts: 10
      retryInterval: 2s
YAML

endpoints=() proxies=() sidecar_pids=()
for i in 0 1 2; do
    endpoints[i]="$(free_port)"
    "$SLUICE" serve --policies "$work/policy.yaml" --listen "127.0.0.1:${endpoints[i]}" \
        --redis "redis://127.0.0.1:$redis_port" 2>"$work/serve$i.log" &
    pids+=($!)
    wait_for_port "${endpoints[i]}" "sluice serve $i"
done
start_sidecar() { # INDEX
    local i="$1"
    "$SLUICE" sidecar --listen "127.0.0.1:${proxies[i]}" --admin-listen "127.0.0.1:$(free_port)" \
        --upstream "127.0.0.1:$app" --endpoint "http://127.0.0.1:${endpoints[i]}" --namespace shop \
        2>>"$work/sidecar$i.log" &
    sidecar_pids[i]=$!
    pids+=($!)
    wait_for_port "${proxies[i]}" "sluice sidecar $i"
}
for i in 0 1 2; do
    proxies[i]="$(free_port)"
    start_sidecar "$i"
done
sleep 2 # each sidecar's first snapshot

# queue_left: entries queued or held, as the first replica last read them (-1: not yet read).
queue_left() {
    curl -fsS "http://127.0.0.1:${endpoints[0]}/v1/snapshot" | python3 -c '
import json, sys
q = json.load(sys.stdin).get("store", {}).get("deferredQueues", [])
print(q[0].get("queued", -1) if q and "error" not in q[0] else -1)'
}

log "offering $RATE writes/s for ${DURATION}s through three sidecars; the rule lets $LIMIT/s through"
python3 "$DRIVER" writers "$(IFS=,; echo "${proxies[*]}")" "$RATE" "$DURATION" >"$work/writers.json" \
    || fail "the writers failed"
written="$(date +%s)"
drain_guess=$((DURATION * 9 + 5))
if [ "$CHAOS" = 1 ]; then
    sleep $((drain_guess / 4 + 1))
    log "kill -9 sidecar 1 mid-replay (queue: $(queue_left)); starting it again in 2 s"
    kill -9 "${sidecar_pids[1]}"
    sleep 2
    start_sidecar 1
    sleep $((drain_guess / 4 + 1))
    log "kill -9 Redis mid-replay (queue: $(queue_left)); starting it again from its AOF in 2 s"
    kill -9 "$REDIS_PID"
    wait "$REDIS_PID" 2>/dev/null || true
    sleep 2
    redis_up
fi
deadline=$((written + drain_guess * 3 + 60))
# Empty once the stats (read every 5 s) say so twice in a row.
empty=0
while [ "$empty" -lt 2 ]; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "the queue did not drain (left: $(queue_left))"
    sleep 5
    if [ "$(queue_left)" = 0 ]; then empty=$((empty + 1)); else empty=0; fi
done
sleep 2
out="$(python3 "$DRIVER" report "$app" "$work/writers.json" "$LIMIT")" || fail "no report"
python3 - "$out" <<'PY' || fail "$out"
import json, sys
r = json.loads(sys.argv[1])
print(f"{'offered':>8} {'live':>6} {'queued':>7} {'refused':>8} {'delivered':>10} {'lost':>5} {'twice':>6} {'max/s':>6} {'limit':>6} {'age p50':>8} {'age p99':>8} {'drain':>7}")
print(f"{r['offered']:8d} {r['live']:6d} {r['queued']:7d} {r['refused']:8d} {r['delivered']:10d} {r['lost']:5d} {r['duplicates']:6d} {r['most_in_a_second']:6d} {r['limit']:6d} {r['age_p50_s']:7.1f}s {r['age_p99_s']:7.1f}s {r['drain_s']:6.1f}s")
if r["failed"]:
    sys.exit(f"{r['failed']} writes failed")
if r["lost"] or r["strays"]:
    sys.exit(f"{r['lost']} accepted writes never delivered, {r['strays']} delivered that were not accepted")
if r["most_in_a_second"] > r["limit"] + 1:
    sys.exit(f"{r['most_in_a_second']} deliveries in one second against the limit {r['limit']} (burst 1)")
PY
log "limit $LIMIT/s (gcra, burst 1), $RATE writes/s offered for ${DURATION}s, chaos $CHAOS; load $(cut -d' ' -f1-3 /proc/loadavg)"
