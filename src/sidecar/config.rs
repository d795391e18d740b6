//! The sidecar's command line, and turning it into a checked [`Config`].
//!
//! Every flag also reads an environment variable, and the pod identity (namespace, labels) can
//! come from downward-API files, because that is how the injected container gets them without
//! needing API access.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::{Authority, Uri};

use super::SidecarError;

/// What to decide while the enforcement endpoint is slow or unreachable and no snapshot has
/// been fetched yet (with a cached snapshot, the local fallback decides instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnFailure {
    /// Forward the request (fail open): a dead limiter never takes the application down.
    Allow,
    /// Answer 429 (fail closed).
    Deny,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SidecarArgs {
    /// Address the proxy listens on (what the pod's Service targets).
    #[arg(long, env = "SLUICE_LISTEN", default_value = "0.0.0.0:8000", value_parser = crate::listen::parse_listen_address)]
    pub listen: SocketAddr,
    /// The application, as HOST:PORT (usually 127.0.0.1:<app port>).
    #[arg(long, env = "SLUICE_UPSTREAM")]
    pub upstream: String,
    /// Base URL of the enforcement endpoint (`sluice serve` or the operator), e.g.
    /// https://sluice.sluice-system.svc:8080 (or http:// on loopback).
    #[arg(long, env = "SLUICE_ENDPOINT")]
    pub endpoint: String,
    /// PEM file of the CA that signed an https:// endpoint's certificate; the only CA trusted.
    #[arg(long, env = "SLUICE_ENDPOINT_CA_FILE", conflicts_with = "endpoint_ca_pem")]
    pub endpoint_ca: Option<PathBuf>,
    /// The same CA as PEM text (what the injecting webhook sets).
    #[arg(long, env = "SLUICE_ENDPOINT_CA_PEM", hide_env_values = true)]
    pub endpoint_ca_pem: Option<String>,
    /// The pod's namespace; wins over --namespace-file. With neither: `default`.
    #[arg(long, env = "SLUICE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Downward-API file holding the namespace (a file with just the name).
    #[arg(long, env = "SLUICE_NAMESPACE_FILE")]
    pub namespace_file: Option<PathBuf>,
    /// The pod's labels as k=v[,k=v…]; merged over --labels-file.
    #[arg(long, env = "SLUICE_LABELS")]
    pub labels: Option<String>,
    /// Downward-API labels file (`key="value"` per line).
    #[arg(long, env = "SLUICE_LABELS_FILE")]
    pub labels_file: Option<PathBuf>,
    /// Decision while the endpoint is unreachable and no snapshot is cached.
    #[arg(long, env = "SLUICE_ON_ENDPOINT_FAILURE", value_enum, default_value = "allow")]
    pub on_endpoint_failure: OnFailure,
    /// How long one check may take before the failure mode decides.
    #[arg(long, env = "SLUICE_ENDPOINT_TIMEOUT", default_value = "100ms", value_parser = crate::duration::parse_positive_std_duration)]
    pub endpoint_timeout: Duration,
    /// Address of /healthz, /readyz and /metrics (the injecting webhook sets it: port 15081 or
    /// the pod's `sluice.dev/admin-port`).
    #[arg(long, env = "SLUICE_ADMIN_LISTEN", default_value = "0.0.0.0:9091", value_parser = crate::listen::parse_listen_address)]
    pub admin_listen: SocketAddr,
    /// Reverse proxies in front of the sidecar whose X-Forwarded-For entries are trusted.
    #[arg(long, env = "SLUICE_TRUSTED_HOPS", default_value_t = 0)]
    pub trusted_hops: usize,
    /// The endpoint holds each snapshot request until the snapshot changes (then answers at once),
    /// so changes arrive without polling; this is the pause after a failed request, and the
    /// polling interval for an endpoint that answers at once (an older release).
    #[arg(long, env = "SLUICE_SNAPSHOT_INTERVAL", default_value = "1s", value_parser = crate::duration::parse_positive_std_duration)]
    pub snapshot_interval: Duration,
    /// File holding the bearer token presented to the endpoint (the injected pod's projected
    /// ServiceAccount token, or a static token of `sluice serve --tokens`); re-read as it
    /// rotates.
    #[arg(long, env = "SLUICE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Check exchanges with the endpoint in flight at once. Requests that arrive while all are
    /// busy wait for the next free one and share it (`POST /v1/checks`): under load, one
    /// exchange decides many requests. 0 sends every check on its own (`POST /v1/check`).
    #[arg(long, env = "SLUICE_ENDPOINT_BATCHES", default_value_t = 2)]
    pub endpoint_batches: usize,
    /// The application's probes, served on the admin port at /app-health/<container>/<kind> and
    /// run against the application unlimited (JSON; the injecting webhook writes it when it moves
    /// the application's probes to the sidecar).
    #[arg(long, env = "SLUICE_APP_PROBES")]
    pub app_probes: Option<String>,
    /// Ports whose inbound connections are redirected to the sidecar (the `iptables` redirect
    /// mode): a connection whose original destination is one of them is forwarded to that port of
    /// the upstream host instead of the --upstream port.
    #[arg(long, env = "SLUICE_INBOUND_PORTS", value_delimiter = ',')]
    pub inbound_ports: Vec<u16>,
    /// Where the container's cgroup is mounted, read for CPU and memory pressure when a policy's
    /// `overload` watches them (cgroup v2, or v1's per-controller directories under it).
    #[arg(long, env = "SLUICE_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Bytes of responses the sidecar keeps for `staleIfLimited` reads (least recently used out
    /// first); 0 keeps none.
    #[arg(long, env = "SLUICE_STALE_CACHE_BYTES", default_value_t = super::proxy::DEFAULT_STALE_CACHE_BYTES)]
    pub stale_cache_bytes: usize,
    /// Header-read timeout and connection cap of the proxy and admin listeners.
    #[command(flatten)]
    pub listen_limits: crate::listen::ListenArgs,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub cgroup_root: PathBuf,
    pub stale_cache_bytes: usize,
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub upstream: Authority,
    /// `…/v1/check`, `…/v1/checks` and `…/v1/snapshot` on the endpoint.
    pub check_uri: Uri,
    pub checks_uri: Uri,
    pub settle_uri: Uri,
    /// `POST /v1/cancel`: an egress request's slot given back when its caller left.
    pub cancel_uri: Uri,
    /// `POST /v1/deferred`, `…/claim`, `…/done`, `…/status`: `deferIfLimited` writes.
    pub deferred_uris: [Uri; 4],
    /// `POST /v1/leases`: slices of hot keys' quota for `consistency: leased` rules.
    pub leases_uri: Uri,
    pub snapshot_uri: Uri,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    pub on_failure: OnFailure,
    pub endpoint_timeout: Duration,
    pub trusted_hops: usize,
    pub snapshot_interval: Duration,
    pub token_file: Option<PathBuf>,
    /// The CA certificates (PEM) an https endpoint must be signed by.
    pub endpoint_ca: Option<Vec<u8>>,
    /// 0: no batches.
    pub endpoint_batches: usize,
    pub app_probes: BTreeMap<String, super::probes::AppProbe>,
    pub inbound_ports: Vec<u16>,
    pub listen_limits: crate::listen::ConnectionLimits,
}

impl Config {
    pub fn from_args(args: SidecarArgs) -> Result<Config, SidecarError> {
        let bad = |what: String| SidecarError::Config(what);
        let upstream_text = args.upstream.strip_prefix("http://").unwrap_or(&args.upstream).trim_end_matches('/');
        let upstream: Authority =
            upstream_text.parse().map_err(|_| bad(format!("--upstream: {:?} is not HOST:PORT", args.upstream)))?;
        if upstream.port_u16().is_none() {
            return Err(bad(format!("--upstream: {:?} has no port", args.upstream)));
        }

        let base = args.endpoint.trim_end_matches('/');
        let endpoint: Uri = base.parse().map_err(|_| bad(format!("--endpoint: {:?} is not a URL", args.endpoint)))?;
        let endpoint_ca = match (&args.endpoint_ca, &args.endpoint_ca_pem) {
            (Some(path), _) => Some(read_file(path, "--endpoint-ca")?.into_bytes()),
            (None, Some(pem)) => Some(pem.clone().into_bytes()),
            (None, None) => None,
        };
        match (endpoint.scheme_str(), &endpoint_ca, endpoint.authority()) {
            (Some("http"), Some(_), Some(_)) => tracing::warn!(
                endpoint = %args.endpoint,
                "--endpoint is http://, so the CA given (--endpoint-ca, SLUICE_ENDPOINT_CA_PEM) is not used: nothing verifies the endpoint and its token travels in clear; if the endpoint serves HTTPS, write https://"
            ),
            (Some("http"), None, Some(_)) => {}
            (Some("https"), Some(_), Some(_)) => {}
            (Some("https"), None, Some(_)) => {
                return Err(bad(format!(
                    "--endpoint: {:?} is https: give the CA that signed its certificate (--endpoint-ca)",
                    args.endpoint
                )));
            }
            _ => {
                return Err(bad(format!("--endpoint: {:?} must be an http(s)://HOST[:PORT] URL", args.endpoint)));
            }
        }
        let endpoint_uri = |path: &str| -> Result<Uri, SidecarError> {
            format!("{base}{path}").parse().map_err(|_| bad(format!("--endpoint: cannot append {path} to {base:?}")))
        };

        let namespace = match (args.namespace, &args.namespace_file) {
            (Some(ns), _) => ns,
            (None, Some(path)) => read_file(path, "--namespace-file")?.trim().to_string(),
            (None, None) => crate::policy::DEFAULT_NAMESPACE.to_string(),
        };
        if namespace.is_empty() {
            return Err(bad("namespace: empty".into()));
        }

        let mut labels = BTreeMap::new();
        if let Some(path) = &args.labels_file {
            labels = parse_downward_labels(&read_file(path, "--labels-file")?)
                .map_err(|e| bad(format!("--labels-file {}: {e}", path.display())))?;
        }
        if let Some(list) = &args.labels {
            labels.extend(crate::request::labels::parse_label_list(list).map_err(|e| bad(format!("--labels: {e}")))?);
        }

        Ok(Config {
            listen: args.listen,
            admin_listen: args.admin_listen,
            cgroup_root: args.cgroup_root.clone(),
            stale_cache_bytes: args.stale_cache_bytes,
            upstream,
            check_uri: endpoint_uri("/v1/check")?,
            checks_uri: endpoint_uri("/v1/checks")?,
            settle_uri: endpoint_uri("/v1/settle")?,
            cancel_uri: endpoint_uri("/v1/cancel")?,
            deferred_uris: [
                endpoint_uri("/v1/deferred")?,
                endpoint_uri("/v1/deferred/claim")?,
                endpoint_uri("/v1/deferred/done")?,
                endpoint_uri("/v1/deferred/status")?,
            ],
            leases_uri: endpoint_uri("/v1/leases")?,
            snapshot_uri: endpoint_uri("/v1/snapshot")?,
            namespace,
            labels,
            on_failure: args.on_endpoint_failure,
            endpoint_timeout: args.endpoint_timeout,
            trusted_hops: args.trusted_hops,
            snapshot_interval: args.snapshot_interval,
            token_file: args.token_file,
            endpoint_ca,
            endpoint_batches: args.endpoint_batches,
            app_probes: match &args.app_probes {
                Some(json) => super::probes::parse(json).map_err(bad)?,
                None => BTreeMap::new(),
            },
            inbound_ports: args.inbound_ports,
            listen_limits: args.listen_limits.limits(),
        })
    }
}

fn read_file(path: &Path, flag: &str) -> Result<String, SidecarError> {
    std::fs::read_to_string(path).map_err(|e| SidecarError::Config(format!("{flag} {}: {e}", path.display())))
}

/// The downward API's labels file: one `key="value"` per line, the value quoted the way Go's
/// `strconv.Quote` does (so `\"`, `\\` and `\n`-style escapes may appear).
pub fn parse_downward_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (k, v) = line.split_once('=').ok_or_else(|| format!("line {}: expected key=\"value\"", n + 1))?;
        let v = v.trim();
        let value = if v.starts_with('"') {
            unquote(v).ok_or_else(|| format!("line {}: badly quoted value {v}", n + 1))?
        } else {
            v.to_string()
        };
        labels.insert(k.trim().to_string(), value);
    }
    Ok(labels)
}

fn unquote(quoted: &str) -> Option<String> {
    let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next()? {
            '"' => out.push('"'),
            '\\' => out.push('\\'),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            other => {
                // Label values are restricted to [A-Za-z0-9._-]; other escapes cannot occur in
                // practice, so keep them verbatim rather than failing the pod.
                out.push('\\');
                out.push(other);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downward_api_labels_file() {
        let text = "app=\"orders\"\npod-template-hash=\"7d9f\"\nnote=\"say \\\"hi\\\"\"\n\n";
        let l = parse_downward_labels(text).unwrap();
        assert_eq!(l.len(), 3);
        assert_eq!(l["app"], "orders");
        assert_eq!(l["pod-template-hash"], "7d9f");
        assert_eq!(l["note"], "say \"hi\"");
        assert!(parse_downward_labels("app=\"unterminated\n").is_err());
        assert!(parse_downward_labels("no equals\n").is_err());
    }

    fn args(upstream: &str, endpoint: &str) -> SidecarArgs {
        SidecarArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstream: upstream.into(),
            endpoint: endpoint.into(),
            namespace: None,
            namespace_file: None,
            labels: Some("app=orders".into()),
            labels_file: None,
            on_endpoint_failure: OnFailure::Allow,
            endpoint_timeout: Duration::from_millis(100),
            admin_listen: "127.0.0.1:0".parse().unwrap(),
            trusted_hops: 0,
            snapshot_interval: Duration::from_secs(1),
            token_file: None,
            endpoint_ca: None,
            endpoint_ca_pem: None,
            endpoint_batches: 4,
            app_probes: None,
            inbound_ports: Vec::new(),
            cgroup_root: "/sys/fs/cgroup".into(),
            stale_cache_bytes: 0,
            listen_limits: crate::listen::ListenArgs {
                header_read_timeout: Duration::from_secs(10),
                max_connections: None,
            },
        }
    }

    #[test]
    fn config_checks_addresses() {
        let c = Config::from_args(args("127.0.0.1:3000", "http://sluice:8080/")).unwrap();
        assert_eq!(c.upstream.as_str(), "127.0.0.1:3000");
        assert_eq!(c.check_uri.to_string(), "http://sluice:8080/v1/check");
        assert_eq!(c.checks_uri.to_string(), "http://sluice:8080/v1/checks");
        assert_eq!(c.snapshot_uri.to_string(), "http://sluice:8080/v1/snapshot");
        assert_eq!(c.namespace, "default");
        assert!(Config::from_args(args("127.0.0.1", "http://sluice:8080")).is_err(), "port required");
        assert!(Config::from_args(args("127.0.0.1:3000", "https://sluice:8080")).is_err(), "https needs its CA");
        let mut with_ca = args("127.0.0.1:3000", "https://sluice:8080");
        with_ca.endpoint_ca_pem = Some("-----BEGIN CERTIFICATE-----".into());
        assert!(Config::from_args(with_ca).is_ok());
        assert!(Config::from_args(args("127.0.0.1:3000", "sluice:8080")).is_err());
    }

    #[test]
    fn namespace_and_labels_from_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("namespace"), "tenant-acme\n").unwrap();
        std::fs::write(dir.path().join("labels"), "app=\"web\"\ntier=\"front\"\n").unwrap();
        let mut a = args("127.0.0.1:3000", "http://sluice:8080");
        a.namespace_file = Some(dir.path().join("namespace"));
        a.labels_file = Some(dir.path().join("labels"));
        let c = Config::from_args(a).unwrap();
        assert_eq!(c.namespace, "tenant-acme");
        assert_eq!(c.labels["app"], "orders", "--labels wins over the file");
        assert_eq!(c.labels["tier"], "front");
    }
}
