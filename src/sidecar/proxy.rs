//! The reverse proxy: one hyper service per client connection (HTTP/1.1 keep-alive or h2c),
//! a decision per request, then the request streamed to the application and its response
//! streamed back. Bodies are never collected; upgrades (WebSocket) are spliced byte for byte.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::connect::{Acknowledger, UpstreamConnector};
use super::decide::Decider;
use super::deferral::{self, Deferral, Offered};
use super::metering::Metering;
use super::metrics::SidecarMetrics;
use super::overload::{Protection, Shed, Slot};
use super::stale::{self, StaleCache};
use super::verdict::{Decision, Declared, HeaderList, Held, Refusal, error_chain};
use crate::api::check::CheckInput;
use crate::api::check::{MAX_PATH_LEN, check_path};
use crate::engine::SettleCost;
use crate::request::{forwarded, headers, host};

/// What the proxy answers with: the application's streaming body, or a small one of its own.
pub type ProxyBody = Either<Releasing<Incoming>, Full<Bytes>>;

/// Most bytes of a request body read for the fields an estimate needs (`responseCost.estimate.
/// requestField`); a longer body reserves the estimate's cap.
pub const MAX_ESTIMATE_BODY: usize = 1024 * 1024;
/// Under overload protection, a body of a declared length up to this is read whole before the
/// request takes a slot, so a client slow to send it holds no slot meanwhile (nginx buffers
/// request bodies the same way). A longer or unannounced (chunked, streamed) body is sent on
/// as it arrives, and its request holds its slot while the body arrives.
pub const MAX_BUFFERED_BODY: usize = 64 * 1024;
/// How long a client has to send what is read ahead of the decision: past it the request is
/// answered 408, and what was read is dropped.
pub const READ_AHEAD_DEADLINE: Duration = Duration::from_secs(10);
/// Bytes of request bodies read ahead and not yet forwarded, across every connection of the
/// sidecar: far below the injected sidecar's 256 MiB memory limit. Once it is spent, estimates
/// take their cap and bodies are forwarded as they arrive.
pub const READ_AHEAD_BUDGET: usize = 32 * 1024 * 1024;
/// Bytes of responses kept for `staleIfLimited` reads when `--stale-cache-bytes` does not say.
pub const DEFAULT_STALE_CACHE_BYTES: usize = 16 * 1024 * 1024;
/// The budget is counted in KiB (a semaphore's permits are u32).
const BUDGET_UNIT: usize = 1024;

/// Settles an admitted request's holds when dropped: when its response body has ended, when
/// the client went away mid-response (hyper drops the body), or when the request never reached
/// the application (an early answer drops it at once), with the cost set by then.
struct Release {
    decider: Arc<Decider>,
    held: Held,
    cost: SettleCost,
}

impl Drop for Release {
    fn drop(&mut self) {
        // At shutdown there may be no runtime left: the holds then run out by themselves.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (decider, held) = (self.decider.clone(), self.held.clone());
            let cost = std::mem::replace(&mut self.cost, SettleCost::AsReserved);
            runtime.spawn(async move { decider.settle(held, cost).await });
        }
    }
}

/// The application's response body, carrying what the request holds until its last frame, and
/// reading its cost on the way (the bytes pass unchanged).
pub struct Releasing<B> {
    inner: B,
    release: Option<Release>,
    metering: Option<Metering>,
    /// Acknowledges what the application sent when the rest keeps us waiting (super::connect).
    acknowledger: Option<Acknowledger>,
    /// A response of a `staleIfLimited` read, kept once its body has ended whole.
    capture: Option<Capture>,
}

/// A response being kept for stale-if-limited reads: its body up to the rule's bound.
struct Capture {
    cache: Arc<StaleCache>,
    key: stale::CacheKey,
    request_headers: HeaderMap,
    status: StatusCode,
    headers: HeaderMap,
    vary: Vec<HeaderName>,
    body: bytes::BytesMut,
    limit: usize,
    metrics: Arc<SidecarMetrics>,
}

impl Capture {
    /// Adds a chunk; false once the body is past the bound (then nothing is kept).
    fn feed(&mut self, data: &Bytes) -> bool {
        if self.body.len() + data.len() > self.limit {
            return false;
        }
        self.body.extend_from_slice(data);
        true
    }

    fn keep(self) {
        self.metrics.stale.get_or_create(&super::metrics::ResultLabels { result: "kept" }).inc();
        self.cache.keep(self.key, &self.request_headers, self.status, self.headers, self.vary, self.body.freeze());
        self.metrics.stale_bytes.set(self.cache.bytes() as i64);
    }
}

impl<B> Releasing<B> {
    /// The body is over: what the request holds is settled (by dropping its release), at the
    /// cost `cost` reads from the metering when the response is metered.
    fn end(&mut self, cost: impl FnOnce(Metering) -> SettleCost) {
        if let Some(mut release) = self.release.take()
            && let Some(metering) = self.metering.take()
        {
            release.cost = cost(metering);
        }
    }
}

impl<B> Drop for Releasing<B> {
    fn drop(&mut self) {
        // Not ended: the client went away.
        self.end(|metering| metering.broken(false));
    }
}

impl<B: hyper::body::Body<Data = Bytes> + Unpin> hyper::body::Body for Releasing<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let (Some(metering), Some(data)) = (self.metering.as_mut(), frame.data_ref()) {
                    metering.feed(data);
                }
                if let (Some(capture), Some(data)) = (self.capture.as_mut(), frame.data_ref())
                    && !capture.feed(data)
                {
                    self.capture = None;
                }
                // hyper stops polling a body that says it has ended: keep it at its last frame.
                if self.inner.is_end_stream()
                    && let Some(capture) = self.capture.take()
                {
                    capture.keep();
                }
            }
            std::task::Poll::Ready(Some(Err(_))) => {
                self.capture = None;
                self.end(|metering| metering.broken(true))
            }
            std::task::Poll::Ready(None) => {
                if let Some(capture) = self.capture.take() {
                    capture.keep();
                }
                self.end(Metering::finish)
            }
            std::task::Poll::Pending => {
                if let Some(acknowledger) = &self.acknowledger {
                    acknowledger.acknowledge();
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The request body the application gets: what was read ahead of the decision (for an
/// estimate's fields), then the rest as it arrives.
pub struct RequestBody {
    read: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Incoming>,
    /// `read`'s share of [`READ_AHEAD_BUDGET`], given back once it is forwarded.
    budget: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl RequestBody {
    fn streaming(body: Incoming) -> RequestBody {
        RequestBody { read: None, trailers: None, rest: Some(body), budget: None }
    }

    fn empty() -> RequestBody {
        RequestBody { read: None, trailers: None, rest: None, budget: None }
    }

    /// Whether more is to come from the client.
    fn is_streaming(&self) -> bool {
        self.rest.as_ref().is_some_and(|rest| !hyper::body::Body::is_end_stream(rest))
    }
}

impl hyper::body::Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        if let Some(read) = self.read.take() {
            self.budget = None;
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(read))));
        }
        if let Some(trailers) = self.trailers.take() {
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::trailers(trailers))));
        }
        match self.rest.as_mut() {
            Some(rest) => std::pin::Pin::new(rest).poll_frame(cx),
            None => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_none() && self.trailers.is_none() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let read = self.read.as_ref().map_or(0, |r| r.len() as u64);
        let mut hint = self.rest.as_ref().map_or_else(|| hyper::body::SizeHint::with_exact(0), |r| r.size_hint());
        // Upper first: SizeHint refuses a lower bound above its upper one.
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + read);
        }
        hint.set_lower(hint.lower() + read);
        hint
    }
}

/// Why a body could not be read ahead.
enum ReadAheadError {
    /// The client broke the body off.
    Broken(hyper::Error),
    /// The client did not send it within [`READ_AHEAD_DEADLINE`].
    Slow,
}

impl From<ReadAheadError> for Refusal {
    fn from(error: ReadAheadError) -> Refusal {
        match error {
            ReadAheadError::Broken(e) => {
                Refusal::new(StatusCode::BAD_REQUEST, format!("the request body broke off: {e}"))
            }
            ReadAheadError::Slow => Refusal::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request body did not arrive within {} s", READ_AHEAD_DEADLINE.as_secs()),
            ),
        }
    }
}

/// Reads up to `limit` bytes of `body` ahead (all of it, when it is shorter), within
/// [`READ_AHEAD_DEADLINE`] and as far as `budget` has room; gives back the body to forward,
/// unchanged, and whether all of it was read.
async fn read_ahead(
    body: Incoming,
    limit: usize,
    budget: &Arc<tokio::sync::Semaphore>,
) -> Result<(RequestBody, bool), ReadAheadError> {
    use http_body_util::BodyExt as _;
    let mut rest = body;
    let mut read = bytes::BytesMut::new();
    let mut trailers = None;
    let mut complete = false;
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    let reading = async {
        while read.len() <= limit {
            match rest.frame().await {
                None => {
                    complete = true;
                    break;
                }
                Some(frame) => match frame.map_err(ReadAheadError::Broken)?.into_data() {
                    Ok(data) => {
                        let units = u32::try_from(data.len().div_ceil(BUDGET_UNIT)).unwrap_or(u32::MAX);
                        match budget.clone().try_acquire_many_owned(units) {
                            Ok(permit) => match held.as_mut() {
                                Some(held) => held.merge(permit),
                                None => held = Some(permit),
                            },
                            // Bytes already taken from the client are forwarded all the same.
                            Err(_) => {
                                read.extend_from_slice(&data);
                                break;
                            }
                        }
                        read.extend_from_slice(&data);
                    }
                    Err(frame) => {
                        trailers = frame.into_trailers().ok();
                        complete = true;
                        break;
                    }
                },
            }
        }
        Ok(())
    };
    match tokio::time::timeout(READ_AHEAD_DEADLINE, reading).await {
        Err(_) => return Err(ReadAheadError::Slow),
        Ok(Err(error)) => return Err(error),
        Ok(Ok(())) => {}
    }
    let read = read.freeze();
    let body = RequestBody {
        read: (!read.is_empty()).then_some(read),
        trailers,
        rest: (!complete).then_some(rest),
        budget: held,
    };
    Ok((body, complete))
}

/// The top-level integer `fields` of a JSON body read whole (none of a partial one: the
/// estimates then take their caps).
fn estimate_fields_of(body: &RequestBody, complete: bool, fields: &[String]) -> BTreeMap<String, String> {
    let mut values = BTreeMap::new();
    let read = body.read.as_deref().unwrap_or_default();
    if complete && let Ok(serde_json::Value::Object(object)) = serde_json::from_slice::<serde_json::Value>(read) {
        for field in fields {
            if let Some(value) = object.get(field).and_then(serde_json::Value::as_u64) {
                values.insert(field.clone(), value.to_string());
            }
        }
    }
    values
}

pub struct Proxy {
    upstream: Authority,
    /// Redirected ports (the `iptables` mode) → the upstream authority with that port.
    inbound: Vec<(u16, Authority)>,
    client: Client<UpstreamConnector, RequestBody>,
    decider: Arc<Decider>,
    /// The application's protection from overload: taken before the rate-limit decision (a shed
    /// request spends no quota), configured by each snapshot the decider's cache installs
    /// ([`Protection::follow_snapshots`]).
    protection: Arc<Protection>,
    trusted_hops: usize,
    metrics: Arc<SidecarMetrics>,
    /// [`READ_AHEAD_BUDGET`] in KiB.
    read_ahead: Arc<tokio::sync::Semaphore>,
    /// Responses kept for `staleIfLimited` reads.
    stale: Arc<StaleCache>,
    /// Where `deferIfLimited` writes go, and their status URLs are answered.
    deferral: Option<Arc<Deferral>>,
}

impl Proxy {
    pub fn new(
        upstream: Authority,
        decider: Arc<Decider>,
        protection: Arc<Protection>,
        trusted_hops: usize,
        metrics: Arc<SidecarMetrics>,
    ) -> Proxy {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            // The Host the client sent is kept; the client must not replace it with the upstream's.
            .set_host(false)
            .build(UpstreamConnector(connector));
        let read_ahead = Arc::new(tokio::sync::Semaphore::new(READ_AHEAD_BUDGET / BUDGET_UNIT));
        let stale = Arc::new(StaleCache::new(DEFAULT_STALE_CACHE_BYTES));
        Proxy {
            upstream,
            inbound: Vec::new(),
            client,
            decider,
            protection,
            trusted_hops,
            metrics,
            read_ahead,
            stale,
            deferral: None,
        }
    }

    /// Queues `deferIfLimited` writes there and answers their status URLs.
    pub fn with_deferral(mut self, deferral: Arc<Deferral>) -> Proxy {
        self.deferral = Some(deferral);
        self
    }

    /// Keeps at most `bytes` of responses for `staleIfLimited` reads (0: none).
    pub fn with_stale_cache_bytes(mut self, bytes: usize) -> Proxy {
        self.stale = Arc::new(StaleCache::new(bytes));
        self
    }

    /// Connections redirected to the sidecar from one of `ports` are forwarded to that port of
    /// the upstream host.
    pub fn with_inbound_ports(mut self, ports: &[u16]) -> Proxy {
        let host = self.upstream.host().to_string();
        self.inbound = ports
            .iter()
            .filter_map(|port| Some((*port, Authority::try_from(format!("{host}:{port}")).ok()?)))
            .collect();
        self
    }

    /// Where a connection accepted as `stream` goes: the port it was sent to when the redirect
    /// brought it from one of the inbound ports, the upstream otherwise.
    pub fn upstream_for(&self, stream: &tokio::net::TcpStream) -> Authority {
        if self.inbound.is_empty() {
            return self.upstream.clone();
        }
        let socket = socket2::SockRef::from(stream);
        let original = match stream.local_addr() {
            Ok(SocketAddr::V6(_)) => socket.original_dst_v6(),
            _ => socket.original_dst_v4(),
        };
        let port = original.ok().and_then(|address| address.as_socket()).map(|address| address.port());
        match port.and_then(|port| self.inbound.iter().find(|(p, _)| *p == port)) {
            Some((_, authority)) => authority.clone(),
            None => self.upstream.clone(),
        }
    }

    pub async fn handle(
        &self,
        peer: SocketAddr,
        upstream: &Authority,
        request: Request<Incoming>,
    ) -> Response<ProxyBody> {
        let mut request = request.map(RequestBody::streaming);
        // The limiter decides on the request the application will get: connection-level headers
        // go before anything is read from the headers. Only a WebSocket upgrade is carried
        // through; any other (h2c above all: it would tunnel unlimited HTTP/2 requests past
        // this one check) is declined, and the request is served as plain HTTP/1.1.
        let upgrade = is_websocket_upgrade(&request);
        headers::strip_hop_by_hop(request.headers_mut(), upgrade);
        if let Err(refusal) = check_target(request.uri()) {
            return self.refuse(refusal);
        }
        // Only the sidecar says a request is a replay.
        request.headers_mut().remove(deferral::DEFERRED_ID_HEADER);
        request.headers_mut().remove(deferral::ATTEMPT_HEADER);
        let client_ip = forwarded::client_ip(request.headers(), peer.ip(), self.trusted_hops);
        let host = match host::request_host(request.headers(), request.uri().authority()) {
            Ok(host) => host.map(str::to_string),
            Err(problem) => return self.refuse(Refusal::new(StatusCode::BAD_REQUEST, problem.to_string())),
        };
        // Taken before the rate-limit check, so a request shed for overload consumes no quota;
        // given back when the application's response head arrives (or the request ends).
        let mut slot: Option<Slot> = None;
        let mut stale_rule = None;
        // A write a `deferIfLimited` rule matches: its terms and its check, as sent.
        let mut defer = None;
        let decision = match self.decider.check_headers(request.headers()).await {
            Err(refusal) => return self.refuse(refusal),
            Ok(Some(headers)) => {
                // Read ahead here (the request's head stays borrowed by the check), forwarded below.
                let mut body = std::mem::replace(request.body_mut(), RequestBody::empty());
                let request_fields = match self.estimate_fields(request.headers(), &mut body).await {
                    Ok(fields) => fields,
                    Err(refusal) => return self.refuse(refusal),
                };
                let input = CheckInput {
                    request_fields,
                    namespace: &self.decider.namespace,
                    labels: &self.decider.labels,
                    method: request.method().as_str(),
                    path: request.uri().path(),
                    host: host.as_deref(),
                    client_ip,
                    headers,
                    egress: None,
                    deadline_ms: None,
                    slot: None,
                };
                if let Some(class) = self.decider.snapshots.classify(&input) {
                    if self.protection.is_on()
                        && let Err(refusal) = self.buffer_small_body(request.headers(), &mut body).await
                    {
                        return self.refuse(refusal);
                    }
                    match self.protection.admit(class).await {
                        Ok(taken) => slot = taken,
                        Err(shed) => return self.shed(shed),
                    }
                }
                if stale::cacheable_request(request.method(), request.headers()) {
                    stale_rule = self.decider.snapshots.stale_for(&input);
                } else if self.deferral.is_some()
                    && let Some(terms) = self.decider.snapshots.defer_for(&input)
                {
                    defer = serde_json::to_value(&input).ok().map(|check| (terms, check));
                }
                let decision = self.decider.decide(&input).await;
                *request.body_mut() = body;
                decision
            }
            Ok(None) => self.decider.undecidable(),
        };
        // Dropped wherever this request ends from here on, which gives its slots back.
        let held: Option<Release>;
        let (delay, rate_headers) = match decision {
            Decision::Deny { retry_after_secs, mut headers, declared, .. } => {
                self.metrics.outcome("limited");
                let mut retry_after_secs = retry_after_secs;
                if let (Some(deferral), Some((terms, check))) = (&self.deferral, defer) {
                    let target = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
                    let (parts, body) = request.into_parts();
                    match deferral.offer(check, &target, &parts.headers, body, &terms).await {
                        Offered::Accepted(answer) => {
                            let (status, mut extra, body) = deferral::accepted(&answer);
                            // The rate-limit headers say the key is limited; no retry is asked for.
                            extra.extend(headers.into_iter().filter(|(name, _)| name != header::RETRY_AFTER));
                            let mut response = Response::new(Either::Right(Full::new(body)));
                            *response.status_mut() = status;
                            *response.headers_mut() = extra;
                            return response;
                        }
                        Offered::TooLarge(limit) => {
                            let detail = format!(
                                "the write is limited, and its body is larger than the {limit} bytes deferIfLimited queues"
                            );
                            return problem(StatusCode::PAYLOAD_TOO_LARGE, "Payload Too Large", &detail, headers);
                        }
                        Offered::Full { retry_after_secs: drain } => {
                            // When the queue will have room, not when the limit would admit.
                            headers.retain(|(name, _)| name != header::RETRY_AFTER);
                            retry_after_secs = Some(drain);
                        }
                        Offered::Failed => {}
                    }
                    return match declared {
                        Some(declared) => declared_refusal(declared, retry_after_secs, headers),
                        None => too_many_requests(retry_after_secs, headers),
                    };
                }
                if let Some(rule) = stale_rule {
                    let key = cache_key(host.as_deref(), request.uri());
                    let kept = self.stale.serve(&key, request.headers(), Duration::from_micros(rule.max_stale));
                    let result = if kept.is_some() { "served" } else { "miss" };
                    self.metrics.stale.get_or_create(&super::metrics::ResultLabels { result }).inc();
                    if let Some((kept, age)) = kept {
                        if let Some(every) = rule.revalidate_every
                            && self.stale.claim_revalidation(&key, Duration::from_micros(every))
                        {
                            self.revalidate(&request, key, upstream, peer, host.as_deref(), rule.max_entry_bytes);
                        }
                        return stale_answer(kept, age, request.method() == Method::HEAD, headers);
                    }
                }
                return match declared {
                    Some(declared) => declared_refusal(declared, retry_after_secs, headers),
                    None => too_many_requests(retry_after_secs, headers),
                };
            }
            Decision::Refuse(refusal) => return self.refuse(refusal),
            Decision::Allow { delay, headers, lease } => {
                // Until the response says otherwise, the request failed (it never reached the
                // application).
                held = lease.map(|held| Release { decider: self.decider.clone(), held, cost: SettleCost::Failed });
                (delay, headers)
            }
        };
        // A deferred write's status URL, once the limits admitted the read: answered here, never
        // forwarded (what it held is given back as the request ends).
        if let Some(deferral) = &self.deferral
            && let Some(id) = request.uri().path().strip_prefix(deferral::STATUS_PREFIX)
            && request.method() == Method::GET
            && self.decider.snapshots.delivers(&self.decider.namespace, &self.decider.labels)
        {
            let mut answer = self.deferred_status(deferral, &request, id, host.as_deref(), client_ip).await;
            add_headers(answer.headers_mut(), rate_headers);
            drop(held);
            return answer;
        }
        if !delay.is_zero() {
            // Shaping (leaky bucket with maxDelay): the endpoint has already admitted the request
            // for this moment, so hold it here rather than making the client retry.
            tokio::time::sleep(delay).await;
        }

        // Rules charging by the response read its body: ask the application for it uncompressed.
        let costs = held.as_ref().map(|release| self.decider.response_costs(&release.held)).unwrap_or_default();
        if costs.iter().any(|(_, cost)| cost.usage.is_some()) {
            request.headers_mut().remove(header::ACCEPT_ENCODING);
        }
        // A read a `staleIfLimited` rule matches: its response may be kept (checked below).
        let keeping = stale_rule
            .filter(|_| request.method() == Method::GET)
            .map(|rule| (cache_key(host.as_deref(), request.uri()), request.headers().clone(), rule.max_entry_bytes));
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
        if self.prepare(&mut request, upstream, peer, host.as_deref(), upgrade).is_err() {
            return problem(StatusCode::BAD_REQUEST, "Bad Request", "unusable request target", Vec::new());
        }
        let started = Instant::now();
        let mut response = match self.client.request(request).await {
            Ok(response) => response,
            Err(error) => {
                self.metrics.outcome("upstream_error");
                tracing::warn!(error = %error_chain(&error), "upstream request failed");
                return problem(StatusCode::BAD_GATEWAY, "Bad Gateway", "the application did not answer", Vec::new());
            }
        };
        let latency = started.elapsed();
        self.metrics.upstream_seconds.observe(latency.as_secs_f64());
        if let Some(slot) = slot {
            slot.finish(latency_sample(&response, latency));
        }

        if let (Some(client_upgrade), StatusCode::SWITCHING_PROTOCOLS) = (client_upgrade, response.status()) {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            let metrics = self.metrics.clone();
            let mut held = held;
            if let Some(held) = held.as_mut() {
                held.cost = SettleCost::AsReserved;
            }
            tokio::spawn(async move {
                // A relayed connection holds its slots until it closes.
                let _held = held;
                match tokio::try_join!(client_upgrade, upstream_upgrade) {
                    Ok((client, upstream)) => {
                        metrics.upgrades_active.inc();
                        let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
                        // Either side closing ends the relay; an error is just a dropped connection.
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        metrics.upgrades_active.dec();
                    }
                    Err(error) => tracing::debug!(%error, "upgrade did not complete"),
                }
            });
            self.metrics.outcome("upgraded");
            let (parts, _) = response.into_parts();
            return Response::from_parts(parts, Either::Right(Full::new(Bytes::new())));
        }

        self.metrics.outcome("forwarded");
        headers::strip_hop_by_hop(response.headers_mut(), false);
        let metering = Metering::start(costs, response.status(), response.headers_mut());
        let capture = keeping.and_then(|(key, request_headers, limit)| {
            let vary = stale::keepable_response(response.status(), response.headers())?;
            Some(Capture {
                cache: self.stale.clone(),
                key,
                request_headers,
                status: response.status(),
                headers: response.headers().clone(),
                vary,
                body: bytes::BytesMut::new(),
                limit,
                metrics: self.metrics.clone(),
            })
        });
        add_headers(response.headers_mut(), rate_headers);
        let acknowledger = response.extensions_mut().remove::<Acknowledger>();
        response.map(|body| Either::Left(Releasing { inner: body, release: held, metering, acknowledger, capture }))
    }

    /// Sends a limited read on to the application in the background (`revalidateEvery`) and
    /// keeps its response in place of the stale one, when it may be kept.
    fn revalidate(
        &self,
        request: &Request<RequestBody>,
        key: stale::CacheKey,
        upstream: &Authority,
        peer: SocketAddr,
        host: Option<&str>,
        limit: usize,
    ) {
        let mut read = Request::new(RequestBody::empty());
        *read.uri_mut() = request.uri().clone();
        *read.headers_mut() = request.headers().clone();
        read.headers_mut().remove(header::CONTENT_LENGTH);
        if self.prepare(&mut read, upstream, peer, host, false).is_err() {
            return;
        }
        let request_headers = request.headers().clone();
        let (client, cache, metrics) = (self.client.clone(), self.stale.clone(), self.metrics.clone());
        tokio::spawn(async move {
            let Ok(response) = client.request(read).await else { return };
            let (parts, body) = response.into_parts();
            let Some(vary) = stale::keepable_response(parts.status, &parts.headers) else { return };
            let Ok(body) = http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit)).await else {
                return;
            };
            let mut headers = parts.headers;
            headers::strip_hop_by_hop(&mut headers, false);
            cache.keep(key, &request_headers, parts.status, headers, vary, body.to_bytes());
            metrics.stale.get_or_create(&super::metrics::ResultLabels { result: "revalidated" }).inc();
            metrics.stale_bytes.set(cache.bytes() as i64);
        });
    }

    /// Answers `GET <status prefix><id>`: the state of a deferred write, for a request of its
    /// key (the endpoint checks it; anyone else gets 404).
    async fn deferred_status(
        &self,
        deferral: &Deferral,
        request: &Request<RequestBody>,
        id: &str,
        host: Option<&str>,
        client_ip: std::net::IpAddr,
    ) -> Response<ProxyBody> {
        let headers = match self.decider.check_headers(request.headers()).await {
            Ok(headers) => headers.unwrap_or_default(),
            Err(refusal) => return self.refuse(refusal),
        };
        let input = CheckInput {
            request_fields: BTreeMap::new(),
            namespace: &self.decider.namespace,
            labels: &self.decider.labels,
            method: request.method().as_str(),
            path: request.uri().path(),
            host,
            client_ip,
            headers,
            egress: None,
            deadline_ms: None,
            slot: None,
        };
        let (status, body) = deferral.status(&input, id).await;
        self.metrics.outcome("deferred_status");
        if status != StatusCode::OK {
            let detail = if status == StatusCode::NOT_FOUND {
                "no deferred write of this id for this key"
            } else {
                "the deferred write's state cannot be read now"
            };
            return problem(status, status.canonical_reason().unwrap_or("Error"), detail, Vec::new());
        }
        let mut response = Response::new(Either::Right(Full::new(body)));
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        response
    }

    /// Answers a request the limiter cannot decide as sent (400, 414, 431: a path too long, an
    /// ambiguous Host, a rate-limited header sent twice or too large): the client's fault, so it
    /// is never forwarded and never counts against the endpoint.
    fn refuse(&self, refusal: Refusal) -> Response<ProxyBody> {
        self.metrics.outcome("refused");
        let title = refusal.status.canonical_reason().unwrap_or("Bad Request");
        problem(refusal.status, title, &refusal.detail, Vec::new())
    }

    /// Answers a request refused because the application is at its overload limit: 503 with
    /// `Retry-After`, never forwarded and never counted against a rate limit.
    fn shed(&self, shed: Shed) -> Response<ProxyBody> {
        self.metrics.outcome("shed");
        if let Some(refusal) = &shed.refusal {
            let declared = Declared {
                status: StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                body: Bytes::from(refusal.body.as_deref().unwrap_or("").to_string()),
            };
            let headers = refusal
                .headers
                .iter()
                .filter_map(|(k, v)| Some((HeaderName::from_bytes(k.as_bytes()).ok()?, HeaderValue::from_str(v).ok()?)))
                .collect();
            return declared_refusal(declared, Some(shed.retry_after_secs), headers);
        }
        let retry_after = shed.retry_after_secs.to_string();
        let mut response = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Service Unavailable",
            &format!("the application is at its load limit; {} requests are refused first", shed.class),
            Vec::new(),
        );
        if let Ok(value) = HeaderValue::from_str(&retry_after) {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        response
    }

    /// The fields of a JSON request body that the namespace's estimates read, when any does:
    /// the body is read ahead (up to [`MAX_ESTIMATE_BODY`]) and forwarded unchanged.
    async fn estimate_fields(
        &self,
        headers: &HeaderMap,
        request_body: &mut RequestBody,
    ) -> Result<BTreeMap<String, String>, Refusal> {
        let is_json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("json"));
        if !is_json {
            return Ok(BTreeMap::new());
        }
        let fields = self.decider.snapshots.estimate_fields();
        let Some(body) = (!fields.is_empty()).then(|| request_body.rest.take()).flatten() else {
            return Ok(BTreeMap::new());
        };
        let (body, complete) = read_ahead(body, MAX_ESTIMATE_BODY, &self.read_ahead).await?;
        let values = estimate_fields_of(&body, complete, &fields);
        *request_body = body;
        Ok(values)
    }

    /// Under overload protection: a body still on its way whose declared length is at most
    /// [`MAX_BUFFERED_BODY`] is read whole before the request takes a slot, so the time a client
    /// takes to send it is not counted as the application's.
    async fn buffer_small_body(&self, headers: &HeaderMap, body: &mut RequestBody) -> Result<(), Refusal> {
        let declared =
            headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
        if declared.is_none_or(|length| length > MAX_BUFFERED_BODY) || !body.is_streaming() {
            return Ok(());
        }
        let Some(rest) = body.rest.take() else { return Ok(()) };
        let (more, _) = read_ahead(rest, MAX_BUFFERED_BODY, &self.read_ahead).await?;
        body.read = match (body.read.take(), more.read) {
            (Some(first), Some(second)) => Some([first, second].concat().into()),
            (first, second) => first.or(second),
        };
        body.trailers = more.trailers;
        body.rest = more.rest;
        body.budget = match (body.budget.take(), more.budget) {
            (Some(mut first), Some(second)) => {
                first.merge(second);
                Some(first)
            }
            (first, second) => first.or(second),
        };
        Ok(())
    }

    /// Rewrites the client's request into the one the application gets.
    fn prepare(
        &self,
        request: &mut Request<RequestBody>,
        upstream: &Authority,
        peer: SocketAddr,
        host: Option<&str>,
        upgrade: bool,
    ) -> Result<(), http::Error> {
        let path = request.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let uri = Uri::builder().scheme(Scheme::HTTP).authority(upstream.clone()).path_and_query(path).build()?;
        *request.uri_mut() = uri;
        // The application speaks HTTP/1.1 on loopback whatever the client spoke to us.
        *request.version_mut() = Version::HTTP_11;
        let headers = request.headers_mut();
        if upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        if !headers.contains_key(header::HOST) {
            // HTTP/2 carries the host in :authority; HTTP/1.1 applications expect Host.
            let value = host.unwrap_or(upstream.as_str());
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(header::HOST, value);
            }
        }
        forwarded::set_forwarded(headers, peer.ip(), self.trusted_hops);
        Ok(())
    }
}

/// The application's latency for the overload limit: the time to its response head, except for
/// answers whose time is not the application's work (a WebSocket upgrade or an event stream,
/// whose length the client decides) or a failure (5xx: a fast failure would look like spare
/// capacity).
fn latency_sample<B>(response: &Response<B>, latency: Duration) -> Option<Duration> {
    let streaming = response.status() == StatusCode::SWITCHING_PROTOCOLS
        || response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("text/event-stream"));
    (!streaming && !response.status().is_server_error()).then_some(latency)
}

fn has_token(headers: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// An HTTP/1.1 `Connection: upgrade` request to `Upgrade: websocket` and nothing else.
pub fn is_websocket_upgrade<B>(request: &Request<B>) -> bool {
    let mut protocols = request.headers().get_all(header::UPGRADE).iter();
    let only_websocket = match (protocols.next().and_then(|v| v.to_str().ok()), protocols.next()) {
        (Some(value), None) => {
            let mut tokens = value.split(',').map(str::trim);
            tokens.next().is_some_and(|t| t.eq_ignore_ascii_case("websocket")) && tokens.next().is_none()
        }
        _ => false,
    };
    request.version() == Version::HTTP_11
        && only_websocket
        && has_token(request.headers(), &header::CONNECTION, "upgrade")
}

/// The request target the endpoint can decide: an origin-form path (or `*`) of at most
/// [`MAX_PATH_LEN`] bytes, and the endpoint's own path rule ([`check_path`]). Anything else is
/// answered here, never forwarded unchecked, and never classified for overload protection.
fn check_target(uri: &Uri) -> Result<(), Refusal> {
    let path = uri.path();
    if path.len() > MAX_PATH_LEN {
        return Err(Refusal::new(StatusCode::URI_TOO_LONG, format!("the path is longer than {MAX_PATH_LEN} bytes")));
    }
    if !(path.starts_with('/') || path == "*") {
        return Err(Refusal::new(StatusCode::BAD_REQUEST, "the request target is not a path (CONNECT is not proxied)"));
    }
    check_path(path).map_err(|bad| Refusal::new(StatusCode::BAD_REQUEST, bad.0))
}

fn add_headers(headers: &mut HeaderMap, extra: HeaderList) {
    for (name, value) in extra {
        headers.insert(name, value);
    }
}

/// 429 with the decision's headers and a short RFC 9457 problem body; never cached (RFC 6585).
fn too_many_requests(retry_after_secs: Option<u64>, headers: HeaderList) -> Response<ProxyBody> {
    let detail = match retry_after_secs {
        Some(s) => format!("rate limit exceeded; retry after {s} s"),
        None => "rate limit exceeded".to_string(),
    };
    let mut response = problem(StatusCode::TOO_MANY_REQUESTS, "Too Many Requests", &detail, headers);
    let map = response.headers_mut();
    if let Some(s) = retry_after_secs
        && !map.contains_key(header::RETRY_AFTER)
    {
        map.insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    map.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// What makes two reads the same resource for `staleIfLimited`: host and path with query.
fn cache_key(host: Option<&str>, uri: &Uri) -> stale::CacheKey {
    (
        host.unwrap_or("").to_ascii_lowercase(),
        uri.path_and_query().map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string()),
    )
}

/// A limited read answered with the response kept for it: its status, headers and body (none
/// for `HEAD`), its `Age`, `Sluice-Stale: limited` saying why, and the rate-limit headers of
/// the refusal it stands in for.
fn stale_answer(kept: stale::Kept, age: Duration, head: bool, headers: HeaderList) -> Response<ProxyBody> {
    let body = if head { Bytes::new() } else { kept.body };
    let mut response = Response::new(Either::Right(Full::new(body)));
    *response.status_mut() = kept.status;
    *response.headers_mut() = kept.headers;
    response.headers_mut().insert(header::AGE, HeaderValue::from(age.as_secs()));
    response.headers_mut().insert(STALE, HeaderValue::from_static("limited"));
    add_headers(response.headers_mut(), headers);
    response
}

/// On a response served stale because the request was limited.
pub const STALE: HeaderName = HeaderName::from_static("sluice-stale");

/// A refusal the policy declared: its status and body, the rate-limit and declared headers.
fn declared_refusal(declared: Declared, retry_after_secs: Option<u64>, headers: HeaderList) -> Response<ProxyBody> {
    let mut response = Response::new(Either::Right(Full::new(declared.body)));
    *response.status_mut() = declared.status;
    let map = response.headers_mut();
    add_headers(map, headers);
    if let Some(s) = retry_after_secs
        && !map.contains_key(header::RETRY_AFTER)
    {
        map.insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    map.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn problem(status: StatusCode, title: &str, detail: &str, headers: HeaderList) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(bytes))));
    *response.status_mut() = status;
    let map = response.headers_mut();
    add_headers(map, headers);
    map.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

/// Accepts connections until `shutdown`, then lets each finish its in-flight requests (up to
/// 20 s). At most `limits.max_connections` at once (past it, a new connection takes the place of
/// the one idle longest, or waits while every one has a request in flight), each given
/// `limits.header_read_timeout` for every request's head (an idle keep-alive connection is closed
/// after it too).
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    limits: crate::listen::ConnectionLimits,
    shutdown: watch::Receiver<bool>,
) {
    let builder = Arc::new(crate::listen::http_builder());
    crate::listen::accept_loop(listener, limits, shutdown, |stream, peer, mut shutdown, activity| {
        let upstream = Arc::new(proxy.upstream_for(&stream));
        let (proxy, builder) = (proxy.clone(), builder.clone());
        async move {
            // Counted in flight until the response is sent: only a connection without one may be
            // closed to make room for a new one (listen.rs).
            let service = activity.track(service_fn(move |request| {
                let (proxy, upstream) = (proxy.clone(), upstream.clone());
                async move { Ok::<_, Infallible>(proxy.handle(peer, &upstream, request).await) }
            }));
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(error = %error, "client connection ended with an error");
                    }
                }
                _ = stopped(&mut shutdown) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        }
    })
    .await;
}

use crate::listen::stopped;
