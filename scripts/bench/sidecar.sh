#!/usr/bin/env bash
# Load benchmark of `sluice sidecar`: latency and throughput through the sidecar against direct
# to the upstream, and the sidecar's resident memory. Prints a Markdown report on stdout.
#
#   scripts/bench/sidecar.sh            # builds the release binary first
#   SLUICE_BIN=path/to/sluice DURATION=10s ROUNDS=3 CONNS=32 PIN=1 scripts/bench/sidecar.sh
#   (PIN=0: no taskset, everything shares every CPU)
#
# Topology, all on loopback:  wrk → [sidecar → (POST /v1/check → sluice serve)] → nginx upstream
# The upstream is nginx answering a fixed 2-byte body (Debian packages: nginx, wrk). wrk is pinned
# to CPU 0 and every server to the remaining CPUs (taskset), so the load generator does not
# compete with what it measures; on a 2-core machine the sidecar, the endpoint and the upstream
# share one core.
#
# A wrk run with non-2xx answers, socket errors or no request answered fails the script, and so
# does a run in which the endpoint decided nothing (the sidecar forwarding without a decision).
# SMOKE=1 (the test command's check that the script works): one round of 1 s runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ "${SMOKE:-0}" = 1 ]; then DURATION=${DURATION:-1s} ROUNDS=${ROUNDS:-1} CONNS=${CONNS:-8}; fi
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
need() { command -v "$1" >/dev/null 2>&1 || { echo "missing $1 (apt-get install -y $2)" >&2; exit 1; }; }
need wrk wrk
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || { echo "missing nginx (apt-get install -y nginx)" >&2; exit 1; }

if [ -z "${SLUICE_BIN:-}" ]; then
  cargo build --release --quiet --bin sluice
  SLUICE_BIN="${CARGO_TARGET_DIR:-target}/release/sluice"
fi

cpus=$(nproc)
if [ "${PIN:-1}" = 1 ] && [ "$cpus" -ge 2 ] && command -v taskset >/dev/null; then
  LOAD="taskset -c 0"; SERVERS="taskset -c 1-$((cpus - 1))"
else
  LOAD=""; SERVERS=""
fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# shellcheck source=scripts/bench/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; tail -n 20 "$work"/*.log "$work"/*.err >&2 2>/dev/null; exit 1; }

UP=$(free_port); EP=$(free_port); SC=$(free_port); ADMIN=$(free_port)

# Upstream: nginx, one worker, a constant answer.
cat > "$work/nginx.conf" <<NGINX
worker_processes 1;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/body; proxy_temp_path $work/proxy; fastcgi_temp_path $work/fcgi;
  uwsgi_temp_path $work/uwsgi; scgi_temp_path $work/scgi;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP; location / { return 200 "ok"; } }
}
NGINX
$SERVERS "$NGINX" -p "$work" -c "$work/nginx.conf" -g "daemon off; master_process off; pid $work/nginx.pid; error_log $work/nginx.err;" &
upstream=$!
pids+=("$upstream")

# Endpoint: a policy that matches every benchmark request with a limit it does not reach, so each
# request costs a real decision (match, key, store) and comes back with headers.
cat > "$work/policy.yaml" <<'YAML'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: bench, namespace: bench}
spec:
  rules:
    - name: per-client
      key: [{clientIP: true}]
      algorithm: tokenBucket
      limit: {requests: 100000, per: 1s}
YAML
RUST_LOG=warn $SERVERS "$SLUICE_BIN" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$EP" 2>"$work/serve.log" &
endpoint=$!
pids+=("$endpoint")
RUST_LOG=warn $SERVERS "$SLUICE_BIN" sidecar --listen "127.0.0.1:$SC" --admin-listen "127.0.0.1:$ADMIN" \
  --upstream "127.0.0.1:$UP" --endpoint "http://127.0.0.1:$EP" --namespace bench --labels app=bench \
  2>"$work/sidecar.log" &
sidecar=$!
pids+=("$sidecar")
wait_port "$UP"; wait_port "$EP"; wait_port "$SC"; wait_port "$ADMIN"
# Let the sidecar fetch the snapshot once before measuring.
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$ADMIN/metrics" | grep -q '^sluice_sidecar_snapshot_cached 1' && break; sleep 0.05; done
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
rss_idle=$(rss "$sidecar")

# wrk's summary: latency percentiles (--latency) and requests/s.
run() {
  $LOAD wrk -t1 -c"$1" -d"$DURATION" --latency "$2" > "$work/wrk.out" 2>&1; cat "$work/wrk.out" >&2
  if grep -qE 'Non-2xx|Socket errors' "$work/wrk.out" || ! awk '/requests in/ {exit !($1 > 0)}' "$work/wrk.out"; then
    echo "FAILED: wrk -c$1 $2: $(grep -E 'Non-2xx|Socket errors|requests in' "$work/wrk.out" | tr '\n' ' ')" >&2; exit 1
  fi
}
pct() { awk -v p="$1" '$1 == p {print $2}' "$work/wrk.out"; }
rps() { awk '/^Requests\/sec/ {printf "%.0f", $2}' "$work/wrk.out"; }
to_us() { awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000; else if (v ~ /s$/) print n * 1e6; else print n }'; }

curl -fs "http://127.0.0.1:$SC/" >/dev/null   # warm the pools
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# The machine may be shared: interleave the targets and report each figure's median over ROUNDS.
ROUNDS=${ROUNDS:-3}
declare -A all
for _ in $(seq "$ROUNDS"); do
  for target in direct sidecar; do
    url="http://127.0.0.1:$UP/"; [ $target = sidecar ] && url="http://127.0.0.1:$SC/"
    run 1 "$url"; all[$target.p50]+="$(to_us "$(pct 50%)") "; all[$target.p99]+="$(to_us "$(pct 99%)") "
    run "$CONNS" "$url"; all[$target.rps]+="$(rps) "
    all[$target.cp50]+="$(to_us "$(pct 50%)") "; all[$target.cp99]+="$(to_us "$(pct 99%)") "
  done
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
declare -A r
for k in "${!all[@]}"; do r[$k]=$(median "${all[$k]}"); echo "$k: ${all[$k]}-> ${r[$k]}" >&2; done
rss_after=$(rss "$sidecar")

# CPU per proxied request of each process (user + system), over one more loaded run.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
declare -A t0
for p in sidecar endpoint upstream; do t0[$p]=$(ticks "${!p}"); done
run "$CONNS" "http://127.0.0.1:$SC/"
total=$(awk '/requests in/ {print $1}' "$work/wrk.out")
hz=$(getconf CLK_TCK)
declare -A cpu
for p in sidecar endpoint upstream; do
  cpu[$p]=$(awk -v a="${t0[$p]}" -v b="$(ticks "${!p}")" -v n="$total" -v hz="$hz" 'BEGIN {printf "%.0f", (b - a) / hz * 1e6 / n}')
done
checks=$(curl -fs "http://127.0.0.1:$ADMIN/metrics" | awk '/^sluice_sidecar_decisions_total\{source="endpoint",result="allow"\}/ {print $2}')
awk -v c="${checks:-0}" 'BEGIN {exit !(c > 0)}' || { echo "FAILED: the endpoint decided none of the requests" >&2; exit 1; }

added50=$(awk -v a="${r[sidecar.p50]}" -v b="${r[direct.p50]}" 'BEGIN {printf "%+.0f", a - b}')
added99=$(awk -v a="${r[sidecar.p99]}" -v b="${r[direct.p99]}" 'BEGIN {printf "%+.0f", a - b}')
ratio=$(awk -v a="${r[sidecar.rps]}" -v b="${r[direct.rps]}" 'BEGIN {printf "%.0f", 100 * a / b}')

cat <<REPORT
| | direct to upstream | through the sidecar | added / ratio |
|---|---|---|---|
| latency p50, 1 connection | ${r[direct.p50]} µs | ${r[sidecar.p50]} µs | ${added50} µs |
| latency p99, 1 connection | ${r[direct.p99]} µs | ${r[sidecar.p99]} µs | ${added99} µs |
| throughput, $CONNS connections | ${r[direct.rps]} req/s | ${r[sidecar.rps]} req/s | ${ratio}% of direct |
| latency p50 / p99, $CONNS connections | ${r[direct.cp50]} / ${r[direct.cp99]} µs | ${r[sidecar.cp50]} / ${r[sidecar.cp99]} µs | |

CPU per request through the sidecar (user + system): sidecar ${cpu[sidecar]} µs, endpoint (sluice serve) ${cpu[endpoint]} µs, upstream (nginx) ${cpu[upstream]} µs.

Sidecar RSS: $((rss_idle / 1024)) MB idle after start (${rss_idle} kB), $((rss_after / 1024)) MB after the runs (${rss_after} kB).
Endpoint decisions during the runs: ${checks:-?} (every proxied request was checked).
Machine: $(nproc) CPUs ($(awk -F: '/model name/ {print $2; exit}' /proc/cpuinfo | sed 's/^ *//')); $(if [ -n "$LOAD" ]; then echo "wrk pinned with '$LOAD', servers with '$SERVERS'"; else echo 'nothing pinned'; fi); duration $DURATION per run, median of $ROUNDS interleaved rounds; load average before: $load_before.
REPORT
