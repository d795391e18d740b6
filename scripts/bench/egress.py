"""The egress benchmark's bank and callers (scripts/bench/egress.sh runs it; docs/egress.md).

    python3 egress.py bank PORT RATE            # the bank: serves, refuses above RATE per second
    python3 egress.py callers MODE BANK_PORT DURATION RATE PACE MAX_DELAY_MS TARGET...
    python3 egress.py report BANK_PORT          # what the bank saw, as JSON

The bank answers 429 to a request that would make more than RATE transactions in the last second
(a sliding window over the requests it accepted), else 200; it records every arrival. The callers are one thread group per
TARGET (a caller replica: its sidecar's egress port, or the bank itself), each offering bursts
of 20 to 40 requests per second for one second, then resting, so the callers' average fits the
bank's rate while their bursts together do not. MODE `direct` sends at once, `client` paces
each caller by its own limiter at RATE (a per-pod client-side limiter, as Go's rate.Limiter.Wait
would), `split` by its own limiter at RATE / callers (the budget divided statically), `sluice`
sends through the sidecars, which pace by the shared budget.
"""

import bisect
import http.client
import http.server
import json
import random
import socketserver
import sys
import threading
import time


def bank(port, rate):
    arrivals, accepted, refused, lock = [], [], [0], threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def answer(self, status, body):
            data = body.encode()
            self.send_response(status)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/report":
                with lock:
                    self.answer(200, json.dumps({"arrivals": arrivals, "refused": refused[0]}))
                return
            if self.path == "/reset":
                with lock:
                    arrivals.clear()
                    accepted.clear()
                    refused[0] = 0
                self.answer(200, "reset\n")
                return
            self.pay()

        def do_POST(self):
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            self.pay()

        def pay(self):
            now = time.monotonic()
            with lock:
                arrivals.append(now)
                # Like a bank's own limiter: RATE transactions in any second; a refused one is
                # not a transaction.
                recent = len(accepted) - bisect.bisect_right(accepted, now - 1.0)
                over = recent >= rate
                if over:
                    refused[0] += 1
                else:
                    accepted.append(now)
            self.answer(429 if over else 200, "too many\n" if over else "paid\n")

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        request_queue_size = 1024

    Server(("127.0.0.1", port), Handler).serve_forever()


def callers(mode, bank_port, duration, rate, pace_rate, max_delay_ms, targets):
    """Returns per-request records: (caller, offered_at, latency_s, status, waited_ms)."""
    records, lock = [], threading.Lock()
    start = time.monotonic() + 0.2
    pace = 1.0 / pace_rate if mode != "split" else len(targets) / pace_rate

    def one(caller, port, offered):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=max_delay_ms / 1000 + 30)
        try:
            connection.request("POST", "/transfer", b"amount=1", {"content-type": "text/plain"})
            response = connection.getresponse()
            response.read()
            status, waited = response.status, response.getheader("sluice-egress-waited-ms")
        except Exception as error:  # a measured call that fails fails the run
            status, waited = f"error: {error!r}", None
        finally:
            connection.close()
        with lock:
            records.append((caller, offered - start, time.monotonic() - offered, status, waited))

    def caller(n, port):
        rng = random.Random(n)
        threads, next_free = [], start
        at = start + rng.uniform(0, 2.0)
        while at < start + duration:
            burst_rate = rng.uniform(20, 40)
            for i in range(int(burst_rate)):
                offered = at + i / burst_rate
                if offered >= start + duration:
                    break
                send = offered
                if mode in ("client", "split"):
                    # This pod's own limiter: its requests leave `pace` apart, whatever the others
                    # do (client: at the bank's rate; split: at its static share of it).
                    send = max(offered, next_free)
                    next_free = send + pace
                delay = send - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                t = threading.Thread(target=one, args=(n, port, offered))
                t.start()
                threads.append(t)
            # Rest so that the average over the callers fits the bank: about rate / callers each.
            at += len(targets) * burst_rate / rate * rng.uniform(0.9, 1.1)
        for t in threads:
            t.join()

    groups = [threading.Thread(target=caller, args=(n, int(p))) for n, p in enumerate(targets)]
    for g in groups:
        g.start()
    for g in groups:
        g.join()
    return records


def percentile(values, p):
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def most_in_window(times, width):
    best, j = 0, 0
    for i in range(len(times)):
        while times[i] - times[j] >= width:
            j += 1
        best = max(best, i - j + 1)
    return best


def main():
    what = sys.argv[1]
    if what == "bank":
        bank(int(sys.argv[2]), int(sys.argv[3]))
    elif what == "callers":
        mode, bank_port, duration = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        rate, pace_rate, max_delay_ms = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
        targets = sys.argv[8:]
        connection = http.client.HTTPConnection("127.0.0.1", bank_port, timeout=10)
        connection.request("GET", "/reset")
        connection.getresponse().read()
        records = callers(mode, bank_port, duration, rate, pace_rate, max_delay_ms, targets)
        connection = http.client.HTTPConnection("127.0.0.1", bank_port, timeout=10)
        connection.request("GET", "/report")
        seen = json.loads(connection.getresponse().read())
        arrivals = sorted(seen["arrivals"])
        errors = [r for r in records if not isinstance(r[3], int)]
        sent = [r for r in records if r[3] in (200, 429) and (mode != "sluice" or r[4] is not None)]
        shaped_refusals = [r for r in records if r[3] == 429 and mode == "sluice" and r[4] is None]
        latencies = [r[2] * 1000 for r in sent]
        waits = [int(r[4]) for r in sent if r[4] is not None]
        # What a perfect shared shaper would make each request wait: departures RATE apart in
        # order of arrival, refusing a wait past maxDelay (the theoretical queueing delay).
        ideal, departure = [], 0.0
        for offered in sorted(r[1] for r in records):
            leave = max(departure, offered)
            if (leave - offered) * 1000 <= max_delay_ms:
                ideal.append((leave - offered) * 1000)
                departure = leave + 1.0 / pace_rate
        summary = {
            "mode": mode,
            "offered": len(records),
            "reached_bank": len(arrivals),
            "bank_refused": seen["refused"],
            "refused_before_sending": len(shaped_refusals),
            "errors": len(errors),
            "error_sample": [str(r[3]) for r in errors[:3]],
            "most_in_1s": most_in_window(arrivals, 1.0),
            "most_in_100ms": most_in_window(arrivals, 0.1),
            "latency_p50_ms": round(percentile(latencies, 50), 1),
            "latency_p99_ms": round(percentile(latencies, 99), 1),
            "waited_p50_ms": percentile(waits, 50),
            "waited_p99_ms": percentile(waits, 99),
            "waited_max_ms": max(waits) if waits else 0,
            "ideal_wait_p50_ms": round(percentile(ideal, 50), 1),
            "ideal_wait_p99_ms": round(percentile(ideal, 99), 1),
            "ideal_refused": len(records) - len(ideal),
        }
        print(json.dumps(summary))
    else:
        sys.exit(f"unknown command {what}")


if __name__ == "__main__":
    main()
