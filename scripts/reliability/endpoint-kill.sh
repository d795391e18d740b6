#!/usr/bin/env bash
# An enforcement endpoint replica killed under load behind sidecars (issue 25). Three
# `sluice sidecar`s (three pods) in front of one application (nginx `return 200`) ask their
# endpoint through a TCP load balancer standing in for the endpoint's Service (nginx stream,
# round robin, a refused connection tried on the next replica); behind it two `sluice serve`
# replicas on one Redis. One rule per algorithm (200 per 10 s), each offered 3x its limit
# through the sidecars by examples/failover_load.rs (`--protocol proxy`: 200 admitted, 429
# refused, anything else counted as an error). At FAULT_AT seconds:
#
#   baseline   nothing
#   kill-one   one endpoint replica killed -9, started again FAULT_FOR (5) seconds later
#   kill-all   both replicas killed -9 (the Service has no endpoint), started again FAULT_FOR later
#
# Reported per scenario: the table against the baseline (admitted, errors: no 5xx may reach a
# client), and from the sidecars' /metrics the decisions by source (endpoint, local fallback from
# the cached snapshot, failure mode) and the endpoint errors by kind.
#
#   scripts/reliability/endpoint-kill.sh                      # every scenario, 40 s each
#   DURATION=20 FAULT_AT=6 scripts/reliability/endpoint-kill.sh kill-all
#
# docs/reliability.md has the figures.
set -euo pipefail
# shellcheck source=scripts/reliability/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
FAULT_FOR="${FAULT_FOR:-5}"
SCENARIOS=("$@")
((${#SCENARIOS[@]})) || SCENARIOS=(baseline kill-one kill-all)

install_missing nginx:nginx
if [ ! -f /usr/lib/nginx/modules/ngx_stream_module.so ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnginx-mod-stream) >&2
fi
build_tools
write_policy
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

# start_endpoint PORT: one `sluice serve` replica on the shared Redis, in the background.
start_endpoint() {
    "$SLUICE" serve --policies "$WORK/policy.yaml" --listen "127.0.0.1:$1" --fallback-replicas 2 \
        --redis "redis://127.0.0.1:$REDIS" 2>>"$WORK/sluice.log" &
    PIDS+=($!)
    ENDPOINT_PID=$!
    wait_for 20 "sluice on $1" curl -sf "http://127.0.0.1:$1/readyz"
    # Something else may have taken the port between free_port and the bind, and answered.
    kill -0 "$ENDPOINT_PID" 2>/dev/null || { log "sluice on $1 exited:"; tail -n 5 "$WORK/sluice.log" >&2; exit 1; }
}

# The sidecars' decisions by source and endpoint errors by kind, summed over the sidecars.
sidecar_counts() {
    local admin
    for admin in "${ADMINS[@]}"; do curl -s "http://127.0.0.1:$admin/metrics"; done |
        awk '/^sluice_sidecar_(decisions|endpoint_errors)_total\{/ {
                 name = $1; sub(/^sluice_sidecar_/, "", name); gsub(/"/, "", name); sum[name] += $2 }
             END { for (n in sum) printf "%s=%d ", n, sum[n]; print "" }'
}

for scenario in "${SCENARIOS[@]}"; do
    REDIS=$(free_port); APP=$(free_port); LB=$(free_port); E1=$(free_port); E2=$(free_port)
    start_redis "$REDIS" 0-1
    PIDS+=("$REDIS_PID")
    mkdir -p "$WORK/nginx"
    cat >"$WORK/nginx/nginx.conf" <<NGINX
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes 1;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body; proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fcgi; uwsgi_temp_path $WORK/nginx/uwsgi; scgi_temp_path $WORK/nginx/scgi;
  server { listen 127.0.0.1:$APP; location / { return 200 "ok\n"; } }
}
stream {
  upstream endpoints { server 127.0.0.1:$E1 max_fails=1 fail_timeout=1s; server 127.0.0.1:$E2 max_fails=1 fail_timeout=1s; }
  server { listen 127.0.0.1:$LB; proxy_pass endpoints; proxy_connect_timeout 100ms; proxy_next_upstream on; }
}
NGINX
    "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" \
        -g "daemon off; master_process off; pid $WORK/nginx/nginx.pid; error_log $WORK/nginx/error.log;" &
    PIDS+=($!)
    start_endpoint "$E1"; E1_PID=$ENDPOINT_PID
    start_endpoint "$E2"; E2_PID=$ENDPOINT_PID
    ENDPOINTS=(); ADMINS=(); SLUICE_PIDS=()
    for _ in 1 2 3; do
        port=$(free_port); admin=$(free_port)
        "$SLUICE" sidecar --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --upstream "127.0.0.1:$APP" \
            --endpoint "http://127.0.0.1:$LB" --namespace failover --labels app=web 2>>"$WORK/sidecar.log" &
        PIDS+=($!); SLUICE_PIDS+=($!); ENDPOINTS+=("127.0.0.1:$port"); ADMINS+=("$admin")
        wait_for 20 "sidecar on $port" curl -sf "http://127.0.0.1:$admin/readyz"
    done
    wait_for 20 "the app through a sidecar" curl -sf "http://${ENDPOINTS[0]}/"
    read -r rss_before fds_before < <(replica_resources)
    log "scenario $scenario: ${DURATION}s at ${RATE}/s per rule through 3 sidecars, fault at ${FAULT_AT}s for ${FAULT_FOR}s"
    LOAD_ARGS=(--protocol proxy)
    start_load "$scenario"
    sleep "$FAULT_AT"
    case "$scenario" in
        baseline) ;;
        kill-one) kill -9 "$E1_PID"; sleep "$FAULT_FOR"; start_endpoint "$E1" ;;
        kill-all) kill -9 "$E1_PID" "$E2_PID"; sleep "$FAULT_FOR"; start_endpoint "$E1"; start_endpoint "$E2" ;;
        *) log "unknown scenario $scenario"; exit 1 ;;
    esac
    wait "$LOAD_PID" || true
    read -r rss_after fds_after < <(replica_resources)
    finish_load "$scenario" "sidecars=$(sidecar_counts)" "sidecar_rss_kib_before=$rss_before" \
        "sidecar_rss_kib_after=$rss_after" "sidecar_fds_before=$fds_before" "sidecar_fds_after=$fds_after"
    kill_all
done
print_table
printf '\n'
for line in "${RESULTS[@]}"; do jq -r '"\(.scenario): \(.sidecars)"' <<<"$line"; done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
