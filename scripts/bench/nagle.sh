#!/usr/bin/env bash
# Added latency through the sidecar in front of an upstream that writes headers and body in two
# sends with Nagle on (scripts/bench/nagle_upstream.py: Python's http.server, keep-alive). Each
# request is a fresh curl connection, as a client opening one per request sees it; the sidecar
# keeps its connection to the upstream pooled, which is where a delayed ACK would stall.
#
#   scripts/bench/nagle.sh            # release binary (built if missing)
#   SLUICE_BIN=path/to/sluice N=200 scripts/bench/nagle.sh
#
# Loopback only. Prints median and p90 of curl's time_total for direct and through the sidecar.
# Any answer but a 200 fails the script (a fast error is no latency figure). SMOKE=1 (the test
# command's check that the script works): N=5.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${SMOKE:-0}" = 1 ]; then N="${N:-5}"; fi
N="${N:-100}"
BIN="${SLUICE_BIN:-${CARGO_TARGET_DIR:-target}/release/sluice}"
[ -x "$BIN" ] || cargo build --release --quiet --bin sluice
command -v curl >/dev/null || { echo "needs curl"; exit 1; }
work="$(mktemp -d)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up="$(port)"; endpoint="$(port)"; sidecar="$(port)"; admin="$(port)"
cat > "$work/policy.yaml" <<'YAML'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: bench, namespace: default}
spec:
  rules:
    - name: generous
      algorithm: tokenBucket
      limit: {requests: 1000000, per: 1s}
YAML
python3 scripts/bench/nagle_upstream.py "$up" & pids+=($!)
"$BIN" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$endpoint" 2>/dev/null & pids+=($!)
"$BIN" sidecar --listen "127.0.0.1:$sidecar" --admin-listen "127.0.0.1:$admin" \
  --upstream "127.0.0.1:$up" --endpoint "http://127.0.0.1:$endpoint" 2>/dev/null & pids+=($!)
for p in "$up" "$endpoint" "$sidecar"; do
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && break; sleep 0.05; done
done
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$admin/readyz" && break; sleep 0.05; done
measure() {
  curl -s -o /dev/null "$1"   # warm: the sidecar's snapshot and its upstream connection
  for _ in $(seq "$N"); do curl -s -o /dev/null -w '%{http_code} %{time_total}\n' "$1" || echo "000 0"; done | sort -k2 -n |
    awk '$1 != 200 {bad++; code=$1} {a[NR]=$2*1000}
      END {if (bad) {printf "FAILED: %d of %d answers were not 200 (e.g. %s)\n", bad, NR, code; exit 1}
           printf "median %.2f ms  p90 %.2f ms  (n=%d)\n", a[int(NR/2)+1], a[int(NR*0.9)], NR}'
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
direct="$(measure "http://127.0.0.1:$up/x")" || { echo "direct: $direct" >&2; exit 1; }
echo "direct:        $direct"
sidecar_line="$(measure "http://127.0.0.1:$sidecar/x")" || { echo "via sidecar: $sidecar_line" >&2; exit 1; }
echo "via sidecar:   $sidecar_line"
