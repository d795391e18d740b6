#!/usr/bin/env bash
# Limitador and Sluice side by side under the same Redis faults (issue 25): Kuadrant Limitador
# (limitador-server, storage `redis` and optionally `redis_cached`) and `sluice serve
# --grpc-listen`, both answering Envoy's rate limit service (gRPC ShouldRateLimit), REPLICAS
# servers each (independent processes sharing one Redis), each limiter with its own Redis behind
# its own toxiproxy (v2.5.0, built from the Go module proxy once, cached in $SLUICE_CACHE), both
# driven at the same time by the same load (examples/failover_load.rs --protocol rls): one limit
# of 200 per 10 s, a fixed window on both (Limitador has only fixed windows; Sluice's rule is
# `algorithm: fixedWindow`, `onStoreFailure: deny`), offered RATE checks/s (default 60, 3x the
# limit) round-robin over the replicas for DURATION seconds from a 10 s boundary. At FAULT_AT
# seconds both Redis get the same fault for FAULT_FOR seconds:
#
#   baseline        none
#   latency-500ms   every Redis answer delayed by 500 ms (Sluice's store deadline is 50 ms;
#                   Limitador's `redis` storage has none; `redis_cached` decides in memory and
#                   flushes to Redis every second with a 350 ms timeout)
#   partition       nothing passes back from Redis (toxiproxy `timeout`, timeout=0: the
#                   connections stay open, commands still reach Redis, its answers are dropped;
#                   removing the toxic closes the connections)
#   restart         both Redis killed (-9) and started again at once, empty
#
# Each check is one descriptor [(path, /fixed), (run, <scenario-pid>)] in domain `failover`, sent
# with a grpc-timeout of RLS_TIMEOUT_MS (default 20: Envoy's rate limit filter's default
# deadline), which the client also enforces. What each server does without Redis: Sluice answers
# the rule's onStoreFailure (deny: OVER_LIMIT); Limitador answers the gRPC error UNAVAILABLE,
# which hands the decision to Envoy's failure_mode_deny (default false: the request passes), and
# a call still waiting for Redis at the deadline is DEADLINE_EXCEEDED, handled the same way.
#
# Printed per scenario and server: admitted (OK) and the difference from the same server's
# baseline, the most admitted in one aligned 10 s window, errors (gRPC errors, the deadline
# included; the requests an Envoy with failure_mode_deny false lets through: `fail-open` is
# admitted + errors), decisions by onStoreFailure (Sluice: recognised in its answers; its own
# sluice_store_failure_decisions_total in brackets), the longest stretch on one replica from its
# first error to its next decision (`no decision`) and from its first decision by onStoreFailure
# to its next answer that was not one (`no store`), and the latency (p50/p99/max, errors
# included). RESULTS_JSON=FILE also writes one JSON object per scenario and server there.
#
#   scripts/reliability/limitador-faults.sh                        # the four scenarios, redis
#   LIMITADOR_STORAGES="redis redis_cached" RLS_TIMEOUT_MS=1000 scripts/reliability/limitador-faults.sh
#   DURATION=20 FAULT_AT=6 FAULT_FOR=4 scripts/reliability/limitador-faults.sh baseline partition
#
# limitador-server comes from SLUICE_LIMITADOR_BIN, else `scripts/bench/limitador.sh build`
# (its cached build, or a source tree in SLUICE_LIMITADOR_SRC; see that script's header).
# CARGO_TARGET_DIR is honoured for Sluice's build; SLUICE_BIN and LOAD_BIN skip it.
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FAULT_FOR="${FAULT_FOR:-5}"
REPLICAS="${REPLICAS:-3}"
RLS_TIMEOUT_MS="${RLS_TIMEOUT_MS:-20}"
read -r -a STORAGES <<<"${LIMITADOR_STORAGES:-redis}"
TOXIPROXY_VERSION=v2.5.0
SCENARIOS=("$@")
((${#SCENARIOS[@]})) || SCENARIOS=(baseline latency-500ms partition restart)
PATH_VALUE=/fixed

install_missing redis-server:redis-server redis-cli:redis-tools python3:python3 jq:jq curl:curl
if [ -z "${SLUICE_BIN:-}" ] || [ -z "${LOAD_BIN:-}" ]; then
    (cd "$RELIABILITY_ROOT" && cargo build --release --quiet --bin sluice --example failover_load)
fi
TARGET="${CARGO_TARGET_DIR:-$RELIABILITY_ROOT/target}"
SLUICE="${SLUICE_BIN:-$TARGET/release/sluice}"
LOAD="${LOAD_BIN:-$TARGET/release/examples/failover_load}"
# The script compares the two side by side: without a Limitador it has nothing to measure. The
# smoke run (SMOKE=1) says so and stops; a real run fails.
if [ -n "${SLUICE_LIMITADOR_BIN:-}" ]; then
    LIMITADOR="$SLUICE_LIMITADOR_BIN"
elif ! LIMITADOR="$("$RELIABILITY_ROOT/scripts/bench/limitador.sh" build)"; then
    skip_peer "Limitador is not built and no source tree was given (scripts/bench/limitador.sh build SRC, or SLUICE_LIMITADOR_BIN)"
fi
TOXIPROXY="${SLUICE_CACHE:-$HOME/.cache/sluice}/toxiproxy/$TOXIPROXY_VERSION"
if [ ! -x "$TOXIPROXY/server" ] || [ ! -x "$TOXIPROXY/cli" ]; then
    log "building toxiproxy $TOXIPROXY_VERSION from the Go module proxy into $TOXIPROXY"
    GOBIN="$TOXIPROXY" PATH="$PATH:/usr/local/go/bin" go install \
        "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" "github.com/Shopify/toxiproxy/v2/cmd/cli@$TOXIPROXY_VERSION"
fi

# The same limit for both: 200 per 10 s per run on descriptor [(path, /fixed), (run, …)].
cat >"$WORK/sluice-policy.yaml" <<EOF
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: faults, namespace: failover}
spec:
  rules:
    - name: fixed
      match:
        descriptor:
          - {key: path, exact: "$PATH_VALUE"}
          - {key: run}
      key: [{descriptor: run}]
      algorithm: fixedWindow
      limit: {requests: 200, per: 10s}
      onStoreFailure: deny
EOF
cat >"$WORK/limitador-limits.yaml" <<EOF
- namespace: failover
  name: fixed
  max_value: 200
  seconds: 10
  conditions: ["descriptors[0].path == '$PATH_VALUE'"]
  variables: ["descriptors[0].run"]
EOF
"$LIMITADOR" --validate "$WORK/limitador-limits.yaml" >/dev/null || { log "the Limitador limits do not validate"; exit 1; }

# start_toxiproxy NAME REDIS_PORT: a toxiproxy server with one proxy NAME to the Redis; its API
# port in TOXI_API[NAME], the proxy's port in PROXY_PORT[NAME].
declare -A TOXI_API PROXY_PORT REDIS_PORT REDIS_PIDS
start_toxiproxy() {
    local name="$1" api proxy
    api=$(free_port); proxy=$(free_port)
    "$TOXIPROXY/server" -host 127.0.0.1 -port "$api" >/dev/null 2>&1 &
    PIDS+=($!)
    wait_for 10 "toxiproxy" "$TOXIPROXY/cli" --host "http://127.0.0.1:$api" list
    "$TOXIPROXY/cli" --host "http://127.0.0.1:$api" create --listen "127.0.0.1:$proxy" \
        --upstream "127.0.0.1:$2" "$name" >/dev/null
    TOXI_API[$name]=$api; PROXY_PORT[$name]=$proxy
}
toxic() { # NAME toxic ARGS...
    local name="$1"; shift
    "$TOXIPROXY/cli" --host "http://127.0.0.1:${TOXI_API[$name]}" toxic "$@" "$name" >/dev/null
}

# start_sluice N REDIS_URL: N `sluice serve` with the gRPC listener; gRPC addresses in
# SLUICE_GRPC, check API (metrics) addresses in SLUICE_HTTP.
start_sluice() {
    local n="$1" url="$2" http grpc endpoint
    SLUICE_GRPC=(); SLUICE_HTTP=()
    for _ in $(seq "$n"); do
        http=$(free_port); grpc=$(free_port)
        "$SLUICE" serve --policies "$WORK/sluice-policy.yaml" --listen "127.0.0.1:$http" \
            --grpc-listen "127.0.0.1:$grpc" --fallback-replicas "$n" --redis "$url" 2>>"$WORK/sluice.log" &
        PIDS+=($!); SLUICE_GRPC+=("127.0.0.1:$grpc"); SLUICE_HTTP+=("127.0.0.1:$http")
    done
    for endpoint in "${SLUICE_HTTP[@]}"; do wait_for 20 "sluice on $endpoint" curl -sf "http://$endpoint/readyz"; done
}

# start_limitador N STORAGE REDIS_URL: N limitador-server; gRPC addresses in LIMITADOR_GRPC.
start_limitador() {
    local n="$1" storage="$2" url="$3" http grpc https=()
    LIMITADOR_GRPC=()
    for _ in $(seq "$n"); do
        http=$(free_port); grpc=$(free_port)
        "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port "$grpc" --http-ip 127.0.0.1 --http-port "$http" \
            "$WORK/limitador-limits.yaml" "$storage" "$url" >>"$WORK/limitador.log" 2>&1 &
        PIDS+=($!); LIMITADOR_GRPC+=("127.0.0.1:$grpc"); https+=("127.0.0.1:$http")
    done
    for http in "${https[@]}"; do
        for _ in $(seq 400); do curl -sf "http://$http/status" >/dev/null 2>&1 && continue 2; sleep 0.05; done
        log "timed out waiting for limitador on $http"
        tail -n 20 "$WORK/limitador.log" >&2
        exit 1
    done
}

# Sluice's own count of decisions by onStoreFailure, over its replicas.
sluice_failure_metric() {
    local endpoint sum=0 n
    for endpoint in "${SLUICE_HTTP[@]}"; do
        n=$(curl -sf "http://$endpoint/metrics" | awk '/^sluice_store_failure_decisions_total[{ ]/ {s += $NF} END {print s + 0}')
        sum=$((sum + n))
    done
    echo "$sum"
}

# load NAME ENDPOINTS RUN: the load on one limiter in the background, its report in
# $WORK/NAME.json and its pid in LOAD_PIDS.
load() {
    "$LOAD" --protocol rls --endpoints "$2" --paths "$PATH_VALUE" --namespace failover --domain failover \
        --descriptor-key path --run-key run --rate "$RATE" --duration "$DURATION" --window 10 \
        --timeout-ms "$RLS_TIMEOUT_MS" --run "$3" >"$WORK/$1.json" &
    LOAD_PIDS+=($!)
}

# record SCENARIO SERVER NAME [KEY=NUMBER...]: the figures of $WORK/NAME.json for the table
# (`pair`: the Limitador storage of the run, so each Sluice row is compared with its own baseline).
record() {
    local scenario="$1" server="$2" name="$3" extra='{}' pair; shift 3
    for pair in "$@"; do extra=$(jq -c --arg k "${pair%%=*}" --argjson v "${pair#*=}" '. + {($k): $v}' <<<"$extra"); done
    RESULTS+=("$(jq -c --arg s "$scenario" --arg v "$server" --argjson e "$extra" --argjson t "$RLS_TIMEOUT_MS" \
        --arg p "$PATH_VALUE" --arg g "$storage" '{scenario: $s, server: $v, pair: $g, timeout_ms: $t} + .[$p] + $e' \
        "$WORK/$name.json")")
    printf '%s\n' "${RESULTS[-1]}"
    [ -z "${RESULTS_JSON:-}" ] || printf '%s\n' "${RESULTS[-1]}" >>"$RESULTS_JSON"
}

for storage in "${STORAGES[@]}"; do
    for scenario in "${SCENARIOS[@]}"; do
        for name in limitador sluice; do
            REDIS_PORT[$name]=$(free_port)
            start_redis "${REDIS_PORT[$name]}" 0-1
            PIDS+=("$REDIS_PID"); REDIS_PIDS[$name]=$REDIS_PID
            start_toxiproxy "$name" "${REDIS_PORT[$name]}"
        done
        start_limitador "$REPLICAS" "$storage" "redis://127.0.0.1:${PROXY_PORT[limitador]}"
        start_sluice "$REPLICAS" "redis://127.0.0.1:${PROXY_PORT[sluice]}"
        log "scenario $scenario (limitador $storage, sluice fixedWindow deny): ${DURATION}s at ${RATE}/s" \
            "(limit 200 per 10s), deadline ${RLS_TIMEOUT_MS} ms, fault at ${FAULT_AT}s for ${FAULT_FOR}s"
        [ "$SMOKE" = 1 ] || python3 -c 'import time; time.sleep(10 - time.time() % 10 + 0.02)'
        LOAD_PIDS=()
        load limitador "$(IFS=,; echo "${LIMITADOR_GRPC[*]}")" "$scenario-$storage-$$"
        load sluice "$(IFS=,; echo "${SLUICE_GRPC[*]}")" "$scenario-$storage-$$"
        sleep "$FAULT_AT"
        case "$scenario" in
            baseline) ;;
            latency-*) ms="${scenario#latency-}"
                for name in limitador sluice; do toxic "$name" add -n fault -t latency -a "latency=${ms%ms}"; done ;;
            partition) for name in limitador sluice; do toxic "$name" add -n fault -t timeout -a timeout=0; done ;;
            restart)
                # Both killed first, then each waited for (its port free again) and started.
                for name in limitador sluice; do kill -9 "${REDIS_PIDS[$name]}"; done
                for name in limitador sluice; do wait "${REDIS_PIDS[$name]}" 2>/dev/null || true; done
                for name in limitador sluice; do
                    start_redis "${REDIS_PORT[$name]}" 0-1
                    PIDS+=("$REDIS_PID"); REDIS_PIDS[$name]=$REDIS_PID
                done
                ;;
            *) log "unknown scenario $scenario"; exit 1 ;;
        esac
        if [ "$scenario" != baseline ] && [ "$scenario" != restart ]; then
            sleep "$FAULT_FOR"
            for name in limitador sluice; do toxic "$name" remove -n fault; done
        fi
        for pid in "${LOAD_PIDS[@]}"; do wait "$pid" || true; done
        record "$scenario" "limitador $storage" limitador
        record "$scenario" "sluice deny" sluice "store_failure_metric=$(sluice_failure_metric)"
        kill_all
    done
done

printf '\ndeadline %s ms; fail-open = admitted + errors (what an Envoy with failure_mode_deny: false lets through)\n' "$RLS_TIMEOUT_MS"
printf '%-14s %-22s %8s %8s %10s %7s %9s %14s %11s %9s %8s %8s %8s\n' scenario server admitted "vs base" max/window errors fail-open \
    "by failure" "no decision" "no store" "p50 ms" "p99 ms" "max ms"
for line in "${RESULTS[@]}"; do
    server=$(jq -r .server <<<"$line"); pair=$(jq -r .pair <<<"$line")
    base=$(printf '%s\n' "${RESULTS[@]}" | jq -r --arg v "$server" --arg g "$pair" \
        'select(.scenario == "baseline" and .server == $v and .pair == $g) | .admitted' | head -n 1)
    jq -r --arg b "${base:-0}" '[.scenario, .server, .admitted, (.admitted - ($b | tonumber)), .max_admitted_in_a_window,
        (.transport_errors + .non_200), (.admitted + .transport_errors + .non_200),
        (([.by_store_failure[]] | add // 0 | tostring) + (if .store_failure_metric == null then "" else " (\(.store_failure_metric))" end)),
        "\(.longest_without_decision_ms) ms", "\(.longest_without_store_ms) ms", .latency_ms.p50, .latency_ms.p99, .latency_ms.max] | @tsv' <<<"$line" |
        awk -F'\t' '{ printf "%-14s %-22s %8s %+8d %10s %7s %9s %14s %11s %9s %8s %8s %8s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13 }'
done
printf '\nerrors by code:\n'
for line in "${RESULTS[@]}"; do jq -r '"\(.scenario) \(.server): \(.errors | tostring)"' <<<"$line"; done
