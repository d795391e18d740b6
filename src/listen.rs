//! Accepting connections, for every HTTP server of Sluice that speaks to callers it has not yet
//! verified: the check API (plain and TLS), the admin ports, the sidecar's proxy and admin ports
//! and the webhooks. One place bounds what a client without a credential can hold:
//!
//! - **headers**: a request's head must arrive within the header-read timeout of the moment the
//!   connection fell idle — it was served, or its last response was sent — so an idle keep-alive
//!   connection is closed after it too, and a slow-header client holds its connection for that
//!   long at most (plus one sweep interval, a quarter of the timeout and at most a second). The
//!   listener's sweep checks every connection's idle time, rather than hyper arming a timer for
//!   every request head: the same bound, without a timer-wheel entry set and cleared per request
//!   nor a `Sleep` polled at every wake-up (together about 1,900 instructions of a
//!   ~50,000-instruction check, docs/benchmarks.md). After its first request an HTTP/2
//!   connection is left out (hyper never bounded its heads either): between requests it is
//!   closed only to make room, below;
//! - **the first request**: a connection's first request head (its TLS handshake included) must
//!   arrive within the header-read timeout of the moment the connection is served, whatever its
//!   protocol — a connection that sends nothing is closed by the same sweep;
//! - **connections**: at most `max_connections` at once (by default three quarters of the
//!   process's file descriptor limit, leaving the rest to Redis, the API server and the
//!   listeners). When they are all taken, a new connection takes the place of the connection that
//!   has been doing nothing longest — one with no request in flight: it has not sent a complete
//!   request head yet (or not finished its TLS handshake), or it is a keep-alive connection
//!   between requests — which is closed. Only when every connection has a request in flight does
//!   the new one wait (accepted, one at a time; the rest in the kernel's backlog) for a request to
//!   finish. Without this, connections that merely stay open took every slot for as long as they
//!   liked, and a verified tenant's check waited behind them.
//!
//! Why evict rather than queue: a connection that has sent nothing costs its client nothing to
//! hold, so any fixed number of slots is filled by one client opening that many; only a
//! connection with a request in flight (whose caller, on the check API, has been verified before
//! its body is read) is worth keeping a newcomer out for. Production servers do the same — nginx
//! closes its "reusable" connections (waiting for a first request or idle between requests),
//! oldest first, when `worker_connections` run out. The longest-idle choice means a connection is
//! closed for a newcomer only after every connection idle longer has been, so a client sending
//! its request promptly is never the one closed while older idle ones remain: a tenant's
//! connection is closed before its head arrives only if `max_connections` other connections are
//! accepted meanwhile. Closing a connection with no request in flight loses nothing an HTTP
//! client does not already expect (RFC 9112 §9.3.1: an idle connection may be closed at any
//! time).
//!
//! Request bodies are read by the handlers after the caller is verified (`super::http`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum_server::tls_rustls::RustlsConfig;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tower::ServiceExt;

/// How long in-flight requests may finish after shutdown before connections are dropped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// What one unverified client can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// For each request's head (so for an idle keep-alive connection too); the first one, TLS
    /// handshake included, counted from the moment the connection is given its slot.
    pub header_read_timeout: Duration,
    /// Connections served at once; past it, a new connection takes the place of the one idle
    /// longest.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits { header_read_timeout: Duration::from_secs(10), max_connections: default_max_connections() }
    }
}

/// A listen address flag: `IP:PORT`, or `localhost:PORT` for 127.0.0.1. Other names are not
/// resolved (a listener binds an address); a bad value gets a message with examples instead of
/// the parser's bare "invalid socket address syntax".
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    // `localhost` is the loopback address people write; resolving names is not the listener's
    // business, so this one name is read as 127.0.0.1 and no other.
    let literal = match text.rsplit_once(':') {
        Some((host, port)) if host.eq_ignore_ascii_case("localhost") => format!("127.0.0.1:{port}"),
        _ => text.to_string(),
    };
    literal.parse::<SocketAddr>().map_err(|_| {
        format!("{text:?} is not IP:PORT or localhost:PORT, e.g. 127.0.0.1:8080, 0.0.0.0:8080 or [::]:8080")
    })
}

/// The flags of every role that serves HTTP.
#[derive(clap::Args, Debug, Clone)]
pub struct ListenArgs {
    /// How long a client may take to send a request's headers (the first request's, TLS handshake
    /// included, from the moment its connection is served); an idle keep-alive connection is
    /// closed after it too.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = crate::duration::parse_positive_std_duration)]
    pub header_read_timeout: Duration,
    /// Connections served at once per listener; when all are taken, a new connection takes the
    /// place of the one idle longest (no request in flight). Default: three quarters of the
    /// open-file limit.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
}

impl ListenArgs {
    pub fn limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: self.header_read_timeout,
            max_connections: self.max_connections.map_or_else(default_max_connections, |n| n as usize),
        }
    }
}

/// Three quarters of the soft limit on open files (`/proc/self/limits`), at least 64; 10,000
/// where the limit cannot be read.
pub fn default_max_connections() -> usize {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    open_files_limit(&limits).map_or(10_000, |soft| (soft / 4 * 3).max(64))
}

/// The soft "Max open files" of a `/proc/<pid>/limits` text.
fn open_files_limit(text: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line.trim_start_matches("Max open files").split_whitespace().next()?;
    match soft {
        "unlimited" => Some(1 << 20),
        number => number.parse().ok(),
    }
}

/// The HTTP/1.1 and HTTP/2 server settings every listener shares. HTTP/1 gets no timer: the
/// header-read timeout is the listener's sweep ([`accept_loop`]), and hyper with a timer would
/// also arm its own per request head.
pub fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    builder
}

/// How often the listener looks for connections past the header-read timeout: a quarter of it,
/// between 10 ms and a second.
fn sweep_interval(header_read_timeout: Duration) -> Duration {
    (header_read_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Accepts connections on `listener` until `shutdown` flips, at most `limits.max_connections`
/// at once, and runs `handle` on each (with its peer, the shutdown signal and the activity its
/// service must report through [`ConnectionActivity::track`]); then closes the listener, so a
/// new connection is refused at once rather than left waiting in the backlog, and waits up to
/// 20 s for the connections to finish their in-flight requests.
///
/// A connection is closed (its `handle` future dropped) when no request has started on it within
/// `limits.header_read_timeout` of being served, or when a new connection needs its slot while
/// it has no request in flight (see the module's documentation).
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    limits: ConnectionLimits,
    mut shutdown: watch::Receiver<bool>,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr, watch::Receiver<bool>, ConnectionActivity) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let table = Arc::new(ConnectionTable::default());
    let sweeper = tokio::spawn(sweep(table.clone(), limits.header_read_timeout));
    // Ends the sweep however this function ends (its future may be dropped on shutdown).
    let _sweeper = AbortOnDrop(sweeper);
    // Each connection task holds a sender; when all are gone, draining is complete.
    let (alive, mut drained) = mpsc::channel::<()>(1);
    loop {
        // Accepted before a slot is found: a connection past the cap may take the place of an idle
        // one, which the listener can only know once it is here. At most this one waits accepted
        // (one descriptor past the cap, well inside the quarter of the limit left over); the rest
        // wait in the kernel's backlog as before.
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut shutdown) => break,
        };
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => match make_room(&slots, &table, limits.max_connections, &mut shutdown).await {
                Some(slot) => slot,
                None => break,
            },
        };
        let _ = stream.set_nodelay(true);
        let (activity, registration) = table.register();
        let connection = handle(stream, peer, shutdown.clone(), ConnectionActivity(activity.clone()));
        let alive = alive.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = connection => {}
                reason = activity.closing() => {
                    tracing::debug!(%peer, reason = reason.as_str(), "connection closed");
                }
            }
            drop((registration, slot, alive));
        });
    }
    drop((alive, listener));
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, drained.recv()).await;
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Closes, every [`sweep_interval`], the connections that have waited longer than `timeout` for a
/// request head: idle (no request in flight) since they were served or since their last response,
/// and not HTTP/2 connections past their first request.
async fn sweep(table: Arc<ConnectionTable>, timeout: Duration) {
    let mut ticks = tokio::time::interval(sweep_interval(timeout));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
    loop {
        ticks.tick().await;
        table.close_overdue(timeout);
    }
}

/// A slot for a connection accepted while all are taken: the one freed by closing the connection
/// idle longest, or, while every connection has a request in flight, the first to free. None on
/// shutdown.
async fn make_room(
    slots: &Arc<Semaphore>,
    table: &ConnectionTable,
    max_connections: usize,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<OwnedSemaphorePermit> {
    loop {
        // Saying so and listening before looking: a connection falling idle just after the look
        // still wakes us (`InFlight::drop`).
        table.clock.newcomer_waiting.store(true, Ordering::SeqCst);
        let became_idle = table.clock.became_idle.notified();
        tokio::pin!(became_idle);
        became_idle.as_mut().enable();
        let made_room = table.evict_longest_idle();
        if made_room {
            table.warn_slots_full(max_connections);
        }
        let found = tokio::select! {
            // The evicted connection's task ends at once and gives its slot back.
            slot = slots.clone().acquire_owned() => Some(slot.ok()),
            () = &mut became_idle, if !made_room => None,
            _ = stopped(shutdown) => Some(None),
        };
        if let Some(slot) = found {
            table.clock.newcomer_waiting.store(false, Ordering::SeqCst);
            return slot;
        }
    }
}

/// `ActivityState::in_flight` once the connection has been chosen to make room: no request starts
/// counting on it, and it is not chosen twice.
const EVICTED: usize = usize::MAX;

/// How often at most the listener says its slots are full (a connection flood would otherwise log
/// once per connection).
const SLOTS_FULL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// The connections one listener serves, so that a newcomer can take the place of an idle one.
#[derive(Default)]
struct ConnectionTable {
    connections: Mutex<HashMap<u64, Arc<ActivityState>>>,
    next_id: AtomicU64,
    clock: Arc<IdleClock>,
    last_slots_full_warning: Mutex<Option<Instant>>,
}

/// When connections fell idle, and a newcomer waiting for one to.
struct IdleClock {
    started: Instant,
    /// A newcomer is waiting for a connection to fall idle: only then does the end of a request
    /// wake it (`Notify` takes a lock the listener's connections would all share).
    newcomer_waiting: AtomicBool,
    became_idle: Notify,
}

impl Default for IdleClock {
    fn default() -> Self {
        IdleClock { started: Instant::now(), newcomer_waiting: AtomicBool::new(false), became_idle: Notify::new() }
    }
}

impl IdleClock {
    /// Nanoseconds since the listener started: only their order matters, and reading the clock
    /// writes nothing the connections share.
    fn now(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Removes a connection from its listener's table when its task ends.
struct Registration {
    table: Arc<ConnectionTable>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.connections.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

impl ConnectionTable {
    fn register(self: &Arc<Self>) -> (Arc<ActivityState>, Registration) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(ActivityState {
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.clock.now()),
            http2: AtomicBool::new(false),
            closing: AtomicU8::new(Closing::MadeRoom as u8),
            evicted: Notify::new(),
            clock: self.clock.clone(),
        });
        self.connections.lock().unwrap_or_else(PoisonError::into_inner).insert(id, activity.clone());
        (activity, Registration { table: self.clone(), id })
    }

    /// Marks the connection idle longest for closing and wakes its task; false when every
    /// connection has a request in flight. One linear pass per newcomer, only while the slots are
    /// full: cheaper than keeping an order up to date on every request.
    fn evict_longest_idle(&self) -> bool {
        let connections = self.connections.lock().unwrap_or_else(PoisonError::into_inner);
        // A request starting between the look and the mark makes the mark fail; look again a few
        // times, then wait for a connection to fall idle.
        for _ in 0..4 {
            let victim = connections
                .values()
                .filter(|activity| activity.in_flight.load(Ordering::SeqCst) == 0)
                .min_by_key(|activity| activity.idle_since.load(Ordering::Acquire));
            let Some(victim) = victim else { return false };
            if victim.close(Closing::MadeRoom) {
                return true;
            }
        }
        false
    }

    /// Closes the connections idle for more than `timeout` ns that are waiting for a request head
    /// (see [`sweep`]). One pass over the table per sweep interval, whatever the request rate.
    fn close_overdue(&self, timeout: u64) {
        let now = self.clock.now();
        let connections = self.connections.lock().unwrap_or_else(PoisonError::into_inner);
        for activity in connections.values() {
            // Only a request marks HTTP/2, so an unmarked connection is before its first request or
            // HTTP/1: waiting for a head either way.
            let waiting = !activity.http2.load(Ordering::Relaxed);
            let idle = activity.in_flight.load(Ordering::Acquire) == 0;
            if waiting && idle && now.saturating_sub(activity.idle_since.load(Ordering::Acquire)) > timeout {
                activity.close(Closing::NoRequestHead);
            }
        }
    }

    fn warn_slots_full(&self, max_connections: usize) {
        let mut last = self.last_slots_full_warning.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_none_or(|at| at.elapsed() >= SLOTS_FULL_WARNING_INTERVAL) {
            *last = Some(Instant::now());
            tracing::warn!(
                max_connections,
                "every connection slot is taken: closing the connections idle longest to serve new ones \
                 (raise --max-connections or the open-file limit if this is ordinary traffic)"
            );
        }
    }
}

/// What the listener knows of one connection: its requests in flight, and since when it has had
/// none.
struct ActivityState {
    /// Requests whose response has not been sent to its end; [`EVICTED`] once chosen to make room.
    in_flight: AtomicUsize,
    /// The [`IdleClock`] when the connection last fell idle (served, or its last response sent):
    /// the smallest has been doing nothing longest.
    idle_since: AtomicU64,
    /// A request came as HTTP/2: past its first request, the sweep leaves the connection alone.
    http2: AtomicBool,
    /// Why the connection was chosen to close ([`Closing`] as a number).
    closing: AtomicU8,
    /// Chosen to make room.
    evicted: Notify,
    clock: Arc<IdleClock>,
}

/// Why the listener closed a connection.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Closing {
    MadeRoom = 0,
    NoRequestHead = 1,
}

impl Closing {
    fn as_str(&self) -> &'static str {
        match self {
            Closing::MadeRoom => "idle longest while every slot was taken: closed for a new connection",
            Closing::NoRequestHead => "no request head within the header-read timeout",
        }
    }
}

impl ActivityState {
    /// Resolves when the listener closes the connection: chosen to make room, or past the
    /// header-read timeout.
    async fn closing(&self) -> Closing {
        self.evicted.notified().await;
        match self.closing.load(Ordering::Acquire) {
            1 => Closing::NoRequestHead,
            _ => Closing::MadeRoom,
        }
    }

    /// Marks the connection for closing, for `reason`, and wakes its task; false when a request
    /// is in flight on it (or it was marked already).
    fn close(&self, reason: Closing) -> bool {
        if self.in_flight.compare_exchange(0, EVICTED, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        self.closing.store(reason as u8, Ordering::Release);
        // A stored permit: the task sees it even if it has not been polled yet.
        self.evicted.notify_one();
        true
    }
}

/// A connection's activity, for its service to report its requests through
/// [`ConnectionActivity::track`]: a connection with a request in flight is never closed to make
/// room.
#[derive(Clone)]
pub struct ConnectionActivity(Arc<ActivityState>);

impl ConnectionActivity {
    /// `service`, counting each request in flight from the moment its head is read to the end of
    /// its response body.
    pub fn track<S>(&self, service: S) -> TrackedService<S> {
        TrackedService { inner: service, activity: self.0.clone() }
    }
}

/// A request in flight on its connection, until dropped (with its response body, or with the
/// response future if the connection ends first).
struct InFlight(Arc<ActivityState>);

impl InFlight {
    /// None when the connection has already been chosen to make room (it is about to close).
    fn start(activity: &Arc<ActivityState>) -> Option<InFlight> {
        activity
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n != EVICTED).then_some(n + 1))
            .ok()
            .map(|_| InFlight(activity.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        // Set before the count reaches zero, so that whoever sees it idle sees since when.
        if activity.in_flight.load(Ordering::Acquire) == 1 {
            activity.idle_since.store(activity.clock.now(), Ordering::Release);
        }
        let before = activity
            .in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n != EVICTED && n > 0).then(|| n - 1));
        // SeqCst, with `make_room`'s flag and its look at `in_flight`: either this sees the flag
        // (and wakes the newcomer), or the newcomer's look comes after this count reached zero.
        if before == Ok(1) && activity.clock.newcomer_waiting.load(Ordering::SeqCst) {
            activity.clock.became_idle.notify_waiters();
        }
    }
}

/// A hyper service whose requests count as in flight on their connection (see
/// [`ConnectionActivity::track`]).
pub struct TrackedService<S> {
    inner: S,
    activity: Arc<ActivityState>,
}

impl<S, RequestBody, ResponseBody> hyper::service::Service<Request<RequestBody>> for TrackedService<S>
where
    S: hyper::service::Service<Request<RequestBody>, Response = Response<ResponseBody>>,
{
    type Response = Response<TrackedBody<ResponseBody>>;
    type Error = S::Error;
    type Future = TrackedFuture<S::Future>;

    fn call(&self, request: Request<RequestBody>) -> Self::Future {
        if request.version() == http::Version::HTTP_2 {
            self.activity.http2.store(true, Ordering::Relaxed);
        }
        TrackedFuture { in_flight: InFlight::start(&self.activity), inner: self.inner.call(request) }
    }
}

pin_project_lite::pin_project! {
    /// The service's response future, then the response with its body tracked. A struct rather
    /// than a boxed async block: no allocation per request, and the inner future (the sidecar's
    /// is kilobytes) is not copied into a box.
    pub struct TrackedFuture<F> {
        #[pin]
        inner: F,
        in_flight: Option<InFlight>,
    }
}

impl<F, ResponseBody, E> Future for TrackedFuture<F>
where
    F: Future<Output = Result<Response<ResponseBody>, E>>,
{
    type Output = Result<Response<TrackedBody<ResponseBody>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.inner.poll(cx))?;
        let in_flight = this.in_flight.take();
        Poll::Ready(Ok(response.map(|body| TrackedBody { inner: body, _in_flight: in_flight })))
    }
}

/// A response body that keeps its request in flight until hyper has sent it to its end and
/// dropped it. Every frame, the end and the size hint (hence `Content-Length`) pass unchanged.
pub struct TrackedBody<B> {
    inner: B,
    _in_flight: Option<InFlight>,
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `router` on `listener` (over TLS with `tls`) until `shutdown` flips, then lets
/// in-flight requests finish (up to 20 s). Handlers can extract `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<RustlsConfig>,
    limits: ConnectionLimits,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let builder = Arc::new(http_builder());
    accept_loop(listener, limits, shutdown, |stream, peer, shutdown, activity| {
        let (router, builder, tls) = (router.clone(), builder.clone(), tls.clone());
        async move { serve_connection(stream, peer, router, &builder, tls, shutdown, activity).await }
    })
    .await;
    Ok(())
}

/// Runs one connection; on shutdown, lets its in-flight requests finish. (A macro: the connection's
/// type names the router's service, which has no name.)
macro_rules! drive {
    ($connection:expr, $shutdown:expr) => {{
        let mut shutdown = $shutdown;
        let connection = $connection;
        tokio::pin!(connection);
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(error = %error, "connection ended with an error");
                }
            }
            _ = stopped(&mut shutdown) => {
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            }
        }
    }};
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    builder: &auto::Builder<TokioExecutor>,
    tls: Option<RustlsConfig>,
    shutdown: watch::Receiver<bool>,
    activity: ConnectionActivity,
) {
    let service = router.map_request(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    });
    let service = activity.track(TowerToHyperService::new(service.map_err(|never: Infallible| match never {})));
    match tls {
        None => drive!(builder.serve_connection_with_upgrades(TokioIo::new(stream), service), shutdown),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.get_inner());
            // No timeout of its own: the handshake counts against the first request's deadline
            // (`accept_loop`), and a connection still shaking hands has no request in flight, so
            // it may be closed to make room.
            match acceptor.accept(stream).await {
                Ok(stream) => drive!(builder.serve_connection_with_upgrades(TokioIo::new(stream), service), shutdown),
                Err(error) => tracing::debug!(%error, %peer, "TLS handshake failed"),
            }
        }
    }
}

/// Resolves once `shutdown` is true, without holding the channel's read guard across awaits.
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_say_what_to_write() {
        assert_eq!(parse_listen_address("0.0.0.0:8080"), Ok(SocketAddr::from(([0, 0, 0, 0], 8080))));
        assert_eq!(parse_listen_address("localhost:8080"), Ok(SocketAddr::from(([127, 0, 0, 1], 8080))));
        assert_eq!(parse_listen_address("LOCALHOST:0"), Ok(SocketAddr::from(([127, 0, 0, 1], 0))));
        let error = parse_listen_address("example.com:8080").unwrap_err();
        assert!(error.contains("not IP:PORT or localhost:PORT"), "{error}");
        assert!(parse_listen_address("8080").unwrap_err().contains("e.g. 127.0.0.1:8080"));
        assert!(parse_listen_address("localhost:http").is_err());
    }

    #[test]
    fn the_connection_cap_follows_the_file_descriptor_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                    Max open files            1024                 524288               files     \n";
        assert_eq!(open_files_limit(text), Some(1024));
        assert_eq!(open_files_limit("Max open files            unlimited            unlimited   files"), Some(1 << 20));
        assert_eq!(open_files_limit("nothing"), None);
        assert!(default_max_connections() >= 64);
    }
}
