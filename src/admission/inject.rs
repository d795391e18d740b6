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
mod tests {
    use super::*;

    fn config() -> InjectConfig {
        InjectConfig {
            image: "sluice:test".into(),
            endpoint: "http://sluice:8080".into(),
            listen_port: 15080,
            upstream_port: 8080,
            admin_port: 15081,
            resources: Resources {
                cpu_request: Some("50m".into()),
                cpu_limit: None,
                memory_request: Some("64Mi".into()),
                memory_limit: Some("256Mi".into()),
            },
            operator_namespace: "sluice-system".into(),
            token_audience: Some("sluice".into()),
            endpoint_ca_pem: Some("-----BEGIN CERTIFICATE-----\n".into()),
            traffic: TrafficDefaults::default(),
            sidecar_kind: SidecarKind::Classic,
        }
    }

    fn native_config() -> InjectConfig {
        InjectConfig { sidecar_kind: SidecarKind::Native, ..config() }
    }

    fn pod(labelled: bool, extra: serde_json::Value) -> Pod {
        let mut value = serde_json::json!({
            "metadata": {"name": "p", "labels": {"app": "a"}},
            "spec": {"containers": [{"name": "app", "image": "app"}]}
        });
        if labelled {
            value["metadata"]["labels"][INJECT_LABEL] = "true".into();
        }
        json_patch::merge(&mut value, &extra);
        serde_json::from_value(value).expect("pod")
    }

    fn annotated(annotations: serde_json::Value) -> Pod {
        pod(true, serde_json::json!({"metadata": {"annotations": annotations}}))
    }

    fn apply(pod: &Pod, patch: &Patch) -> Pod {
        let mut value = serde_json::to_value(pod).expect("json");
        json_patch::patch(&mut value, patch).expect("patch applies");
        serde_json::from_value(value).expect("pod")
    }

    /// The injected pod and its sidecar container (classic, the cluster default of [`config`]).
    fn inject(pod: &Pod) -> (Pod, Container, Vec<String>) {
        inject_with(pod, &config())
    }

    /// The injected pod and its sidecar container, native or classic.
    fn inject_with(pod: &Pod, config: &InjectConfig) -> (Pod, Container, Vec<String>) {
        let injection = patch(pod, "tenant", config);
        assert_eq!(injection.outcome, PodOutcome::Injected);
        let injected = apply(pod, injection.patch.as_ref().expect("patch"));
        let spec = injected.spec.as_ref().expect("spec");
        let sidecar =
            spec.containers.iter().chain(spec.init_containers.iter().flatten()).find(|c| c.name == CONTAINER_NAME);
        let sidecar = sidecar.cloned().expect("sidecar");
        (injected, sidecar, injection.warnings)
    }

    fn init_names(pod: &Pod) -> Vec<String> {
        pod.spec.iter().flat_map(|s| s.init_containers.iter().flatten()).map(|c| c.name.clone()).collect()
    }

    fn container_names(pod: &Pod) -> Vec<String> {
        pod.spec.iter().flat_map(|s| s.containers.iter()).map(|c| c.name.clone()).collect()
    }

    fn kind_annotation(pod: &Pod) -> Option<String> {
        pod.metadata.annotations.as_ref().and_then(|a| a.get(SIDECAR_KIND_ANNOTATION)).cloned()
    }

    #[test]
    fn a_classic_sidecar_is_a_container_next_to_the_app() {
        let (injected, sidecar, warnings) = inject(&web_pod(serde_json::json!({})));
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
        assert!(init_names(&injected).is_empty());
        assert_eq!((sidecar.restart_policy, sidecar.startup_probe), (None, None), "as before native sidecars");
        assert_eq!(kind_annotation(&injected).as_deref(), Some("classic"));
    }

    #[test]
    fn a_native_sidecar_is_a_restartable_init_container_with_a_startup_probe() {
        let (classic_pod, classic, _) = inject(&web_pod(serde_json::json!({})));
        let (injected, native, warnings) = inject_with(&web_pod(serde_json::json!({})), &native_config());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(container_names(&injected), ["app"]);
        assert_eq!(init_names(&injected), [CONTAINER_NAME]);
        assert_eq!(native.restart_policy.as_deref(), Some("Always"));
        // The kubelet starts what follows once this passes: the proxy's listener is bound then.
        let startup = native.startup_probe.clone().expect("startupProbe");
        let get = startup.http_get.clone().expect("httpGet");
        assert_eq!((get.path.as_deref(), get.port), (Some("/healthz"), IntOrString::Int(15081)));
        assert_eq!((startup.period_seconds, startup.failure_threshold), (Some(1), Some(NATIVE_STARTUP_FAILURES)));
        // Everything else is the classic container's: ports, probes, resources, securityContext, env.
        let same = Container { restart_policy: None, startup_probe: None, ..native.clone() };
        assert_eq!(same, classic);
        assert!(native.liveness_probe.is_some() && native.readiness_probe.is_some());
        // The app's side is the same too: its port's name taken over, its probes moved.
        assert_eq!(
            injected.spec.as_ref().expect("spec").containers,
            classic_pod.spec.as_ref().expect("spec").containers[..1]
        );
        assert_eq!(kind_annotation(&injected).as_deref(), Some("native"));
        // Injected once: a second admission finds it among the init containers.
        assert_eq!(super::patch(&injected, "tenant", &native_config()).outcome, PodOutcome::Skipped);
        assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped);
    }

    #[test]
    fn a_native_sidecar_goes_after_the_redirect_and_before_the_pods_own_init_containers() {
        let with_init = |annotations: serde_json::Value| {
            let mut value = serde_json::to_value(web_pod(annotations)).expect("json");
            value["spec"]["initContainers"] =
                serde_json::json!([{"name": "migrate", "image": "app"}, {"name": "seed", "image": "app"}]);
            serde_json::from_value::<Pod>(value).expect("pod")
        };
        let iptables = serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"});
        let cases = [
            (web_pod(serde_json::json!({})), vec![CONTAINER_NAME]),
            (web_pod(iptables.clone()), vec![traffic::INIT_CONTAINER_NAME, CONTAINER_NAME]),
            (with_init(serde_json::json!({})), vec![CONTAINER_NAME, "migrate", "seed"]),
            (with_init(iptables), vec![traffic::INIT_CONTAINER_NAME, CONTAINER_NAME, "migrate", "seed"]),
        ];
        for (pod, order) in cases {
            let (injected, _, warnings) = inject_with(&pod, &native_config());
            assert!(warnings.is_empty(), "{warnings:?}");
            assert_eq!(init_names(&injected), order);
            let spec = injected.spec.as_ref().expect("spec");
            for init in spec.init_containers.iter().flatten() {
                // Only the sidecar keeps running; the redirect and the pod's own run to completion.
                let restartable = init.restart_policy.as_deref() == Some("Always");
                assert_eq!(restartable, init.name == CONTAINER_NAME, "{}", init.name);
            }
            assert_eq!(container_names(&injected), ["app"]);
        }
        // Classic with the redirect: the init container alone, still first.
        let (injected, _, _) = inject(&with_init(serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"})));
        assert_eq!(init_names(&injected), [traffic::INIT_CONTAINER_NAME, "migrate", "seed"]);
        assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
    }

    #[test]
    fn the_pods_annotation_overrides_the_cluster_kind_both_ways() {
        let native = annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "native"}));
        let (injected, sidecar, warnings) = inject_with(&native, &config());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            (init_names(&injected), sidecar.restart_policy.as_deref()),
            (vec![CONTAINER_NAME.to_string()], Some("Always"))
        );
        let classic = annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "classic"}));
        let (injected, sidecar, warnings) = inject_with(&classic, &native_config());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
        assert_eq!((init_names(&injected).len(), sidecar.restart_policy), (0, None));
        assert_eq!(kind_annotation(&injected).as_deref(), Some("classic"));
    }

    #[test]
    fn an_unknown_kind_is_warned_about_and_the_cluster_kind_used() {
        for (config, expected) in [(native_config(), "native"), (config(), "classic")] {
            let (injected, _, warnings) =
                inject_with(&annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "sidecar"})), &config);
            assert_eq!(
                warnings,
                [format!("{SIDECAR_KIND_ANNOTATION}: \"sidecar\" is not native or classic; using {expected}")]
            );
            assert_eq!(kind_annotation(&injected).as_deref(), Some(expected));
        }
    }

    #[test]
    fn a_native_sidecar_of_the_pods_own_is_only_stamped() {
        let original = pod(
            true,
            serde_json::json!({"spec": {"initContainers": [{"name": CONTAINER_NAME, "image": "mine:2", "restartPolicy": "Always"}]}}),
        );
        let injection = patch(&original, "tenant", &native_config());
        assert_eq!(injection.outcome, PodOutcome::Annotated);
        let stamped = apply(&original, injection.patch.as_ref().expect("patch"));
        assert_eq!(
            (container_names(&stamped), init_names(&stamped)),
            (vec!["app".to_string()], vec![CONTAINER_NAME.to_string()])
        );
        let annotations = stamped.metadata.annotations.expect("annotations");
        assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("mine:2"));
    }

    #[test]
    fn a_native_sidecar_clashes_with_the_pods_init_containers_ports() {
        let original = pod(
            true,
            serde_json::json!({"spec": {"initContainers": [{"name": "warm", "image": "app", "ports": [{"containerPort": 15080}]}]}}),
        );
        let (_, _, warnings) = inject_with(&original, &native_config());
        assert!(warnings.len() == 1 && warnings[0].contains("container warm already uses port 15080"), "{warnings:?}");
        // A classic sidecar starts after the init containers are done.
        let (_, _, warnings) = inject(&original);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    fn env_value(c: &Container, name: &str) -> Option<String> {
        c.env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone())
    }

    fn quantities(map: &Option<BTreeMap<String, Quantity>>) -> Vec<(String, String)> {
        map.iter().flatten().map(|(k, v)| (k.clone(), v.0.clone())).collect()
    }

    #[test]
    fn labelled_pod_gets_the_sidecar_once() {
        let original = pod(true, serde_json::json!({"metadata": {"annotations": {UPSTREAM_PORT_ANNOTATION: "9000"}}}));
        let (injected, sidecar, warnings) = inject(&original);
        assert!(warnings.is_empty(), "{warnings:?}");
        let spec = injected.spec.as_ref().expect("spec");
        assert_eq!(env_value(&sidecar, "SLUICE_UPSTREAM").as_deref(), Some("http://127.0.0.1:9000"));
        assert!(spec.volumes.as_ref().is_some_and(|v| v.iter().any(|v| v.name == PODINFO_VOLUME)));
        let token = spec.volumes.as_ref().and_then(|v| v.iter().find(|v| v.name == TOKEN_VOLUME)).expect("token");
        let projection = token.projected.as_ref().and_then(|p| p.sources.as_ref()).expect("projected");
        let sa = projection[0].service_account_token.as_ref().expect("service account token");
        assert_eq!((sa.audience.as_deref(), sa.expiration_seconds), (Some("sluice"), Some(TOKEN_LIFETIME_SECONDS)));
        assert_eq!(env_value(&sidecar, "SLUICE_TOKEN_FILE").as_deref(), Some("/var/run/secrets/sluice/token"));
        // Stamped, so a labelled pod without the stamp is known to have slipped past the webhook.
        let annotations = injected.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("sluice:test"));
        assert_eq!(annotations.get(UPSTREAM_PORT_ANNOTATION).map(String::as_str), Some("9000"), "kept");
        // Idempotent: a second pass over the injected pod changes nothing.
        assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped);
    }

    #[test]
    fn the_sidecar_passes_pod_security_restricted() {
        let (_, sidecar, _) = inject(&pod(true, serde_json::json!({})));
        let sc = sidecar.security_context.expect("securityContext");
        assert_eq!(sc.run_as_non_root, Some(true));
        assert!(sc.run_as_user.is_some_and(|u| u != 0), "non-root user");
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.privileged, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]));
        assert_eq!(sc.seccomp_profile.map(|p| p.type_).as_deref(), Some("RuntimeDefault"));
    }

    #[test]
    fn the_sidecar_has_default_resources_and_probes_on_its_admin_port() {
        let (_, sidecar, _) = inject(&pod(true, serde_json::json!({})));
        let resources = sidecar.resources.clone().expect("resources");
        assert_eq!(quantities(&resources.requests), [("cpu".into(), "50m".into()), ("memory".into(), "64Mi".into())]);
        assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
        assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:15081"));
        for (probe, path) in [(&sidecar.liveness_probe, "/healthz"), (&sidecar.readiness_probe, "/readyz")] {
            let get = probe.as_ref().and_then(|p| p.http_get.clone()).expect("httpGet probe");
            assert_eq!((get.path.as_deref(), get.port), (Some(path), IntOrString::Int(15081)));
        }
        let ports: Vec<_> = sidecar.ports.iter().flatten().map(|p| (p.name.clone(), p.container_port)).collect();
        assert_eq!(ports, [(Some("sluice-http".into()), 15080), (Some("sluice-admin".into()), 15081)]);
    }

    #[test]
    fn annotations_override_ports_and_resources() {
        let original = annotated(serde_json::json!({
            ADMIN_PORT_ANNOTATION: "19000", LISTEN_PORT_ANNOTATION: "19001",
            CPU_REQUEST_ANNOTATION: "0.25", CPU_LIMIT_ANNOTATION: "1", MEMORY_REQUEST_ANNOTATION: "100M",
            MEMORY_LIMIT_ANNOTATION: "1Gi",
        }));
        let (_, sidecar, warnings) = inject(&original);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:19000"));
        assert_eq!(env_value(&sidecar, "SLUICE_LISTEN").as_deref(), Some("0.0.0.0:19001"));
        let get = sidecar.readiness_probe.and_then(|p| p.http_get).expect("probe");
        assert_eq!(get.port, IntOrString::Int(19000));
        let resources = sidecar.resources.expect("resources");
        assert_eq!(quantities(&resources.requests), [("cpu".into(), "0.25".into()), ("memory".into(), "100M".into())]);
        assert_eq!(quantities(&resources.limits), [("cpu".into(), "1".into()), ("memory".into(), "1Gi".into())]);
    }

    #[test]
    fn bad_annotations_fall_back_to_the_defaults_with_warnings() {
        let original = annotated(serde_json::json!({
            ADMIN_PORT_ANNOTATION: "70000", CPU_REQUEST_ANNOTATION: "lots", MEMORY_LIMIT_ANNOTATION: "-1Gi",
        }));
        let (_, sidecar, warnings) = inject(&original);
        assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:15081"));
        let resources = sidecar.resources.expect("resources");
        assert_eq!(quantities(&resources.requests), [("cpu".into(), "50m".into()), ("memory".into(), "64Mi".into())]);
        assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(warnings[0].contains(ADMIN_PORT_ANNOTATION) && warnings[0].contains("using 15081"), "{warnings:?}");
        assert!(warnings.iter().any(|w| w.contains(CPU_REQUEST_ANNOTATION) && w.contains("\"lots\"")));
        assert!(warnings.iter().any(|w| w.contains(MEMORY_LIMIT_ANNOTATION) && w.contains("using 256Mi")));
    }

    #[test]
    fn a_request_above_its_limit_never_reaches_the_api_server() {
        // Only the request annotated, above the default limit: the request falls back.
        let (_, sidecar, warnings) = inject(&annotated(serde_json::json!({MEMORY_REQUEST_ANNOTATION: "1Gi"})));
        let resources = sidecar.resources.expect("resources");
        assert_eq!(quantities(&resources.requests)[1], ("memory".into(), "64Mi".into()));
        assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
        assert!(warnings.len() == 1 && warnings[0].contains("above its limit"), "{warnings:?}");
        // Only the limit annotated, below the default request: the limit falls back.
        let (_, sidecar, _) = inject(&annotated(serde_json::json!({MEMORY_LIMIT_ANNOTATION: "10Mi"})));
        assert_eq!(quantities(&sidecar.resources.expect("resources").limits), [("memory".into(), "256Mi".into())]);
        // Both annotated and inconsistent: both fall back.
        let (_, sidecar, _) =
            inject(&annotated(serde_json::json!({CPU_REQUEST_ANNOTATION: "2", CPU_LIMIT_ANNOTATION: "500m"})));
        let resources = sidecar.resources.expect("resources");
        assert_eq!(quantities(&resources.requests)[0], ("cpu".into(), "50m".into()));
        assert!(quantities(&resources.limits).iter().all(|(k, _)| k != "cpu"));
        // Equal values in different notations are consistent.
        let (_, _, warnings) = inject(&annotated(
            serde_json::json!({MEMORY_REQUEST_ANNOTATION: "1Gi", MEMORY_LIMIT_ANNOTATION: "1024Mi"}),
        ));
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn port_clashes_are_warned_about() {
        let original = pod(
            true,
            serde_json::json!({"spec": {"containers": [{"name": "app", "image": "app", "ports": [{"containerPort": 15081}]}]}}),
        );
        let (_, _, warnings) = inject(&original);
        assert!(warnings.len() == 1 && warnings[0].contains("container app already uses port 15081"), "{warnings:?}");
        let (_, _, warnings) = inject(&annotated(serde_json::json!({LISTEN_PORT_ANNOTATION: "15081"})));
        assert!(warnings.iter().any(|w| w.contains("will not start")), "{warnings:?}");
    }

    #[test]
    fn a_pod_with_a_sidecar_of_its_own_is_only_stamped() {
        let original = pod(
            true,
            serde_json::json!({"spec": {"containers": [{"name": "app", "image": "app"}, {"name": CONTAINER_NAME, "image": "mine:1"}]}}),
        );
        let injection = patch(&original, "tenant", &config());
        assert_eq!(injection.outcome, PodOutcome::Annotated);
        let stamped = apply(&original, injection.patch.as_ref().expect("patch"));
        assert_eq!(stamped.spec.as_ref().expect("spec").containers.len(), 2);
        let annotations = stamped.metadata.annotations.expect("annotations");
        assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("mine:1"));
    }

    #[test]
    fn unlabelled_and_operator_namespace_pods_are_untouched() {
        assert!(patch(&pod(false, serde_json::json!({})), "tenant", &config()).patch.is_none());
        assert!(patch(&pod(true, serde_json::json!({})), "sluice-system", &config()).patch.is_none());
    }

    #[test]
    fn existing_volumes_are_kept() {
        let original = pod(true, serde_json::json!({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}}));
        let (injected, _, _) = inject(&original);
        let names: Vec<_> =
            injected.spec.expect("spec").volumes.expect("volumes").into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["data", PODINFO_VOLUME, TOKEN_VOLUME]);
    }

    fn web_pod(annotations: serde_json::Value) -> Pod {
        pod(
            true,
            serde_json::json!({
                "metadata": {"annotations": annotations},
                "spec": {"containers": [{
                    "name": "app", "image": "app",
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}}
                }]}
            }),
        )
    }

    #[test]
    fn service_mode_hands_the_ports_name_to_the_sidecar() {
        let (injected, sidecar, warnings) = inject(&web_pod(serde_json::json!({})));
        assert!(warnings.is_empty(), "{warnings:?}");
        let spec = injected.spec.as_ref().expect("spec");
        let app = &spec.containers[0];
        let app_port = &app.ports.as_ref().expect("ports")[0];
        assert_eq!((app_port.name.as_deref(), app_port.container_port), (None, 8080), "the app's port lost its name");
        let ports: Vec<_> = sidecar.ports.iter().flatten().map(|p| (p.name.clone(), p.container_port)).collect();
        assert_eq!(ports[0], (Some("http".into()), 15080), "targetPort: http now reaches the sidecar");
        let probe = app.readiness_probe.as_ref().and_then(|p| p.http_get.clone()).expect("probe");
        assert_eq!((probe.path.as_deref(), probe.port), (Some("/app-health/app/readyz"), IntOrString::Int(15081)));
        let probes = env_value(&sidecar, "SLUICE_APP_PROBES").expect("the sidecar knows the probe");
        let probes = crate::sidecar::probes::parse(&probes).expect("valid");
        assert_eq!(probes["/app-health/app/readyz"].port, 8080);
        assert!(spec.init_containers.is_none(), "no privilege in service mode");
        let annotations = injected.metadata.annotations.as_ref().expect("annotations");
        assert_eq!(annotations.get(traffic::REDIRECT_ANNOTATION).map(String::as_str), Some("service"));
        assert_eq!(annotations.get(traffic::GUARDED_PORTS_ANNOTATION).map(String::as_str), Some("8080"));
        let labels = injected.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels.get(traffic::INGRESS_PORTS_LABEL).map(String::as_str), Some("15080.15081"));
        assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped, "once");
    }

    #[test]
    fn iptables_mode_adds_a_narrow_init_container_first() {
        let original = web_pod(serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"}));
        let mut with_init = serde_json::to_value(&original).expect("json");
        with_init["spec"]["initContainers"] = serde_json::json!([{"name": "migrate", "image": "app"}]);
        let with_init: Pod = serde_json::from_value(with_init).expect("pod");
        for pod in [original, with_init] {
            let (injected, sidecar, warnings) = inject(&pod);
            assert!(warnings.is_empty(), "{warnings:?}");
            let spec = injected.spec.as_ref().expect("spec");
            let init = &spec.init_containers.as_ref().expect("init containers")[0];
            assert_eq!(init.name, traffic::INIT_CONTAINER_NAME);
            assert_eq!(env_value(init, "SLUICE_REDIRECT_PORTS").as_deref(), Some("8080"));
            assert_eq!(env_value(init, "SLUICE_REDIRECT_TO_PORT").as_deref(), Some("15080"));
            let sc = init.security_context.as_ref().expect("securityContext");
            let caps = sc.capabilities.as_ref().expect("capabilities");
            assert_eq!(caps.add.as_deref(), Some(&["NET_ADMIN".to_string(), "NET_RAW".to_string()][..]));
            assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
            assert_eq!(
                (sc.privileged, sc.allow_privilege_escalation, sc.read_only_root_filesystem),
                (Some(false), Some(false), Some(true))
            );
            assert!(spec.volumes.iter().flatten().any(|v| v.name == traffic::XTABLES_VOLUME));
            assert_eq!(spec.containers[0].ports.as_ref().expect("ports")[0].name.as_deref(), Some("http"), "name kept");
            assert_eq!(env_value(&sidecar, "SLUICE_INBOUND_PORTS").as_deref(), Some("8080"));
            let labels = injected.metadata.labels.as_ref().expect("labels");
            assert_eq!(labels.get(traffic::INGRESS_PORTS_LABEL).map(String::as_str), Some("8080.15080.15081"));
            // The sidecar and the app get no capability.
            assert_eq!(sidecar.security_context.and_then(|s| s.capabilities).and_then(|c| c.add), None);
        }
    }

    #[test]
    fn quantities_parse_as_the_api_server_reads_them() {
        let q = |s| quantity_nanos(s);
        assert_eq!(q("1"), Some(1_000_000_000));
        assert_eq!(q("100m"), Some(100_000_000));
        assert_eq!(q("0.1"), q("100m"));
        assert_eq!(q("1Ki"), Some(1024 * 1_000_000_000));
        assert_eq!(q("1Gi"), q("1024Mi"));
        assert_eq!(q("1e3"), q("1k"));
        assert_eq!(q("1E"), Some(10u128.pow(27)));
        assert_eq!(q("1n"), Some(1));
        assert_eq!(q("0.1n"), Some(1), "rounded up to nano precision");
        assert_eq!(q(".5"), Some(500_000_000));
        assert_eq!(q("+2"), q("2"));
        for bad in ["", "abc", "-1", "1.2.3", "1Kb", "1 Gi", "Gi", ".", "1e", "1e+", "1ee3", "1e1000"] {
            assert_eq!(q(bad), None, "{bad:?}");
        }
        assert!(
            Resources { memory_request: Some("2Gi".into()), memory_limit: Some("1Gi".into()), ..Default::default() }
                .check()
                .is_err()
        );
        assert!(Resources { cpu_request: Some("x".into()), ..Default::default() }.check().is_err());
        assert!(config().resources.check().is_ok());
    }
}
