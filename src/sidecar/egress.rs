//! The egress path (`spec.egress`): the application sends plain HTTP to `127.0.0.1:<listenPort>`;
//! each request asks the endpoint for a departure slot in the destination's shared budget,
//! waits here for it (bounded in count and bytes), then goes to the destination, over TLS for
//! an `https://` one, verified against the system roots or the entry's `caBundle`.
//!
//! A request whose wait would pass `maxDelay` or its caller's own deadline (`grpc-timeout`, or
//! the entry's `deadlineHeader`) is refused at once with 429 and `Retry-After`. The body is read
//! before the wait, so a caller that goes away is noticed (hyper ends the connection's task on
//! EOF) and its slot is given back (`POST /v1/cancel`) where the algorithm allows. While the
//! endpoint is away, this pod's copy of the snapshot shapes locally: the downstream then sees at
//! most the rate per pod, not in total (docs/egress.md).
//!
//! Listeners follow the snapshots: an entry offered to this pod gets its port bound the first
//! time a snapshot offers it; an entry withdrawn leaves its port answering 503.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::sync::{Semaphore, watch};

use super::decide::Decider;
use super::metrics::{OutcomeLabels, SidecarMetrics};
use crate::api::check::{CheckAnswer, CheckInput};
use crate::engine::Holds;
use crate::policy::Snapshot;
use crate::policy::egress::{CompiledEgress, Destination};

/// On each egress response: the milliseconds the request waited for its departure slot.
pub const WAITED: HeaderName = HeaderName::from_static("sluice-egress-waited-ms");

type DestinationClient = super::endpoint::EndpointClient;

/// What one port forwards to, rebuilt when a snapshot changes the entry.
struct Route {
    name: String,
    /// The policy offering it, for messages.
    policy: String,
    destination: Destination,
    /// `host[:port]`, the port left out when it is the scheme's own.
    host_header: HeaderValue,
    client: DestinationClient,
    waiting: Arc<Semaphore>,
    max_body_bytes: usize,
    deadline_header: Option<HeaderName>,
}

/// A bound egress port: its route now (`None`: no longer offered).
struct Port {
    route: ArcSwapOption<Route>,
    egress: Arc<Egress>,
}

/// The egress listeners of this pod.
pub struct Egress {
    decider: Arc<Decider>,
    metrics: Arc<SidecarMetrics>,
    cancel_uri: Uri,
    /// Each entry's terms as last built, by port, to rebuild a route only when they change.
    bound: parking_lot::Mutex<HashMap<u16, (String, Arc<Port>)>>,
}

/// The entries a snapshot offers this pod (with the policy offering each), as the ports follow them.
pub type Offered = Vec<(String, OfferedEntry)>;

#[derive(Clone)]
pub struct OfferedEntry {
    name: String,
    destination: Destination,
    listen_port: u16,
    ca_bundle: Option<String>,
    max_waiting: u32,
    max_body_bytes: u64,
    deadline_header: Option<String>,
}

impl OfferedEntry {
    fn of(entry: &CompiledEgress) -> OfferedEntry {
        OfferedEntry {
            name: entry.name.clone(),
            destination: entry.destination.clone(),
            listen_port: entry.listen_port,
            ca_bundle: entry.ca_bundle.clone(),
            max_waiting: entry.max_waiting,
            max_body_bytes: entry.max_body_bytes,
            deadline_header: entry.deadline_header.clone(),
        }
    }

    /// What a route is built from: a change rebuilds it (a new client, a new queue bound).
    fn terms(&self) -> String {
        format!(
            "{}|{}|{}|{:?}|{}|{}|{:?}",
            self.name,
            self.destination.authority(),
            self.destination.tls,
            self.ca_bundle,
            self.max_waiting,
            self.max_body_bytes,
            self.deadline_header
        )
    }
}

impl Egress {
    pub fn new(decider: Arc<Decider>, metrics: Arc<SidecarMetrics>, cancel_uri: Uri) -> Arc<Egress> {
        Arc::new(Egress { decider, metrics, cancel_uri, bound: parking_lot::Mutex::new(HashMap::new()) })
    }

    /// What a snapshot offers a pod of `namespace` with `labels`, sent to [`Self::follow`].
    pub fn offered(
        snapshot: &Snapshot,
        namespace: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Offered {
        snapshot
            .egress_for(namespace, labels)
            .into_iter()
            .map(|(policy, entry)| (policy.to_string(), OfferedEntry::of(entry)))
            .collect()
    }

    /// Binds and updates the ports as `offers` says, until `stop`.
    pub async fn follow(self: Arc<Self>, mut offers: watch::Receiver<Offered>, stop: watch::Receiver<bool>) {
        loop {
            let offered = offers.borrow_and_update().clone();
            self.reconcile(&offered, &stop).await;
            if offers.changed().await.is_err() {
                return;
            }
        }
    }

    async fn reconcile(self: &Arc<Self>, offered: &Offered, stop: &watch::Receiver<bool>) {
        let mut taken: Vec<u16> = Vec::new();
        for (policy, entry) in offered {
            let port = entry.listen_port;
            if taken.contains(&port) {
                tracing::error!(port, policy, egress = %entry.name, "two egress entries offered to this pod name one listen port: this one is not served");
                continue;
            }
            taken.push(port);
            let terms = format!("{policy}|{}", entry.terms());
            let existing = self.bound.lock().get(&port).cloned();
            // An unchanged entry keeps its route: building one reads the system roots from disk.
            if existing.as_ref().is_some_and(|(old, slot)| *old == terms && slot.route.load().is_some()) {
                continue;
            }
            let route = match build_route(policy, entry) {
                Ok(route) => Arc::new(route),
                Err(error) => {
                    tracing::error!(port, policy, egress = %entry.name, %error, "egress entry cannot be served");
                    continue;
                }
            };
            match existing {
                Some((_, slot)) => {
                    slot.route.store(Some(route));
                    self.bound.lock().insert(port, (terms, slot));
                }
                None => {
                    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                    let listener = match tokio::net::TcpListener::bind(address).await {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::error!(%address, policy, egress = %entry.name, %error, "cannot listen for egress requests");
                            continue;
                        }
                    };
                    let slot = Arc::new(Port { route: ArcSwapOption::new(Some(route)), egress: self.clone() });
                    tracing::info!(%address, egress = %entry.name, destination = %entry.destination.authority(), tls = entry.destination.tls, "egress listening");
                    let app = Router::new().fallback(forward).with_state(slot.clone());
                    tokio::spawn(crate::listen::serve(
                        listener,
                        app,
                        None,
                        crate::listen::ConnectionLimits::default(),
                        stop.clone(),
                    ));
                    self.bound.lock().insert(port, (terms, slot));
                }
            }
        }
        for (port, (_, slot)) in self.bound.lock().iter() {
            if !taken.contains(port) {
                slot.route.store(None);
            }
        }
    }

    fn count(&self, outcome: &'static str) {
        self.metrics.egress.get_or_create(&OutcomeLabels { outcome }).inc();
    }
}

fn build_route(policy: &str, entry: &OfferedEntry) -> Result<Route, String> {
    let destination = &entry.destination;
    let default_port = if destination.tls { 443 } else { 80 };
    let host =
        if destination.host.contains(':') { format!("[{}]", destination.host) } else { destination.host.clone() };
    let host_header = if destination.port == default_port { host } else { format!("{host}:{}", destination.port) };
    let host_header = HeaderValue::from_str(&host_header).map_err(|e| format!("host {host_header:?}: {e}"))?;
    Ok(Route {
        name: entry.name.clone(),
        policy: policy.to_string(),
        destination: destination.clone(),
        host_header,
        client: destination_client(entry.ca_bundle.as_deref())?,
        waiting: Arc::new(Semaphore::new(entry.max_waiting as usize)),
        max_body_bytes: usize::try_from(entry.max_body_bytes).unwrap_or(usize::MAX),
        deadline_header: entry.deadline_header.as_deref().and_then(|h| HeaderName::from_bytes(h.as_bytes()).ok()),
    })
}

/// The client to a destination: plain HTTP, or TLS verified against `ca_bundle` when given,
/// else the system's roots.
fn destination_client(ca_bundle: Option<&str>) -> Result<DestinationClient, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_bundle {
        Some(pem) => {
            use rustls::pki_types::CertificateDer;
            use rustls::pki_types::pem::PemObject;
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|e| format!("caBundle: {e}"))?;
                roots.add(cert).map_err(|e| format!("caBundle: {e}"))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
        }
    }
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    http.enforce_http(false);
    super::endpoint::pooled_client(roots, http)
}

/// An answer made here, with what it is about.
fn plain(status: StatusCode, detail: String, retry_after_secs: Option<u64>) -> Response {
    let mut response = (status, format!("{detail}\n")).into_response();
    if let Some(secs) = retry_after_secs {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    response
}

/// The caller's own deadline in ms: `grpc-timeout` (gRPC's units), or the entry's header (ms).
fn deadline_ms(headers: &HeaderMap, declared: Option<&HeaderName>) -> Option<u64> {
    let grpc = headers.get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(|text| {
        let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
        let n: u64 = digits.parse().ok()?;
        Some(match unit {
            "H" => n.saturating_mul(3_600_000),
            "M" => n.saturating_mul(60_000),
            "S" => n.saturating_mul(1_000),
            "m" => n,
            "u" => n / 1_000,
            "n" => n / 1_000_000,
            _ => return None,
        })
    });
    let own = declared.and_then(|name| headers.get(name)).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    match (grpc, own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
    .map(|ms| ms.min(crate::api::check::MAX_DEADLINE_MS))
}

/// A slot granted and not yet departed: dropped before [`Self::departed`], its caller left and
/// the slot goes back.
struct Waiting {
    egress: Arc<Egress>,
    name: String,
    slot: Option<(String, bool)>,
}

impl Waiting {
    fn departed(mut self) {
        self.slot = None;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some((slot, local)) = self.slot.take() else { return };
        let egress = self.egress.clone();
        let name = std::mem::take(&mut self.name);
        egress.count("abandoned");
        tokio::spawn(async move { egress.give_back(&name, &slot, local).await });
    }
}

/// What the budget said about one request.
enum Answer {
    Depart { delay: Duration, slot: Option<String>, local: bool },
    Refused { status: StatusCode, retry_after_ms: Option<u64>, detail: String },
}

impl Egress {
    fn input<'a>(&'a self, name: &'a str, deadline_ms: Option<u64>, slot: Option<&'a str>) -> CheckInput<'a> {
        CheckInput {
            namespace: &self.decider.namespace,
            labels: &self.decider.labels,
            method: "GET",
            path: "/",
            host: None,
            client_ip: std::net::IpAddr::V4(Ipv4Addr::LOCALHOST),
            headers: Default::default(),
            request_fields: Default::default(),
            egress: Some(name),
            deadline_ms,
            slot,
        }
    }

    /// Asks the endpoint for a slot; while it cannot answer, this pod's snapshot decides.
    async fn ask(&self, name: &str, deadline_ms: Option<u64>) -> Answer {
        let input = self.input(name, deadline_ms, None);
        let endpoint = self.decider.endpoint();
        let asked = match serde_json::to_vec(&input) {
            Ok(body) => endpoint.post(&endpoint.check_uri, Bytes::from(body)).await.ok(),
            Err(_) => None,
        };
        if let Some((status, body)) = asked {
            if status.is_success()
                && let Ok(answer) = serde_json::from_slice::<CheckAnswer>(&body)
            {
                return match answer.allowed {
                    Some(true) => Answer::Depart {
                        delay: Duration::from_millis(answer.delay_ms),
                        slot: answer.slot,
                        local: false,
                    },
                    _ => Answer::Refused {
                        status: StatusCode::TOO_MANY_REQUESTS,
                        retry_after_ms: answer.retry_after_ms,
                        detail: format!("egress {name}: no slot within the wait allowed"),
                    },
                };
            }
            if status.is_client_error() {
                return Answer::Refused {
                    status: StatusCode::BAD_GATEWAY,
                    retry_after_ms: None,
                    detail: format!(
                        "egress {name}: the endpoint refused the check ({status}): {}",
                        String::from_utf8_lossy(&body).trim()
                    ),
                };
            }
        }
        // The endpoint is away: this pod's copy of the policies shapes, alone.
        let local = self.decider.snapshots.local();
        let response = local.check(&input.view(), Holds::Returned).await;
        if response.allowed {
            Answer::Depart { delay: Duration::from_millis(response.delay_ms), slot: response.slot, local: true }
        } else {
            Answer::Refused {
                status: StatusCode::TOO_MANY_REQUESTS,
                retry_after_ms: response.retry_after_ms,
                detail: format!(
                    "egress {name}: no slot within the wait allowed (decided in this pod: the endpoint is away)"
                ),
            }
        }
    }

    async fn give_back(&self, name: &str, slot: &str, local: bool) {
        if local {
            if let Some(slots) = crate::engine::parse_slot(slot) {
                let input = self.input(name, None, None);
                let _ = self.decider.snapshots.local().cancel(&input.view(), &slots).await;
            }
            return;
        }
        let input = self.input(name, None, Some(slot));
        if let Ok(body) = serde_json::to_vec(&input)
            && let Err(error) = self.decider.endpoint().post(&self.cancel_uri, Bytes::from(body)).await
        {
            tracing::debug!(%error, egress = name, "an abandoned egress slot was not given back");
        }
    }
}

/// Hop-by-hop headers, never forwarded (RFC 9110 §7.6.1), and the egress path's own.
fn forwarded(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

async fn forward(State(port): State<Arc<Port>>, request: Request) -> Response {
    let egress = port.egress.clone();
    let Some(route) = port.route.load_full() else {
        egress.count("undeclared");
        return plain(StatusCode::SERVICE_UNAVAILABLE, "no egress entry is offered on this port now".into(), None);
    };
    // Bounded: a waiting request holds a permit until it departs or is refused.
    let Ok(_permit) = route.waiting.clone().try_acquire_owned() else {
        egress.count("queue_full");
        return plain(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("egress {}: this pod already holds its most waiting requests (maxWaiting)", route.name),
            Some(1),
        );
    };
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, route.max_body_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                egress.count("too_large");
                return plain(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("egress {}: body larger than maxBodyBytes ({})", route.name, route.max_body_bytes),
                    None,
                );
            }
            egress.count("failed");
            return plain(
                StatusCode::BAD_REQUEST,
                format!("egress {}: cannot read the body: {error}", route.name),
                None,
            );
        }
    };
    let deadline = deadline_ms(&parts.headers, route.deadline_header.as_ref());
    let delay = match egress.ask(&route.name, deadline).await {
        Answer::Refused { status, retry_after_ms, detail } => {
            egress.count("refused");
            return plain(status, detail, retry_after_ms.map(|ms| ms.div_ceil(1000)));
        }
        Answer::Depart { delay, slot, local } => {
            // Dropped with this future if the caller leaves while it waits: the slot goes back.
            let waiting = Waiting { egress: egress.clone(), name: route.name.clone(), slot: slot.map(|s| (s, local)) };
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            waiting.departed();
            delay
        }
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let scheme = if route.destination.tls { "https" } else { "http" };
    let uri = match format!("{scheme}://{}{path}", route.destination.authority()).parse::<Uri>() {
        Ok(uri) => uri,
        Err(error) => {
            egress.count("failed");
            return plain(StatusCode::BAD_REQUEST, format!("egress {}: bad path: {error}", route.name), None);
        }
    };
    let mut outbound = http::Request::builder().method(parts.method).uri(uri);
    if let Some(headers) = outbound.headers_mut() {
        for (name, value) in parts.headers.iter().filter(|(name, _)| forwarded(name)) {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(header::HOST, route.host_header.clone());
    }
    let Ok(outbound) = outbound.body(Full::new(body)) else {
        egress.count("failed");
        return plain(StatusCode::BAD_REQUEST, format!("egress {}: request not forwardable", route.name), None);
    };
    match route.client.request(outbound).await {
        Ok(response) => {
            egress.count("sent");
            let (mut parts, body) = response.into_parts();
            // How long the request waited for its slot, as the budget decided it.
            parts.headers.insert(WAITED, HeaderValue::from(delay.as_millis() as u64));
            Response::from_parts(parts, Body::new(body))
        }
        Err(error) => {
            egress.count("failed");
            plain(
                StatusCode::BAD_GATEWAY,
                format!(
                    "egress {} (policy {}): {} did not answer: {}",
                    route.name,
                    route.policy,
                    route.destination.authority(),
                    super::verdict::error_chain(&error)
                ),
                None,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_deadline_is_read_from_grpc_timeout_or_the_declared_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(deadline_ms(&headers, None), None);
        headers.insert("grpc-timeout", HeaderValue::from_static("250m"));
        assert_eq!(deadline_ms(&headers, None), Some(250));
        headers.insert("grpc-timeout", HeaderValue::from_static("2S"));
        let declared = HeaderName::from_static("x-deadline-ms");
        headers.insert("x-deadline-ms", HeaderValue::from_static("900"));
        assert_eq!(deadline_ms(&headers, Some(&declared)), Some(900), "the nearer of the two");
        headers.insert("grpc-timeout", HeaderValue::from_static("bogus"));
        assert_eq!(deadline_ms(&headers, Some(&declared)), Some(900));
        headers.insert("x-deadline-ms", HeaderValue::from_static("99999999999"));
        assert_eq!(deadline_ms(&headers, Some(&declared)), Some(crate::api::check::MAX_DEADLINE_MS));
    }

    #[test]
    fn hop_by_hop_headers_and_host_stay_behind() {
        for name in ["connection", "transfer-encoding", "host", "upgrade", "proxy-authorization"] {
            assert!(!forwarded(&HeaderName::from_static(name)), "{name}");
        }
        for name in ["authorization", "content-type", "x-request-id"] {
            assert!(forwarded(&HeaderName::from_static(name)), "{name}");
        }
    }
}
