#!/usr/bin/env bash
# Redis CPU per decision, by Redis's own accounting (examples/redis_cost.rs): every algorithm with
# 1 and 3 rules per decision, against a minimal INCRBY script measured in the same run, on a
# private redis-server (Debian's) started here on 127.0.0.1 and stopped afterwards.
#
#   scripts/bench/redis-cost.sh                 # ~1 minute
#   DECISIONS=50000 scripts/bench/redis-cost.sh
#
# Redis runs on CPU $REDIS_CPU, the client on $CLIENT_CPU. The CPU figures are Redis's own
# (used_cpu_user + used_cpu_sys deltas, commandstats usec), so the client's share of the machine
# does not enter them.
# Env: DECISIONS (20000 per row), CONCURRENCY (32), REDIS_CPU (0), CLIENT_CPU (1), SKIP_BUILD (1
#      to reuse the release example), BATCHES (the store's batched calls in flight; 0: one call
#      per request), SMOKE (1: 200 decisions per row, 4 in flight, nothing pinned: the test
#      command's check that the script works).
# examples/redis_cost.rs stops at the first decision the store failed (a timeout included), so a
# run never reports the cost of failed calls.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
# The smoke run shares the machine with whatever else runs (the test command's other work):
# Redis and the client may use either core, so that neither waits out the store's 50 ms deadline
# behind the other on one core.
if [ "$SMOKE" = 1 ]; then
    DECISIONS="${DECISIONS:-200}" CONCURRENCY="${CONCURRENCY:-4}" REDIS_CPU="${REDIS_CPU:-0-1}" CLIENT_CPU="${CLIENT_CPU:-0-1}"
fi
DECISIONS="${DECISIONS:-20000}"
CONCURRENCY="${CONCURRENCY:-32}"
REDIS_CPU="${REDIS_CPU:-0}"
CLIENT_CPU="${CLIENT_CPU:-1}"

install_missing redis-server:redis-server redis-cli:redis-tools
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --example redis_cost)
fi
port="$(free_port)"
trap 'kill "${REDIS_PID:-}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
start_redis "$port" "$REDIS_CPU"
echo "redis $(redis-server --version | grep -o 'v=[0-9.]*'), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
taskset -c "$CLIENT_CPU" "$TARGET/release/examples/redis_cost" "redis://127.0.0.1:$port" "$DECISIONS" "$CONCURRENCY"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
