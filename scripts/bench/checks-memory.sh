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
#      (450), ROUNDS (1: batches per client, one after the other).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
CONCURRENT="${CONCURRENT:-3}"
VALUE_BYTES="${VALUE_BYTES:-450}"
ROUNDS="${ROUNDS:-1}"

install_missing redis-server:redis-server redis-cli:redis-tools
SLUICE="${SLUICE:-}"
if [ -z "$SLUICE" ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
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
for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$serve_port/healthz" >/dev/null 2>&1 && break
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
statuses = []
def client(n):
    for r in range(rounds):
        data = body(n * 1000 + r)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/checks", data=data,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            statuses.append((response.status, len(data)))
threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrent)]
for t in threads: t.start()
for t in threads: t.join()
print(f"bodies: {len(statuses)}, statuses {sorted({s for s, _ in statuses})}, {max(b for _, b in statuses) / 1e6:.2f} MB each")
PY
echo "endpoint peak RSS: before $before MiB, after $(hwm) MiB ($CONCURRENT concurrent batches, values of $VALUE_BYTES bytes; load: $(cut -d' ' -f1-3 /proc/loadavg))"
