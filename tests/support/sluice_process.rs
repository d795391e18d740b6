//! Starts the real `sluice` binary for integration tests and stops it on drop.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct SluiceProcess {
    pub child: Child,
    pub addr: SocketAddr,
    pub logs: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl SluiceProcess {
    /// Runs `sluice <args…>` and waits for its "listening" log line to learn the address.
    pub fn start(args: &[&str]) -> SluiceProcess {
        Self::try_start(args).unwrap_or_else(|e| panic!("sluice {args:?} did not start: {e}"))
    }

    pub fn try_start(args: &[&str]) -> Result<SluiceProcess, String> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .env("RUST_LOG", std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .env("SLUICE_LOG_FORMAT", "text")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("address=") {
                    let addr = line[i + 8..].split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
                sink.lock().unwrap().push(line);
            }
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(addr) => Ok(SluiceProcess { child, addr: addr.parse().map_err(|e| format!("{addr}: {e}"))?, logs }),
            Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                Err(format!("no listening line; exit {status:?}; logs:\n{}", logs.lock().unwrap().join("\n")))
            }
        }
    }

    /// `sluice sidecar` on free loopback ports in front of `upstream`, asking `endpoint` for
    /// `namespace`, its snapshot polled every 100 ms (unless `extra` says), then `extra`; its
    /// admin address is [`Self::logged_address`]`("admin")`.
    pub fn sidecar(upstream: &str, endpoint: &str, namespace: &str, extra: &[&str]) -> SluiceProcess {
        let mut args = vec![
            "sidecar",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--endpoint",
            endpoint,
            "--namespace",
            namespace,
        ];
        if !extra.contains(&"--snapshot-interval") {
            args.extend_from_slice(&["--snapshot-interval", "100ms"]);
        }
        args.extend_from_slice(extra);
        SluiceProcess::start(&args)
    }

    /// The address a log line names as `field=ADDRESS` (the sidecar's `admin=`), waiting up to
    /// 10 s for it.
    pub fn logged_address(&self, field: &str) -> SocketAddr {
        let needle = format!("{field}=");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let found = self.logs.lock().unwrap().iter().find_map(|line| {
                let at = line.find(&needle)?;
                line[at + needle.len()..].split_whitespace().next()?.parse::<SocketAddr>().ok()
            });
            if let Some(address) = found {
                return address;
            }
            assert!(std::time::Instant::now() < deadline, "no {needle} line in {:?}", self.logs.lock().unwrap());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Sends SIGTERM and returns the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        for _ in 0..100 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().expect("child exits")
    }
}

impl Drop for SluiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `sluice <args>` to completion, returning (exit code, stderr).
pub fn run_to_end(args: &[&str], cwd: &Path) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).current_dir(cwd).output().expect("runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Runs `sluice <args>` until it exits or `limit` passes (then it is killed: a process that
/// should have refused to start must fail the test, not hang it); returns (exit code, stderr).
pub fn run_for_at_most(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + limit;
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (code, stderr)
}
