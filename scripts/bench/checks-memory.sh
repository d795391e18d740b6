#!/usr/bin/env bash
# The endpoint's peak memory under key-amplifying batches (issue 23, item 3): `sluice serve` on
# a private redis-server, one policy of 64 fixedWindow rules each keyed on 8 headers X-K0…X-K7;
# CONCURRENT clients post one /v1/checks body each at once: 256 checks, each with 8 header values
# of VALUE_BYTES bytes (~0.95 MB per body at 450). Prints the endpoint's peak RSS (VmHWM) before
# and after, in MiB.
#
#   scripts/bench/checks-memory.sh                          # the release build of this checkout
#   SLUICE=/path/to/other/sluice scripts/bench/checks-memory.sh   # another build, side by side
#
# Env: SLUICE (binary; default target/release/sluice, built here), CONCURRENT (3), VALUE_BYTES
#      (450), ROUNDS (1: batches per client, one after the other), SLUICE_BIN (as SLUICE),
#      SMOKE (1: one client, values of 16 bytes: the test command's check that the script works).
# A batch that is not answered 200, or a check in it decided without the store (storeFailure),
# fails the script: the memory of failures is not the figure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "$SMOKE" = 1 ]; then CONCURRENT="${CONCURRENT:-1}" VALUE_BYTES="${VALUE_BYTES:-16}"; fi
CONCURRENT="${CONCURRENT:-3}"
VALUE_BYTES="${VALUE_BYTES:-450}"
ROUNDS="${ROUNDS:-1}"

install_missing redis-server:redis-server redis-cli:redis-tools
SLUICE="${SLUICE:-${SLUICE_BIN:-}}"
if [ -z "$SLUICE" ]; then
    [ "${SKIP_BUILD:-0}" = 1 ] || (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="$TARGET/release/sluice"
fi
work="$(mktemp -d)"
redis_port="$(free_port)"
serve_port="$(free_port)"
cleanup() {
    [ -n "${SERVE_PID:-}" ] && kill "$SERVE_PID" 2>/dev/null
    [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
start_redis "$redis_port" 0

python3 - "$work/policy.yaml" <<'PY'
import sys
keys = ", ".join(f"{{header: X-K{i}}}" for i in range(8))
rules = "".join(
    f"    - name: r{r}\n      key: [{keys}]\n      algorithm: fixedWindow\n      limit: {{requests: 1000000, per: 1h}}\n"
    for r in range(64)
)
open(sys.argv[1], "w").write(
    "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: amplify, namespace: default}\n"
    "spec:\n  rules:\n" + rules
)
PY
"$SLUICE" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$serve_port" \
    --redis "redis://127.0.0.1:$redis_port" --redis-timeout 5s 2>"$work/serve.log" &
SERVE_PID=$!
for i in $(seq 100); do
    curl -fsS "http://127.0.0.1:$serve_port/healthz" >/dev/null 2>&1 && break
    [ "$i" != 100 ] || fail "sluice serve did not answer: $(tail -n 5 "$work/serve.log")"
    sleep 0.1
done
hwm() { awk '/^VmHWM/ {printf "%.1f", $2 / 1024}' "/proc/$SERVE_PID/status"; }
before="$(hwm)"
python3 - "$serve_port" "$CONCURRENT" "$VALUE_BYTES" "$ROUNDS" <<'PY'
import json, sys, threading, urllib.request, random, string
port, concurrent, value_bytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def body(seed):
    rng = random.Random(seed)
    value = lambda: "".join(rng.choice(string.ascii_letters) for _ in range(value_bytes))
    checks = [{"path": "/", "headers": {f"X-K{i}": value() for i in range(8)}} for _ in range(256)]
    return json.dumps({"requests": checks}).encode()
statuses, failures = [], []
def store_failures(value):
    if isinstance(value, dict):
        return (value.get("storeFailure") is not None) + sum(store_failures(v) for v in value.values())
    if isinstance(value, list):
        return sum(store_failures(v) for v in value)
    return 0
def client(n):
    for r in range(rounds):
        data = body(n * 1000 + r)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/checks", data=data,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                statuses.append((response.status, len(data)))
                failed = store_failures(json.load(response))
                if failed: failures.append(f"{failed} checks decided without the store")
        except Exception as error:  # an HTTP error status, a reset, a timeout
            failures.append(repr(error))
threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrent)]
for t in threads: t.start()
for t in threads: t.join()
if failures or len(statuses) != concurrent * rounds or any(s != 200 for s, _ in statuses):
    sys.exit(f"FAILED: {len(statuses)} of {concurrent * rounds} batches answered {sorted({s for s, _ in statuses})}: {failures[:3]}")
print(f"bodies: {len(statuses)}, statuses {sorted({s for s, _ in statuses})}, {max(b for _, b in statuses) / 1e6:.2f} MB each")
PY
echo "endpoint peak RSS: before $before MiB, after $(hwm) MiB ($CONCURRENT concurrent batches, values of $VALUE_BYTES bytes; load: $(cut -d' ' -f1-3 /proc/loadavg))"
