#!/usr/bin/env bash
# What slow and stalled clients of an application take from its sidecar (issue 37): `sluice
# serve` (memory) with a policy whose rule estimates a cost from the request body's max_tokens
# and whose overload protection holds 8 requests in flight, the sidecar in front of a small
# application on loopback. Two attacks by clients of the application:
#
# - stalled: STALLED connections each announce a 1 MiB JSON body, send 900 KiB of it and stop;
#   the sidecar's resident memory is sampled until READ_AHEAD_DEADLINE (10 s) + 3 s, and the
#   answers they got are counted by status (a build without a read-ahead deadline answers none
#   of those it reads ahead, and keeps their bytes; past the read-ahead budget a body is sent on
#   to the application, which reads it before it answers);
# - trickle: 8 clients each announce a 1 000-byte upload and send 5 bytes a second, while 20
#   `GET /` are sent one after the other: how many the application served.
#
#   scripts/bench/read-ahead.sh                          # this checkout's release build
#   SLUICE_BIN=/path/to/sluice scripts/bench/read-ahead.sh   # another build, side by side
#
# Env: SLUICE_BIN, STALLED (100), SMOKE (1: 10 stalled connections, the test command's check
# that the script works). A GET that gets no answer, or an attack that could not start, fails
# the script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/bench/lib.sh
. "$ROOT/scripts/bench/lib.sh"
if [ "$SMOKE" = 1 ]; then STALLED="${STALLED:-10}"; fi
STALLED="${STALLED:-100}"
SLUICE="$(sluice_bin)"
work="$(mktemp -d)"
cleanup() {
    [ -n "${SIDECAR_PID:-}" ] && kill "$SIDECAR_PID" 2>/dev/null
    [ -n "${SERVE_PID:-}" ] && kill "$SERVE_PID" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/policy.yaml" <<'YAML'
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: app, namespace: shop}
spec:
  overload: {initialLimit: 8, minLimit: 8, maxLimit: 8}
  rules:
    - name: tokens
      algorithm: fixedWindow
      limit: {requests: 100000000, per: 1h}
      responseCost:
        fields: [usage.total_tokens]
        estimate: {requestField: max_tokens, cap: 1000}
YAML
app_port="$(free_port)" serve_port="$(free_port)" proxy_port="$(free_port)" admin_port="$(free_port)"
"$SLUICE" serve --policies "$work/policy.yaml" --listen "127.0.0.1:$serve_port" 2>"$work/serve.log" &
SERVE_PID=$!
"$SLUICE" sidecar --listen "127.0.0.1:$proxy_port" --admin-listen "127.0.0.1:$admin_port" \
    --upstream "127.0.0.1:$app_port" --endpoint "http://127.0.0.1:$serve_port" --namespace shop \
    --snapshot-interval 100ms 2>"$work/sidecar.log" &
SIDECAR_PID=$!

python3 - "$app_port" "$proxy_port" "$admin_port" "$SIDECAR_PID" "$STALLED" <<'PY'
import http.server, json, socket, sys, threading, time, urllib.request
app_port, proxy_port, admin_port, sidecar_pid, stalled = (int(a) for a in sys.argv[1:])

class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "3"); self.end_headers(); self.wfile.write(b"ok\n")
    def do_POST(self):
        # Like most applications: the whole body first, then the answer.
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.do_GET()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", app_port), App)
server.handle_error = lambda request, address: None  # clients the attacks drop mid-request
threading.Thread(target=server.serve_forever, daemon=True).start()

def rss_mib():
    with open(f"/proc/{sidecar_pid}/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS")) / 1024

deadline = time.monotonic() + 20
while True:
    try:
        state = json.load(urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/overload", timeout=2))
        if state.get("protection"):
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("FAILED: the sidecar never turned overload protection on")
    time.sleep(0.1)

def get():
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code

# stalled
base = rss_mib()
sockets, answers = [], {}
for _ in range(stalled):
    s = socket.create_connection(("127.0.0.1", proxy_port))
    s.sendall(b"POST /v1/chat HTTP/1.1\r\nhost: app\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n")
    s.sendall(b" " * (900 * 1024))
    s.setblocking(False)
    sockets.append(s)
peak, started = base, time.monotonic()
while time.monotonic() - started < 13:
    peak = max(peak, rss_mib())
    for s in list(sockets):
        try:
            head = s.recv(64)
            status = head[9:12].decode() if head.startswith(b"HTTP/1.1 ") else "closed"
            answers[status] = answers.get(status, 0) + 1
            sockets.remove(s); s.close()
        except BlockingIOError:
            pass
    time.sleep(0.5)
after = rss_mib()
for s in sockets: s.close()
print(f"stalled: {stalled} uploads of 900 KiB of 1 MiB; sidecar RSS {base:.0f} MiB before, peak +{peak - base:.0f} MiB, "
      f"+{after - base:.0f} MiB after 13 s; answers {dict(sorted(answers.items()))}, {len(sockets)} still waiting")
if get() != 200:
    sys.exit("FAILED: GET / through the sidecar after the stalled uploads")

# trickle
stop = threading.Event()
def trickle(n):
    s = socket.create_connection(("127.0.0.1", proxy_port))
    s.sendall(f"POST /upload/{n} HTTP/1.1\r\nhost: app\r\ncontent-type: application/octet-stream\r\ncontent-length: 1000\r\n\r\n".encode())
    while not stop.is_set():
        try:
            s.sendall(b"xxxxx")
        except OSError:
            return
        stop.wait(1)
    s.close()
threads = [threading.Thread(target=trickle, args=(n,)) for n in range(8)]
for t in threads: t.start()
time.sleep(0.5)
statuses = [get() for _ in range(20)]
stop.set()
for t in threads: t.join()
print(f"trickle: 8 uploads at 5 B/s; GET / served {statuses.count(200)} of 20 (others: {sorted(s for s in statuses if s != 200)})")
PY
echo "binary: $SLUICE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
