#!/usr/bin/env bash
# Reads that degrade instead of failing (issue 43 item 1; docs/degradation.md): a catalogue
# origin behind one `sluice sidecar` (its endpoint `sluice serve`, memory store), a rule letting
# LIMIT reads a second through to the origin with `staleIfLimited`, and readers offering
# RATE (10 × LIMIT) reads a second over ITEMS items (a few hot ones, a long tail). Runs three
# times, side by side: without staleIfLimited (every limited read refused), with it, and with it and
# `revalidateEvery: REVALIDATE` seconds (stale-while-revalidate at the limiter). Prints: reads
# answered fresh, answered stale, refused, the origin's most hits in a second (the limit, plus
# the revalidations in the third run), and the sidecar's resident memory against its cache bound.
#
#   scripts/bench/degrade.sh
#   RATE=400 LIMIT=40 DURATION=20 scripts/bench/degrade.sh
#
# Env: LIMIT (20), RATE (10 × LIMIT), DURATION (15 s), ITEMS (500), BODY (2048 bytes), REVALIDATE
# (10 s), CACHE (the sidecar's --stale-cache-bytes, 262144: smaller than the catalogue, so the
# bound binds), SLUICE_BIN. A read that fails (no answer, a status other than 200 or 429) fails the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then
    DURATION="${DURATION:-2}" ITEMS="${ITEMS:-50}"
fi
LIMIT="${LIMIT:-20}"
RATE="${RATE:-$((LIMIT * 10))}"
DURATION="${DURATION:-15}"
ITEMS="${ITEMS:-500}"
BODY="${BODY:-2048}"
CACHE="${CACHE:-262144}"
REVALIDATE="${REVALIDATE:-10}"

install_missing python3:python3 curl:curl
SLUICE="${SLUICE_BIN:-}"
if [ -z "$SLUICE" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice"
fi
DRIVER="$ROOT/scripts/bench/degrade.py"
work="$(mktemp -d)"
pids=()
cleanup() {
    ((${#pids[@]})) && kill "${pids[@]}" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT


origin="$(free_port)"
python3 "$DRIVER" origin "$origin" "$BODY" &
pids+=($!)
wait_for_port "$origin" "the origin"

printf '%-16s %8s %8s %8s %8s %13s %13s %12s %13s %10s\n' run offered fresh stale refused 'origin total' 'origin max/s' 'stale share' 'sidecar RSS' 'kept bytes'
run() { # NAME STALE(0|1|2: with revalidateEvery)
    local name="$1" stale="" endpoint proxy admin sidecar out
    [ "$2" = 1 ] && stale="    staleIfLimited: {maxStale: 5m}"
    [ "$2" = 2 ] && stale="    staleIfLimited: {maxStale: 5m, revalidateEvery: ${REVALIDATE}s}"
    cat >"$work/policy.yaml" <<YAML
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: catalogue, namespace: shop}
spec:
  rules:
  - name: catalogue
    match: {methods: [GET], paths: [{prefix: /catalogue}]}
    algorithm: tokenBucket
    limit: {requests: $LIMIT, per: 1s, burst: $LIMIT}
$stale
YAML
    endpoint="$(free_port)"
    proxy="$(free_port)"
    admin="$(free_port)"
    "$SLUICE" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$endpoint" 2>"$work/serve.log" &
    local serve_pid=$!
    wait_for_port "$endpoint" "sluice serve"
    "$SLUICE" sidecar --listen "127.0.0.1:$proxy" --admin-listen "127.0.0.1:$admin" --upstream "127.0.0.1:$origin" \
        --endpoint "http://127.0.0.1:$endpoint" --namespace shop --stale-cache-bytes "$CACHE" 2>"$work/sidecar.log" &
    sidecar=$!
    wait_for_port "$proxy" "sluice sidecar"
    # The first read waits for the sidecar's copy of the policies, so none is decided without it.
    for t in $(seq 100); do
        curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$proxy/catalogue/warm" | grep -q 200 && break
        [ "$t" != 100 ] || fail "the sidecar never answered"
        sleep 0.1
    done
    sleep 1
    out="$(python3 "$DRIVER" readers "$proxy" "$origin" "$RATE" "$DURATION" "$ITEMS")" || fail "$name: readers failed"
    local rss kept
    rss="$(awk '/^VmRSS:/ {print $2}' "/proc/$sidecar/status")"
    kept="$(curl -fsS "http://127.0.0.1:$admin/metrics" | awk '/^sluice_sidecar_stale_cache_bytes / {print $2}')"
    python3 - "$name" "$out" "$rss" "$CACHE" "${kept:-0}" <<'PY' || fail "$name: $out"
import json, sys
name, c, rss_kib, cache, kept = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if kept > cache:
    sys.exit(f"kept {kept} bytes, over the bound {cache}")
if c["failed"]:
    sys.exit(f"{c['failed']} reads failed")
offered = c["fresh"] + c["stale"] + c["refused"]
limited = c["stale"] + c["refused"]
share = f"{100 * c['stale'] / limited:.1f}%" if limited else "-"
print(f"{name:<16} {offered:8d} {c['fresh']:8d} {c['stale']:8d} {c['refused']:8d} {c['origin_total']:13d} {c['origin_max_per_s']:13d} {share:>12} {rss_kib / 1024:9.1f} MiB {kept:>10d}")
PY
    kill "$sidecar" "$serve_pid" 2>/dev/null
    wait "$sidecar" "$serve_pid" 2>/dev/null || true
}
run refuse 0
run staleIfLimited 1
run revalidate 2
log "limit $LIMIT/s, $RATE reads/s offered over $ITEMS items, ${DURATION}s per run, cache bound $CACHE bytes of ${BODY}-byte bodies; load $(cut -d' ' -f1-3 /proc/loadavg)"
