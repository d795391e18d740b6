//! Envoy's global rate limit service: gRPC `envoy.service.ratelimit.v3.RateLimitService`
//! (`ShouldRateLimit`) and `grpc.health.v1`, over the same engine as the HTTP check API.
//!
//! The request's `domain` is the namespace whose policies decide; its descriptors are matched by
//! rules with `match.descriptor` (docs/envoy.md). The caller is established from the
//! `x-sluice-authorization` metadata exactly as for HTTP, and a tenant may only name its own
//! namespace and may not set `hits_addend`.
//!
//! What is answered how: a decision (also one taken by a rule's `onStoreFailure` because the
//! store was slow or away) is `OK` or `OVER_LIMIT` with one status per descriptor. A gRPC error —
//! which hands the decision to the proxy's own `failure_mode_deny` — is returned only for a
//! request Sluice cannot decide: `INVALID_ARGUMENT` (malformed, or a per-descriptor limit
//! override), `UNAUTHENTICATED`, `PERMISSION_DENIED`, or `UNAVAILABLE` (no policies loaded
//! yet, or the credential cannot be verified now).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::auth::{Auth, AuthError, Caller};
use crate::engine::MAX_COST;
use crate::engine::{DescriptorsChecked, Engine, RuleResult};
use crate::policy::Descriptor;
use crate::policy::validate::is_dns_label;
use crate::store::Store;
use crate::telemetry::{CodeLabels, Metrics, ReasonLabels};

/// Descriptors per request; Envoy sends one per matching `rate_limits` action.
pub const MAX_DESCRIPTORS: usize = 64;
/// Entries per descriptor. Longer descriptors match no rule anyway (rules match at most
/// [`crate::policy::crd::MAX_DESCRIPTOR_ENTRIES`]); this bounds what a hostile caller can send.
pub const MAX_ENTRIES: usize = 32;
/// Bytes of one entry's key or value.
pub const MAX_ENTRY_BYTES: usize = 4096;
/// Encoded request size; the HTTP check API's body limit.
pub const MAX_MESSAGE_BYTES: usize = crate::api::MAX_BODY_BYTES;
/// The share of the caller's `grpc-timeout` the store may use before the rules' `onStoreFailure`
/// decides: the rest is for deciding, encoding and the way back, so the answer beats the deadline.
const STORE_SHARE_OF_DEADLINE: f64 = 0.6;

/// Flags of the gRPC listener, shared by `sluice serve` and `sluice operator`.
#[derive(clap::Args, Debug, Clone)]
pub struct GrpcArgs {
    /// Address of Envoy's rate limit service (gRPC `ShouldRateLimit` and `grpc.health.v1`, HTTP/2
    /// cleartext unless --grpc-tls). Off without it.
    #[arg(long, env = "SLUICE_GRPC_LISTEN", value_parser = crate::listen::parse_listen_address)]
    pub grpc_listen: Option<SocketAddr>,
    /// Serve the gRPC listener over TLS with the check API's certificate (`serve`: --tls-cert and
    /// --tls-key; `operator`: the operator's certificate, signed by its CA).
    #[arg(long, env = "SLUICE_GRPC_TLS", default_value_t = false, action = clap::ArgAction::Set)]
    pub grpc_tls: bool,
    /// `on`: answers carry the RateLimit-Policy, RateLimit, X-RateLimit-* and Retry-After headers
    /// of the check API in `response_headers_to_add`. `off` when Envoy computes its own from the
    /// statuses (`enable_x_ratelimit_headers`), to avoid sending them twice.
    #[arg(long, env = "SLUICE_GRPC_RESPONSE_HEADERS", default_value = "on", value_parser = ["on", "off"])]
    pub grpc_response_headers: String,
    /// Concurrent requests (HTTP/2 streams) per connection; Envoy multiplexes every request of a
    /// worker over one connection.
    #[arg(long, env = "SLUICE_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 1024)]
    pub grpc_max_concurrent_streams: u32,
    /// Trust gRPC calls that carry no credential as a gateway's (a credential sent is still
    /// verified). For gateways that cannot add metadata to their rate limit calls (Contour,
    /// Emissary, kgateway); only safe when a NetworkPolicy admits nothing but the gateway to the
    /// gRPC port (docs/security.md).
    #[arg(long, env = "SLUICE_GRPC_UNAUTHENTICATED_GATEWAY", default_value_t = false, action = clap::ArgAction::Set)]
    pub grpc_unauthenticated_gateway: bool,
}

/// The caller of a credential-less call under `--grpc-unauthenticated-gateway`.
pub const UNAUTHENTICATED_GATEWAY: &str = "unauthenticated gRPC gateway";

/// The `RateLimitService` implementation.
pub struct RateLimiter<S> {
    engine: Arc<Engine<S>>,
    auth: Auth,
    response_headers: bool,
    unauthenticated_gateway: bool,
}

impl<S: Store> RateLimiter<S> {
    pub fn new(engine: Arc<Engine<S>>, auth: Auth, response_headers: bool) -> RateLimiter<S> {
        RateLimiter { engine, auth, response_headers, unauthenticated_gateway: false }
    }

    /// The limiter `args` describe.
    pub fn from_args(engine: Arc<Engine<S>>, auth: Auth, args: &GrpcArgs) -> RateLimiter<S> {
        RateLimiter {
            engine,
            auth,
            response_headers: args.grpc_response_headers == "on",
            unauthenticated_gateway: args.grpc_unauthenticated_gateway,
        }
    }

    fn metrics(&self) -> &Metrics {
        self.engine.metrics()
    }

    fn refuse(&self, status: Status) -> Status {
        let code = match status.code() {
            tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
            tonic::Code::Unauthenticated => "UNAUTHENTICATED",
            tonic::Code::PermissionDenied => "PERMISSION_DENIED",
            tonic::Code::Unavailable => "UNAVAILABLE",
            _ => "OTHER",
        };
        self.metrics().rls_requests.get_or_create(&CodeLabels { code }).inc();
        status
    }

    async fn caller(&self, metadata: &tonic::metadata::MetadataMap) -> Result<Caller, Status> {
        let headers: &http::HeaderMap = metadata.as_ref();
        if self.unauthenticated_gateway && !headers.contains_key(super::auth::AUTHORIZATION_HEADER) {
            return Ok(Caller::Gateway { name: UNAUTHENTICATED_GATEWAY.into() });
        }
        self.auth.caller(headers).await.map_err(|error| {
            let reason = match &error {
                AuthError::Missing => "missing",
                AuthError::Invalid(_) => "invalid",
                AuthError::Unavailable(_) => "unavailable",
            };
            self.metrics().auth_failures.get_or_create(&ReasonLabels { reason }).inc();
            match error {
                AuthError::Unavailable(_) => Status::unavailable(error.to_string()),
                _ => Status::unauthenticated(error.to_string()),
            }
        })
    }

    /// The whole `ShouldRateLimit`, with errors as statuses.
    async fn decide(&self, request: Request<RateLimitRequest>) -> Result<RateLimitResponse, Status> {
        let budget = grpc_timeout(request.metadata()).map(store_budget);
        let caller = self.caller(request.metadata()).await?;
        let request = request.into_inner();
        let costs = validate(&request, &caller).map_err(|error| match error {
            Refusal::Invalid(message) => Status::invalid_argument(message),
            Refusal::Forbidden(message) => {
                self.metrics().auth_failures.get_or_create(&ReasonLabels { reason: "forbidden" }).inc();
                Status::permission_denied(message)
            }
        })?;
        if !self.engine.is_loaded() {
            return Err(Status::unavailable("no policies loaded yet"));
        }
        let descriptors: Vec<(&dyn Descriptor, u64)> =
            request.descriptors.iter().zip(costs).map(|(d, cost)| (d as &dyn Descriptor, cost)).collect();
        let checked = self.engine.check_descriptors(&request.domain, &descriptors, budget, caller.is_trusted()).await;
        Ok(answer(&checked, self.response_headers))
    }
}

#[tonic::async_trait]
impl<S: Store> RateLimitService for RateLimiter<S> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        match self.decide(request).await {
            Ok(response) => {
                let code = if response.overall_code == Code::OverLimit as i32 { "OVER_LIMIT" } else { "OK" };
                self.metrics().rls_requests.get_or_create(&CodeLabels { code }).inc();
                Ok(Response::new(response))
            }
            Err(status) => Err(self.refuse(status)),
        }
    }
}

impl Descriptor for RateLimitDescriptor {
    fn entry_count(&self) -> usize {
        self.entries.len()
    }
    fn entry(&self, i: usize) -> Option<(&str, &str)> {
        self.entries.get(i).map(|e| (e.key.as_str(), e.value.as_str()))
    }
}

enum Refusal {
    Invalid(String),
    Forbidden(String),
}

/// Checks a request against what Sluice can decide and the caller may ask; returns each
/// descriptor's cost (its own `hits_addend`, else the request's, else 1).
fn validate(request: &RateLimitRequest, caller: &Caller) -> Result<Vec<u64>, Refusal> {
    let domain = &request.domain;
    if !is_dns_label(domain) {
        return Err(Refusal::Invalid(format!(
            "domain {domain:?}: must be the namespace whose policies decide (a DNS label: lowercase letters, digits and '-', at most 63)"
        )));
    }
    caller.require_namespace(domain).map_err(|f| Refusal::Forbidden(f.0))?;
    if request.descriptors.is_empty() {
        return Err(Refusal::Invalid("descriptors: at least one descriptor is needed".into()));
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(Refusal::Invalid(format!(
            "descriptors: at most {MAX_DESCRIPTORS}, got {}",
            request.descriptors.len()
        )));
    }
    let request_cost = if request.hits_addend == 0 { 1 } else { u64::from(request.hits_addend) };
    let mut costs = Vec::with_capacity(request.descriptors.len());
    for (i, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.is_empty() || descriptor.entries.len() > MAX_ENTRIES {
            return Err(Refusal::Invalid(format!(
                "descriptors[{i}]: needs 1 to {MAX_ENTRIES} entries, got {}",
                descriptor.entries.len()
            )));
        }
        for (j, entry) in descriptor.entries.iter().enumerate() {
            if entry.key.is_empty() || entry.key.len() > MAX_ENTRY_BYTES || entry.value.len() > MAX_ENTRY_BYTES {
                return Err(Refusal::Invalid(format!(
                    "descriptors[{i}].entries[{j}]: the key must be 1 to {MAX_ENTRY_BYTES} bytes and the value at most {MAX_ENTRY_BYTES}"
                )));
            }
        }
        if descriptor.limit.is_some() {
            return Err(Refusal::Invalid(format!(
                "descriptors[{i}].limit: limit overrides are not accepted; limits are set by RateLimitPolicies in namespace {domain}"
            )));
        }
        if descriptor.is_negative_hits {
            return Err(Refusal::Invalid(format!("descriptors[{i}].is_negative_hits: refunds are not supported")));
        }
        // A descriptor's own hits_addend overrides the request's, 0 included (Envoy's check
        // without consuming: what a gateway sends to admit a request whose cost it reports later).
        let cost = match descriptor.hits_addend {
            Some(hits) => hits.value,
            None => request_cost,
        };
        if cost > MAX_COST {
            return Err(Refusal::Invalid(format!("descriptors[{i}].hits_addend: at most {MAX_COST}")));
        }
        costs.push(cost);
    }
    let sets_cost = request.hits_addend > 1 || costs.iter().any(|&c| c > 1);
    if sets_cost && !caller.is_trusted() {
        return Err(Refusal::Forbidden(format!(
            "hits_addend: caller {} may not set the cost of a request (gateways may)",
            caller.name()
        )));
    }
    Ok(costs)
}

/// The caller's deadline from `grpc-timeout` (`<digits><unit>`, units H M S m u n; gRPC over
/// HTTP/2 spec).
fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long the store may take within a caller's deadline (the store's own timeout still
/// applies when it is shorter).
fn store_budget(deadline: Duration) -> Duration {
    deadline.mul_f64(STORE_SHARE_OF_DEADLINE)
}

/// The response: the overall code, one status per descriptor, and (optionally) the headers.
fn answer(checked: &DescriptorsChecked, response_headers: bool) -> RateLimitResponse {
    let response = &checked.response;
    let statuses = checked.rules_of.iter().map(|indices| descriptor_status(&response.rules, indices)).collect();
    let response_headers_to_add = if response_headers {
        response.headers.iter().map(|(key, value)| header(key, value)).collect()
    } else {
        Vec::new()
    };
    RateLimitResponse {
        overall_code: if response.allowed { Code::Ok } else { Code::OverLimit } as i32,
        statuses,
        response_headers_to_add,
        ..RateLimitResponse::default()
    }
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue { key: key.to_string(), value: value.to_string(), ..HeaderValue::default() }
}

/// One descriptor's status, from the rules it matched: the most restrictive enforcing rule (one
/// that refused, else the least remaining); shadow rules only when no enforcing rule matched,
/// and then always `OK`. Without rules: `OK` and no limit.
fn descriptor_status(rules: &[RuleResult], indices: &[usize]) -> DescriptorStatus {
    // Rules a cached denial left undecided only speak for a descriptor nothing else reports on.
    let decided = indices.iter().filter_map(|&i| rules.get(i)).any(|r| !r.not_decided);
    let candidates = || indices.iter().filter_map(|&i| rules.get(i)).filter(move |r| !decided || !r.not_decided);
    let enforcing = candidates().filter(|r| !r.shadow).min_by_key(|r| (r.allowed, r.remaining));
    let Some(rule) = enforcing.or_else(|| candidates().min_by_key(|r| r.remaining)) else {
        return DescriptorStatus { code: Code::Ok as i32, ..DescriptorStatus::default() };
    };
    let over = !rule.allowed && !rule.shadow;
    let (requests_per_unit, unit) = per_unit(rule.limit, rule.quota_window_ms);
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: Some(RateLimit { name: rule_name(rule), requests_per_unit, unit: unit as i32 }),
        limit_remaining: u32::try_from(rule.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(proto_duration(Duration::from_millis(rule.reset_ms))),
        ..DescriptorStatus::default()
    }
}

/// `policy/rule`, without the namespace the caller named as its domain.
fn rule_name(rule: &RuleResult) -> String {
    let policy = rule.policy.rsplit_once('/').map_or(&*rule.policy, |(_, name)| name);
    format!("{policy}/{}", rule.rule)
}

const UNITS: [(Unit, u64); 5] = [
    (Unit::Second, 1_000),
    (Unit::Minute, 60_000),
    (Unit::Hour, 3_600_000),
    (Unit::Day, 86_400_000),
    (Unit::Week, 604_800_000),
];

/// A quota of `capacity` per `window_ms` as Envoy's `requests_per_unit` per `unit`: exact when
/// the window is one unit; otherwise the smallest unit at least as long as the window (a week for
/// longer windows), with the quota scaled to it at the same rate, rounded down, at least 1:
/// 10 per 30s reads 20 per minute, 100 per 90m reads 1600 per day.
fn per_unit(capacity: u64, window_ms: u64) -> (u32, Unit) {
    let window_ms = window_ms.max(1);
    let (unit, unit_ms) = UNITS.iter().copied().find(|&(_, ms)| ms >= window_ms).unwrap_or(UNITS[UNITS.len() - 1]);
    let scaled = if unit_ms == window_ms {
        capacity
    } else {
        (u128::from(capacity) * u128::from(unit_ms) / u128::from(window_ms)).try_into().unwrap_or(u64::MAX)
    };
    (u32::try_from(scaled.max(1)).unwrap_or(u32::MAX), unit)
}

fn proto_duration(d: Duration) -> ProtoDuration {
    ProtoDuration { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

/// Serves the rate limit service and `grpc.health.v1` on `listener` until `shutdown` flips:
/// health says `SERVING` once the engine has a snapshot and `NOT_SERVING` from the moment the
/// drain starts; then in-flight calls finish and connections get a GOAWAY.
pub async fn serve_grpc<S: Store>(
    listener: TcpListener,
    limiter: RateLimiter<S>,
    args: &GrpcArgs,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let (health, health_task) = health_service(limiter.engine.clone(), shutdown.clone()).await;
    let health = tonic_health::pb::health_server::HealthServer::new(health);
    let service = RateLimitServiceServer::new(limiter).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(args.grpc_max_concurrent_streams)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(health)
        .add_service(service);
    let stopped = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    let served = match tls {
        None => {
            // Without TCP_NODELAY a small answer waits for the peer's delayed ACK (40 ms).
            let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router.serve_with_incoming_shutdown(incoming, stopped).await
        }
        Some(tls) => router.serve_with_incoming_shutdown(tls_incoming(listener, tls), stopped).await,
    };
    health_task.abort();
    served
}

/// `grpc.health.v1` for the server (`""`) and the rate limit service: `NOT_SERVING` until the
/// engine has a snapshot, `SERVING` from then on, `NOT_SERVING` again once `shutdown` flips.
pub async fn health_service<S: Store>(
    engine: Arc<Engine<S>>,
    mut shutdown: watch::Receiver<bool>,
) -> (tonic_health::server::HealthService, tokio::task::JoinHandle<()>) {
    let reporter = tonic_health::server::HealthReporter::new();
    let service_name = <RateLimitServiceServer<RateLimiter<S>> as tonic::server::NamedService>::NAME;
    for name in ["", service_name] {
        reporter.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
    }
    let service = tonic_health::server::HealthService::from_health_reporter(reporter.clone());
    let task = tokio::spawn(async move {
        let mut poll = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = poll.tick() => if engine.is_loaded() { break },
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
        }
        for name in ["", service_name] {
            reporter.set_service_status(name, tonic_health::ServingStatus::Serving).await;
        }
        let _ = shutdown.wait_for(|stop| *stop).await;
        for name in ["", service_name] {
            reporter.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
        }
    });
    (service, task)
}

/// Accepted connections after their TLS handshake, each handshake in its own task so a slow
/// client cannot hold up the others. The certificate is read per connection, so a renewed one is
/// served from the next connection on.
fn tls_incoming(
    listener: TcpListener,
    tls: axum_server::tls_rustls::RustlsConfig,
) -> impl futures::Stream<Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>> {
    const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::debug!(%error, "gRPC accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let mut config = (*tls.get_inner()).clone();
            config.alpn_protocols = vec![b"h2".to_vec()];
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(error)) => tracing::debug!(%peer, %error, "gRPC TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "gRPC TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_stated_per_the_smallest_unit_that_holds_them() {
        assert_eq!(per_unit(100, 1_000), (100, Unit::Second));
        assert_eq!(per_unit(100, 60_000), (100, Unit::Minute));
        assert_eq!(per_unit(10, 30_000), (20, Unit::Minute));
        assert_eq!(per_unit(10, 500), (20, Unit::Second));
        assert_eq!(per_unit(100, 5_400_000), (1600, Unit::Day));
        assert_eq!(per_unit(7, 604_800_000), (7, Unit::Week));
        assert_eq!(per_unit(1, 30 * 86_400_000), (1, Unit::Week), "at least 1");
        assert_eq!(per_unit(u64::MAX, 1), (u32::MAX, Unit::Second), "saturates");
    }

    #[tokio::test]
    async fn health_follows_the_first_snapshot_and_the_drain() {
        use tonic_health::pb::health_server::Health;
        use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
        let clock = Arc::new(crate::clock::SystemClock);
        let store = Arc::new(crate::store::memory::MemoryStore::new(16));
        let engine = Arc::new(Engine::new(store, clock, Arc::new(Metrics::new())));
        let (stop, stopped) = watch::channel(false);
        let (health, _task) = health_service(engine.clone(), stopped).await;
        let status = |service: &'static str| {
            let health = &health;
            async move {
                let request = tonic::Request::new(HealthCheckRequest { service: service.into() });
                health.check(request).await.expect("known service").into_inner().status
            }
        };
        let service = "envoy.service.ratelimit.v3.RateLimitService";
        assert_eq!(status("").await, ServingStatus::NotServing as i32, "no snapshot yet");
        assert_eq!(status(service).await, ServingStatus::NotServing as i32);
        engine.install(Arc::new(crate::policy::Snapshot::default()));
        let serving = async {
            while status(service).await != ServingStatus::Serving as i32 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), serving).await.expect("SERVING once loaded");
        assert_eq!(status("").await, ServingStatus::Serving as i32);
        stop.send(true).unwrap();
        let draining = async {
            while status("").await != ServingStatus::NotServing as i32 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), draining).await.expect("NOT_SERVING on drain");
    }

    #[test]
    fn grpc_timeouts_parse_per_the_spec() {
        let timeout = |text: &str| {
            let mut metadata = tonic::metadata::MetadataMap::new();
            metadata.insert("grpc-timeout", text.parse().unwrap());
            grpc_timeout(&metadata)
        };
        assert_eq!(timeout("20m"), Some(Duration::from_millis(20)));
        assert_eq!(timeout("1S"), Some(Duration::from_secs(1)));
        assert_eq!(timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(timeout("500u"), Some(Duration::from_micros(500)));
        assert_eq!(timeout("123456789m"), None, "at most 8 digits");
        assert_eq!(timeout("m"), None);
        assert_eq!(timeout("20x"), None);
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}
