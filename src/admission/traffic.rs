//! How traffic meant for the application reaches the injected sidecar instead, as pure functions
//! of the pod: the redirect mode, the application ports the sidecar guards, the probes it serves
//! on the application's behalf, the init container of the `iptables` mode and the ports the
//! generated NetworkPolicy leaves open. [`super::inject`] turns the [`Plan`] into the patch.
//!
//! - `service` (no privilege): the sidecar takes over the name of the application's port (the
//!   application's port loses its name, the sidecar's listener gets it), so a Service's
//!   `targetPort: http` reaches the sidecar; a numeric `targetPort` still reaches the application
//!   and the operator reports it (`crate::operator::exposure`).
//! - `iptables`: an init container with NET_ADMIN and NET_RAW only redirects inbound TCP to the
//!   application's ports to the sidecar (`sluice redirect`); the sidecar forwards to the port the
//!   client dialled (its original destination). Its own loopback connections are not redirected.
//!
//! In both modes the application's HTTP and TCP probes are rewritten to the sidecar's admin port
//! (`/app-health/<container>/<kind>`), which runs them against the application unlimited, the way
//! Istio rewrites probes to its agent: a probe is never rate limited, redirected or blocked by the
//! NetworkPolicy, and a pod never fails its probes because it was injected.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, HTTPGetAction, Pod, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};

use crate::sidecar::probes::{APP_HEALTH_PREFIX, AppProbe, HttpProbe};

/// `service` or `iptables`: how this pod's inbound traffic reaches the sidecar.
pub const REDIRECT_ANNOTATION: &str = "sluice.dev/redirect";
/// `iptables` mode: the ports redirected to the sidecar (comma-separated); default: every TCP port
/// the application's containers declare, and the upstream port.
pub const INBOUND_PORTS_ANNOTATION: &str = "sluice.dev/inbound-ports";
/// Ports left to the application, unguarded: never redirected, and open in the NetworkPolicy.
pub const EXCLUDE_INBOUND_PORTS_ANNOTATION: &str = "sluice.dev/exclude-inbound-ports";
/// `iptables` mode: `auto` (nft, else legacy), `nft` or `legacy`.
pub const IPTABLES_ANNOTATION: &str = "sluice.dev/iptables";
/// `"false"`: this pod is left out of the generated NetworkPolicy.
pub const NETWORK_POLICY_ANNOTATION: &str = "sluice.dev/network-policy";
/// Stamped by the webhook: the application ports only the sidecar may front (`service` mode), which
/// a Service must not target by number.
pub const GUARDED_PORTS_ANNOTATION: &str = "sluice.dev/guarded-ports";
/// Stamped by the webhook: the ports the pod admits ingress on (dot-separated, e.g.
/// `15080.15081`); the operator's NetworkPolicy for the pod selects this label.
pub const INGRESS_PORTS_LABEL: &str = "sluice.dev/ingress-ports";
pub const INIT_CONTAINER_NAME: &str = "sluice-init";
/// The init container's writable directory for iptables-legacy's lock (its root is read-only).
pub const XTABLES_DIR: &str = "/run/xtables";
pub const XTABLES_VOLUME: &str = "sluice-xtables";
/// Longest label value Kubernetes accepts.
const MAX_LABEL_VALUE: usize = 63;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedirectMode {
    /// No privilege: Services reach the sidecar by the port name it takes over from the app.
    #[default]
    Service,
    /// An init container (NET_ADMIN, NET_RAW) redirects inbound TCP to the app's ports.
    Iptables,
}

impl RedirectMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RedirectMode::Service => "service",
            RedirectMode::Iptables => "iptables",
        }
    }

    fn parse(text: &str) -> Option<RedirectMode> {
        match text.trim() {
            "service" => Some(RedirectMode::Service),
            "iptables" => Some(RedirectMode::Iptables),
            _ => None,
        }
    }
}

/// What the webhook was configured with (operator flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrafficDefaults {
    pub redirect: RedirectMode,
    /// Label pods for the operator's NetworkPolicy.
    pub network_policy: bool,
}

impl Default for TrafficDefaults {
    fn default() -> Self {
        TrafficDefaults { redirect: RedirectMode::Service, network_policy: true }
    }
}

/// One app container's probe, rewritten to the sidecar's admin port.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeRewrite {
    pub container_index: usize,
    /// `livenessProbe`, `readinessProbe` or `startupProbe` (the field name).
    pub field: &'static str,
    pub probe: Probe,
}

/// How this pod's traffic reaches the sidecar.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub mode: RedirectMode,
    /// The name the sidecar's listen port takes (from the application's port, which loses it).
    pub listen_port_name: String,
    /// (container index, port index) of the application port whose name the sidecar took.
    pub renamed_port: Option<(usize, usize)>,
    /// Application ports only the sidecar may front (`service` mode); empty in `iptables` mode.
    pub guarded_ports: Vec<u16>,
    /// `iptables` mode: the ports redirected to the sidecar.
    pub redirected_ports: Vec<u16>,
    /// `iptables` mode: `auto`, `nft` or `legacy`.
    pub iptables: String,
    /// The ports the NetworkPolicy admits ingress on; None: no NetworkPolicy for this pod.
    pub ingress_ports: Option<Vec<u16>>,
    pub probes: Vec<ProbeRewrite>,
    /// Path on the admin port → what the sidecar runs (its `SLUICE_APP_PROBES`).
    pub app_probes: BTreeMap<String, AppProbe>,
}

impl Plan {
    /// The [`INGRESS_PORTS_LABEL`] value.
    pub fn ingress_label(&self) -> Option<String> {
        self.ingress_ports.as_ref().map(|ports| join_ports(ports, "."))
    }
}

pub fn join_ports(ports: &[u16], separator: &str) -> String {
    ports.iter().map(u16::to_string).collect::<Vec<_>>().join(separator)
}

/// Ports as the annotations and labels write them (`8080,9090`, or `15080.15081`).
pub fn parse_ports(text: &str) -> Result<Vec<u16>, String> {
    let mut ports = BTreeSet::new();
    for part in text.split([',', '.']).map(str::trim).filter(|p| !p.is_empty()) {
        match part.parse::<u16>() {
            Ok(port) if port != 0 => {
                ports.insert(port);
            }
            _ => return Err(format!("{part:?} is not a port (1-65535)")),
        }
    }
    Ok(ports.into_iter().collect())
}

fn annotation<'a>(pod: &'a Pod, name: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(name)).map(String::as_str)
}

fn ports_annotation(pod: &Pod, name: &str, warnings: &mut Vec<String>) -> Option<Vec<u16>> {
    let text = annotation(pod, name)?;
    match parse_ports(text) {
        Ok(ports) => Some(ports),
        Err(error) => {
            warnings.push(format!("{name}: {error}; ignored"));
            None
        }
    }
}

/// The application's containers: the pod's, as admitted (a pod that already has the sidecar is
/// never planned for: `super::inject::patch` only stamps it).
fn app_containers(pod: &Pod) -> impl Iterator<Item = (usize, &Container)> {
    pod.spec.iter().flat_map(|s| s.containers.iter().enumerate())
}

fn is_tcp(protocol: &Option<String>) -> bool {
    protocol.as_deref().is_none_or(|p| p == "TCP")
}

/// The port a probe's `port` means in `container` (a name resolves against its own ports).
fn resolve_port(container: &Container, port: &IntOrString) -> Option<u16> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok().filter(|p| *p != 0),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

const PROBE_KINDS: [(&str, &str); 3] =
    [("livenessProbe", "livez"), ("readinessProbe", "readyz"), ("startupProbe", "startupz")];

fn probe_of<'a>(container: &'a Container, field: &str) -> Option<&'a Probe> {
    match field {
        "livenessProbe" => container.liveness_probe.as_ref(),
        "readinessProbe" => container.readiness_probe.as_ref(),
        _ => container.startup_probe.as_ref(),
    }
}

/// The application's HTTP and TCP probes, moved to the sidecar's admin port. Probes with a `host`
/// (they do not target the pod), exec and gRPC probes are left alone; a gRPC probe on a
/// redirected port is warned about.
fn rewrite_probes(
    pod: &Pod,
    admin: u16,
    redirected: &[u16],
    warnings: &mut Vec<String>,
) -> (Vec<ProbeRewrite>, BTreeMap<String, AppProbe>) {
    let mut rewrites = Vec::new();
    let mut app_probes = BTreeMap::new();
    for (index, container) in app_containers(pod) {
        for (field, kind) in PROBE_KINDS {
            let Some(probe) = probe_of(container, field) else { continue };
            let timeout_seconds =
                probe.timeout_seconds.and_then(|t| u32::try_from(t).ok()).filter(|t| *t > 0).unwrap_or(1);
            let target = if let Some(get) =
                probe.http_get.as_ref().filter(|g| g.host.as_deref().is_none_or(str::is_empty))
            {
                resolve_port(container, &get.port).map(|port| AppProbe {
                    port,
                    http: Some(HttpProbe {
                        path: get.path.clone().filter(|p| !p.is_empty()).unwrap_or_else(|| "/".into()),
                        scheme: get.scheme.clone().unwrap_or_else(|| "HTTP".into()).to_ascii_uppercase(),
                        headers: get.http_headers.iter().flatten().map(|h| (h.name.clone(), h.value.clone())).collect(),
                    }),
                    timeout_seconds,
                })
            } else if let Some(tcp) = probe.tcp_socket.as_ref().filter(|t| t.host.as_deref().is_none_or(str::is_empty))
            {
                resolve_port(container, &tcp.port).map(|port| AppProbe { port, http: None, timeout_seconds })
            } else {
                if let Some(grpc) = &probe.grpc
                    && u16::try_from(grpc.port).is_ok_and(|p| redirected.contains(&p))
                {
                    warnings.push(format!(
                        "container {}: its gRPC {field} on port {} goes through the sidecar, which proxies HTTP/1.1 to the application; add the port to {EXCLUDE_INBOUND_PORTS_ANNOTATION}",
                        container.name, grpc.port
                    ));
                }
                None
            };
            let Some(target) = target else { continue };
            let path = format!("{APP_HEALTH_PREFIX}{}/{kind}", container.name);
            let rewritten = Probe {
                http_get: Some(HTTPGetAction {
                    path: Some(path.clone()),
                    port: IntOrString::Int(i32::from(admin)),
                    scheme: Some("HTTP".into()),
                    ..Default::default()
                }),
                tcp_socket: None,
                // The sidecar's own deadline is the probe's; the kubelet's must allow for the hop.
                timeout_seconds: Some(i32::try_from(target.timeout_seconds).unwrap_or(1).saturating_add(1)),
                ..probe.clone()
            };
            rewrites.push(ProbeRewrite { container_index: index, field, probe: rewritten });
            app_probes.insert(path, target);
        }
    }
    (rewrites, app_probes)
}

/// The plan for `pod`, whose sidecar listens on `listen`, forwards to `upstream` and serves its
/// admin port on `admin`; `warnings` get what was ignored or cannot be kept.
pub fn plan(
    pod: &Pod,
    defaults: TrafficDefaults,
    (listen, upstream, admin): (u16, u16, u16),
    warnings: &mut Vec<String>,
) -> Plan {
    let mode = match annotation(pod, REDIRECT_ANNOTATION) {
        None => defaults.redirect,
        Some(text) => RedirectMode::parse(text).unwrap_or_else(|| {
            warnings.push(format!(
                "{REDIRECT_ANNOTATION}: {text:?} is not service or iptables; using {}",
                defaults.redirect.as_str()
            ));
            defaults.redirect
        }),
    };
    let excluded = ports_annotation(pod, EXCLUDE_INBOUND_PORTS_ANNOTATION, warnings).unwrap_or_default();
    let own = [listen, admin];

    // The application port the sidecar fronts, and its name.
    let upstream_port = app_containers(pod).find_map(|(ci, c)| {
        c.ports
            .iter()
            .flatten()
            .enumerate()
            .find(|(_, p)| p.container_port == i32::from(upstream) && is_tcp(&p.protocol))
            .map(|(pi, p)| (ci, pi, p.name.clone()))
    });
    let (mut listen_port_name, mut renamed_port) = ("sluice-http".to_string(), None);
    if mode == RedirectMode::Service
        && let Some((ci, pi, Some(name))) = &upstream_port
    {
        listen_port_name = name.clone();
        renamed_port = Some((*ci, *pi));
    }

    let mut redirected_ports = Vec::new();
    let mut guarded_ports = Vec::new();
    match mode {
        RedirectMode::Service => {
            if !excluded.contains(&upstream) {
                guarded_ports.push(upstream);
            }
        }
        RedirectMode::Iptables => {
            let declared = || {
                let mut ports: BTreeSet<u16> = app_containers(pod)
                    .flat_map(|(_, c)| c.ports.iter().flatten())
                    .filter(|p| is_tcp(&p.protocol))
                    .filter_map(|p| u16::try_from(p.container_port).ok())
                    .collect();
                ports.insert(upstream);
                ports.into_iter().collect::<Vec<_>>()
            };
            let wanted = ports_annotation(pod, INBOUND_PORTS_ANNOTATION, warnings).unwrap_or_else(declared);
            for port in wanted {
                if own.contains(&port) {
                    warnings.push(format!(
                        "port {port} is one of the sidecar's own ports: it is not redirected (set {INBOUND_PORTS_ANNOTATION})"
                    ));
                } else if !excluded.contains(&port) {
                    redirected_ports.push(port);
                }
            }
            if redirected_ports.is_empty() {
                warnings.push(format!(
                    "{REDIRECT_ANNOTATION}: iptables with no port to redirect: nothing reaches the sidecar but what dials it"
                ));
            }
        }
    }

    let network_policy =
        defaults.network_policy && annotation(pod, NETWORK_POLICY_ANNOTATION).is_none_or(|v| v.trim() != "false");
    let ingress_ports = network_policy
        .then(|| {
            let mut open: BTreeSet<u16> = own.into_iter().chain(excluded.iter().copied()).collect();
            // Redirected ports are rewritten inside the pod, after the NetworkPolicy saw them.
            open.extend(redirected_ports.iter().copied());
            let open: Vec<u16> = open.into_iter().collect();
            if join_ports(&open, ".").len() > MAX_LABEL_VALUE {
                warnings.push(format!(
                    "too many open ports ({}) for the {INGRESS_PORTS_LABEL} label: no NetworkPolicy for this pod",
                    open.len()
                ));
                None
            } else {
                Some(open)
            }
        })
        .flatten();

    let (probes, app_probes) = rewrite_probes(pod, admin, &redirected_ports, warnings);
    let iptables = match annotation(pod, IPTABLES_ANNOTATION).map(str::trim) {
        None => "auto".to_string(),
        Some(v @ ("auto" | "nft" | "legacy")) => v.to_string(),
        Some(other) => {
            warnings.push(format!("{IPTABLES_ANNOTATION}: {other:?} is not auto, nft or legacy; using auto"));
            "auto".to_string()
        }
    };
    Plan {
        mode,
        listen_port_name,
        renamed_port,
        guarded_ports,
        redirected_ports,
        iptables,
        ingress_ports,
        probes,
        app_probes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value, annotations: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": annotations},
            "spec": spec,
        }))
        .expect("pod")
    }

    fn web(annotations: serde_json::Value) -> Pod {
        pod(
            serde_json::json!({"containers": [{
                "name": "app", "image": "app",
                "ports": [{"name": "http", "containerPort": 8080}, {"name": "metrics", "containerPort": 9090},
                          {"name": "dns", "containerPort": 5353, "protocol": "UDP"}],
                "livenessProbe": {"httpGet": {"path": "/live", "port": "http",
                                  "httpHeaders": [{"name": "X-Probe", "value": "1"}]}, "periodSeconds": 7},
                "readinessProbe": {"tcpSocket": {"port": 9090}, "timeoutSeconds": 3},
                "startupProbe": {"exec": {"command": ["true"]}}
            }]}),
            annotations,
        )
    }

    const PORTS: (u16, u16, u16) = (15080, 8080, 15081);

    #[test]
    fn service_mode_takes_over_the_named_port_and_guards_it() {
        let mut warnings = Vec::new();
        let plan = super::plan(&web(serde_json::json!({})), TrafficDefaults::default(), PORTS, &mut warnings);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(plan.mode, RedirectMode::Service);
        assert_eq!((plan.listen_port_name.as_str(), plan.renamed_port), ("http", Some((0, 0))));
        assert_eq!(plan.guarded_ports, [8080]);
        assert!(plan.redirected_ports.is_empty());
        assert_eq!(plan.ingress_label().as_deref(), Some("15080.15081"), "the app's ports are closed");
    }

    #[test]
    fn an_unnamed_or_undeclared_port_keeps_the_sidecars_own_name() {
        let unnamed = pod(
            serde_json::json!({"containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]}),
            serde_json::json!({}),
        );
        let plan = super::plan(&unnamed, TrafficDefaults::default(), PORTS, &mut Vec::new());
        assert_eq!((plan.listen_port_name.as_str(), plan.renamed_port), ("sluice-http", None));
        assert_eq!(plan.guarded_ports, [8080], "a numeric targetPort 8080 still bypasses it");
    }

    #[test]
    fn iptables_mode_redirects_every_declared_tcp_port() {
        let mut warnings = Vec::new();
        let plan = super::plan(
            &web(serde_json::json!({REDIRECT_ANNOTATION: "iptables"})),
            TrafficDefaults::default(),
            PORTS,
            &mut warnings,
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(plan.redirected_ports, [8080, 9090], "UDP is not redirected");
        assert!(plan.guarded_ports.is_empty() && plan.renamed_port.is_none());
        assert_eq!(plan.listen_port_name, "sluice-http");
        assert_eq!(plan.ingress_label().as_deref(), Some("8080.9090.15080.15081"));
        assert_eq!(plan.iptables, "auto");
    }

    #[test]
    fn declared_and_excluded_port_lists_are_honoured() {
        let mut warnings = Vec::new();
        let annotations = serde_json::json!({
            REDIRECT_ANNOTATION: "iptables", INBOUND_PORTS_ANNOTATION: "8080, 7000,15081",
            EXCLUDE_INBOUND_PORTS_ANNOTATION: "7000,9100", IPTABLES_ANNOTATION: "legacy",
        });
        let plan = super::plan(&web(annotations), TrafficDefaults::default(), PORTS, &mut warnings);
        assert_eq!(plan.redirected_ports, [8080]);
        assert!(warnings.len() == 1 && warnings[0].contains("port 15081 is one of the sidecar's own"), "{warnings:?}");
        assert_eq!(plan.ingress_label().as_deref(), Some("7000.8080.9100.15080.15081"));
        assert_eq!(plan.iptables, "legacy");
    }

    #[test]
    fn the_cluster_default_and_bad_annotations() {
        let defaults = TrafficDefaults { redirect: RedirectMode::Iptables, network_policy: false };
        let mut warnings = Vec::new();
        let plan = super::plan(
            &web(serde_json::json!({REDIRECT_ANNOTATION: "ebpf", IPTABLES_ANNOTATION: "x"})),
            defaults,
            PORTS,
            &mut warnings,
        );
        assert_eq!(plan.mode, RedirectMode::Iptables);
        assert_eq!(plan.ingress_ports, None, "network policies off");
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        let mut warnings = Vec::new();
        let opted_out =
            web(serde_json::json!({NETWORK_POLICY_ANNOTATION: "false", EXCLUDE_INBOUND_PORTS_ANNOTATION: "80x"}));
        let plan = super::plan(&opted_out, TrafficDefaults::default(), PORTS, &mut warnings);
        assert_eq!(plan.ingress_ports, None);
        assert!(warnings.len() == 1 && warnings[0].contains("\"80x\" is not a port"), "{warnings:?}");
    }

    #[test]
    fn http_and_tcp_probes_move_to_the_admin_port() {
        let plan = super::plan(&web(serde_json::json!({})), TrafficDefaults::default(), PORTS, &mut Vec::new());
        let fields: Vec<_> = plan.probes.iter().map(|p| p.field).collect();
        assert_eq!(fields, ["livenessProbe", "readinessProbe"], "exec probes stay");
        let live = &plan.probes[0].probe;
        let get = live.http_get.as_ref().expect("httpGet");
        assert_eq!((get.path.as_deref(), &get.port), (Some("/app-health/app/livez"), &IntOrString::Int(15081)));
        assert_eq!(
            (live.period_seconds, live.timeout_seconds),
            (Some(7), Some(2)),
            "timing kept, one second for the hop"
        );
        let ready = &plan.probes[1].probe;
        assert!(ready.tcp_socket.is_none() && ready.http_get.is_some());
        assert_eq!(
            plan.app_probes["/app-health/app/livez"],
            AppProbe {
                port: 8080,
                http: Some(HttpProbe {
                    path: "/live".into(),
                    scheme: "HTTP".into(),
                    headers: vec![("X-Probe".into(), "1".into())]
                }),
                timeout_seconds: 1,
            },
            "the named port resolved before the sidecar took the name"
        );
        assert_eq!(plan.app_probes["/app-health/app/readyz"], AppProbe { port: 9090, http: None, timeout_seconds: 3 });
    }

    #[test]
    fn too_many_open_ports_drop_the_network_policy_with_a_warning() {
        let many: Vec<String> = (20000..20012).map(|p| p.to_string()).collect();
        let mut warnings = Vec::new();
        let plan = super::plan(
            &web(serde_json::json!({EXCLUDE_INBOUND_PORTS_ANNOTATION: many.join(",")})),
            TrafficDefaults::default(),
            PORTS,
            &mut warnings,
        );
        assert_eq!(plan.ingress_ports, None);
        assert!(warnings.iter().any(|w| w.contains("too many open ports")), "{warnings:?}");
    }
}
