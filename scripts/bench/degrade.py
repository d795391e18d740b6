"""The read-degradation benchmark's origin and readers (scripts/bench/degrade.sh runs it).

    python3 degrade.py origin PORT BODY_BYTES     # the catalogue: counts its hits per second
    python3 degrade.py readers SIDECAR_PORT ORIGIN_PORT RATE DURATION ITEMS

The origin answers GET /catalogue/<n> with a body of BODY_BYTES and `Cache-Control:
max-age=60`, and GET /report with its hits by second. The readers offer RATE reads a second
for DURATION seconds through the sidecar, item n drawn with probability ∝ 1/(n+1) (a few hot
items, a long tail), and print one JSON line: answered fresh, answered stale, refused, failed,
and the origin's hits per second.
"""

import http.client
import http.server
import json
import random
import socketserver
import sys
import threading
import time


def origin(port, body_bytes):
    hits, lock = {}, threading.Lock()
    body = b"x" * body_bytes

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/report":
                with lock:
                    data = json.dumps(hits).encode()
                    hits.clear()
            else:
                second = str(int(time.monotonic()))
                with lock:
                    hits[second] = hits.get(second, 0) + 1
                data = body
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.send_header("cache-control", "max-age=60")
            self.end_headers()
            self.wfile.write(data)

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        request_queue_size = 1024

    Server(("127.0.0.1", port), Handler).serve_forever()


def readers(sidecar_port, origin_port, rate, duration, items):
    counts, lock = {"fresh": 0, "stale": 0, "refused": 0, "failed": 0}, threading.Lock()
    weights = [1.0 / (n + 1) for n in range(items)]
    rng = random.Random(7)
    local = threading.local()

    def one(item):
        try:
            if not hasattr(local, "c"):
                local.c = http.client.HTTPConnection("127.0.0.1", sidecar_port, timeout=10)
            local.c.request("GET", f"/catalogue/{item}")
            response = local.c.getresponse()
            response.read()
            if response.status == 200:
                kind = "stale" if response.getheader("sluice-stale") else "fresh"
            elif response.status == 429:
                kind = "refused"
            else:
                kind = "failed"
        except Exception:
            local.__dict__.pop("c", None)
            kind = "failed"
        with lock:
            counts[kind] += 1

    workers = 16
    per_worker = rate / workers
    start = time.monotonic()

    def worker(w):
        wrng = random.Random(w)
        n = 0
        while True:
            at = start + (n + wrng.random()) / per_worker
            if at > start + duration:
                return
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            one(wrng.choices(range(items), weights)[0])
            n += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = http.client.HTTPConnection("127.0.0.1", origin_port, timeout=10)
    c.request("GET", "/report")
    hits = json.loads(c.getresponse().read())
    per_second = [hits[k] for k in sorted(hits)][1:-1] or list(hits.values())
    counts["origin_max_per_s"] = max(per_second) if per_second else 0
    counts["origin_total"] = sum(hits.values())
    print(json.dumps(counts))


if __name__ == "__main__":
    if sys.argv[1] == "origin":
        origin(int(sys.argv[2]), int(sys.argv[3]))
    else:
        readers(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
