//! Real `redis-server` processes for integration tests (Debian: `apt-get install redis-server
//! redis-tools`).
//!
//! Each server runs under a tiny `sh` watchdog that reads the test process's pipe: when the test
//! binary exits, even by a panic or a kill, the pipe closes and the watchdog kills its server, so
//! the shared `static` servers (never dropped) do not outlive the tests.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `SLUICE_REDIS_SERVER` overrides the binary.
fn server_binary() -> PathBuf {
    std::env::var_os("SLUICE_REDIS_SERVER").map_or_else(|| PathBuf::from("/usr/bin/redis-server"), PathBuf::from)
}

fn cli_binary() -> PathBuf {
    std::env::var_os("SLUICE_REDIS_CLI").map_or_else(|| PathBuf::from("/usr/bin/redis-cli"), PathBuf::from)
}

/// A port nothing listens on now (and, for cluster nodes, whose bus port +10000 is free too).
pub fn free_port(with_bus: bool) -> u16 {
    for _ in 0..200 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = listener.local_addr().expect("local addr").port();
        if !with_bus {
            return port;
        }
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port found");
}

pub struct RedisServer {
    port: u16,
    /// A configuration file given first (a sentinel's, which it rewrites).
    config: Option<PathBuf>,
    extra: Vec<String>,
    /// The watchdog `sh`, the pipe it reads, and the redis-server's own pid (which it prints).
    child: Option<(Child, ChildStdin, u32)>,
}

impl RedisServer {
    /// A fresh server on a free port, without persistence. A port another test's server took
    /// between `free_port` and this server's bind is given up for another one.
    pub fn start() -> RedisServer {
        let mut refused = Vec::new();
        for _ in 0..5 {
            let mut server = RedisServer { port: free_port(false), config: None, extra: Vec::new(), child: None };
            match server.spawn() {
                Ok(()) => return server,
                Err(error) => refused.push(error),
            }
        }
        panic!("no port for a redis-server: {refused:?}");
    }

    pub fn start_with(port: u16, extra: &[String]) -> RedisServer {
        let mut server = RedisServer { port, config: None, extra: extra.to_vec(), child: None };
        server.spawn().unwrap_or_else(|error| panic!("{error}"));
        server
    }

    /// A Redis Sentinel on `port`, configured by `config` (which it rewrites as it learns).
    pub fn start_sentinel(port: u16, config: &Path) -> RedisServer {
        let mut server =
            RedisServer { port, config: Some(config.to_path_buf()), extra: vec!["--sentinel".into()], child: None };
        server.spawn().unwrap_or_else(|error| panic!("{error}"));
        server
    }

    /// One server per test binary, for tests that only need a working Redis.
    pub fn shared() -> &'static RedisServer {
        static SHARED: OnceLock<RedisServer> = OnceLock::new();
        SHARED.get_or_init(RedisServer::start)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server and waits until it answers on its port. Fails when another process
    /// serves the port: this server could not bind it (it exits), while the other answers PING
    /// all the same — sharing it would have one test's end reset the other's connections.
    fn spawn(&mut self) -> Result<(), String> {
        let binary = server_binary();
        assert!(
            binary.exists(),
            "{} not found: install it with `apt-get install -y redis-server redis-tools` \
             (or set SLUICE_REDIS_SERVER)",
            binary.display()
        );
        let mut command = Command::new("sh");
        command
            .arg("-c")
            // The server's pid first, so that stopping it can name the process (a port can be
            // taken by another test's server the moment this one frees it). The server's own
            // output goes to /dev/null, not to the pipe, which is closed once the pid is read.
            .arg(r#"bin="$1"; shift; "$bin" "$@" >/dev/null & r=$!; echo "$r"; read _ignored; kill -9 $r 2>/dev/null; wait $r 2>/dev/null; exit 0"#)
            .arg("sh")
            .arg(&binary)
            .args(&self.config)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(if self.config.is_some() { &[][..] } else { &["--save", "", "--appendonly", "no"][..] })
            .args(&self.extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = command.spawn().expect("spawn redis-server");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout")).read_line(&mut line).expect("read the server's pid");
        let pid = line.trim().parse().unwrap_or_else(|_| panic!("the watchdog printed no pid: {line:?}"));
        wait_for_ping(self.port, Duration::from_secs(10));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !listens(pid, self.port) {
            if !alive(pid) || Instant::now() >= deadline {
                // The watchdog kills what is left of this server when its pipe closes.
                drop(stdin);
                let _ = child.wait();
                return Err(format!("port {} is served by another process, not by redis-server pid {pid}", self.port));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.child = Some((child, stdin, pid));
        Ok(())
    }

    /// Kills the server abruptly (SIGKILL) and waits until it is gone and its port refuses
    /// connections (a test that kills its Redis means an outage).
    pub fn kill(&mut self) {
        if let Err(error) = self.stop() {
            panic!("{error}");
        }
    }

    /// [`Self::kill`] without panicking: the watchdog is told to kill the server; if it has not
    /// within 5 s (a starved machine), the server and the watchdog get SIGKILL from here. Then
    /// waits, at most 5 s, for the process to be gone and the port to refuse connections.
    fn stop(&mut self) -> Result<(), String> {
        let Some((mut child, mut stdin, pid)) = self.child.take() else { return Ok(()) };
        let _ = stdin.write_all(b"stop\n");
        drop(stdin);
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if matches!(child.try_wait(), Ok(None)) {
            eprintln!("redis-server on {} (pid {pid}): its watchdog did not stop it within 5 s; kill -9", self.port);
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            let _ = child.kill();
        }
        let _ = child.wait();
        // Never signalled from here any more: the pid may belong to someone else by now.
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(pid) || TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            if Instant::now() >= deadline {
                return Err(if alive(pid) {
                    format!("redis-server on {} (pid {pid}) did not stop after SIGKILL", self.port)
                } else {
                    format!("redis-server on {} (pid {pid}) stopped, but its port still answers", self.port)
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Starts the server again on the same port (its data is gone: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap_or_else(|error| panic!("{error}"));
    }

    /// Runs `redis-cli -p PORT args…` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    /// Never panics: a panic here while a failed test unwinds would abort the whole test binary
    /// (its other tests then report nothing). A server that would not stop is logged; the
    /// watchdog and SIGKILL have been tried, and nothing more can be done from here.
    fn drop(&mut self) {
        if let Err(error) = self.stop() {
            eprintln!("{error} (ignored while dropping it)");
        }
    }
}

pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new(cli_binary())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    // A server started with --requirepass answers, refusing: it is up all the same.
    stream.read_exact(&mut reply).is_ok() && (&reply == b"+PONG\r\n" || &reply == b"-NOAUTH")
}

/// Whether `pid` is a redis-server still running: gone once its /proc entry is (or is a zombie
/// waiting to be reaped), or names another program (the pid reused).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.contains("(redis-") && stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// Whether process `pid` holds the socket listening on 127.0.0.1:`port`: the listening socket's
/// inode from /proc/net/tcp (state 0A), found among the process's descriptors.
fn listens(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else { return false };
    let local = format!("0100007F:{port:04X}");
    let sockets: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let Ok(descriptors) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    descriptors.flatten().any(|descriptor| {
        std::fs::read_link(descriptor.path())
            .is_ok_and(|target| sockets.iter().any(|s| target.as_os_str() == s.as_str()))
    })
}

fn wait_for_ping(port: u16, within: Duration) {
    let deadline = Instant::now() + within;
    while !ping(port) {
        assert!(Instant::now() < deadline, "redis-server on port {port} did not answer PING");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server that also listens with TLS, with a certificate for 127.0.0.1 signed by a throwaway
/// CA made with `openssl`. Returns the server, its TLS port, the CA certificate (PEM) to trust
/// and the directory holding the files.
pub fn start_tls() -> (RedisServer, u16, Vec<u8>, tempfile::TempDir) {
    let tls = TlsRedis::start(false);
    (tls.server, tls.port, tls.ca, tls.dir)
}

/// A TLS server ([`start_tls`]) and, for mutual TLS, a client certificate signed by its CA.
pub struct TlsRedis {
    pub server: RedisServer,
    pub port: u16,
    pub ca: Vec<u8>,
    pub client_certificate: Vec<u8>,
    pub client_key: Vec<u8>,
    pub dir: tempfile::TempDir,
}

impl TlsRedis {
    /// With `clients_authenticate`, the server refuses clients without a certificate of its CA.
    pub fn start(clients_authenticate: bool) -> TlsRedis {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(path("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").expect("write ext");
        let openssl = |args: &[&str]| {
            let status = Command::new("openssl")
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("run openssl (apt-get install openssl)");
            assert!(status.success(), "openssl {args:?} failed");
        };
        let (ca, ca_key) = (path("ca.pem"), path("ca.key"));
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=sluice test CA",
            "-keyout",
            &ca_key,
            "-out",
            &ca,
        ]);
        let sign = |name: &str, subject: &str| {
            let (key, csr, cert) =
                (path(&format!("{name}.key")), path(&format!("{name}.csr")), path(&format!("{name}.pem")));
            openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out", &csr]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &path("ext.cnf"),
                "-out",
                &cert,
            ]);
            (cert, key)
        };
        let (cert, key) = sign("server", "/CN=127.0.0.1");
        let (client_cert, client_key) = sign("client", "/CN=sluice");
        let port = free_port(false);
        let extra: Vec<String> = [
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            if clients_authenticate { "yes" } else { "no" },
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let server = RedisServer::start_with(free_port(false), &extra);
        let read = |p: &str| std::fs::read(p).expect("read a PEM file");
        TlsRedis {
            server,
            port,
            ca: read(&ca),
            client_certificate: read(&client_cert),
            client_key: read(&client_key),
            dir,
        }
    }
}

/// A master, its replica and three Sentinels watching them as `mymaster` (quorum 2, a node
/// is down after 1 s without answers).
pub struct RedisSentinels {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisSentinels {
    pub const MASTER_NAME: &str = "mymaster";

    pub fn start() -> RedisSentinels {
        let dir = tempfile::tempdir().expect("temp dir");
        let master = RedisServer::start();
        // A replica saves what its master sends to its directory: the temporary one, not the
        // test's working directory (the checkout).
        let replica = RedisServer::start_with(
            free_port(false),
            &[
                "--replicaof".into(),
                "127.0.0.1".into(),
                master.port().to_string(),
                "--dir".into(),
                dir.path().display().to_string(),
            ],
        );
        let sentinels = (0..3)
            .map(|i| {
                let port = free_port(false);
                let config = dir.path().join(format!("sentinel-{i}.conf"));
                std::fs::write(
                    &config,
                    format!(
                        "sentinel monitor {name} 127.0.0.1 {master} 2\n\
                         sentinel down-after-milliseconds {name} 1000\n\
                         sentinel failover-timeout {name} 10000\n\
                         sentinel parallel-syncs {name} 1\n",
                        name = Self::MASTER_NAME,
                        master = master.port()
                    ),
                )
                .expect("write sentinel.conf");
                RedisServer::start_sentinel(port, &config)
            })
            .collect();
        let set = RedisSentinels { master, replica, sentinels, _dir: dir };
        set.wait_until(Duration::from_secs(20), "the replica is in sync and every sentinel sees it", |set| {
            set.replica.cli(&["INFO", "replication"]).contains("master_link_status:up")
                && set.sentinels.iter().all(|s| {
                    s.cli(&["SENTINEL", "replicas", Self::MASTER_NAME]).contains(&set.replica.port().to_string())
                        && s.cli(&["SENTINEL", "sentinels", Self::MASTER_NAME]).matches("127.0.0.1").count() >= 2
                })
        });
        set
    }

    /// `redis://127.0.0.1:PORT` of each sentinel.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The master's port as the first sentinel names it.
    pub fn named_master_port(&self) -> Option<u16> {
        let out = self.sentinels[0].cli(&["SENTINEL", "get-master-addr-by-name", Self::MASTER_NAME]);
        out.lines().nth(1)?.trim().parse().ok()
    }

    pub fn wait_until(&self, within: Duration, what: &str, done: impl Fn(&RedisSentinels) -> bool) {
        let deadline = Instant::now() + within;
        while !done(self) {
            assert!(Instant::now() < deadline, "waited {within:?} for: {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Three masters, no replicas, slots spread by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                let port = free_port(true);
                RedisServer::start_with(port, &cluster_args(dir.path(), port))
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addresses.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let out = Command::new(cli_binary()).args(&args).output().expect("redis-cli --cluster create");
        assert!(out.status.success(), "cluster create failed: {}", String::from_utf8_lossy(&out.stdout));
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "cluster did not become ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes, _dir: dir }
    }

    pub fn shared() -> &'static RedisCluster {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(RedisCluster::start)
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}

fn cluster_args(dir: &Path, port: u16) -> Vec<String> {
    vec![
        "--cluster-enabled".into(),
        "yes".into(),
        "--cluster-config-file".into(),
        dir.join(format!("nodes-{port}.conf")).display().to_string(),
        "--dir".into(),
        dir.display().to_string(),
        "--cluster-node-timeout".into(),
        "2000".into(),
    ]
}

/// The least-privilege ACL rule docs/redis.md gives (what follows the password in its `ACL
/// SETUSER sluice on …` command), one argument per item, quotes removed.
pub fn documented_acl_rule() -> Vec<String> {
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"))
        .expect("read docs/redis.md");
    let start = page.find("ACL SETUSER sluice on ").expect("docs/redis.md gives `ACL SETUSER sluice on …`");
    let mut command = String::new();
    for line in page[start..].lines() {
        let line = line.trim();
        match line.strip_suffix('\\') {
            Some(continued) => command.push_str(continued),
            None => {
                command.push_str(line);
                break;
            }
        }
        command.push(' ');
    }
    command
        .split_whitespace()
        .skip(6) // ACL SETUSER sluice on ">$(cat redis-password)"
        .map(|item| item.trim_matches('\'').to_string())
        .collect()
}
