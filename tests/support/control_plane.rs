//! The e2e control plane, started once per test binary: `e2e/control-plane.sh` builds (or reuses)
//! etcd and kube-apiserver and starts them on loopback. With `SLUICE_E2E_KUBECONFIG` set, that
//! cluster (kind, say) is used instead; `SLUICE_E2E_OPERATOR_KUBECONFIG` then names the
//! least-privilege credentials (the admin one otherwise).
//!
//! Teardown: the script's watchdog stops the servers once this test process is gone, since Rust
//! runs no destructors for statics.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};

pub struct ControlPlane {
    pub kubeconfig: PathBuf,
    /// The API server's service-account signing key (local control plane only), for tests that
    /// mint tokens the TokenRequest API will not (already expired ones).
    pub service_account_key: Option<PathBuf>,
    /// Credentials of user `sluice-operator`, bound only to deploy/rbac.yaml's roles.
    pub operator_kubeconfig: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

static CONTROL_PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane, or why there is none.
pub fn control_plane() -> Result<&'static ControlPlane, String> {
    CONTROL_PLANE.get_or_init(start).as_ref().map_err(Clone::clone)
}

/// The control plane; the README test command builds it, so its absence fails the test.
pub fn cluster() -> &'static ControlPlane {
    control_plane().unwrap_or_else(|reason| panic!("no control plane: {reason} (scripts/test.sh builds it)"))
}

/// Measurements go straight to stderr: libtest captures print!/eprint! of passing tests, but the
/// numbers belong in every test log.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "e2e measurement: {line}");
}

/// Creates namespace `name` with `labels` (an existing one is fine).
pub async fn namespace(client: &kube::Client, name: &str, labels: serde_json::Value) {
    use k8s_openapi::api::core::v1::Namespace;
    let api: kube::Api<Namespace> = kube::Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": labels}})).expect("ns");
    match api.create(&kube::api::PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
}

fn start() -> Result<ControlPlane, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Ok(path) = std::env::var("SLUICE_E2E_KUBECONFIG") {
        let operator = std::env::var("SLUICE_E2E_OPERATOR_KUBECONFIG").unwrap_or_else(|_| path.clone());
        let cp = ControlPlane {
            kubeconfig: path.into(),
            operator_kubeconfig: operator.into(),
            service_account_key: None,
            _dir: None,
        };
        install(&cp)?;
        return Ok(cp);
    }
    let script = repo().join("e2e/control-plane.sh");
    let started = Instant::now();
    let build =
        Command::new("bash").arg(&script).arg("build").stderr(Stdio::inherit()).output().map_err(|e| e.to_string())?;
    if !build.status.success() {
        return Err(format!("control plane could not be built ({})", build.status));
    }
    eprintln!("control plane binaries ready in {:?}", started.elapsed());
    let dir = tempfile::Builder::new().prefix("sluice-e2e-").tempdir().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .arg("start")
        .arg(dir.path())
        .arg(std::process::id().to_string())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    // A control plane that was built but does not start is a failure, not a skip.
    assert!(out.status.success(), "control plane did not start");
    eprintln!("control plane ready in {:?}", started.elapsed());
    let cp = ControlPlane {
        kubeconfig: dir.path().join("kubeconfig"),
        operator_kubeconfig: dir.path().join("operator.kubeconfig"),
        service_account_key: Some(dir.path().join("pki/sa.key")),
        _dir: Some(dir),
    };
    install(&cp)?;
    Ok(cp)
}

pub fn kubectl_path() -> PathBuf {
    let out = Command::new("bash").arg(repo().join("e2e/control-plane.sh")).arg("bin-dir").output().expect("bin-dir");
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("kubectl");
    if bin.exists() { bin } else { PathBuf::from("kubectl") }
}

impl ControlPlane {
    /// Runs kubectl as admin; panics with its output when it fails.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> String {
        let (ok, out) = self.try_kubectl(args, stdin);
        assert!(ok, "kubectl {args:?} failed: {out}");
        out
    }

    pub fn try_kubectl(&self, args: &[&str], stdin: Option<&str>) -> (bool, String) {
        let mut child = Command::new(kubectl_path())
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl runs");
        if let Some(text) = stdin {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write stdin");
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().expect("kubectl output");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    pub async fn client(&self) -> kube::Client {
        client_for(&self.kubeconfig).await
    }

    /// Kills etcd and the API server and starts them again on the same ports and data (the local
    /// control plane only: a kind cluster's cannot be restarted from here).
    pub fn restart(&self) {
        let dir =
            self._dir.as_ref().expect("restarting the control plane needs the local one, not SLUICE_E2E_KUBECONFIG");
        let out = Command::new("bash")
            .arg(repo().join("e2e/control-plane.sh"))
            .arg("restart")
            .arg(dir.path())
            .stderr(Stdio::inherit())
            .status()
            .expect("control-plane.sh restart");
        assert!(out.success(), "the control plane did not restart");
    }

    /// The API server's address, from the kubeconfig's `server:` (quoted, as this repository's
    /// scripts write it, in block or flow style, or not, as kind writes it).
    pub fn api_server(&self) -> SocketAddr {
        let text = std::fs::read_to_string(&self.kubeconfig).expect("kubeconfig");
        let server = text
            .split("server:")
            .nth(1)
            .map(|rest| rest.trim_start().trim_start_matches('"'))
            .and_then(|rest| rest.strip_prefix("https://"))
            .and_then(|rest| rest.split(['"', ',', '}', '/', ' ', '\n']).next());
        server.and_then(|s| s.parse().ok()).expect("the kubeconfig's server is https://IP:PORT")
    }
}

/// A copy of `kubeconfig` (in `dir`) that reaches the API server through `proxy`: the API
/// server's certificate names 127.0.0.1, so TLS still verifies.
pub fn kubeconfig_via(kubeconfig: &Path, api_server: SocketAddr, proxy: SocketAddr, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let (from, to) = (format!("https://{api_server}"), format!("https://{proxy}"));
    assert!(text.contains(&from), "{} names {api_server}", kubeconfig.display());
    let path = dir.join(kubeconfig.file_name().expect("file name"));
    std::fs::write(&path, text.replace(&from, &to)).expect("write kubeconfig");
    path
}

/// A TCP relay to `upstream` that can be cut (every open connection dropped, new ones closed on
/// accept) and restored: a partition between one client and a server.
pub struct CuttableProxy {
    pub addr: SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
    relays: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl CuttableProxy {
    pub async fn start(upstream: SocketAddr) -> CuttableProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relays: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let (is_cut, tasks) = (cut.clone(), relays.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if is_cut.load(std::sync::atomic::Ordering::SeqCst) {
                    continue;
                }
                let relay = tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                let mut tasks = tasks.lock().expect("relays");
                tasks.retain(|t| !t.is_finished());
                tasks.push(relay);
            }
        });
        CuttableProxy { addr, cut, relays, accept }
    }

    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for relay in self.relays.lock().expect("relays").drain(..) {
            relay.abort();
        }
    }

    pub fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

pub async fn client_for(path: &Path) -> kube::Client {
    let kubeconfig = Kubeconfig::read_from(path).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("config");
    kube::Client::try_from(config).expect("client")
}

/// CRD from crds/, RBAC from deploy/, and the test user bound to exactly those roles.
fn install(cp: &ControlPlane) -> Result<(), String> {
    let crd = repo().join("crds/ratelimitpolicy.yaml");
    cp.kubectl(&["apply", "--server-side", "-f", crd.to_str().unwrap_or_default()], None);
    cp.kubectl(&["wait", "--for=condition=Established", "--timeout=60s", "crd/ratelimitpolicies.sluice.dev"], None);
    let (_, _) = cp.try_kubectl(&["create", "namespace", "sluice-system"], None);
    let rbac = repo().join("deploy/rbac.yaml");
    cp.kubectl(&["apply", "-f", rbac.to_str().unwrap_or_default()], None);
    let bindings = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: sluice-operator-e2e-user}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: sluice-operator}
subjects: [{kind: User, name: sluice-operator, apiGroup: rbac.authorization.k8s.io}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: sluice-operator-e2e-user, namespace: sluice-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: sluice-operator}
subjects: [{kind: User, name: sluice-operator, apiGroup: rbac.authorization.k8s.io}]
"#;
    cp.kubectl(&["apply", "-f", "-"], Some(bindings));
    Ok(())
}

/// A running `sluice operator`, killed on drop.
pub struct Operator {
    pub child: Child,
    pub addr: SocketAddr,
    pub identity: String,
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl Operator {
    pub fn start(kubeconfig: &Path, identity: &str, args: &[&str]) -> Operator {
        let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
        command.arg("operator").args([
            "--listen",
            "127.0.0.1:0",
            "--identity",
            identity,
            "--operator-namespace",
            "sluice-system",
        ]);
        // Tests about policies and leases talk to the check API without credentials; the
        // tests about callers turn verification on themselves.
        if !args.iter().any(|a| a.starts_with("--token-review")) {
            command.arg("--token-review=false");
        }
        let mut child = command
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,sluice=debug")
            .env("SLUICE_LOG_FORMAT", "text")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sluice operator starts");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("check API listening")
                    && let Some(i) = line.find("address=")
                {
                    let _ = tx.send(line[i + 8..].split_whitespace().next().unwrap_or("").to_string());
                }
                sink.lock().expect("logs").push(line);
            }
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => Operator { child, addr: addr.parse().expect("address"), identity: identity.into(), logs },
            Err(_) => {
                let _ = child.kill();
                panic!("operator did not start:\n{}", logs.lock().expect("logs").join("\n"));
            }
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn logs(&self) -> String {
        self.logs.lock().expect("logs").join("\n")
    }

    /// SIGTERM, then the exit status (SIGKILL after 20 s).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().expect("child exits")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `probe` until it yields a value, failing after `timeout` with `what` (and the probe's
/// last note). Waiting on a condition, not a fixed sleep.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(value) => return value,
            Err(note) => note,
        };
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}: {last}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}
