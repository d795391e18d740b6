//! The two halves of scripts/bench/overload.sh:
//!
//! - `app`: an application of known capacity. `--workers K` requests are served at once, each
//!   taking `--service-ms S` of work; the rest wait in a FIFO queue, as in a thread pool. Its
//!   capacity is K × 1000 / S requests per second, and past it latency grows without bound (the
//!   overload a service without protection suffers). `--capacity-file F`: K is re-read from F
//!   every 100 ms, so a run can halve the capacity and restore it.
//! - `load`: an open-loop generator. Requests are scheduled at `--rate` per second whatever the
//!   answers (no coordinated omission); `--critical-share` of them go to `/checkout` (the
//!   critical class), the rest to `/reports` (sheddable). Each request's latency is measured
//!   from its scheduled time; one taking longer than `--timeout-ms` counts as failed. Prints one
//!   JSON line: per class, sent, ok (2xx in time), refused (429/503), failed, and the p50/p99
//!   of the ok ones, plus the run's goodput.
//!
//! `cargo run --release --example overload_bench -- app --port 3000 --workers 8 --service-ms 20`
//! `cargo run --release --example overload_bench -- load --addr 127.0.0.1:15080 --rate 1600 --duration 20`

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::sync::oneshot;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn number(args: &[String], name: &str, default: f64) -> f64 {
    flag(args, name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("app") => app(&args).await,
        Some("load") => load(&args).await,
        _ => eprintln!("usage: overload_bench app|load [flags] (see the file's header)"),
    }
}

/// The application: a pool of `workers` that each hold a request for `service` of work.
struct Pool {
    workers: AtomicUsize,
    busy: AtomicUsize,
    queue: Mutex<VecDeque<oneshot::Sender<()>>>,
}

impl Pool {
    async fn serve(&self, service: Duration) {
        let waiting = {
            let mut queue = self.queue.lock();
            if self.busy.load(Ordering::SeqCst) < self.workers.load(Ordering::SeqCst) && queue.is_empty() {
                self.busy.fetch_add(1, Ordering::SeqCst);
                None
            } else {
                let (tx, rx) = oneshot::channel();
                queue.push_back(tx);
                Some(rx)
            }
        };
        if let Some(rx) = waiting {
            // Handed a worker by the request that finished before.
            let _ = rx.await;
        }
        tokio::time::sleep(service).await;
        self.hand_over();
    }

    /// A worker is free: the next waiting request takes it, or it goes back to the pool (or away,
    /// when the capacity was lowered); when it was raised, more waiting requests start.
    fn hand_over(&self) {
        let mut queue = self.queue.lock();
        let workers = self.workers.load(Ordering::SeqCst);
        let mut handed = false;
        if self.busy.load(Ordering::SeqCst) <= workers {
            while let Some(next) = queue.pop_front() {
                if next.send(()).is_ok() {
                    handed = true;
                    break;
                }
            }
        }
        if !handed {
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
        while self.busy.load(Ordering::SeqCst) < workers {
            let Some(next) = queue.pop_front() else { break };
            if next.send(()).is_ok() {
                self.busy.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

async fn app(args: &[String]) {
    let port = number(args, "--port", 3000.0) as u16;
    let service = Duration::from_secs_f64(number(args, "--service-ms", 20.0) / 1000.0);
    let pool = Arc::new(Pool {
        workers: AtomicUsize::new(number(args, "--workers", 8.0) as usize),
        busy: AtomicUsize::new(0),
        queue: Mutex::new(VecDeque::new()),
    });
    if let Some(file) = flag(args, "--capacity-file") {
        let pool = pool.clone();
        tokio::spawn(async move {
            loop {
                if let Some(k) = std::fs::read_to_string(&file).ok().and_then(|t| t.trim().parse().ok()) {
                    pool.workers.store(k, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
    eprintln!("app listening on 127.0.0.1:{port}");
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let pool = pool.clone();
        tokio::spawn(async move {
            let service_fn = hyper::service::service_fn(move |_request: Request<Incoming>| {
                let pool = pool.clone();
                async move {
                    pool.serve(service).await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service_fn).await;
        });
    }
}

#[derive(Default)]
struct ClassStats {
    sent: u64,
    ok: u64,
    refused: u64,
    failed: u64,
    latencies: Vec<Duration>,
}

impl ClassStats {
    fn json(&mut self) -> serde_json::Value {
        self.latencies.sort();
        let at = |q: f64| {
            if self.latencies.is_empty() {
                return serde_json::Value::Null;
            }
            let i = ((self.latencies.len() as f64 * q).ceil() as usize).clamp(1, self.latencies.len()) - 1;
            serde_json::json!((self.latencies[i].as_secs_f64() * 1000.0 * 10.0).round() / 10.0)
        };
        serde_json::json!({
            "sent": self.sent, "ok": self.ok, "refused": self.refused, "failed": self.failed,
            "successRate": if self.sent == 0 { 0.0 } else { self.ok as f64 / self.sent as f64 },
            "p50Ms": at(0.5), "p99Ms": at(0.99),
        })
    }
}

async fn load(args: &[String]) {
    let addr = flag(args, "--addr").unwrap_or_else(|| "127.0.0.1:15080".into());
    let rate = number(args, "--rate", 100.0);
    let duration = number(args, "--duration", 10.0);
    let critical_share = number(args, "--critical-share", 0.2);
    let timeout = Duration::from_secs_f64(number(args, "--timeout-ms", 2000.0) / 1000.0);
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(4096)
        .build_http::<Full<Bytes>>();
    let stats = Arc::new(Mutex::new([ClassStats::default(), ClassStats::default()]));
    let start = Instant::now();
    let total = (rate * duration) as u64;
    let mut tasks = Vec::with_capacity(total as usize);
    for k in 0..total {
        let scheduled = start + Duration::from_secs_f64(k as f64 / rate);
        tokio::time::sleep_until(scheduled.into()).await;
        // Every fifth request critical (with the default share), spread evenly.
        let critical = ((k + 1) as f64 * critical_share).floor() > (k as f64 * critical_share).floor();
        let path = if critical { "/checkout" } else { "/reports" };
        let uri: hyper::Uri = format!("http://{addr}{path}").parse().expect("uri");
        let (client, stats) = (client.clone(), stats.clone());
        tasks.push(tokio::spawn(async move {
            let request = Request::get(uri).body(Full::new(Bytes::new())).expect("request");
            let outcome = tokio::time::timeout(timeout, async {
                let response = client.request(request).await.ok()?;
                let status = response.status();
                http_body_util::BodyExt::collect(response.into_body()).await.ok()?;
                Some(status)
            })
            .await;
            let latency = scheduled.elapsed();
            let mut stats = stats.lock();
            let class = &mut stats[usize::from(!critical)];
            class.sent += 1;
            match outcome {
                Ok(Some(status)) if status.is_success() => {
                    class.ok += 1;
                    class.latencies.push(latency);
                }
                Ok(Some(status)) if status.as_u16() == 429 || status.as_u16() == 503 => class.refused += 1,
                _ => class.failed += 1,
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut stats = stats.lock();
    let ok = stats[0].ok + stats[1].ok;
    let line = serde_json::json!({
        "rate": rate, "seconds": (elapsed * 10.0).round() / 10.0,
        "goodput": (ok as f64 / duration * 10.0).round() / 10.0,
        "critical": stats[0].json(), "sheddable": stats[1].json(),
    });
    println!("{line}");
}
