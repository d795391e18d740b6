//! Admission webhooks served by `sluice operator`:
//!
//! - [`validate`]: RateLimitPolicy validation with the same [`crate::policy::validate`] compile
//!   uses, plus what CEL cannot see (cross-policy conflicts), and [`crate::policy::warnings`] as
//!   admission warnings.
//! - [`inject`]: the sidecar for pods labelled `sluice.dev/inject: "true"`.
//! - [`certs`]: the serving certificate, generated at startup, shared by replicas through a
//!   Secret, renewed by the leader, and its CA kept in the webhook configurations' caBundle.
//!
//! The handlers are thin: parse the AdmissionReview, call a pure function, answer.

pub mod certs;
pub mod inject;
pub mod sidecar_kind;
pub mod traffic;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::runtime::reflector::Store;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::policy::RateLimitPolicy;
use crate::telemetry::{Metrics, ResultLabels};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("certificate generation: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("secret {0} lacks {1}")]
    IncompleteSecret(String, &'static str),
    #[error("TLS configuration: {0}")]
    Tls(std::io::Error),
    #[error("secret {0} does not exist (--generate-certificates=false: something else must write it)")]
    MissingSecret(String),
    #[error("secret {0} kept changing while it was being written; giving up")]
    SecretContention(String),
    #[error("--sidecar-*-request/limit: {0}")]
    SidecarResources(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

/// A resource quantity flag: empty leaves it unset.
fn quantity_flag(text: &str) -> Result<String, String> {
    let text = text.trim();
    if text.is_empty() || inject::quantity_nanos(text).is_some() {
        Ok(text.to_string())
    } else {
        Err(format!("{text:?} is not a quantity (e.g. 100m, 64Mi), nor empty"))
    }
}

/// Webhook flags of `sluice operator`.
#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Address of the HTTPS admission webhooks (`/validate-policy`, `/mutate-pod`); unset disables them.
    #[arg(long = "webhook-listen", env = "SLUICE_WEBHOOK_LISTEN", value_parser = crate::listen::parse_listen_address)]
    pub webhook_listen: Option<SocketAddr>,
    /// Names (DNS or IP) the serving certificate is valid for: the webhook Service's DNS names,
    /// and the check API Service's when it serves TLS (--check-api-tls).
    #[arg(
        long = "webhook-host",
        env = "SLUICE_WEBHOOK_HOSTS",
        value_delimiter = ',',
        default_value = "sluice-webhook.sluice-system.svc"
    )]
    pub hosts: Vec<String>,
    /// Secret (in the operator namespace) holding the shared CA and serving keypair.
    #[arg(long = "webhook-secret", env = "SLUICE_WEBHOOK_SECRET", default_value = "sluice-webhook-tls")]
    pub secret: String,
    /// ValidatingWebhookConfiguration whose caBundle is patched; empty to skip (cert-manager).
    #[arg(long = "validating-webhook", env = "SLUICE_VALIDATING_WEBHOOK", default_value = "sluice")]
    pub validating_config: String,
    /// MutatingWebhookConfiguration whose caBundle is patched; empty to skip (cert-manager).
    #[arg(long = "mutating-webhook", env = "SLUICE_MUTATING_WEBHOOK", default_value = "sluice")]
    pub mutating_config: String,
    /// Image of the injected sidecar container.
    #[arg(long = "sidecar-image", env = "SLUICE_SIDECAR_IMAGE", default_value = "sluice:latest")]
    pub sidecar_image: String,
    /// Enforcement endpoint the injected sidecar asks (the operator's check API Service).
    #[arg(
        long = "sidecar-endpoint",
        env = "SLUICE_SIDECAR_ENDPOINT",
        default_value = "http://sluice.sluice-system.svc:8080"
    )]
    pub sidecar_endpoint: String,
    /// Port the sidecar listens on unless the pod's `sluice.dev/listen-port` annotation says otherwise.
    #[arg(long = "sidecar-listen-port", env = "SLUICE_SIDECAR_LISTEN_PORT", default_value_t = 15080)]
    pub sidecar_listen_port: u16,
    /// Application port the sidecar forwards to unless the pod's `sluice.dev/upstream-port` annotation says otherwise.
    #[arg(long = "sidecar-upstream-port", env = "SLUICE_SIDECAR_UPSTREAM_PORT", default_value_t = 8080)]
    pub sidecar_upstream_port: u16,
    /// Port of the sidecar's /healthz, /readyz and /metrics (its probes) unless the pod's
    /// `sluice.dev/admin-port` annotation says otherwise. Next to the proxy's 15080, and none of
    /// the ports Istio's or Linkerd's sidecars use (Istio's health and metrics are 15021, 15090).
    #[arg(long = "sidecar-admin-port", env = "SLUICE_SIDECAR_ADMIN_PORT", default_value_t = 15081, value_parser = clap::value_parser!(u16).range(1..))]
    pub sidecar_admin_port: u16,
    /// The sidecar's CPU request unless `sluice.dev/sidecar-cpu-request` says otherwise; empty: none.
    #[arg(long = "sidecar-cpu-request", env = "SLUICE_SIDECAR_CPU_REQUEST", default_value = "50m", value_parser = quantity_flag)]
    pub sidecar_cpu_request: String,
    /// The sidecar's CPU limit unless `sluice.dev/sidecar-cpu-limit` says otherwise; empty (the
    /// default): none, so a busy proxy is never throttled in the request path.
    #[arg(long = "sidecar-cpu-limit", env = "SLUICE_SIDECAR_CPU_LIMIT", default_value = "", value_parser = quantity_flag)]
    pub sidecar_cpu_limit: String,
    /// The sidecar's memory request unless `sluice.dev/sidecar-memory-request` says otherwise; empty: none.
    #[arg(long = "sidecar-memory-request", env = "SLUICE_SIDECAR_MEMORY_REQUEST", default_value = "64Mi", value_parser = quantity_flag)]
    pub sidecar_memory_request: String,
    /// The sidecar's memory limit unless `sluice.dev/sidecar-memory-limit` says otherwise; empty: none.
    #[arg(long = "sidecar-memory-limit", env = "SLUICE_SIDECAR_MEMORY_LIMIT", default_value = "256Mi", value_parser = quantity_flag)]
    pub sidecar_memory_limit: String,
    /// How inbound traffic reaches the injected sidecar unless the pod's `sluice.dev/redirect`
    /// annotation says otherwise: `service` (no privilege: the sidecar takes over the name of the
    /// application's port, so a Service's named targetPort reaches it) or `iptables` (an init
    /// container with NET_ADMIN and NET_RAW redirects inbound TCP to the application's ports).
    #[arg(long = "sidecar-redirect", env = "SLUICE_SIDECAR_REDIRECT", value_enum, default_value = "service")]
    pub sidecar_redirect: traffic::RedirectMode,
    /// Where the injected sidecar goes unless the pod's `sluice.dev/sidecar-kind` annotation says
    /// otherwise: `native` (an init container with `restartPolicy: Always`: up before the pod's
    /// init containers and application, stopped after them, and a Job's pod completes),
    /// `classic` (a container next to the application's) or `auto` (native when the API server's
    /// /version, read at start, is 1.29 or later; classic when it is older or cannot be read).
    #[arg(long = "sidecar-kind", env = "SLUICE_SIDECAR_KIND", value_enum, default_value = "auto")]
    pub sidecar_kind: sidecar_kind::KindFlag,
    /// Label injected pods with the ports they admit ingress on, and have the leader keep a
    /// NetworkPolicy per namespace and port set that admits ingress only there (the sidecar's,
    /// and the redirected or excluded ones), so the application's port is not a way around the
    /// sidecar where the CNI enforces NetworkPolicy. A pod opts out with
    /// `sluice.dev/network-policy: "false"`.
    #[arg(long = "sidecar-network-policy", env = "SLUICE_SIDECAR_NETWORK_POLICY", default_value_t = true, action = clap::ArgAction::Set)]
    pub sidecar_network_policy: bool,
    /// Create, renew and replace the certificate Secret (a CA of 10 years, a serving certificate
    /// of 1 year renewed by the leader). false: only read it, when cert-manager or other tooling
    /// writes it.
    #[arg(long = "generate-certificates", env = "SLUICE_GENERATE_CERTIFICATES", default_value_t = true, action = clap::ArgAction::Set)]
    pub generate_certificates: bool,
    /// With --webhook-listen: watch the metadata of pods labelled `sluice.dev/inject=true` and
    /// report those running without the sidecar (a SidecarMissing Event and a metric, by the leader).
    #[arg(long = "report-missing-sidecars", env = "SLUICE_REPORT_MISSING_SIDECARS", default_value_t = true, action = clap::ArgAction::Set)]
    pub report_missing_sidecars: bool,
}

impl WebhookArgs {
    /// The injected sidecar's default requests and limits.
    pub fn sidecar_resources(&self) -> inject::Resources {
        let set = |s: &String| (!s.is_empty()).then(|| s.clone());
        inject::Resources {
            cpu_request: set(&self.sidecar_cpu_request),
            cpu_limit: set(&self.sidecar_cpu_limit),
            memory_request: set(&self.sidecar_memory_request),
            memory_limit: set(&self.sidecar_memory_limit),
        }
    }
}

struct AppState {
    policies: Vec<Store<RateLimitPolicy>>,
    client: Client,
    inject: inject::InjectConfig,
    /// With the check API on TLS: the pair served now, whose CA injected sidecars get.
    endpoint_ca: Option<watch::Receiver<certs::Keypair>>,
    metrics: Arc<Metrics>,
    /// Replicas sharing each `localFallback` limit, for the layering report.
    fallback_replicas: u32,
}

/// How long `--sidecar-kind auto` waits for the API server's /version.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The cluster's sidecar kind: `flag`, and for `auto` the API server's version; logged with why.
async fn default_sidecar_kind(client: &Client, flag: sidecar_kind::KindFlag) -> sidecar_kind::SidecarKind {
    let version = match flag {
        sidecar_kind::KindFlag::Auto => match tokio::time::timeout(VERSION_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(info)) => Ok(sidecar_kind::version_text(&info)),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("no answer within {} s", VERSION_TIMEOUT.as_secs())),
        },
        _ => Err("not asked".to_string()),
    };
    let decision = sidecar_kind::decide(flag, version.as_deref().map_err(String::as_str));
    let kind = decision.kind.as_str();
    if flag == sidecar_kind::KindFlag::Auto && version.is_err() {
        tracing::warn!(kind, "injected sidecars are {kind}: {}", decision.reason);
    } else {
        tracing::info!(kind, "injected sidecars are {kind}: {}", decision.reason);
    }
    decision.kind
}

/// How long the API server is given to trust a CA just added to caBundle.
const CA_PROPAGATION: Duration = Duration::from_secs(2);

/// Sets up certificates and serves the webhooks until `stop` flips.
#[allow(clippy::too_many_arguments)]
pub async fn start(
    client: Client,
    args: &WebhookArgs,
    operator_namespace: &str,
    sidecar: SidecarTrust<'_>,
    certificates: &Certificates,
    policies: Vec<Store<RateLimitPolicy>>,
    metrics: Arc<Metrics>,
    limits: crate::listen::ConnectionLimits,
    fallback_replicas: u32,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, Error> {
    let resources = args.sidecar_resources();
    resources.check().map_err(Error::SidecarResources)?;
    let ca_pem = certificates.current.borrow().ca_pem.clone();
    let (validating, mutating) = (&args.validating_config, &args.mutating_config);
    if certs::sync_ca_bundles(&client, validating, mutating, &ca_pem, SystemTime::now()).await? {
        // We just put this CA into caBundle (a new Secret): the API server's webhook clients pick
        // it up a moment later. Answering before would fail its calls, and a failed pod webhook
        // lets pods through without the sidecar.
        tokio::time::sleep(CA_PROPAGATION).await;
    }
    let tls = certificates.tls.clone();
    let kind = default_sidecar_kind(&client, args.sidecar_kind).await;
    let state = Arc::new(AppState {
        policies,
        client: client.clone(),
        inject: inject::InjectConfig {
            image: args.sidecar_image.clone(),
            endpoint: args.sidecar_endpoint.clone(),
            listen_port: args.sidecar_listen_port,
            upstream_port: args.sidecar_upstream_port,
            admin_port: args.sidecar_admin_port,
            resources,
            operator_namespace: operator_namespace.to_string(),
            token_audience: sidecar.token_audience.map(str::to_string),
            endpoint_ca_pem: None,
            traffic: traffic::TrafficDefaults {
                redirect: args.sidecar_redirect,
                network_policy: args.sidecar_network_policy,
            },
            sidecar_kind: kind,
        },
        endpoint_ca: sidecar.verify_endpoint.then(|| certificates.current.clone()),
        metrics,
        fallback_replicas,
    });
    let app = Router::new()
        .route("/validate-policy", post(validate_policy))
        .route("/mutate-pod", post(mutate_pod))
        .with_state(state);
    let addr = args.webhook_listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 9443)));
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Listen { addr, source })?;
    if let Ok(bound) = listener.local_addr() {
        tracing::info!(address = %bound, "webhooks listening");
    }
    let task = tokio::spawn(async move {
        if let Err(error) = crate::listen::serve(listener, app, Some(tls), limits, stop).await {
            tracing::error!(%error, "webhook server failed");
        }
    });
    Ok(task)
}

/// What injected sidecars are given to trust and be trusted by the endpoint.
#[derive(Clone, Copy, Debug, Default)]
pub struct SidecarTrust<'a> {
    /// The audience of the projected ServiceAccount token they present (token review on).
    pub token_audience: Option<&'a str>,
    /// The check API serves TLS: give them the CA to verify it with.
    pub verify_endpoint: bool,
}

/// The operator's serving keypair (shared by replicas through a Secret) and the TLS
/// configuration built from it, reloaded in place when the Secret changes. The webhooks and the
/// check API serve the same certificate.
pub struct Certificates {
    /// The pair served now.
    pub current: watch::Receiver<certs::Keypair>,
    pub tls: RustlsConfig,
}

impl Certificates {
    /// Reads (or creates, or replaces when it cannot serve) the shared keypair and starts
    /// following the Secret until `stop` flips, so every replica serves the current pair, the
    /// leader (`leading`) renews it before it expires, and `args`' webhook configurations keep
    /// its CA in caBundle.
    pub async fn load(
        client: &Client,
        args: &WebhookArgs,
        operator_namespace: &str,
        leading: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
        stop: watch::Receiver<bool>,
    ) -> Result<Certificates, Error> {
        let policy = certs::SecretPolicy {
            namespace: operator_namespace.to_string(),
            name: args.secret.clone(),
            hosts: args.hosts.clone(),
            generate: args.generate_certificates,
        };
        let keypair = certs::shared_keypair(client, &policy, &metrics).await?;
        let tls = RustlsConfig::from_pem(keypair.cert_pem.clone().into_bytes(), keypair.key_pem.clone().into_bytes())
            .await
            .map_err(Error::Tls)?;
        certs::record_expiry(&metrics, &keypair);
        let ca_bundles = if args.webhook_listen.is_some() {
            (args.validating_config.clone(), args.mutating_config.clone())
        } else {
            (String::new(), String::new())
        };
        let (current, receiver) = watch::channel(keypair);
        let follower =
            certs::Follower { client: client.clone(), policy, ca_bundles, tls: tls.clone(), current, leading, metrics };
        tokio::spawn(certs::follow_secret(follower, stop));
        Ok(Certificates { current: receiver, tls })
    }
}

fn review_of<T: kube::Resource + serde::de::DeserializeOwned>(
    review: AdmissionReview<T>,
) -> Result<AdmissionRequest<T>, Box<AdmissionResponse>> {
    review.try_into().map_err(|e: kube::core::admission::ConvertAdmissionReviewError| {
        Box::new(AdmissionResponse::invalid(format!("malformed AdmissionReview: {e}")))
    })
}

async fn validate_policy(
    State(state): State<Arc<AppState>>,
    Json(review): Json<AdmissionReview<RateLimitPolicy>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request = match review_of(review) {
        Ok(r) => r,
        Err(response) => return Json(response.into_review()),
    };
    let response = AdmissionResponse::from(&request);
    let Some(policy) = request.object.as_ref() else {
        // DELETE carries no object; nothing to check.
        return Json(response.into_review());
    };
    let namespace = request.namespace.clone().or_else(|| policy.metadata.namespace.clone()).unwrap_or_default();
    let others = state.namespace_policies(&namespace).await;
    let verdict = validate::review(policy, &namespace, &others, state.fallback_replicas);
    let mut response = match verdict.denial {
        Some(message) => response.deny(message),
        None => response,
    };
    if !verdict.warnings.is_empty() {
        response.warnings = Some(verdict.warnings);
    }
    Json(response.into_review())
}

impl AppState {
    /// The other policies of `namespace`: from the reflector when it holds any of them; otherwise
    /// (a namespace outside `--namespaces`, or one with no policy yet) listed from the API server,
    /// so an operator limited to some namespaces still validates all.
    async fn namespace_policies(&self, namespace: &str) -> Vec<RateLimitPolicy> {
        let cached: Vec<RateLimitPolicy> = self
            .policies
            .iter()
            .flat_map(|s| s.state())
            .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
            .map(|p| (*p).clone())
            .collect();
        if !cached.is_empty() {
            return cached;
        }
        let api: kube::Api<RateLimitPolicy> = kube::Api::namespaced(self.client.clone(), namespace);
        match api.list(&Default::default()).await {
            Ok(list) => list.items,
            Err(error) => {
                // Conflicts are a second line of defence (compile keeps both rules apart anyway);
                // an API hiccup must not block every apply.
                tracing::warn!(%error, "cannot list policies for the conflict check");
                Vec::new()
            }
        }
    }
}

async fn mutate_pod(
    State(state): State<Arc<AppState>>,
    Json(review): Json<AdmissionReview<Pod>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request = match review_of(review) {
        Ok(r) => r,
        Err(response) => return Json(response.into_review()),
    };
    let response = AdmissionResponse::from(&request);
    let Some(pod) = request.object.as_ref() else {
        return Json(response.into_review());
    };
    let namespace = request.namespace.clone().or_else(|| pod.metadata.namespace.clone()).unwrap_or_default();
    let injection = match &state.endpoint_ca {
        // The CA of the pair served now: a rotation reaches pods injected from then on.
        Some(current) => {
            let mut config = state.inject.clone();
            config.endpoint_ca_pem = Some(current.borrow().ca_pem.clone());
            inject::patch(pod, &namespace, &config)
        }
        None => inject::patch(pod, &namespace, &state.inject),
    };
    state.metrics.pod_admissions.get_or_create(&ResultLabels { result: injection.outcome.as_str() }).inc();
    if !injection.warnings.is_empty() {
        // Pods are mostly created by controllers, which drop admission warnings: log them too.
        let pod_name = pod.metadata.name.clone().or_else(|| pod.metadata.generate_name.clone()).unwrap_or_default();
        for warning in &injection.warnings {
            tracing::warn!(namespace = %namespace, pod = %pod_name, "{warning}");
        }
        state.metrics.injection_warnings.inc_by(injection.warnings.len() as u64);
    }
    let mut response = response;
    if !injection.warnings.is_empty() {
        response.warnings = Some(injection.warnings);
    }
    match injection.patch {
        None => Json(response.into_review()),
        Some(patch) => match response.clone().with_patch(patch) {
            Ok(patched) => Json(patched.into_review()),
            Err(error) => {
                // failurePolicy is Ignore, but answering "allowed, unchanged" is clearer than an error.
                tracing::error!(%error, "cannot serialize the injection patch");
                Json(response.into_review())
            }
        },
    }
}
