//! Sidecar injection for pods labelled `sluice.dev/inject: "true"`, as a pure function from the
//! pod to a JSON patch and the admission warnings about the pod's annotations.
//!
//! The injected container passes Pod Security `restricted` (non-root, no privilege escalation,
//! no capabilities, RuntimeDefault seccomp, read-only root), has requests and limits (operator
//! defaults, per-pod annotations), and liveness and readiness probes on its admin port. It goes
//! into `spec.initContainers` with `restartPolicy: Always` (a native sidecar, with a startup probe
//! the kubelet waits for before the next init container) or into `spec.containers` (classic), per
//! [`super::sidecar_kind`]. Every
//! injected pod is stamped [`INJECTED_ANNOTATION`], which is how the operator tells a labelled
//! pod that slipped past the webhook (see `crate::operator::injection`).

use std::collections::BTreeMap;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector, Pod, Probe, ProjectedVolumeSource, ResourceRequirements,
    SeccompProfile, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::sidecar_kind::{SIDECAR_KIND_ANNOTATION, SidecarKind};
use super::traffic::{self, Plan, RedirectMode, TrafficDefaults};

pub const INJECT_LABEL: &str = "sluice.dev/inject";
/// Stamped on every pod the webhook injected (or found already carrying the sidecar): the image
/// of its sidecar. A labelled pod without it was created while the webhook was not called.
pub const INJECTED_ANNOTATION: &str = "sluice.dev/injected";
pub const LISTEN_PORT_ANNOTATION: &str = "sluice.dev/listen-port";
pub const UPSTREAM_PORT_ANNOTATION: &str = "sluice.dev/upstream-port";
pub const ADMIN_PORT_ANNOTATION: &str = "sluice.dev/admin-port";
pub const CPU_REQUEST_ANNOTATION: &str = "sluice.dev/sidecar-cpu-request";
pub const CPU_LIMIT_ANNOTATION: &str = "sluice.dev/sidecar-cpu-limit";
pub const MEMORY_REQUEST_ANNOTATION: &str = "sluice.dev/sidecar-memory-request";
pub const MEMORY_LIMIT_ANNOTATION: &str = "sluice.dev/sidecar-memory-limit";
pub const CONTAINER_NAME: &str = "sluice-sidecar";
pub const PODINFO_VOLUME: &str = "sluice-podinfo";
/// Where the sidecar reads its pod's labels (downward API file, updated when labels change).
pub const PODINFO_PATH: &str = "/etc/sluice/podinfo";
pub const TOKEN_VOLUME: &str = "sluice-token";
/// Where the sidecar reads its projected ServiceAccount token (rotated by the kubelet).
pub const TOKEN_DIR: &str = "/var/run/secrets/sluice";
/// Lifetime asked for the projected token; the kubelet renews it at 80% of that.
pub const TOKEN_LIFETIME_SECONDS: i64 = 3600;
/// The sidecar's user and group: the image's (distroless `nonroot`).
pub const RUN_AS: i64 = 65532;
/// A native sidecar's startup probe, every second: failures before the kubelet restarts it.
pub const NATIVE_STARTUP_FAILURES: i32 = 60;

/// The sidecar's requests and limits; None leaves one unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_request: Option<String>,
    pub cpu_limit: Option<String>,
    pub memory_request: Option<String>,
    pub memory_limit: Option<String>,
}

impl Resources {
    /// The operator's defaults must make a valid container by themselves.
    pub fn check(&self) -> Result<(), String> {
        for (what, request, limit) in
            [("cpu", &self.cpu_request, &self.cpu_limit), ("memory", &self.memory_request, &self.memory_limit)]
        {
            for value in [request, limit].into_iter().flatten() {
                if quantity_nanos(value).is_none() {
                    return Err(format!("sidecar {what}: {value:?} is not a quantity"));
                }
            }
            if let (Some(r), Some(l)) = (request, limit)
                && quantity_nanos(r) > quantity_nanos(l)
            {
                return Err(format!("sidecar {what} request {r} is above its limit {l}"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct InjectConfig {
    pub image: String,
    pub endpoint: String,
    pub listen_port: u16,
    pub upstream_port: u16,
    /// The sidecar's `/healthz`, `/readyz` and `/metrics` (probes).
    pub admin_port: u16,
    pub resources: Resources,
    /// Never injected: the operator must not depend on itself to start.
    pub operator_namespace: String,
    /// With the endpoint verifying ServiceAccount tokens: the audience of the projected token the
    /// sidecar presents.
    pub token_audience: Option<String>,
    /// With the check API on TLS: the CA the sidecar verifies the endpoint against (PEM).
    pub endpoint_ca_pem: Option<String>,
    /// How traffic reaches the sidecar unless the pod's annotations say otherwise.
    pub traffic: TrafficDefaults,
    /// Native or classic unless the pod's [`SIDECAR_KIND_ANNOTATION`] says otherwise (the
    /// operator's `--sidecar-kind`, resolved at start).
    pub sidecar_kind: SidecarKind,
}

/// What the webhook does with one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodOutcome {
    /// Not labelled, in the operator's namespace, or already injected and stamped.
    Skipped,
    /// It already had the sidecar (written by hand, or admitted twice): only stamped.
    Annotated,
    Injected,
}

impl PodOutcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PodOutcome::Skipped => "skipped",
            PodOutcome::Annotated => "annotated",
            PodOutcome::Injected => "injected",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Injection {
    pub outcome: PodOutcome,
    pub patch: Option<Patch>,
    /// Annotations that were ignored for the defaults, and port clashes, for the user (admission
    /// warnings; `kubectl` prints them).
    pub warnings: Vec<String>,
}

impl Injection {
    fn skipped() -> Injection {
        Injection { outcome: PodOutcome::Skipped, patch: None, warnings: Vec::new() }
    }
}

/// A Kubernetes quantity (`100m`, `64Mi`, `1.5`, `2e3`) in billionths of a unit (rounded up, as
/// the API server rounds to nano precision), or None when `text` is not a non-negative quantity.
pub fn quantity_nanos(text: &str) -> Option<u128> {
    let text = text.strip_prefix('+').unwrap_or(text);
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') || whole.len() + fraction.len() > 30 {
        return None;
    }
    let (exp10, exp2): (i32, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        exponent => {
            let digits = exponent.strip_prefix(['e', 'E'])?;
            let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) || unsigned.len() > 3 {
                return None;
            }
            (digits.parse().ok()?, 0)
        }
    };
    let mantissa: u128 = format!("{whole}{fraction}").parse().ok()?;
    let scale = exp10 + 9 - i32::try_from(fraction.len()).ok()?;
    let value = mantissa.checked_mul(1u128.checked_shl(exp2)?)?;
    if scale >= 0 {
        value.checked_mul(10u128.checked_pow(u32::try_from(scale).ok()?)?)
    } else {
        let divisor = 10u128.checked_pow(scale.unsigned_abs())?;
        Some(value.div_ceil(divisor))
    }
}

fn annotation<'a>(pod: &'a Pod, name: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(name)).map(String::as_str)
}

fn port_annotation(pod: &Pod, name: &str, default: u16, warnings: &mut Vec<String>) -> u16 {
    match annotation(pod, name) {
        None => default,
        Some(text) => match text.trim().parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => {
                warnings.push(format!("{name}: {text:?} is not a port (1-65535); using {default}"));
                default
            }
        },
    }
}

/// One resource's request and limit: the annotations where they are valid quantities and keep
/// request ≤ limit, the defaults otherwise (with a warning).
fn request_and_limit(
    pod: &Pod,
    resource: &str,
    (request_annotation, limit_annotation): (&str, &str),
    (default_request, default_limit): (&Option<String>, &Option<String>),
    warnings: &mut Vec<String>,
) -> (Option<String>, Option<String>) {
    let mut pick = |name: &str, default: &Option<String>| -> (Option<String>, bool) {
        match annotation(pod, name) {
            None => (default.clone(), false),
            Some(text) if quantity_nanos(text.trim()).is_some() => (Some(text.trim().to_string()), true),
            Some(text) => {
                let fallback = default.as_deref().unwrap_or("none");
                warnings.push(format!("{name}: {text:?} is not a quantity (e.g. 100m, 64Mi); using {fallback}"));
                (default.clone(), false)
            }
        }
    };
    let (mut request, annotated_request) = pick(request_annotation, default_request);
    let (mut limit, annotated_limit) = pick(limit_annotation, default_limit);
    if let (Some(r), Some(l)) = (request.clone(), limit.clone())
        && quantity_nanos(&r) > quantity_nanos(&l)
    {
        // The API server refuses a container whose request is above its limit; the defaults
        // (checked at startup) never are.
        if annotated_request {
            request = default_request.clone();
        }
        if annotated_limit {
            limit = default_limit.clone();
        }
        let show = |q: &Option<String>| q.clone().unwrap_or_else(|| "none".into());
        warnings.push(format!(
            "sidecar {resource} request {r} is above its limit {l} ({request_annotation} / {limit_annotation}); using request {} and limit {}",
            show(&request),
            show(&limit)
        ));
    }
    (request, limit)
}

fn resources(pod: &Pod, defaults: &Resources, warnings: &mut Vec<String>) -> ResourceRequirements {
    let (cpu_request, cpu_limit) = request_and_limit(
        pod,
        "cpu",
        (CPU_REQUEST_ANNOTATION, CPU_LIMIT_ANNOTATION),
        (&defaults.cpu_request, &defaults.cpu_limit),
        warnings,
    );
    let (memory_request, memory_limit) = request_and_limit(
        pod,
        "memory",
        (MEMORY_REQUEST_ANNOTATION, MEMORY_LIMIT_ANNOTATION),
        (&defaults.memory_request, &defaults.memory_limit),
        warnings,
    );
    let map = |cpu: Option<String>, memory: Option<String>| {
        let mut m = BTreeMap::new();
        if let Some(cpu) = cpu {
            m.insert("cpu".to_string(), Quantity(cpu));
        }
        if let Some(memory) = memory {
            m.insert("memory".to_string(), Quantity(memory));
        }
        (!m.is_empty()).then_some(m)
    };
    ResourceRequirements {
        requests: map(cpu_request, memory_request),
        limits: map(cpu_limit, memory_limit),
        ..Default::default()
    }
}

/// What Pod Security `restricted` asks of a container, and a read-only root filesystem (the
/// sidecar writes nothing).
fn security_context() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS),
        run_as_group: Some(RUN_AS),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Default::default() }),
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..Default::default() }),
        ..Default::default()
    }
}

fn probe(path: &str, port: u16, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(i32::from(port)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(1),
        ..Default::default()
    }
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() }
}

fn add(path: &[&str], value: serde_json::Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path: PointerBuf::from_tokens(path.iter().copied()), value })
}

/// Sets `annotations` on the pod (JSON patch cannot add to a map that does not exist).
fn annotate(pod: &Pod, annotations: &[(&str, String)]) -> Vec<PatchOperation> {
    match &pod.metadata.annotations {
        Some(_) => annotations.iter().map(|(k, v)| add(&["metadata", "annotations", k], v.as_str().into())).collect(),
        None => {
            let map: serde_json::Map<String, serde_json::Value> =
                annotations.iter().map(|(k, v)| (k.to_string(), v.as_str().into())).collect();
            vec![add(&["metadata", "annotations"], map.into())]
        }
    }
}

/// Stamps [`INJECTED_ANNOTATION`].
fn stamp(pod: &Pod, image: &str) -> PatchOperation {
    annotate(pod, &[(INJECTED_ANNOTATION, image.to_string())]).remove(0)
}

fn replace(path: &[&str], value: serde_json::Value) -> PatchOperation {
    PatchOperation::Replace(ReplaceOperation { path: PointerBuf::from_tokens(path.iter().copied()), value })
}

fn remove(path: &[&str]) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation { path: PointerBuf::from_tokens(path.iter().copied()) })
}

/// The `iptables` mode's init container: `sluice redirect` with NET_ADMIN and NET_RAW and nothing
/// else (gone once it exits: neither the sidecar nor the application ever holds them).
fn init_container(config: &InjectConfig, plan: &Plan, listen: u16) -> Container {
    let quantity = |q: &str| Quantity(q.to_string());
    Container {
        name: traffic::INIT_CONTAINER_NAME.into(),
        image: Some(config.image.clone()),
        args: Some(vec!["redirect".into()]),
        env: Some(vec![
            env("SLUICE_REDIRECT_TO_PORT", &listen.to_string()),
            env("SLUICE_REDIRECT_PORTS", &traffic::join_ports(&plan.redirected_ports, ",")),
            env("SLUICE_IPTABLES", &plan.iptables),
            env("XTABLES_LOCKFILE", &format!("{}/xtables.lock", traffic::XTABLES_DIR)),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some([("cpu".to_string(), quantity("10m")), ("memory".to_string(), quantity("16Mi"))].into()),
            limits: Some([("memory".to_string(), quantity("64Mi"))].into()),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(false),
            run_as_user: Some(0),
            run_as_group: Some(0),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into(), "NET_RAW".into()]),
                drop: Some(vec!["ALL".into()]),
            }),
            seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..Default::default() }),
            ..Default::default()
        }),
        // Its error (a missing capability, above all) becomes the container's termination
        // message, which `kubectl describe pod` shows.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(vec![VolumeMount {
            name: traffic::XTABLES_VOLUME.into(),
            mount_path: traffic::XTABLES_DIR.into(),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// The patch operations that put the sidecar in the path: the application port's name, its
/// probes, the NetworkPolicy label and what the operator reads back. The redirect's init
/// container goes to `init` (first of the init containers put before the pod's own).
fn traffic_ops(
    pod: &Pod,
    config: &InjectConfig,
    (plan, kind): (&Plan, SidecarKind),
    listen: u16,
    volumes: &mut Vec<Volume>,
    init: &mut Vec<Container>,
) -> Vec<PatchOperation> {
    let mut ops = Vec::new();
    let index = |i: usize| i.to_string();
    if let Some((container, port)) = plan.renamed_port {
        ops.push(remove(&["spec", "containers", &index(container), "ports", &index(port), "name"]));
    }
    for rewrite in &plan.probes {
        ops.push(replace(
            &["spec", "containers", &index(rewrite.container_index), rewrite.field],
            serde_json::to_value(&rewrite.probe).unwrap_or_default(),
        ));
    }
    if plan.mode == RedirectMode::Iptables {
        // First: every other init container (a native sidecar too), and the application, start
        // behind the redirect.
        init.insert(0, init_container(config, plan, listen));
        volumes.push(Volume {
            name: traffic::XTABLES_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity("1Mi".into())),
            }),
            ..Default::default()
        });
    }
    if let Some(value) = plan.ingress_label() {
        ops.push(add(&["metadata", "labels", traffic::INGRESS_PORTS_LABEL], value.into()));
    }
    let mut annotations = vec![
        (INJECTED_ANNOTATION, config.image.clone()),
        (traffic::REDIRECT_ANNOTATION, plan.mode.as_str().to_string()),
        (SIDECAR_KIND_ANNOTATION, kind.as_str().to_string()),
    ];
    if !plan.guarded_ports.is_empty() {
        annotations.push((traffic::GUARDED_PORTS_ANNOTATION, traffic::join_ports(&plan.guarded_ports, ",")));
    }
    ops.extend(annotate(pod, &annotations));
    ops
}

/// Port clashes the sidecar cannot fix: they are the user's to resolve. The containers that run
/// while the sidecar does: the application's, the pod's own native sidecars, and with a native
/// sidecar the pod's init containers too (they start after it).
fn port_clashes(pod: &Pod, (listen, upstream, admin): (u16, u16, u16), kind: SidecarKind, warnings: &mut Vec<String>) {
    if listen == admin {
        warnings.push(format!("the sidecar's listen and admin ports are both {listen}: it will not start; set {LISTEN_PORT_ANNOTATION} or {ADMIN_PORT_ANNOTATION}"));
    }
    if upstream == listen || upstream == admin {
        warnings.push(format!(
            "the sidecar's upstream port {upstream} is one of its own ports; set {UPSTREAM_PORT_ANNOTATION} to the application's port"
        ));
    }
    let alongside = |c: &&Container| kind == SidecarKind::Native || c.restart_policy.as_deref() == Some("Always");
    let containers =
        pod.spec.iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten().filter(alongside)));
    for container in containers {
        for declared in container.ports.iter().flatten() {
            for (what, port, annotation) in
                [("listen", listen, LISTEN_PORT_ANNOTATION), ("admin", admin, ADMIN_PORT_ANNOTATION)]
            {
                if declared.container_port == i32::from(port) {
                    warnings.push(format!(
                        "container {} already uses port {port}, the sidecar's {what} port; set {annotation}",
                        container.name
                    ));
                }
            }
        }
    }
}

/// What admission does with `pod`: nothing when it must be left alone (not labelled, in the
/// operator's namespace, or already injected: admission may run twice on one pod), the stamp
/// alone when it already has the sidecar, otherwise the sidecar.
pub fn patch(pod: &Pod, namespace: &str, config: &InjectConfig) -> Injection {
    let labelled = pod.metadata.labels.as_ref().and_then(|l| l.get(INJECT_LABEL)).is_some_and(|v| v == "true");
    if !labelled || namespace == config.operator_namespace {
        return Injection::skipped();
    }
    let Some(spec) = pod.spec.as_ref() else { return Injection::skipped() };
    // Native (an init container) or classic: either way the pod has it.
    let mut all_containers = spec.containers.iter().chain(spec.init_containers.iter().flatten());
    if let Some(existing) = all_containers.find(|c| c.name == CONTAINER_NAME) {
        if annotation(pod, INJECTED_ANNOTATION).is_some() {
            return Injection::skipped();
        }
        let image = existing.image.as_deref().unwrap_or("unknown");
        return Injection {
            outcome: PodOutcome::Annotated,
            patch: Some(Patch(vec![stamp(pod, image)])),
            warnings: vec![],
        };
    }
    let mut warnings = Vec::new();
    let listen = port_annotation(pod, LISTEN_PORT_ANNOTATION, config.listen_port, &mut warnings);
    let upstream = port_annotation(pod, UPSTREAM_PORT_ANNOTATION, config.upstream_port, &mut warnings);
    let admin = port_annotation(pod, ADMIN_PORT_ANNOTATION, config.admin_port, &mut warnings);
    let kind = match annotation(pod, SIDECAR_KIND_ANNOTATION) {
        None => config.sidecar_kind,
        Some(text) => SidecarKind::parse(text).unwrap_or_else(|| {
            warnings.push(format!(
                "{SIDECAR_KIND_ANNOTATION}: {text:?} is not native or classic; using {}",
                config.sidecar_kind.as_str()
            ));
            config.sidecar_kind
        }),
    };
    port_clashes(pod, (listen, upstream, admin), kind, &mut warnings);
    let resources = resources(pod, &config.resources, &mut warnings);
    let plan = traffic::plan(pod, config.traffic, (listen, upstream, admin), &mut warnings);
    let mut env_vars = vec![
        env("SLUICE_ENDPOINT", &config.endpoint),
        env("SLUICE_LISTEN", &format!("0.0.0.0:{listen}")),
        env("SLUICE_UPSTREAM", &format!("http://127.0.0.1:{upstream}")),
        // Explicit, so the admin port is the one the probes use and never the binary's default.
        env("SLUICE_ADMIN_LISTEN", &format!("0.0.0.0:{admin}")),
        env("SLUICE_LABELS_FILE", &format!("{PODINFO_PATH}/labels")),
        EnvVar {
            name: "SLUICE_NAMESPACE".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector { field_path: "metadata.namespace".into(), ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    let mut mounts = vec![VolumeMount {
        name: PODINFO_VOLUME.into(),
        mount_path: PODINFO_PATH.into(),
        read_only: Some(true),
        ..Default::default()
    }];
    let mut volumes = vec![Volume {
        name: PODINFO_VOLUME.into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "labels".into(),
                field_ref: Some(ObjectFieldSelector { field_path: "metadata.labels".into(), ..Default::default() }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }];
    if let Some(ca) = &config.endpoint_ca_pem {
        env_vars.push(env("SLUICE_ENDPOINT_CA_PEM", ca));
    }
    if !plan.app_probes.is_empty() {
        env_vars.push(env("SLUICE_APP_PROBES", &serde_json::to_string(&plan.app_probes).unwrap_or_default()));
    }
    if !plan.redirected_ports.is_empty() {
        env_vars.push(env("SLUICE_INBOUND_PORTS", &traffic::join_ports(&plan.redirected_ports, ",")));
    }
    if let Some(audience) = &config.token_audience {
        // The pod's own ServiceAccount, bound to Sluice's audience and short-lived: it proves the
        // sidecar's namespace to the endpoint and is useless against the API server.
        env_vars.push(env("SLUICE_TOKEN_FILE", &format!("{TOKEN_DIR}/token")));
        mounts.push(VolumeMount {
            name: TOKEN_VOLUME.into(),
            mount_path: TOKEN_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        });
        volumes.push(Volume {
            name: TOKEN_VOLUME.into(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some(audience.clone()),
                        expiration_seconds: Some(TOKEN_LIFETIME_SECONDS),
                        path: "token".into(),
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let mut container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(config.image.clone()),
        args: Some(vec!["sidecar".into()]),
        ports: Some(vec![
            ContainerPort {
                name: Some(plan.listen_port_name.clone()),
                container_port: i32::from(listen),
                ..Default::default()
            },
            ContainerPort { name: Some("sluice-admin".into()), container_port: i32::from(admin), ..Default::default() },
        ]),
        env: Some(env_vars),
        resources: Some(resources),
        security_context: Some(security_context()),
        // Liveness is the process only: failing it because the endpoint is away would restart
        // the pod, which the failure modes exist to avoid. Ready once it serves.
        liveness_probe: Some(probe("/healthz", admin, 10, 3)),
        readiness_probe: Some(probe("/readyz", admin, 5, 2)),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut init = Vec::new();
    let mut ops = traffic_ops(pod, config, (&plan, kind), listen, &mut volumes, &mut init);
    match kind {
        SidecarKind::Classic => {
            ops.push(add(&["spec", "containers", "-"], serde_json::to_value(container).unwrap_or_default()))
        }
        SidecarKind::Native => {
            // Kept running beside the init containers after it and the application; the kubelet
            // starts the next init container once its startup probe passed, which is once the
            // proxy's listener is bound (the admin port is served after it). /healthz, not
            // /readyz: a sidecar configured wrong for the endpoint must leave the pod unready,
            // not be restarted for ever with the application never started.
            container.restart_policy = Some("Always".into());
            container.startup_probe = Some(probe("/healthz", admin, 1, NATIVE_STARTUP_FAILURES));
            init.push(container);
        }
    }
    // Before the pod's own init containers: the redirect first (it runs to completion), then the
    // native sidecar, so both are in place before anything of the pod's own starts.
    ops.extend(init.into_iter().enumerate().map(|(index, container)| {
        let value = serde_json::to_value(container).unwrap_or_default();
        match spec.init_containers.as_ref() {
            Some(existing) if !existing.is_empty() => add(&["spec", "initContainers", &index.to_string()], value),
            // JSON patch cannot insert into an array that does not exist.
            _ if index == 0 => add(&["spec", "initContainers"], serde_json::Value::Array(vec![value])),
            _ => add(&["spec", "initContainers", "-"], value),
        }
    }));
    // A projected ServiceAccount token needs a named ServiceAccount. The API server's
    // ServiceAccount admission plugin names `default` before webhooks run; where it is off, say
    // what it would have.
    if config.token_audience.is_some() && spec.service_account_name.as_deref().is_none_or(str::is_empty) {
        ops.push(add(&["spec", "serviceAccountName"], "default".into()));
    }
    // JSON patch cannot append to an array that does not exist: create it when absent.
    match &spec.volumes {
        Some(v) if !v.is_empty() => {
            for volume in volumes {
                ops.push(add(&["spec", "volumes", "-"], serde_json::to_value(volume).unwrap_or_default()));
            }
        }
        _ => ops.push(add(&["spec", "volumes"], serde_json::to_value(volumes).unwrap_or_default())),
    }
    Injection { outcome: PodOutcome::Injected, patch: Some(Patch(ops)), warnings }
}

#[cfg(test)]
mod tests;
