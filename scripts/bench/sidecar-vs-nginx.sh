#!/usr/bin/env bash
# CPU per proxied request: Sluice's sidecar against what a user would deploy instead, side by side
# in one run on the same upstream and endpoint (docs/benchmarks.md, "Sidecar against nginx").
#
#   scripts/bench/sidecar-vs-nginx.sh                  # builds the release binary first
#   SLUICE_BIN=path/to/sluice DURATION=10s ROUNDS=3 CONNS=64 KEYS=10000 scripts/bench/sidecar-vs-nginx.sh
#   SIDECAR_BATCHES=1 scripts/bench/sidecar-vs-nginx.sh  # the batched sidecar's --endpoint-batches
#   PERF_OUT=sidecar.txt scripts/bench/sidecar-vs-nginx.sh   # also profile the sidecar (perf, cpu-clock
#                                                           samples) during one more run, report there
#   PERF_OUT=leased.txt PERF_TRAFFIC=hot TARGETS="nginx-auth-leased sidecar-leased" scripts/bench/sidecar-vs-nginx.sh
#                         # only those targets; the profile on the hot keys' traffic (keys, static, hot)
#
# Targets, every server on CPU 0 and wrk on CPU 1, all on loopback:
#   direct        wrk → upstream (nginx `return 200`)
#   nginx-proxy   wrk → nginx proxy_pass (keep-alive) → upstream
#   nginx-auth    wrk → nginx auth_request → `sluice serve` /v1/authz, then proxy_pass → upstream
#                 (the examples/nginx configuration)
#   sidecar       wrk → `sluice sidecar` (checks batched under load, POST /v1/checks → `sluice serve`)
#                 → upstream
#   sidecar-single  the same with --endpoint-batches 0: one POST /v1/check per request
#   sidecar-norule  the batched sidecar on paths no rule applies to: decided without the endpoint
#                 while it pushes the snapshot
#   nginx-auth-leased, sidecar-leased  nginx auth_request and the batched sidecar on HOT_KEYS hot
#                 keys of a `consistency: leased` rule (docs/leasing.md): the sidecar decides them
#                 from slices the endpoint grants, with no exchange per request
# The endpoint's policy is one fixedWindow rule per X-API-Key on /orders that the run never reaches;
# wrk sends KEYS distinct keys. Each process's CPU (utime + stime from /proc) is divided by the requests wrk
# completed, so the figures do not depend on how the processes shared the core. Prints Markdown.
# A run with non-2xx answers, socket errors or no request answered fails the script. SMOKE=1 (the
# test command's check that the script works): one round of 1 s per target, 8 connections.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${SMOKE:-0}" = 1 ]; then DURATION=${DURATION:-1s} ROUNDS=${ROUNDS:-1} CONNS=${CONNS:-8} KEYS=${KEYS:-100}; fi
DURATION=${DURATION:-10s}
CONNS=${CONNS:-64}
KEYS=${KEYS:-10000}
HOT_KEYS=${HOT_KEYS:-10}
ROUNDS=${ROUNDS:-3}
TARGETS=${TARGETS:-direct nginx-proxy nginx-auth sidecar-single sidecar sidecar-norule nginx-auth-leased sidecar-leased}
PERF_TRAFFIC=${PERF_TRAFFIC:-keys}
need() { command -v "$1" >/dev/null 2>&1 || { echo "missing $1 (apt-get install -y $2)" >&2; exit 1; }; }
need wrk wrk
need taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "missing nginx (apt-get install -y nginx)" >&2; exit 1; }
if [ -z "${SLUICE_BIN:-}" ]; then
  cargo build --release --quiet --bin sluice
  SLUICE_BIN="${CARGO_TARGET_DIR:-target}/release/sluice"
fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
# shellcheck source=scripts/bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
wait_port() {
  for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done
  echo "port $1 never opened" >&2; tail -n 20 "$work"/*.log "$work"/*.err >&2 2>/dev/null; exit 1
}
UP=$(free_port); PROXY=$(free_port); AUTH=$(free_port); EP=$(free_port); SC=$(free_port); ADMIN=$(free_port)
SC1=$(free_port); ADMIN1=$(free_port)
SERVERS="taskset -c 0"
LOAD="taskset -c 1"

# nginx_instance NAME SERVER_BLOCK: one worker, no master, its own prefix.
nginx_instance() {
  local name="$1" server="$2"
  mkdir -p "$work/$name"
  cat > "$work/$name/nginx.conf" <<NGINX
worker_processes 1;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/$name/body; proxy_temp_path $work/$name/proxy;
  fastcgi_temp_path $work/$name/fcgi; uwsgi_temp_path $work/$name/uwsgi; scgi_temp_path $work/$name/scgi;
  keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$UP; keepalive 64; keepalive_requests 1000000; }
  upstream sluice_endpoint { server 127.0.0.1:$EP; keepalive 64; keepalive_requests 1000000; }
  $server
}
NGINX
  $SERVERS "$NGINX" -p "$work/$name" -c "$work/$name/nginx.conf" \
    -g "daemon off; master_process off; pid $work/$name/nginx.pid; error_log $work/$name.err;" &
  pids+=($!)
  declare -g "pid_$name=$!"
}

nginx_instance upstream "server { listen 127.0.0.1:$UP; location / { return 200 \"ok\"; } }"
nginx_instance proxy "server { listen 127.0.0.1:$PROXY; location / {
    proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
# examples/nginx/sluice.conf, without the gateway token (this endpoint has none configured).
nginx_instance auth "server { listen 127.0.0.1:$AUTH;
  location / {
    auth_request /_sluice_check;
    auth_request_set \$sluice_ratelimit \$upstream_http_ratelimit;
    auth_request_set \$sluice_ratelimit_policy \$upstream_http_ratelimit_policy;
    error_page 403 = @sluice_limited;
    add_header RateLimit \$sluice_ratelimit always;
    add_header RateLimit-Policy \$sluice_ratelimit_policy always;
    proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection \"\";
  }
  location = /_sluice_check {
    internal;
    proxy_method \$request_method;
    proxy_pass http://sluice_endpoint/v1/authz\$request_uri;
    proxy_pass_request_body off;
    proxy_set_header Content-Length \"\";
    proxy_http_version 1.1; proxy_set_header Connection \"\";
    proxy_set_header X-Forwarded-For \$remote_addr;
    proxy_set_header X-Sluice-Namespace bench;
    proxy_set_header X-Sluice-Labels app=bench;
    proxy_set_header X-Sluice-Deny-Status 403;
  }
  location @sluice_limited { return 429; }
}"

cat > "$work/policy.yaml" <<'YAML'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: bench, namespace: bench}
spec:
  rules:
    - name: per-key
      match: {paths: [{prefix: /orders}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1000000000, per: 1h}
    - name: per-key-leased
      match: {paths: [{prefix: /leased}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1000000000, per: 1h}
      consistency: {mode: leased, maxOvershoot: "2%"}
YAML
RUST_LOG=warn $SERVERS "$SLUICE_BIN" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$EP" 2>"$work/serve.log" &
# shellcheck disable=SC2034  # read through ${!pv} below
declare -g pid_endpoint=$!; pids+=($!)
RUST_LOG=warn $SERVERS "$SLUICE_BIN" sidecar --listen "127.0.0.1:$SC" --admin-listen "127.0.0.1:$ADMIN" \
  --upstream "127.0.0.1:$UP" --endpoint "http://127.0.0.1:$EP" --namespace bench --labels app=bench \
  ${SIDECAR_BATCHES:+--endpoint-batches "$SIDECAR_BATCHES"} 2>"$work/sidecar.log" &
declare -g pid_sidecar=$!; pids+=($!)
RUST_LOG=warn $SERVERS "$SLUICE_BIN" sidecar --listen "127.0.0.1:$SC1" --admin-listen "127.0.0.1:$ADMIN1" \
  --upstream "127.0.0.1:$UP" --endpoint "http://127.0.0.1:$EP" --namespace bench --labels app=bench \
  --endpoint-batches 0 2>"$work/sidecar-single.log" &
# shellcheck disable=SC2034  # read through ${!pv} below
declare -g pid_single=$!; pids+=($!)
for p in "$UP" "$PROXY" "$AUTH" "$EP" "$SC" "$ADMIN" "$SC1" "$ADMIN1"; do wait_port "$p"; done
for admin in "$ADMIN" "$ADMIN1"; do
  for _ in $(seq 100); do curl -fs "http://127.0.0.1:$admin/metrics" | grep -q '^sluice_sidecar_snapshot_cached 1' && break; sleep 0.05; done
done

# The no-rule target asks for paths the rule does not cover (/static/…).
cat > "$work/static.lua" <<LUA
local reqs, n = {}, $KEYS
function init(args)
  for i = 1, n do reqs[i] = wrk.format("GET", "/static/" .. (i % 100), { ["X-API-Key"] = "key-" .. i }) end
  math.randomseed(os.time())
end
function request() return reqs[math.random(n)] end
LUA
cat > "$work/keys.lua" <<LUA
local reqs, n = {}, $KEYS
function init(args)
  for i = 1, n do reqs[i] = wrk.format("GET", "/orders/" .. (i % 100), { ["X-API-Key"] = "key-" .. i }) end
  math.randomseed(os.time())
end
function request() return reqs[math.random(n)] end
LUA

cat > "$work/hot.lua" <<LUA
local reqs, n = {}, $HOT_KEYS
function init(args)
  for i = 1, n do reqs[i] = wrk.format("GET", "/leased/" .. i, { ["X-API-Key"] = "hot-" .. i }) end
  math.randomseed(os.time())
end
function request() return reqs[math.random(n)] end
LUA

# Answers must be the upstream's (200 "ok") and, through Sluice, carry its headers.
for target in "$UP" "$PROXY" "$AUTH" "$SC" "$SC1"; do
  out=$(curl -s -D - -H 'X-API-Key: probe' "http://127.0.0.1:$target/orders/1")
  grep -q '^HTTP/1.1 200' <<<"$out" || { echo "port $target: $out" >&2; exit 1; }
done
has_headers() {
  for _ in $(seq 50); do
    curl -s -D - -H 'X-API-Key: probe' "http://127.0.0.1:$1/orders/1" | grep -qi '^ratelimit-policy:' && return 0
    sleep 0.1
  done
  return 1
}
has_headers "$AUTH" || { echo "nginx auth_request answers without RateLimit-Policy" >&2; exit 1; }
has_headers "$SC" || { echo "the sidecar answers without RateLimit-Policy" >&2; exit 1; }
has_headers "$SC1" || { echo "the unbatched sidecar answers without RateLimit-Policy" >&2; exit 1; }
# Read whole before grep: with pipefail, grep -q leaving early would fail curl's write.
pushed() { local page; page=$(curl -fs "http://127.0.0.1:$ADMIN/metrics") && grep -q '^sluice_sidecar_snapshot_pushed 1' <<<"$page"; }
for _ in $(seq 100); do pushed && break; sleep 0.05; done
pushed || { echo "the endpoint does not push the snapshot to the sidecar" >&2; exit 1; }

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
# processes of each target, in the order of the report's columns
declare -A procs=([direct]="upstream" [nginx-proxy]="proxy upstream" [nginx-auth]="auth endpoint upstream"
  [sidecar]="sidecar endpoint upstream" [sidecar-single]="single endpoint upstream"
  [sidecar-norule]="sidecar endpoint upstream" [nginx-auth-leased]="auth endpoint upstream"
  [sidecar-leased]="sidecar endpoint upstream")
declare -A port=([direct]=$UP [nginx-proxy]=$PROXY [nginx-auth]=$AUTH [sidecar]=$SC [sidecar-single]=$SC1 [sidecar-norule]=$SC
  [nginx-auth-leased]=$AUTH [sidecar-leased]=$SC)
declare -A script=([direct]=keys [nginx-proxy]=keys [nginx-auth]=keys [sidecar]=keys [sidecar-single]=keys
  [sidecar-norule]=static [nginx-auth-leased]=hot [sidecar-leased]=hot)
declare -A all
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for round in $(seq "$ROUNDS"); do
  for target in $TARGETS; do
    [ -n "${procs[$target]:-}" ] || { echo "TARGETS: no target $target (${!procs[*]})" >&2; exit 2; }
    declare -A t0=()
    for p in ${procs[$target]}; do pv="pid_$p"; t0[$p]=$(ticks "${!pv}"); done
    $LOAD wrk -t1 -c"$CONNS" -d"$DURATION" -s "$work/${script[$target]}.lua" "http://127.0.0.1:${port[$target]}/" > "$work/wrk.out" 2>&1
    total=$(awk '/requests in/ {print $1}' "$work/wrk.out")
    non2xx=$(awk '/Non-2xx/ {print $NF}' "$work/wrk.out"); [ -z "$non2xx" ] || { cat "$work/wrk.out" >&2; echo "$target: non-2xx answers" >&2; exit 1; }
    if grep -q 'Socket errors' "$work/wrk.out" || [ "${total:-0}" -le 0 ]; then
      cat "$work/wrk.out" >&2; echo "FAILED: $target: socket errors or no request answered" >&2; exit 1
    fi
    all[$target.rps]+="$(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$work/wrk.out") "
    sum=0
    for p in ${procs[$target]}; do
      pv="pid_$p"
      us=$(awk -v a="${t0[$p]}" -v b="$(ticks "${!pv}")" -v n="$total" -v hz="$hz" 'BEGIN {printf "%.1f", (b - a) / hz * 1e6 / n}')
      all[$target.$p]+="$us "
      sum=$(awk -v a="$sum" -v b="$us" 'BEGIN {print a + b}')
    done
    all[$target.sum]+="$sum "
    echo "round $round $target: $(awk '/^Requests\/sec/ {print $2}' "$work/wrk.out") req/s, CPU µs/request ${procs[$target]}: $sum" >&2
  done
done
if [ -n "${PERF_OUT:-}" ]; then
  need perf linux-perf
  perf record -q -e cpu-clock -F 4000 -g -p "$pid_sidecar" -o "$work/perf.data" -- sleep "${DURATION%s}" 2>/dev/null &
  perf_pid=$!
  $LOAD wrk -t1 -c"$CONNS" -d"$DURATION" -s "$work/$PERF_TRAFFIC.lua" "http://127.0.0.1:$SC/" > "$work/wrk.out" 2>&1
  wait "$perf_pid" || true
  { echo "# perf report (cpu-clock, sidecar only, self time), by shared object, then by symbol"
    perf report -i "$work/perf.data" --no-children --stdio --sort dso -g none 2>/dev/null | grep '%'
    perf report -i "$work/perf.data" --no-children --stdio --sort dso,symbol --percent-limit 0.8 -g none 2>/dev/null \
      | grep '%' | sed 's/  *$//'; } > "$PERF_OUT"
  echo "profile: $PERF_OUT" >&2
fi
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
m() { median "${all[$1]:-}"; }

echo "load before: $load_before, after: $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds × $DURATION, $CONNS connections, $KEYS keys; medians"
echo
echo "| target | requests/s | CPU µs per request, all processes | the proxy's own | the endpoint's | the upstream's |"
echo "|---|---:|---:|---:|---:|---:|"
echo "| direct | $(m direct.rps) | $(m direct.sum) | — | — | $(m direct.upstream) |"
echo "| nginx proxy_pass | $(m nginx-proxy.rps) | $(m nginx-proxy.sum) | $(m nginx-proxy.proxy) | — | $(m nginx-proxy.upstream) |"
echo "| nginx auth_request → sluice serve | $(m nginx-auth.rps) | $(m nginx-auth.sum) | $(m nginx-auth.auth) | $(m nginx-auth.endpoint) | $(m nginx-auth.upstream) |"
echo "| sluice sidecar → sluice serve, one check per request | $(m sidecar-single.rps) | $(m sidecar-single.sum) | $(m sidecar-single.single) | $(m sidecar-single.endpoint) | $(m sidecar-single.upstream) |"
echo "| sluice sidecar → sluice serve, batched (default) | $(m sidecar.rps) | $(m sidecar.sum) | $(m sidecar.sidecar) | $(m sidecar.endpoint) | $(m sidecar.upstream) |"
echo "| sluice sidecar, a path no rule applies to (no exchange) | $(m sidecar-norule.rps) | $(m sidecar-norule.sum) | $(m sidecar-norule.sidecar) | $(m sidecar-norule.endpoint) | $(m sidecar-norule.upstream) |"
echo "| nginx auth_request → sluice serve, $HOT_KEYS hot keys of a leased rule | $(m nginx-auth-leased.rps) | $(m nginx-auth-leased.sum) | $(m nginx-auth-leased.auth) | $(m nginx-auth-leased.endpoint) | $(m nginx-auth-leased.upstream) |"
echo "| sluice sidecar, $HOT_KEYS hot keys of a leased rule (slices) | $(m sidecar-leased.rps) | $(m sidecar-leased.sum) | $(m sidecar-leased.sidecar) | $(m sidecar-leased.endpoint) | $(m sidecar-leased.upstream) |"
batches=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^sluice_sidecar_endpoint_exchanges_total\{kind="batch"\}/ {e = $2} /^sluice_sidecar_batched_checks_total/ {c = $2} END {if (e > 0) printf "%.1f", c / e}')
no_rule=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^sluice_sidecar_decisions_total\{source="no_rule"/ {n += $2} END {print n + 0}')
from_slices=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^sluice_sidecar_decisions_total\{source="lease"/ {n += $2} END {print n + 0}')
echo
echo "mean checks per batch exchange (whole run, warm-up included): $batches; requests decided without the endpoint (no rule applies): $no_rule; from slices of leased rules: $from_slices"
echo
awk -v s="$(m sidecar.sidecar)" -v n="$(m nginx-proxy.proxy)" -v a="$(m sidecar.rps)" -v b="$(m nginx-auth.rps)" 'BEGIN {
  if (n == 0 || b == 0) exit  # a TARGETS run without these
  printf "sidecar own CPU ÷ nginx proxy_pass own CPU: %.2f× (target ≤ 1.5×); sidecar + endpoint throughput ÷ nginx + auth_request: %.2f× (target ≥ 4×)\n", s / n, a / b }'
awk -v s="$(m sidecar-leased.sidecar)" -v n="$(m nginx-proxy.proxy)" -v a="$(m sidecar-leased.rps)" -v b="$(m nginx-auth-leased.rps)" 'BEGIN {
  if (b == 0) exit
  cpu = (n == 0) ? "n/a (nginx-proxy not run)" : sprintf("%.2f×", s / n)
  printf "leased: sidecar own CPU ÷ nginx proxy_pass own CPU: %s (target ≤ 2×); sidecar throughput ÷ nginx + auth_request on the same keys: %.2f× (target ≥ 3×)\n", cpu, a / b }'
