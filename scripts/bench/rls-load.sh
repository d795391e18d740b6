#!/usr/bin/env bash
# Envoy's gRPC rate limit service (`ShouldRateLimit`) under load, side by side in one run on one
# Redis: `sluice serve` on its memory store, `sluice serve --redis`, envoyproxy/ratelimit
# (scripts/bench/envoy-ratelimit.sh) and Kuadrant/Limitador's `redis` storage
# (scripts/bench/limitador.sh), each with 1 and 3 descriptors per request, plus Limitador's
# `redis_cached` storage (counters in the server, flushed to Redis in batches) with 1, driven by the
# independent Go client e2e/rls-client (`bench`: descriptors api_key=key-<n>, remote_address=10.0.x.y,
# path=/orders; n uniform in [0, KEYS)).
#
#   scripts/bench/rls-load.sh                               # ~2 minutes after building sluice
#   SLUICE_BIN=/tmp/rls-bench/sluice scripts/bench/rls-load.sh
#   DURATION=5s WARMUP=1s scripts/bench/rls-load.sh        # quick look
#
# All servers get the same limits: domain / namespace `bench`, one fixedWindow 100000 per 1s rule
# per descriptor key, one counter per value (the policies are written into a temp dir here;
# envoyproxy/ratelimit's are envoy-ratelimit.sh's bench config, Limitador's limitador.sh's, which
# address the descriptors by position), so nothing is denied and each descriptor costs each server
# one counter update. Limitador answers with empty `statuses`, so its sample call is checked by
# the counters it leaves in Redis instead (one per limit). Sluice runs with --grpc-response-headers off
# (envoyproxy/ratelimit sends no headers by default); one extra memory run with headers on shows
# what they cost.
#
# Placement on a 2-core machine: the server under test (Sluice or ratelimit) AND Redis on CPU
# $SERVER_CPU, the load client on CPU $CLIENT_CPU (taskset). Per run: FLUSHALL, an unmeasured
# warm-up run of WARMUP, then CONFIG RESETSTAT and samples of Redis `INFO cpu` and the server's
# /proc/PID/stat, the measured run (`rls-client bench -warmup 0s -duration DURATION`, so Redis'
# counters and the CPU deltas cover exactly the calls the client counts, plus at most CONCURRENCY
# calls in flight at the end), and the samples again. Reported per decision (one ShouldRateLimit):
# server CPU (utime+stime), Redis CPU (used_cpu_user+used_cpu_sys), Redis commands from
# `INFO commandstats` (by command). /proc/loadavg is recorded before and after each run.
#
# Env: DURATION (10s), WARMUP (2s), CONNS (4), CONCURRENCY (64), KEYS (10000), SERVER_CPU (0),
#      CLIENT_CPU (1), REDIS_PORT (18479), GRPC_PORT (18481), HTTP_PORT (18480, Limitador's HTTP
#      API), SLUICE_BIN (a sluice binary; else `cargo build --release --bin sluice`, honouring
#      CARGO_TARGET_DIR), OUT (markdown results file, appended to), SLUICE_CACHE (where
#      envoy-ratelimit.sh, limitador.sh and rls-client.sh cache builds), LIMITADOR (auto, the
#      default: skip the Limitador rows when `limitador.sh build` has no binary (it needs a source
#      tree, see there: SLUICE_LIMITADOR_SRC), saying so on stderr and in OUT; 1: Limitador rows
#      required, fail without them; 0: skip), ENVOY_RATELIMIT (1, the default: build it if not
#      cached, about a minute; auto: its rows only if already built, skipped with a note
#      otherwise; 0: skip), SMOKE (1: the test command's smoke run, DURATION 500ms, WARMUP 200ms,
#      ENVOY_RATELIMIT auto),
#      SLUICE_LIMITADOR_BIN (a limitador-server binary), REDIS_CPU (SERVER_CPU: Redis's core),
#      HOG_CPUS (cores given a busy loop for the whole run, e.g. "0" or "0 1": other work on the
#      machine, at the servers' priority), ONLY (batching: only Sluice on Redis, with each
#      --redis-batches of BATCHES ("2 0"; 0 is one call per request), ROUNDS times alternately, so
#      all see the same machine), ROUNDS (3).
# A measured run with any error, no request, or (Sluice) store errors or fallbacks fails the
# script: its numbers would be those of failures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="$ROOT/scripts/bench"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "${SMOKE:-0}" = 1 ]; then DURATION="${DURATION:-500ms}" WARMUP="${WARMUP:-200ms}" ENVOY_RATELIMIT="${ENVOY_RATELIMIT:-auto}"; fi
DURATION="${DURATION:-10s}"
WARMUP="${WARMUP:-2s}"
CONNS="${CONNS:-4}"
CONCURRENCY="${CONCURRENCY:-64}"
KEYS="${KEYS:-10000}"
SERVER_CPU="${SERVER_CPU:-0}"
CLIENT_CPU="${CLIENT_CPU:-1}"
REDIS_PORT="${REDIS_PORT:-18479}"
GRPC_PORT="${GRPC_PORT:-18481}"
HTTP_PORT="${HTTP_PORT:-18480}"
LIMITADOR="${LIMITADOR:-auto}"
ENVOY_RATELIMIT="${ENVOY_RATELIMIT:-1}"
REDIS_CPU="${REDIS_CPU:-$SERVER_CPU}"
HOG_CPUS="${HOG_CPUS:-}"
ONLY="${ONLY:-}"
ROUNDS="${ROUNDS:-3}"
BATCHES="${BATCHES:-2 0}"
[ -z "$ONLY" ] || [ "$ONLY" = batching ] || { echo "ONLY=$ONLY: only ONLY=batching is known" >&2; exit 2; }
[ "$ONLY" != batching ] || LIMITADOR=0
OUT="${OUT:-$(mktemp -t rls-load.XXXXXX.md)}"
# shellcheck source=scripts/bench/lib.sh
. "$BENCH/lib.sh"

# --- tools and binaries -------------------------------------------------------------------------
install_missing redis-server:redis-server redis-cli:redis-tools taskset:util-linux
if [ "$(nproc)" -lt 2 ]; then
    log "warning: fewer than 2 CPUs; the servers and the load client will share one"
    CLIENT_CPU="$SERVER_CPU"
fi
if [ -n "${SLUICE_BIN:-}" ]; then
    SLUICE="$SLUICE_BIN"
else
    log "building sluice (release)"
    (cd "$ROOT" && cargo build --release --quiet --bin sluice)
    SLUICE="$TARGET/release/sluice"
fi
[ -x "$SLUICE" ] || { log "missing $SLUICE"; exit 1; }
RLS="$("$ROOT/e2e/rls-client.sh")"
RATELIMIT_SKIPPED=
case "$ENVOY_RATELIMIT" in
    0) RATELIMIT_SKIPPED="envoyproxy/ratelimit rows skipped: ENVOY_RATELIMIT=0" ;;
    1) RATELIMIT="$("$BENCH/envoy-ratelimit.sh" build)" ;;
    auto) RATELIMIT="$("$BENCH/envoy-ratelimit.sh" built)" ||
        RATELIMIT_SKIPPED="envoyproxy/ratelimit rows skipped: not built (scripts/bench/envoy-ratelimit.sh build)" ;;
    *) log "ENVOY_RATELIMIT must be 1, auto or 0"; exit 2 ;;
esac
if [ -n "$RATELIMIT_SKIPPED" ]; then
    log "*** $RATELIMIT_SKIPPED ***"
    RL_VERSION="skipped"
else
    RL_VERSION="$(basename "$(dirname "$RATELIMIT")")"
    RL_VERSION="${RL_VERSION#envoy-ratelimit-}"
fi
LIMITADOR_SKIPPED=
case "$LIMITADOR" in
    0) LIMITADOR_SKIPPED="Limitador rows skipped: LIMITADOR=0" ;;
    1 | auto)
        if [ -n "${SLUICE_LIMITADOR_BIN:-}" ]; then
            [ -x "$SLUICE_LIMITADOR_BIN" ] || LIMITADOR_SKIPPED="Limitador rows skipped: SLUICE_LIMITADOR_BIN=$SLUICE_LIMITADOR_BIN is not executable"
        elif SLUICE_LIMITADOR_BIN="$("$BENCH/limitador.sh" build)"; then
            :
        else
            LIMITADOR_SKIPPED="Limitador rows skipped: no limitador-server binary (scripts/bench/limitador.sh build SRC)"
        fi
        if [ -n "$LIMITADOR_SKIPPED" ] && [ "$LIMITADOR" = 1 ]; then
            log "$LIMITADOR_SKIPPED; LIMITADOR=auto skips them, LIMITADOR=0 always"; exit 1
        fi
        ;;
    *) log "LIMITADOR must be 1, auto or 0"; exit 2 ;;
esac
if [ -n "$LIMITADOR_SKIPPED" ]; then
    log "*** $LIMITADOR_SKIPPED ***"
    LIMITADOR_VERSION="skipped"
else
    export SLUICE_LIMITADOR_BIN
    LIMITADOR_VERSION="$(basename "$(dirname "$SLUICE_LIMITADOR_BIN")")"
    LIMITADOR_VERSION="${LIMITADOR_VERSION#limitador-}"
fi

WORK="$(mktemp -d -t rls-load.XXXXXX)"
PIDS=()
SERVER_PID=
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The same limits as envoy-ratelimit.sh's bench config: every value of each key its own
# 100000/second counter.
cat >"$WORK/policies.yaml" <<'EOF'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: bench, namespace: bench}
spec:
  rules:
    - name: per-api-key
      match: {descriptor: [{key: api_key}]}
      key: [{descriptor: api_key}]
      algorithm: fixedWindow
      limit: {requests: 100000, per: 1s}
    - name: per-remote-address
      match: {descriptor: [{key: remote_address}]}
      key: [{descriptor: remote_address}]
      algorithm: fixedWindow
      limit: {requests: 100000, per: 1s}
    - name: per-path
      match: {descriptor: [{key: path}]}
      key: [{descriptor: path}]
      algorithm: fixedWindow
      limit: {requests: 100000, per: 1s}
EOF

# --- redis --------------------------------------------------------------------------------------
cli() { redis-cli -p "$REDIS_PORT" "$@"; }
start_redis "$REDIS_PORT" "$REDIS_CPU" --dir "$WORK"; PIDS+=("$REDIS_PID")
REDIS_VERSION="$(cli INFO server | awk -F: '/^redis_version:/ {print $2}' | tr -d '\r')"
# "cmd=calls;cmd=calls;..." for every command but the ones this script sends.
redis_cmds() {
    cli INFO commandstats | tr -d '\r' | awk -F: '/^cmdstat_/ {
        c = $1; sub(/^cmdstat_/, "", c); split($2, f, ","); split(f[1], kv, "=")
        if (c !~ /^(info|config|flushall|ping)/) printf "%s=%s;", c, kv[2] }'
}

# --- servers ------------------------------------------------------------------------------------
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rls() { "$RLS" stdio -addr "127.0.0.1:$GRPC_PORT"; }
wait_serving() {
    for _ in $(seq 150); do
        if kill -0 "$SERVER_PID" 2>/dev/null &&
            echo '{"op":"health","service":"","timeout_ms":500}' | rls 2>/dev/null | grep -q '"status":"SERVING"'; then
            return 0
        fi
        sleep 0.2
    done
    log "server (pid $SERVER_PID) did not become SERVING"; tail -20 "$WORK/server.log" >&2; exit 1
}
# One call with the three descriptors: every one must come back OK with the 100000/second limit,
# i.e. every rule matched (a descriptor no rule matches is OK too, but costs nothing).
check_sample() {
    local answer
    answer=$(echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"key-1"}]},{"entries":[{"key":"remote_address","value":"10.0.0.1"}]},{"entries":[{"key":"path","value":"/orders"}]}]}' | rls)
    log "sample answer: $answer"
    if [ "$(grep -o '"requests_per_unit":100000,"unit":"SECOND"' <<<"$answer" | wc -l)" != 3 ] ||
        ! grep -q '"overall_code":"OK"' <<<"$answer"; then
        log "the sample was not decided by three 100000/second limits"; exit 1
    fi
}
start_sluice() { # extra serve flags...
    RUST_LOG=info taskset -c "$SERVER_CPU" "$SLUICE" serve -p "$WORK/policies.yaml" --listen 127.0.0.1:0 \
        --grpc-listen "127.0.0.1:$GRPC_PORT" "$@" >"$WORK/server.log" 2>&1 & SERVER_PID=$!; PIDS+=("$SERVER_PID")
    wait_serving
    # The check API's port, for /metrics (store errors and fallbacks must stay 0).
    METRICS="$(sed 's/\x1b\[[0-9;]*m//g' "$WORK/server.log" | grep -o 'address=127\.0\.0\.1:[0-9]*' | head -1 | cut -d= -f2)"
    [ -n "$METRICS" ] || { log "no check API address in the server's log"; exit 1; }
    check_sample
}
start_ratelimit() {
    # envoy-ratelimit.sh execs the server, so $! is its PID.
    taskset -c "$SERVER_CPU" "$BENCH/envoy-ratelimit.sh" run "$WORK/ratelimit" "$REDIS_PORT" "$GRPC_PORT" \
        >"$WORK/server.log" 2>&1 & SERVER_PID=$!; PIDS+=("$SERVER_PID")
    wait_serving
    METRICS=
    check_sample
}
start_limitador() { # redis|redis_cached [storage args...]
    # limitador.sh execs the server, so $! is its PID. It has no grpc.health.v1 service: ready
    # when a ShouldRateLimit call gets an answer.
    taskset -c "$SERVER_CPU" "$BENCH/limitador.sh" run "$WORK/limitador" "$REDIS_PORT" "$GRPC_PORT" \
        "$HTTP_PORT" "$@" >"$WORK/server.log" 2>&1 & SERVER_PID=$!; PIDS+=("$SERVER_PID")
    local i
    for i in $(seq 150); do
        if kill -0 "$SERVER_PID" 2>/dev/null &&
            echo '{"op":"rls","domain":"bench-ready","descriptors":[{"entries":[{"key":"k","value":"v"}]}],"timeout_ms":500}' |
            rls 2>/dev/null | grep -q '"ok":true'; then
            break
        fi
        [ "$i" != 150 ] || { log "limitador (pid $SERVER_PID) did not answer"; tail -20 "$WORK/server.log" >&2; exit 1; }
        sleep 0.2
    done
    METRICS=
    check_sample_limitador
}
# Limitador's answers carry no statuses (so no limit to look at): the sample must come back OK
# and leave exactly the three counters in Redis, one per limit (descriptors[0].api_key,
# [1].remote_address, [2].path). redis_cached writes them on its next flush (every second by
# default) and the 1-second windows expire, so the sample is repeated until they show up.
check_sample_limitador() {
    local answer keys i
    cli FLUSHALL >/dev/null
    for i in $(seq 25); do
        answer=$(echo '{"op":"rls","domain":"bench","descriptors":[{"entries":[{"key":"api_key","value":"key-1"}]},{"entries":[{"key":"remote_address","value":"10.0.0.1"}]},{"entries":[{"key":"path","value":"/orders"}]}]}' | rls)
        grep -q '"overall_code":"OK"' <<<"$answer" || { log "sample answer: $answer"; log "the sample was not OK"; exit 1; }
        sleep 0.2
        keys=$(cli --scan --pattern '*,counter:*')
        if [ "$(grep -c . <<<"$keys")" = 3 ] &&
            grep -qF '"descriptors[0].api_key":"key-1"' <<<"$keys" &&
            grep -qF '"descriptors[1].remote_address":"10.0.0.1"' <<<"$keys" &&
            grep -qF '"descriptors[2].path":"/orders"' <<<"$keys"; then
            log "sample answer: $answer"
            log "  counters in Redis after $i sample call(s): $(tr '\n' ' ' <<<"$keys")"
            return 0
        fi
    done
    log "sample answer: $answer"; log "the sample did not leave the three counters in Redis: $keys"; exit 1
}
stop_server() {
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
}
sluice_failures() { # store errors + fallbacks so far, from /metrics
    [ -n "$METRICS" ] || { echo "-"; return; }
    curl -s "http://$METRICS/metrics" | awk '/^sluice_store_(errors|fallbacks)/ {s += $NF} END {printf "%.0f", s}'
}

# --- runs ---------------------------------------------------------------------------------------
{
    echo
    echo "### rls-load $(date -u +%Y-%m-%dT%H:%MZ): DURATION=$DURATION WARMUP=$WARMUP CONNS=$CONNS CONCURRENCY=$CONCURRENCY KEYS=$KEYS"
    echo
    echo "$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); servers on CPU $SERVER_CPU, Redis $REDIS_VERSION on CPU $REDIS_CPU, rls-client on CPU $CLIENT_CPU."
    echo "sluice: $SLUICE; envoyproxy/ratelimit $RL_VERSION; Kuadrant/Limitador $LIMITADOR_VERSION."
    [ -z "$LIMITADOR_SKIPPED" ] || { echo; echo "**$LIMITADOR_SKIPPED.**"; }
    [ -z "$RATELIMIT_SKIPPED" ] || { echo; echo "**$RATELIMIT_SKIPPED.**"; }
    echo
    echo "| target | descriptors | decisions/s | p50 µs | p99 µs | p99.9 µs | server CPU µs/decision | Redis CPU µs/decision | Redis commands/decision | requests | ok | over_limit | errors | load before | load after |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|"
} >>"$OUT"

measure() { # name descriptors uses_redis(0|1) [commands the server sends besides scripts, e.g. MGET]
    local name=$1 nd=$2 redis=$3 direct=${4:-} t0 t1 c0 c1 f0 f1 out load0 load1
    local bench=(bench -addr "127.0.0.1:$GRPC_PORT" -conns "$CONNS" -concurrency "$CONCURRENCY" -keys "$KEYS" -domain bench -descriptors "$nd")
    cli FLUSHALL >/dev/null
    taskset -c "$CLIENT_CPU" "$RLS" "${bench[@]}" -warmup 0s -duration "$WARMUP" >/dev/null
    load0="$(cut -d' ' -f1-3 /proc/loadavg)"
    cli CONFIG RESETSTAT >/dev/null
    c0=$(redis_cpu "$REDIS_PORT"); t0=$(cpu_ticks "$SERVER_PID"); f0=$(sluice_failures)
    out=$(taskset -c "$CLIENT_CPU" "$RLS" "${bench[@]}" -warmup 0s -duration "$DURATION")
    t1=$(cpu_ticks "$SERVER_PID"); c1=$(redis_cpu "$REDIS_PORT"); f1=$(sluice_failures)
    load1="$(cut -d' ' -f1-3 /proc/loadavg)"
    local cmds
    cmds=$(redis_cmds)
    # {"requests":N,"ok":N,...} -> shell-free parsing with awk
    local row
    row=$(awk -v j="$out" -v n="$name" -v d="$nd" -v r="$redis" -v t0="$t0" -v t1="$t1" -v hz="$(getconf CLK_TCK)" \
        -v c0="$c0" -v c1="$c1" -v cmds="$cmds" -v direct="$direct" -v l0="$load0" -v l1="$load1" 'BEGIN {
        gsub(/[{}"]/, "", j); k = split(j, kv, ",")
        for (i = 1; i <= k; i++) { split(kv[i], p, ":"); v[p[1]] = p[2] }
        req = v["requests"]
        cpu = (t1 - t0) / hz * 1e6 / req
        if (r == 1) {
            rcpu = sprintf("%.2f", (c1 - c0) * 1e6 / req)
            # Commands a script runs are counted in commandstats too: when scripts ran, the other
            # commands are listed as what they ran, but for the ones the caller names as sent
            # directly ($4: Limitador sends MGET; Sluice and envoyproxy/ratelimit nothing else).
            m = split(cmds, lines, ";"); sent = 0; inner = 0; ls = ""; li = ""
            nd2 = split(direct, dl, " "); for (i = 1; i <= nd2; i++) isdirect[toupper(dl[i])] = 1
            for (i = 1; i <= m; i++) if (split(lines[i], q, "=") == 2) {
                c = toupper(q[1])
                if (c ~ /^(EVALSHA|EVAL|EVALSHA_RO|EVAL_RO|FCALL|FCALL_RO|SCRIPT\|LOAD)$/ || (c in isdirect)) script[c] = q[2]
                else other[c] = q[2]
            }
            for (c in script) { sent += script[c]; ls = ls (ls == "" ? "" : " + ") sprintf("%s %.3f", c, script[c] / req) }
            if (sent > 0) {
                for (c in other) { inner += other[c]; li = li (li == "" ? "" : ", ") sprintf("%s %.3f", c, other[c] / req) }
                rc = sprintf("%.3f: %s (running %.3f inside: %s)", sent / req, ls, inner / req, li)
            } else {
                for (c in other) { sent += other[c]; ls = ls (ls == "" ? "" : " + ") sprintf("%s %.3f", c, other[c] / req) }
                rc = (sent == 0 ? "none" : sprintf("%.3f: %s", sent / req, ls))
            }
        } else { rcpu = "—"; rc = "—" }
        printf "| %s | %s | %.0f | %.0f | %.0f | %.0f | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |\n",
            n, d, v["rps"], v["p50_us"], v["p99_us"], v["p999_us"], cpu, rcpu, rc, req, v["ok"], v["over_limit"], v["errors"], l0, l1
    }')
    if [ "$f0" != "-" ]; then
        log "  sluice_store_errors + sluice_store_fallbacks during the run: $((f1 - f0))"
        [ "$f0" = "$f1" ] || row="$row (store errors/fallbacks during the run: $((f1 - f0)))"
    fi
    log "$row"
    [ "$redis" = 0 ] || log "  Redis calls in the measured run (${cmds//;/ }) for $(grep -o '"requests":[0-9]*' <<<"$out")"
    echo "$row" >>"$OUT"
    # Numbers of failed calls are no measurement: errors, nothing answered, or decisions Sluice
    # made without its store fail the run.
    local requests errors
    requests=$(grep -o '"requests":[0-9]*' <<<"$out" | cut -d: -f2)
    errors=$(grep -o '"errors":[0-9]*' <<<"$out" | cut -d: -f2)
    [ "${requests:-0}" -gt 0 ] || fail "$name, $nd descriptors: no request answered: $out"
    [ "${errors:-1}" = 0 ] || fail "$name, $nd descriptors: $errors of $requests calls failed: $out"
    [ "$f0" = "-" ] || [ "$f0" = "$f1" ] || fail "$name, $nd descriptors: $((f1 - f0)) store errors/fallbacks"
}

for cpu in $HOG_CPUS; do
    taskset -c "$cpu" sh -c 'while :; do :; done' & PIDS+=("$!")
done
[ -z "$HOG_CPUS" ] || echo "A busy loop on CPU $HOG_CPUS throughout." >>"$OUT"
log "load before: $(cut -d' ' -f1-3 /proc/loadavg); results -> $OUT"
if [ "$ONLY" = batching ]; then
    for round in $(seq "$ROUNDS"); do
        for batches in $BATCHES; do
            name="Sluice Redis, round $round, --redis-batches $batches"
            [ "$batches" != 0 ] || name="Sluice Redis, round $round, one call per request"
            start_sluice --grpc-response-headers off --redis "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s --redis-batches "$batches"
            measure "$name" 1 1
            measure "$name" 3 1
            stop_server
        done
    done
    echo >>"$OUT"
    log "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
    cat "$OUT"
    exit 0
fi
start_sluice --grpc-response-headers off
measure "Sluice memory" 1 0
measure "Sluice memory" 3 0
stop_server
start_sluice --grpc-response-headers on
measure "Sluice memory, headers on" 1 0
stop_server
start_sluice --grpc-response-headers off --redis "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s
measure "Sluice Redis, one call per request (default)" 1 1
measure "Sluice Redis, one call per request (default)" 3 1
stop_server
start_sluice --grpc-response-headers off --redis "redis://127.0.0.1:$REDIS_PORT" --redis-timeout 1s --redis-batches 2
measure "Sluice Redis, batched (--redis-batches 2)" 1 1
measure "Sluice Redis, batched (--redis-batches 2)" 3 1
stop_server
if [ -z "$RATELIMIT_SKIPPED" ]; then
    start_ratelimit
    measure "envoyproxy/ratelimit Redis" 1 1
    measure "envoyproxy/ratelimit Redis" 3 1
    stop_server
else
    log "*** $RATELIMIT_SKIPPED ***"
fi
if [ -z "$LIMITADOR_SKIPPED" ]; then
    start_limitador redis
    measure "Limitador Redis" 1 1 MGET
    measure "Limitador Redis" 3 1 MGET
    stop_server
    start_limitador redis_cached
    measure "Limitador redis_cached" 1 1
    stop_server
else
    log "*** $LIMITADOR_SKIPPED ***"
fi
echo >>"$OUT"
log "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
cat "$OUT"
log "results appended to $OUT"
