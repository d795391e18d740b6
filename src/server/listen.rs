//! Accepting connections, for every HTTP server of Sluice that speaks to callers it has not yet
//! verified: the check API (plain and TLS), the admin ports, the sidecar's admin port and the
//! webhooks. One place bounds what a client without a credential can hold:
//!
//! - **headers**: a request's head must arrive within the header-read timeout; hyper starts that
//!   clock whenever the connection waits for a head, so an idle keep-alive connection is closed
//!   after it too, and a slow-header client holds its connection for that long at most;
//! - **TLS**: the handshake must finish within the same bound;
//! - **connections**: at most `max_connections` at once (by default three quarters of the
//!   process's file descriptor limit, leaving the rest to Redis, the API server and the
//!   listeners); past it, new connections wait in the kernel's backlog rather than taking the
//!   descriptors the existing ones need.
//!
//! Request bodies are read by the handlers after the caller is verified (`super::http`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum_server::tls_rustls::RustlsConfig;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tower::ServiceExt;

/// How long in-flight requests may finish after shutdown before connections are dropped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// What one unverified client can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// For a request's head (and so for an idle keep-alive connection), and for a TLS handshake.
    pub header_read_timeout: Duration,
    /// Connections served at once.
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
    /// How long a client may take to send a request's headers (and a TLS handshake); an idle
    /// keep-alive connection is closed after it too.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = crate::duration::parse_positive_std_duration)]
    pub header_read_timeout: Duration,
    /// Connections served at once per listener; default: three quarters of the open-file limit.
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

/// The HTTP/1.1 and HTTP/2 server settings every listener shares: the header-read timeout needs
/// hyper's timer, without which it never fires.
pub fn http_builder(limits: ConnectionLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    builder
}

/// Accepts connections on `listener` until `shutdown` flips, at most `limits.max_connections`
/// at once, and runs `handle` on each (with its peer and the shutdown signal); then waits up to
/// 20 s for the connections to finish their in-flight requests.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    limits: ConnectionLimits,
    mut shutdown: watch::Receiver<bool>,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr, watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Each connection task holds a sender; when all are gone, draining is complete.
    let (alive, mut drained) = mpsc::channel::<()>(1);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = stopped(&mut shutdown) => break,
        };
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
        let _ = stream.set_nodelay(true);
        let connection = handle(stream, peer, shutdown.clone());
        let alive = alive.clone();
        tokio::spawn(async move {
            connection.await;
            drop((slot, alive));
        });
    }
    drop(alive);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, drained.recv()).await;
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
    let builder = Arc::new(http_builder(limits));
    accept_loop(listener, limits, shutdown, |stream, peer, shutdown| {
        let (router, builder, tls) = (router.clone(), builder.clone(), tls.clone());
        async move { serve_connection(stream, peer, router, &builder, tls, limits.header_read_timeout, shutdown).await }
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
    handshake_timeout: Duration,
    shutdown: watch::Receiver<bool>,
) {
    let service = router.map_request(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    });
    let service = TowerToHyperService::new(service.map_err(|never: Infallible| match never {}));
    match tls {
        None => drive!(builder.serve_connection_with_upgrades(TokioIo::new(stream), service), shutdown),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.get_inner());
            match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => {
                    drive!(builder.serve_connection_with_upgrades(TokioIo::new(stream), service), shutdown)
                }
                Ok(Err(error)) => tracing::debug!(%error, %peer, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake not finished in time"),
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
