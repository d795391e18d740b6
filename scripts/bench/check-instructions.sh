#!/usr/bin/env bash
# Instructions per `POST /v1/check` (memory store, one and three rules) against minimal axum
# (examples/minimal_axum.rs), counted by valgrind's callgrind in the server process under wrk's
# closed-loop load. Unlike requests per second, the count does not move with the machine's load
# (repeat runs agree within ~0.5%), so it can compare builds on a busy two-core machine, bisect a
# regression, and show where a request's instructions go (KEEP: callgrind_annotate the files).
# It counts user-space instructions only: a request's system calls, cache misses and scheduling
# are not in it, which is why check-load.sh's wall-clock ratios stay the targets.
#
#   scripts/bench/check-instructions.sh                          # this checkout's release build
#   BINS="old=/tmp/sluice-old new=target/release/sluice" scripts/bench/check-instructions.sh
#   KEEP=/tmp/cg scripts/bench/check-instructions.sh             # keep callgrind's files there
#   SMOKE=1 scripts/bench/check-instructions.sh                  # the test command's short run
#
# Each server starts uninstrumented under callgrind; after a warm-up the instrumentation is
# switched on, warmed again, zeroed, and the measured wrk run's instructions are divided by the
# requests wrk completed. Env: DURATION (s, 8), WARMUP (s, 3), CONNS (16), KEYS (10000), BINS
# (name=path pairs of sluice builds; default this checkout's release build), OUT (a markdown file
# the table is appended to), SKIP_BUILD (1: use the built binaries).
# A run with non-2xx answers, socket errors or nothing answered fails the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="$ROOT/scripts/bench"
# shellcheck source=scripts/bench/lib.sh
. "$BENCH/lib.sh"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "${SMOKE:-0}" = 1 ]; then
    DURATION="${DURATION:-1}" WARMUP="${WARMUP:-1}" KEYS="${KEYS:-100}"
fi
DURATION="${DURATION:-8}"
WARMUP="${WARMUP:-3}"
CONNS="${CONNS:-16}"
KEYS="${KEYS:-10000}"
OUT="${OUT:-}"
export BENCH_KEYS="$KEYS" RUST_LOG=warn

install_missing wrk:wrk valgrind:valgrind callgrind_control:valgrind
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$ROOT" && cargo build --release --quiet --bin sluice --example minimal_axum)
fi
BINS="${BINS:-sluice=${SLUICE_BIN:-$TARGET/release/sluice}}"
MINIMAL="$TARGET/release/examples/minimal_axum"
for pair in $BINS "minimal=$MINIMAL"; do
    [ -x "${pair#*=}" ] || { log "missing ${pair#*=}"; exit 1; }
done

WORK=$(mktemp -d -t check-instructions.XXXXXX)
SERVER_PID=""
cleanup() {
    [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# load PORT SECONDS: one wrk run; prints wrk's output, fails on errors or non-2xx answers.
load() {
    local out
    out=$(wrk -t1 -c"$CONNS" -d"$2s" -s "$BENCH/check.lua" "http://127.0.0.1:$1")
    if grep -qE 'Non-2xx|Socket errors' <<<"$out" || ! grep -q 'requests in' <<<"$out"; then
        log "FAILED: wrk on :$1"; log "$out"; exit 1
    fi
    printf '%s\n' "$out"
}

# count NAME COMMAND...: instructions per request of the server COMMAND starts (its last
# argument is its listen address).
count() {
    local name="$1"; shift
    local port="${*: -1}"; port="${port##*:}"
    local file="$WORK/$name.out"
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$file" "$@" >/dev/null 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
        curl -s -o /dev/null "http://127.0.0.1:$port/" && break
        kill -0 "$SERVER_PID" 2>/dev/null || { log "FAILED: $name did not start"; exit 1; }
        sleep 0.2
    done
    load "$port" "$WARMUP" >/dev/null
    callgrind_control -i on "$SERVER_PID" >/dev/null 2>&1
    load "$port" "$WARMUP" >/dev/null
    callgrind_control -z "$SERVER_PID" >/dev/null 2>&1
    local out requests instructions
    out=$(load "$port" "$DURATION")
    callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
    requests=$(awk '/requests in/ { print $1 }' <<<"$out")
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
    instructions=$(awk '/^summary:/ { print $2 }' "$file.1")
    if [ -z "$instructions" ] || [ "${requests:-0}" -le 0 ]; then
        log "FAILED: no count for $name"; exit 1
    fi
    [ -z "${KEEP:-}" ] || { mkdir -p "$KEEP"; cp "$file.1" "$KEEP/$name.callgrind"; }
    echo $((instructions / requests))
}

declare -A RESULT
port=$(free_port)
RESULT[minimal]=$(count minimal "$MINIMAL" "127.0.0.1:$port")
names=()
for pair in $BINS; do
    name="${pair%%=*}" bin="${pair#*=}"
    names+=("$name")
    for policies in policies-1rule policies-3rules; do
        rules="${policies#policies-}" rules="${rules%%rule*}"
        port=$(free_port)
        RESULT[$name/$rules]=$(count "$name-$policies" "$bin" serve \
            --policies "$BENCH/$policies" --listen "127.0.0.1:$port")
    done
done

table=$(
    echo "| build | 1 rule | 3 rules | 1 rule ÷ minimal axum |"
    echo "|---|---|---|---|"
    for name in "${names[@]}"; do
        awk -v n="$name" -v a="${RESULT[$name/1]}" -v b="${RESULT[$name/3]}" -v m="${RESULT[minimal]}" \
            'BEGIN { printf "| %s | %d | %d | %.3f |\n", n, a, b, a / m }'
    done
    echo "| minimal axum | ${RESULT[minimal]} | | 1 |"
)
header="### Instructions per request ($(date -u +%Y-%m-%dT%H:%MZ), $(git -C "$ROOT" rev-parse --short HEAD), wrk -c$CONNS, ${DURATION}s, $KEYS keys)"
printf '%s\n\n%s\n' "$header" "$table"
[ -z "$OUT" ] || printf '\n%s\n\n%s\n' "$header" "$table" >>"$OUT"
