//! An open-loop (constant arrival rate) HTTP/1.1 load generator for `POST /v1/check`, used by
//! scripts/bench/check-load.sh to measure latency at a fixed fraction of peak throughput. Debian
//! has `wrk` but not `wrk2`, and wrk is closed-loop: a slow response delays the next request, so
//! its percentiles hide queueing ("coordinated omission"). Here request k is *scheduled* at
//! `start + k / rate` whatever happened before, and its latency is measured from that scheduled
//! time to the last byte of its response, so time spent waiting behind a slow response counts.
//!
//! Requests go round-robin over a fixed set of keep-alive connections; the bodies are the same as
//! scripts/bench/check.lua's (distinct X-API-Key values and client IPs, one chosen per request).
//! Pacing spins on the runtime (yield, not a millisecond timer), so the generator needs a core of
//! its own; it reports the rate it really achieved next to the one asked for.
//!
//! `cargo run --release --example open_loop -- --addr 127.0.0.1:8080 --rate 20000 \
//!      --connections 64 --duration 15 --warmup 3 --keys 100000`

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

struct Args {
    addr: String,
    path: String,
    rate: f64,
    connections: usize,
    duration: f64,
    warmup: f64,
    keys: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        addr: "127.0.0.1:8080".into(),
        path: "/v1/check".into(),
        rate: 10_000.0,
        connections: 64,
        duration: 15.0,
        warmup: 3.0,
        keys: 100_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => args.addr = value,
            "--path" => args.path = value,
            "--rate" => args.rate = value.parse().expect("--rate: requests per second"),
            "--connections" => args.connections = value.parse().expect("--connections: a count"),
            "--duration" => args.duration = value.parse().expect("--duration: seconds"),
            "--warmup" => args.warmup = value.parse().expect("--warmup: seconds"),
            "--keys" => args.keys = value.parse().expect("--keys: a count"),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(args.rate > 0.0 && args.connections > 0 && args.keys > 0);
    args
}

fn requests(args: &Args) -> Vec<Vec<u8>> {
    (1..=args.keys)
        .map(|i| {
            let body = format!(
                r#"{{"namespace":"bench","labels":{{"app":"orders"}},"method":"POST","path":"/orders/{}","host":"api.example.com","clientIp":"10.{}.{}.{}","headers":{{"x-api-key":"key-{}"}},"cost":1}}"#,
                i % 100,
                (i >> 16) & 255,
                (i >> 8) & 255,
                i & 255,
                i
            );
            format!(
                "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
                args.path,
                args.addr,
                body.len(),
                body
            )
            .into_bytes()
        })
        .collect()
}

#[derive(Default)]
struct ConnStats {
    /// Nanoseconds from scheduled send to the response's last byte, measured requests only.
    latencies: Vec<u64>,
    ok: u64,
    non_200: u64,
    errors: u64,
}

/// Reads one response; returns its status code.
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<u16> {
    let eof = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed");
    loop {
        if let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| eof())?;
            let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            let total = head_end + 4 + length;
            while buf.len() < total {
                let mut chunk = [0u8; 8192];
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Err(eof());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..total);
            return Ok(status);
        }
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(eof());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn connection(
    addr: String,
    reqs: std::sync::Arc<Vec<Vec<u8>>>,
    mut schedule: mpsc::UnboundedReceiver<(Instant, usize, bool)>,
) -> ConnStats {
    let mut stats = ConnStats::default();
    let mut stream = match TcpStream::connect(&addr).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("connect {addr}: {e}");
            stats.errors += 1;
            return stats;
        }
    };
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::with_capacity(16 * 1024);
    while let Some((scheduled, key, measured)) = schedule.recv().await {
        let result = async {
            stream.write_all(&reqs[key]).await?;
            read_response(&mut stream, &mut buf).await
        }
        .await;
        let done = Instant::now();
        match result {
            Ok(status) => {
                if status == 200 {
                    stats.ok += 1;
                } else {
                    stats.non_200 += 1;
                }
                if measured {
                    stats.latencies.push(done.saturating_duration_since(scheduled).as_nanos() as u64);
                }
            }
            Err(e) => {
                eprintln!("request failed: {e}");
                stats.errors += 1;
                return stats;
            }
        }
    }
    stats
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
}

fn main() {
    let args = parse_args();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async move {
        let reqs = std::sync::Arc::new(requests(&args));
        let mut senders = Vec::with_capacity(args.connections);
        let mut tasks = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.push(tx);
            tasks.push(tokio::spawn(connection(args.addr.clone(), reqs.clone(), rx)));
        }
        // Let the connections open before the clock starts.
        tokio::time::sleep(Duration::from_millis(200)).await;

        let start = Instant::now();
        let warm_until = start + Duration::from_secs_f64(args.warmup);
        let end = warm_until + Duration::from_secs_f64(args.duration);
        let mut rng_state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut sent: u64 = 0;
        let mut measured_sent: u64 = 0;
        loop {
            let now = Instant::now();
            if now >= end {
                break;
            }
            let due = ((now - start).as_secs_f64() * args.rate) as u64;
            while sent < due {
                let scheduled = start + Duration::from_secs_f64(sent as f64 / args.rate);
                // xorshift64: a key per request, as check.lua's math.random does.
                rng_state ^= rng_state << 13;
                rng_state ^= rng_state >> 7;
                rng_state ^= rng_state << 17;
                let key = (rng_state % args.keys as u64) as usize;
                let measured = scheduled >= warm_until;
                measured_sent += u64::from(measured);
                let _ = senders[(sent % args.connections as u64) as usize].send((scheduled, key, measured));
                sent += 1;
            }
            tokio::task::yield_now().await;
        }
        drop(senders);

        // Bounded drain: whatever has not answered within 5 s after the end counts as missing.
        let mut all = Vec::new();
        let (mut ok, mut non_200, mut errors) = (0, 0, 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        for task in tasks {
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(stats)) => {
                    all.extend(stats.latencies);
                    ok += stats.ok;
                    non_200 += stats.non_200;
                    errors += stats.errors;
                }
                _ => errors += 1,
            }
        }
        let completed = all.len() as u64;
        all.sort_unstable();
        println!(
            "open-loop: target {:.0} req/s over {} connections for {:.0}s (after {:.0}s warm-up)",
            args.rate, args.connections, args.duration, args.warmup
        );
        println!(
            "  sent {measured_sent} measured, completed {completed} ({:.0} req/s achieved), 200: {ok}, non-200: {non_200}, errors: {errors}",
            completed as f64 / args.duration
        );
        println!(
            "  latency from scheduled send (us): p50 {:.0}  p90 {:.0}  p99 {:.0}  p99.9 {:.0}  max {:.0}",
            percentile(&all, 50.0),
            percentile(&all, 90.0),
            percentile(&all, 99.0),
            percentile(&all, 99.9),
            percentile(&all, 100.0)
        );
        println!(
            "RESULT rate={:.0} achieved={:.0} p50_us={:.0} p99_us={:.0} p999_us={:.0} max_us={:.0} non200={non_200} errors={errors} missing={}",
            args.rate,
            completed as f64 / args.duration,
            percentile(&all, 50.0),
            percentile(&all, 99.0),
            percentile(&all, 99.9),
            percentile(&all, 100.0),
            measured_sent.saturating_sub(completed)
        );
    });
    // Connections still waiting past the drain deadline are dropped with the runtime.
}
