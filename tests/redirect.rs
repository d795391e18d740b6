//! `sluice redirect` in real network namespaces, once per iptables backend (nft, legacy): a
//! client namespace and a pod namespace joined by a veth pair, the rules installed in the pod's
//! (twice: the second run must change nothing), then connections from the client to the app's
//! ports reach the "sidecar" listener with their original destination port, the admin port is
//! not redirected, loopback inside the pod still reaches the app, and without NET_ADMIN the
//! command fails saying so.
//!
//! Needs root (to make network namespaces), `ip` (iproute2), Debian's iptables, python3 (the
//! listeners and the client) and setpriv (util-linux); scripts/test.sh installs them. Not root
//! is a failure, not a skip.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");
const SIDECAR_PORT: u16 = 15080;
const ADMIN_PORT: u16 = 15081;

/// The pod's listeners, both families: 15080 the sidecar (answers `sidecar <original dst port>`,
/// from SO_ORIGINAL_DST), 8080 the app (`app`), 15081 the sidecar's admin port (`admin`).
const SERVERS: &str = r#"
import socket, struct, threading

def serve(family, port, name):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(("::", port))
    else:
        s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        answer = name
        if name == "sidecar":
            try:
                if family == socket.AF_INET6:
                    raw = c.getsockopt(socket.IPPROTO_IPV6, 80, 28)  # IP6T_SO_ORIGINAL_DST
                else:
                    raw = c.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST
                answer = "sidecar %d" % struct.unpack("!H", raw[2:4])[0]
            except OSError as e:
                answer = "sidecar ? (%s)" % e
        try:
            c.sendall(answer.encode())
        finally:
            c.close()

for family in (socket.AF_INET, socket.AF_INET6):
    for port, name in ((15080, "sidecar"), (8080, "app"), (15081, "admin")):
        threading.Thread(target=serve, args=(family, port, name), daemon=True).start()
threading.Event().wait()
"#;

/// Connects, prints what the server sent until it closed.
const CLIENT: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
data = b""
while True:
    chunk = s.recv(256)
    if not chunk:
        break
    data += chunk
print(data.decode(), end="")
"#;

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|line| line.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1)) == Some("0")
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} {args:?}: {e}"))
}

fn text(output: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let output = run("ip", args);
    assert!(output.status.success(), "ip {args:?}: {}", text(&output));
}

/// Two network namespaces joined by a veth pair: `client` 10.231.X.1 and fd31:231:X::1, `pod`
/// 10.231.X.2 and fd31:231:X::2. Deleted when dropped.
struct Namespaces {
    client: String,
    pod: String,
    subnet: u8,
}

impl Namespaces {
    fn new() -> Namespaces {
        let tag: u32 = rand::random();
        let subnet = rand::random_range(1..=254u8);
        let namespaces =
            Namespaces { client: format!("sluice-rt-{tag:08x}-c"), pod: format!("sluice-rt-{tag:08x}-p"), subnet };
        ip(&["netns", "add", &namespaces.client]);
        ip(&["netns", "add", &namespaces.pod]);
        // Created inside the client namespace with its peer in the pod's: no name in the host's.
        ip(&[
            "-n",
            &namespaces.client,
            "link",
            "add",
            "veth0",
            "type",
            "veth",
            "peer",
            "name",
            "veth0",
            "netns",
            &namespaces.pod,
        ]);
        for (namespace, host) in [(&namespaces.client, 1), (&namespaces.pod, 2)] {
            ip(&["-n", namespace, "addr", "add", &format!("10.231.{subnet}.{host}/24"), "dev", "veth0"]);
            ip(&["-n", namespace, "addr", "add", &format!("fd31:231:{subnet}::{host}/64"), "dev", "veth0", "nodad"]);
            ip(&["-n", namespace, "link", "set", "veth0", "up"]);
            ip(&["-n", namespace, "link", "set", "lo", "up"]);
        }
        namespaces
    }

    fn pod_address(&self) -> String {
        format!("10.231.{}.2", self.subnet)
    }

    fn pod_address6(&self) -> String {
        format!("fd31:231:{}::2", self.subnet)
    }

    /// `ip netns exec NAMESPACE ARGS`.
    fn exec(&self, namespace: &str, args: &[&str]) -> Output {
        let mut all = vec!["netns", "exec", namespace];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `sluice redirect` in the pod's namespace, behind `wrapper` (e.g. setpriv and its flags).
    fn redirect(&self, wrapper: &[&str], backend: &str) -> Output {
        let mut args = wrapper.to_vec();
        args.extend_from_slice(&[
            SLUICE,
            "redirect",
            "--to-port",
            "15080",
            "--ports",
            "8080,9090",
            "--iptables",
            backend,
        ]);
        self.exec(&self.pod, &args)
    }

    /// What `host:port` answers, connecting from `namespace`.
    fn connect(&self, namespace: &str, host: &str, port: u16) -> Result<String, String> {
        let output = self.exec(namespace, &["python3", "-c", CLIENT, host, &port.to_string()]);
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(text(&output))
        }
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for namespace in [&self.client, &self.pod] {
            let _ = Command::new("ip").args(["netns", "delete", namespace]).status();
        }
    }
}

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn prerouting_jumps(save: &str) -> usize {
    save.lines().filter(|line| line.starts_with("-A PREROUTING") && line.ends_with("-j SLUICE_INBOUND")).count()
}

fn scenario(backend: &str) {
    assert!(is_root(), "needs root (network namespaces)");
    let net = Namespaces::new();

    // Installed, and the rules printed for `kubectl logs`.
    let first = net.redirect(&[], backend);
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success(), "sluice redirect: {}", text(&first));
    assert!(stdout.contains(&format!("(iptables {backend})")), "{stdout}");
    for rule in [
        "-A PREROUTING -p tcp -j SLUICE_INBOUND",
        "-A SLUICE_INBOUND -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 15080",
        "-A SLUICE_INBOUND -p tcp -m tcp --dport 9090 -j REDIRECT --to-ports 15080",
    ] {
        assert!(stdout.contains(rule), "{rule:?} not printed:\n{stdout}");
    }
    // The veth pair and lo have IPv6 addresses: ip6tables ran too.
    assert!(stdout.contains("IPv6 rules"), "{stdout}");

    // Again (a restarted init container): same rules, one jump per family.
    let second = net.redirect(&[], backend);
    assert!(second.status.success(), "second sluice redirect: {}", text(&second));
    for family in ["iptables", "ip6tables"] {
        let save = net.exec(&net.pod, &[&format!("{family}-{backend}-save"), "-t", "nat"]);
        assert!(save.status.success(), "{family}-{backend}-save: {}", text(&save));
        let save = String::from_utf8_lossy(&save.stdout);
        assert_eq!(prerouting_jumps(&save), 1, "{family}:\n{save}");
        assert_eq!(save.matches("-j REDIRECT --to-ports 15080").count(), 2, "{family}:\n{save}");
    }

    let mut servers = Command::new("ip");
    servers.args(["netns", "exec", &net.pod, "python3", "-c", SERVERS]).stdin(Stdio::null());
    let _servers = Killed(servers.spawn().expect("cannot start the listeners (python3)"));
    // Up once every listener answers over loopback (not redirected), within 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    for (host, port) in [("127.0.0.1", 15080), ("127.0.0.1", 8080), ("127.0.0.1", 15081), ("::1", 15080), ("::1", 8080)]
    {
        while let Err(error) = net.connect(&net.pod, host, port) {
            assert!(Instant::now() < deadline, "listener {host}:{port} not up: {error}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    let pod = net.pod_address();
    let pod6 = net.pod_address6();
    let expectations = [
        (&net.client, pod.as_str(), 8080, "sidecar 8080"),
        (&net.client, pod.as_str(), 9090, "sidecar 9090"),
        (&net.client, pod.as_str(), ADMIN_PORT, "admin"),
        (&net.client, pod.as_str(), SIDECAR_PORT, "sidecar 15080"),
        (&net.client, pod6.as_str(), 8080, "sidecar 8080"),
        (&net.client, pod6.as_str(), 9090, "sidecar 9090"),
        (&net.client, pod6.as_str(), ADMIN_PORT, "admin"),
        // The sidecar's own connection to the app: loopback, through OUTPUT, untouched.
        (&net.pod, "127.0.0.1", 8080, "app"),
        (&net.pod, "::1", 8080, "app"),
    ];
    for (namespace, host, port, expected) in expectations {
        let from = if *namespace == net.client { "client" } else { "pod" };
        let answer = net.connect(namespace, host, port).unwrap_or_else(|e| panic!("{from} -> {host}:{port}: {e}"));
        assert_eq!(answer, expected, "{from} -> {host}:{port} ({backend})");
    }

    // Without NET_ADMIN and NET_RAW (gone from the bounding set, so root's permitted set lacks
    // them too): exit code 1, saying which capability is missing.
    let denied = net.redirect(
        &["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-net_admin,-net_raw", "--"],
        backend,
    );
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert_eq!(denied.status.code(), Some(1), "without NET_ADMIN: {}", text(&denied));
    assert!(stderr.contains("NET_ADMIN"), "without NET_ADMIN: {}", text(&denied));
    assert!(stderr.contains(&format!("iptables-{backend}-save")), "what failed is named: {stderr}");
}

#[test]
fn nft_redirects_inbound_to_the_sidecar() {
    scenario("nft");
}

#[test]
fn legacy_redirects_inbound_to_the_sidecar() {
    scenario("legacy");
}
