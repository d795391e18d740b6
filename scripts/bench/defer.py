"""The deferred-write benchmark's application and writers (scripts/bench/defer.sh runs them).

    python3 defer.py app PORT                       # records every write that reaches it
    python3 defer.py writers PORTS RATE DURATION    # PORTS: the sidecars, comma-separated
    python3 defer.py report APP_PORT WRITERS_JSON LIMIT

The app answers every POST 201 and records, per `Idempotency-Key`, each arrival's time (and
whether it was a replay: `Sluice-Deferred-Id`); GET /report gives them. The writers offer RATE
writes a second for DURATION seconds, spread over the sidecars, each with its own
`Idempotency-Key`, and print one JSON object: per key, the status (201 live, 202 queued, 429
refused) and when it was answered; any other answer counts as failed. `report` joins both and
prints the figures: every accepted write delivered exactly once (lost, duplicates), the most
delivered in any second against the limit, the queue age at delivery (p50, p99), the drain time.
"""

import http.client
import http.server
import json
import socketserver
import sys
import threading
import time


def app(port):
    arrivals, lock = {}, threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            key = self.headers.get("idempotency-key") or "-"
            replay = self.headers.get("sluice-deferred-id") is not None
            with lock:
                arrivals.setdefault(key, []).append([time.time(), replay])
            self.send_response(201)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_GET(self):
            with lock:
                data = json.dumps(arrivals).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        request_queue_size = 1024

    Server(("127.0.0.1", port), Handler).serve_forever()


def writers(ports, rate, duration):
    answers, lock = {}, threading.Lock()
    local = threading.local()
    workers = 24
    per_worker = rate / workers
    start = time.time()

    def one(port, key):
        status = 0
        try:
            conns = local.__dict__.setdefault("c", {})
            if port not in conns:
                conns[port] = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c = conns[port]
            c.request("POST", "/orders", body=json.dumps({"order": key}),
                      headers={"content-type": "application/json", "idempotency-key": key})
            response = c.getresponse()
            response.read()
            status = response.status
        except Exception:
            local.__dict__.get("c", {}).pop(port, None)
        with lock:
            answers[key] = [status, time.time()]

    def worker(w):
        n = 0
        while True:
            at = start + (n + 0.5) / per_worker
            if at > start + duration:
                return
            delay = at - time.time()
            if delay > 0:
                time.sleep(delay)
            key = f"w{w}-{n}"
            one(ports[(w + n) % len(ports)], key)
            n += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"start": start, "end": time.time(), "answers": answers}))


def fetch(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/report")
    return json.loads(c.getresponse().read())


def report(app_port, writers_file, limit):
    with open(writers_file) as f:
        w = json.load(f)
    arrivals = fetch(app_port)
    answers = w["answers"]
    by_status = {}
    for status, _ in answers.values():
        by_status[status] = by_status.get(status, 0) + 1
    accepted = [k for k, (s, _) in answers.items() if s in (201, 202)]
    lost = [k for k in accepted if k not in arrivals]
    duplicates = sum(len(arrivals[k]) - 1 for k in accepted if k in arrivals)
    strays = [k for k in arrivals if answers.get(k, [0])[0] not in (201, 202)]
    times = sorted(t for k in accepted for t, _ in arrivals.get(k, []))
    most, j = 0, 0
    for i in range(len(times)):
        while times[i] - times[j] >= 1.0:
            j += 1
        most = max(most, i - j + 1)
    ages = sorted(arrivals[k][0][0] - answers[k][1] for k, (s, _) in answers.items() if s == 202 and k in arrivals)
    pct = lambda q: ages[min(len(ages) - 1, int(q * (len(ages) - 1) + 0.5))] if ages else 0.0
    print(json.dumps({
        "offered": len(answers), "live": by_status.get(201, 0), "queued": by_status.get(202, 0),
        "refused": by_status.get(429, 0),
        "failed": sum(n for s, n in by_status.items() if s not in (201, 202, 429)),
        "delivered": len(accepted) - len(lost), "lost": len(lost), "duplicates": duplicates,
        "strays": len(strays), "most_in_a_second": most, "limit": limit,
        "age_p50_s": round(pct(0.5), 3), "age_p99_s": round(pct(0.99), 3),
        "drain_s": round(times[-1] - w["end"], 1) if times else 0.0,
    }))


if __name__ == "__main__":
    if sys.argv[1] == "app":
        app(int(sys.argv[2]))
    elif sys.argv[1] == "writers":
        writers([int(p) for p in sys.argv[2].split(",")], float(sys.argv[3]), float(sys.argv[4]))
    else:
        report(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
