#!/usr/bin/env bash
# Load benchmark of `POST /v1/check` (memory store) against a minimal axum JSON endpoint built the
# same way (examples/minimal_axum.rs): same crate versions, release profile and runtime.
#
#   scripts/bench/check-load.sh            # full run: 3 rounds x (16, 64 connections), ~8 minutes
#   NICE=-20 HALF_RT=1 scripts/bench/check-load.sh   # as root on a machine busy with other work
#   RUNS=1 DURATION=5 WARMUP=2 scripts/bench/check-load.sh   # quick look
#
# Servers run on CPU $SERVER_CPU, the load generator on CPU $CLIENT_CPU (taskset), so each has a
# core of its own on a 2-core machine; a tokio multi-thread runtime pinned to one CPU runs one
# worker. Closed-loop throughput and latency come from wrk (Debian's, installed if missing) with
# scripts/bench/check.lua (100k distinct keys, one chosen per request); rounds interleave the
# targets so drift from other load on the machine hits them alike, and the median round is
# reported. Latency at half of peak comes from examples/open_loop.rs (Debian has no wrk2): a
# constant arrival rate with latency measured from each request's scheduled send time.
#
# Env: DURATION (s, 15), WARMUP (s, 5), CONNS ("16 64"), RUNS (3), KEYS (100000),
#      SERVER_CPU (0), CLIENT_CPU (1), HALF_CONNS (64), OUT (markdown results file),
#      CARGO_TARGET_DIR (cargo's), SKIP_BUILD (1 to reuse built binaries), HALF_RT (1: repeat
#      the half-load runs with the servers in SCHED_FIFO, see below),
#      NICE (0; e.g. -20 as root on a machine busy with other work, so the servers and the load
#      generator are not starved by it; the servers' CPU use is reported either way),
#      SMOKE (1: one round of 1 s at 16 connections over 1000 keys, no warm-up, the test
#      command's check that the script works).
# A run with non-2xx answers, socket errors or nothing answered fails the script: its numbers
# would be those of failures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="$ROOT/scripts/bench"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "${SMOKE:-0}" = 1 ]; then
    DURATION="${DURATION:-1}" WARMUP="${WARMUP:-0}" CONNS="${CONNS:-16}" RUNS="${RUNS:-1}" KEYS="${KEYS:-1000}"
    HALF_CONNS="${HALF_CONNS:-16}"
fi
DURATION="${DURATION:-15}"
WARMUP="${WARMUP:-5}"
CONNS="${CONNS:-16 64}"
RUNS="${RUNS:-3}"
KEYS="${KEYS:-100000}"
SERVER_CPU="${SERVER_CPU:-0}"
CLIENT_CPU="${CLIENT_CPU:-1}"
HALF_CONNS="${HALF_CONNS:-64}"
NICE="${NICE:-0}"
OUT="${OUT:-$(mktemp -t check-load.XXXXXX.md)}"
export BENCH_KEYS="$KEYS"

PORT_S1=18181   # sluice serve, one rule
PORT_S3=18183   # sluice serve, three rules
PORT_MIN=18190  # minimal axum

log() { printf '%s\n' "$*" >&2; }

# With autogroup scheduling (Linux's default for desktop and many VM kernels), `nice` only ranks
# processes within one session; other sessions' builds still get an equal share of the CPU. So a
# NICE run starts its own session and raises that session's autogroup priority as well.
if [ "$NICE" != 0 ] && [ "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null || echo 0)" = 1 ]; then
    if [ -z "${CHECK_LOAD_SESSION:-}" ]; then
        CHECK_LOAD_SESSION=1 exec setsid --wait "$0" "$@"
    fi
    echo "$NICE" >/proc/$$/autogroup 2>/dev/null || log "could not set the autogroup's nice (not root?)"
fi

# --- tools --------------------------------------------------------------------------------------
if ! command -v wrk >/dev/null; then
    log "installing wrk"
    (apt-get update -qq && apt-get install -y -qq wrk) >&2
fi
if [ "$(nproc)" -lt 2 ]; then
    log "warning: fewer than 2 CPUs; server and load generator will share one"
    CLIENT_CPU="$SERVER_CPU"
fi

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    log "building release binaries"
    # One invocation, so the server, the baseline and the client share one feature resolution.
    (cd "$ROOT" && cargo build --release --quiet --bin sluice --example minimal_axum --example open_loop)
fi
SLUICE="${SLUICE_BIN:-$TARGET/release/sluice}"
MINIMAL="$TARGET/release/examples/minimal_axum"
OPEN_LOOP="$TARGET/release/examples/open_loop"
for b in "$SLUICE" "$MINIMAL" "$OPEN_LOOP"; do [ -x "$b" ] || { log "missing $b"; exit 1; }; done

# --- servers ------------------------------------------------------------------------------------
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # port
    for _ in $(seq 100); do
        if curl -s -o /dev/null -X POST -H 'content-type: application/json' \
            -d '{"path":"/"}' "http://127.0.0.1:$1/v1/check"; then return 0; fi
        sleep 0.1
    done
    log "server on port $1 did not come up"; exit 1
}

RUST_LOG=warn nice -n "$NICE" taskset -c "$SERVER_CPU" "$SLUICE" serve --policies "$BENCH/policies-1rule" \
    --listen "127.0.0.1:$PORT_S1" 2>/dev/null & PIDS+=($!); PID_S1=$!
RUST_LOG=warn nice -n "$NICE" taskset -c "$SERVER_CPU" "$SLUICE" serve --policies "$BENCH/policies-3rules" \
    --listen "127.0.0.1:$PORT_S3" 2>/dev/null & PIDS+=($!); PID_S3=$!
nice -n "$NICE" taskset -c "$SERVER_CPU" "$MINIMAL" "127.0.0.1:$PORT_MIN" 2>/dev/null & PIDS+=($!); PID_MIN=$!
wait_port $PORT_S1; wait_port $PORT_S3; wait_port $PORT_MIN

sample='{"namespace":"bench","labels":{"app":"orders"},"method":"POST","path":"/orders/1","host":"api.example.com","clientIp":"10.0.0.1","headers":{"x-api-key":"key-1"},"cost":1}'
for port in $PORT_S1 $PORT_S3 $PORT_MIN; do
    body=$(curl -s -X POST -H 'content-type: application/json' -d "$sample" "http://127.0.0.1:$port/v1/check")
    log "sample answer on :$port (${#body} bytes): $body"
    case "$body" in *'"allowed":true'*) ;; *) log "not allowed?"; exit 1 ;; esac
done

name_of() { case "$1" in "$PORT_S1") echo "sluice-1rule" ;; "$PORT_S3") echo "sluice-3rules" ;; "$PORT_MIN") echo "minimal-axum" ;; esac; }
pid_of() { case "$1" in "$PORT_S1") echo "$PID_S1" ;; "$PORT_S3") echo "$PID_S3" ;; "$PORT_MIN") echo "$PID_MIN" ;; esac; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

to_us() { # "123.45us" | "1.23ms" | "1.02s" -> microseconds
    awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000; else if (v ~ /s$/) print n * 1000000; else print n }'
}

# One wrk run; prints "rps p50_us p99_us server_cpu_pct errors".
wrk_run() { # port conns seconds
    local port=$1 conns=$2 secs=$3 pid t0 t1 out
    pid=$(pid_of "$port")
    t0=$(cpu_ticks "$pid")
    out=$(timeout $((secs + 30)) nice -n "$NICE" taskset -c "$CLIENT_CPU" wrk -t1 -c"$conns" -d"${secs}s" --latency \
        -s "$BENCH/check.lua" "http://127.0.0.1:$port/v1/check")
    t1=$(cpu_ticks "$pid")
    local rps p50 p99 errs
    rps=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
    p50=$(to_us "$(awk '$1 == "50%" {print $2}' <<<"$out")")
    p99=$(to_us "$(awk '$1 == "99%" {print $2}' <<<"$out")")
    errs=$(awk '/Non-2xx|Socket errors/ {printf "%s ", $0}' <<<"$out")
    if [ -n "$errs" ] || ! awk -v r="$rps" 'BEGIN { exit !(r > 0) }'; then
        log "FAILED: wrk on :$port, $conns connections: ${errs:-no requests answered}"; exit 1
    fi
    printf '%s %s %s %s %s\n' "$rps" "$p50" "$p99" \
        "$(awk -v a="$t0" -v b="$t1" -v s="$secs" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.0f", (b - a) / hz / s * 100 }')" \
        "${errs:-none}"
}

RESULTS="$(mktemp)"
log "nice $NICE; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
for run in $(seq "$RUNS"); do
    for conns in $CONNS; do
        for port in $PORT_S1 $PORT_S3 $PORT_MIN; do
            [ "$WARMUP" = 0 ] || wrk_run "$port" "$conns" "$WARMUP" >/dev/null
            line=$(wrk_run "$port" "$conns" "$DURATION")
            load=$(cut -d' ' -f1 /proc/loadavg)
            log "run $run  $(name_of "$port")  c=$conns  rps p50 p99 cpu%: $line  (load $load)"
            echo "$run $(name_of "$port") $conns $line" | awk '{print $1, $2, $3, $4, $5, $6, $7}' >>"$RESULTS"
        done
    done
done
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
med() { # name conns column
    awk -v n="$1" -v c="$2" -v k="$3" '$2 == n && $3 == c { print $k }' "$RESULTS" | median
}

{
    echo "### Closed loop (wrk -t1, ${DURATION}s after ${WARMUP}s warm-up, median of $RUNS rounds)"
    echo
    echo "| target | connections | requests/s | p50 | p99 | server CPU | vs minimal (medians) | vs minimal (median of per-round ratios) |"
    echo "|---|---|---|---|---|---|---|---|"
    for conns in $CONNS; do
        base=$(med minimal-axum "$conns" 4)
        for name in sluice-1rule sluice-3rules minimal-axum; do
            rps=$(med "$name" "$conns" 4); p50=$(med "$name" "$conns" 5); p99=$(med "$name" "$conns" 6); cpu=$(med "$name" "$conns" 7)
            # Rounds interleave the targets, so a ratio within one round is least affected by drift.
            paired=$(awk -v n="$name" -v c="$conns" '$3 == c && $2 == "minimal-axum" { m[$1] = $4 } $3 == c && $2 == n { r[$1] = $4 }
                END { for (k in r) if (m[k] > 0) print 100 * r[k] / m[k] }' "$RESULTS" | median)
            awk -v n="$name" -v c="$conns" -v r="$rps" -v a="$p50" -v b="$p99" -v u="$cpu" -v m="$base" -v p="$paired" \
                'BEGIN { printf "| %s | %s | %.0f | %.0f µs | %.0f µs | %.0f%% | %.1f%% | %.1f%% |\n", n, c, r, a, b, u, 100 * r / m, p }'
        done
    done
    echo
    echo "Per round (requests/s): "
    echo
    echo '```'
    awk '{ printf "round %s  %-14s c=%-3s %10.0f req/s  p50 %6.0f us  p99 %6.0f us  server CPU %s%%\n", $1, $2, $3, $4, $5, $6, $7 }' "$RESULTS"
    echo '```'
} >"$OUT"

# --- latency at half of peak (open loop) --------------------------------------------------------
peak() { for c in $CONNS; do med "$1" "$c" 4; done | sort -g | tail -1; }
PEAK_S1=$(peak sluice-1rule); PEAK_S3=$(peak sluice-3rules)
{
    echo
    echo "### Latency at half of peak (examples/open_loop.rs, $HALF_CONNS connections, ${DURATION}s after ${WARMUP}s warm-up)"
    echo
    echo "Latency is measured from each request's scheduled send time (constant arrival rate), so queueing is counted."
    echo
    echo "| target | peak req/s (wrk) | offered req/s | achieved | p50 | p99 | p99.9 | max |"
    echo "|---|---|---|---|---|---|---|---|"
} >>"$OUT"
half_run() { # port peak
    local rate line
    rate=$(awk -v p="$2" 'BEGIN { printf "%.0f", p / 2 }')
    line=$(timeout $((DURATION + WARMUP + 30)) nice -n "$NICE" taskset -c "$CLIENT_CPU" "$OPEN_LOOP" --addr "127.0.0.1:$1" \
        --rate "$rate" --connections "$HALF_CONNS" --duration "$DURATION" --warmup "$WARMUP" --keys "$KEYS" | grep '^RESULT')
    log "half load $(name_of "$1"): $line (load $(cut -d' ' -f1 /proc/loadavg))"
    awk -v l="$line" 'BEGIN { split(l, f, " "); for (i in f) { split(f[i], kv, "="); v[kv[1]] = kv[2] }
        exit !(v["non200"] + v["errors"] + v["missing"] == 0 && v["achieved"] > 0) }' \
        || { log "FAILED: open loop on :$1: $line"; exit 1; }
    awk -v n="$(name_of "$1")" -v p="$2" -v l="$line" 'BEGIN {
        split(l, f, " "); for (i in f) { split(f[i], kv, "="); v[kv[1]] = kv[2] }
        printf "| %s | %.0f | %s | %s | %s µs | %s µs | %s µs | %s µs |\n", n, p, v["rate"], v["achieved"], v["p50_us"], v["p99_us"], v["p999_us"], v["max_us"]
        if (v["non200"] + v["errors"] + v["missing"] > 0) printf "|  | (non-200 %s, errors %s, missing %s) |||||||\n", v["non200"], v["errors"], v["missing"]
    }' >>"$OUT"
}
half_run $PORT_S1 "$PEAK_S1"
half_run $PORT_S3 "$PEAK_S3"
half_run $PORT_MIN "$PEAK_S1"   # the minimal endpoint at Sluice's half-peak rate, for reference

# On a machine shared with other work, the tail above is mostly the servers waiting for a CPU
# behind other processes' time slices. HALF_RT=1 (root) repeats the half-load runs with the
# servers' threads in SCHED_FIFO, which at half load (about 50% of a core) stays far below the
# kernel's real-time throttle. The spinning load generator stays a normal process.
if [ "${HALF_RT:-0}" = 1 ]; then
    if chrt -a -f -p 10 "$PID_S1" >/dev/null && chrt -a -f -p 10 "$PID_S3" >/dev/null && chrt -a -f -p 10 "$PID_MIN" >/dev/null; then
        echo "| *servers SCHED_FIFO:* |||||||" >>"$OUT"
        half_run $PORT_S1 "$PEAK_S1"
        half_run $PORT_S3 "$PEAK_S3"
        half_run $PORT_MIN "$PEAK_S1"
    else
        log "chrt failed; skipping the SCHED_FIFO half-load runs"
    fi
fi

# --- sanity: nothing was limited ----------------------------------------------------------------
{
    echo
    for port in $PORT_S1 $PORT_S3; do
        m=$(curl -s "http://127.0.0.1:$port/metrics")
        allowed=$(awk '/^sluice_decisions_total/ && /outcome="allowed"/ { s += $NF } END { printf "%.0f", s }' <<<"$m")
        limited=$(awk '/^sluice_decisions_total/ && /outcome="limited"/ { s += $NF } END { printf "%.0f", s }' <<<"$m")
        echo "- $(name_of "$port"): rule decisions allowed $allowed, limited $limited"
    done
    echo "- load average (1/5/15 min) before: $LOAD_BEFORE; after the closed-loop rounds: $LOAD_AFTER; at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$OUT"

cat "$OUT"
log "results written to $OUT"
