//! `sluice sidecar`: a per-pod reverse proxy in front of the application container.
//!
//! Each request is checked with the enforcement endpoint (`POST /v1/check`); a denial is answered
//! here with 429, an admission is forwarded to the application, streamed both ways. The endpoint's
//! snapshot is cached (`GET /v1/snapshot`) so that while the endpoint is away the same policies
//! are enforced locally; see [`decide`] and [`snapshot`]. Overload protection is the proxy's
//! ([`overload`]), configured by each snapshot as it is cached. In the "iptables" mode an init
//! container runs [`redirect`] first, so nothing reaches the application past the sidecar.

mod batch;
mod config;
pub mod connect;
pub mod decide;
pub mod deferral;
pub mod egress;
mod endpoint;
mod exchange;
pub mod metering;
pub mod metrics;
pub mod overload;
pub mod probes;
pub mod proxy;
pub mod redirect;
mod settling;
pub mod snapshot;
pub mod stale;
pub mod verdict;

use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{Config, OnFailure, SidecarArgs};
use decide::Decider;
use metrics::SidecarMetrics;
use proxy::Proxy;

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot listen on {address}: {source}")]
    Listen { address: std::net::SocketAddr, source: std::io::Error },
    #[error("admin server failed: {0}")]
    Admin(std::io::Error),
}

/// `/healthz`, `/readyz` and `/metrics`. Health reports the sidecar process only, and readiness
/// does not wait for the endpoint either: failing them because the endpoint is down would
/// restart or unroute the application, which the failure modes exist to prevent. Readiness fails
/// (503, naming the cause) only while the endpoint's answers show this sidecar is configured
/// wrong for it ([`snapshot::Readiness`]). The admin server starts after the proxy's listener is
/// bound, so answering `/readyz` means the proxy accepts connections. The application's own probes, when
/// the webhook moved them here, are under `/app-health/` ([`probes`]).
pub fn admin_router(
    metrics: Arc<SidecarMetrics>,
    app_health: Arc<probes::AppHealth>,
    protection: Arc<overload::Protection>,
    readiness: Arc<snapshot::Readiness>,
) -> Router {
    let app_probes = Router::new().route("/app-health/{container}/{kind}", get(probes::handler)).with_state(app_health);
    Router::new()
        .merge(app_probes)
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/overload", get(move || std::future::ready(axum::Json(protection.state()))))
        .route(
            "/readyz",
            get(move || {
                let cause = readiness.not_ready_because();
                std::future::ready(match cause {
                    None => (axum::http::StatusCode::OK, "ready\n".to_string()),
                    Some(cause) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {cause}\n")),
                })
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                        metrics.encode(),
                    )
                        .into_response()
                }
            }),
        )
}

/// Runs the sidecar until SIGTERM or Ctrl-C, then drains in-flight requests.
pub async fn run(args: SidecarArgs) -> Result<(), SidecarError> {
    let config = Config::from_args(args)?;
    let metrics = Arc::new(SidecarMetrics::new());
    // The proxy's, following the snapshots the decider caches (the first one included).
    let protection = overload::Protection::new(metrics.clone(), config.cgroup_root.clone());
    let follow = protection.follow_snapshots(config.namespace.clone(), config.labels.clone());
    // The egress ports follow the same snapshots: each tells which `spec.egress` entries this
    // pod is offered.
    let (offer, offers) = watch::channel(Vec::new());
    let (namespace, labels) = (config.namespace.clone(), config.labels.clone());
    let on_install: snapshot::OnInstall = Box::new(move |snapshot| {
        follow(snapshot);
        let _ = offer.send(egress::Egress::offered(snapshot, &namespace, &labels));
    });
    let decider = Arc::new(Decider::new(&config, metrics.clone(), on_install)?);
    let egress = egress::Egress::new(decider.clone(), metrics.clone(), config.cancel_uri.clone());
    let deferral = deferral::Deferral::new(
        decider.clone(),
        metrics.clone(),
        config.deferred_uris.clone(),
        config.upstream.clone(),
    );
    let proxy = Arc::new(
        Proxy::new(config.upstream.clone(), decider.clone(), protection.clone(), config.trusted_hops, metrics.clone())
            .with_inbound_ports(&config.inbound_ports)
            .with_stale_cache_bytes(config.stale_cache_bytes)
            .with_deferral(deferral.clone()),
    );
    let app_health = Arc::new(probes::AppHealth::new(config.app_probes.clone()));

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| SidecarError::Listen { address: config.listen, source })?;
    let admin = TcpListener::bind(config.admin_listen)
        .await
        .map_err(|source| SidecarError::Listen { address: config.admin_listen, source })?;
    let address = listener.local_addr().map_err(|source| SidecarError::Listen { address: config.listen, source })?;
    let admin_address =
        admin.local_addr().map_err(|source| SidecarError::Listen { address: config.admin_listen, source })?;
    // The URI it asks: batches of checks, or one check a request (--endpoint-batches 0).
    let asks = if config.endpoint_batches == 0 { &config.check_uri } else { &config.checks_uri };
    tracing::info!(%address, upstream = %config.upstream, endpoint = %asks, namespace = %config.namespace, "sidecar listening");
    tracing::info!(admin = %admin_address, app_probes = config.app_probes.len(), "sidecar admin (healthz, readyz, metrics, app-health) listening");
    if !config.inbound_ports.is_empty() {
        tracing::info!(ports = ?config.inbound_ports, "redirected connections go to the port they were sent to");
    }

    let (stop, stopped) = watch::channel(false);
    let poller = tokio::spawn(decider.snapshots.clone().poll_snapshots(config.snapshot_interval, stopped.clone()));
    let sweeper = tokio::spawn(crate::role::sweep_memory(decider.snapshots.local_store(), stopped.clone()));
    let pressure = tokio::spawn(protection.clone().watch_pressure(stopped.clone()));
    let lease_keeper = tokio::spawn(decider.clone().keep_leases(stopped.clone()));
    let egress_ports = tokio::spawn(egress.follow(offers, stopped.clone()));
    let replays = tokio::spawn(deferral.replay(stopped.clone()));
    let admin_server = tokio::spawn(crate::listen::serve(
        admin,
        admin_router(metrics, app_health, protection, decider.snapshots.readiness.clone()),
        None,
        config.listen_limits,
        stopped.clone(),
    ));
    let proxy_server = tokio::spawn(proxy::serve(listener, proxy, config.listen_limits, stopped));

    crate::role::termination_signal().await;
    tracing::info!("shutting down: draining in-flight requests");
    let _ = stop.send(true);
    let _ = proxy_server.await;
    egress_ports.abort();
    // A replay under way ends (and its queue hears of it) before the process does, so a
    // rollout does not deliver it again; one that takes longer is left to its retry.
    if tokio::time::timeout(std::time::Duration::from_secs(5), replays).await.is_err() {
        tracing::warn!("a replay was still under way at shutdown: it will be delivered again");
    }
    let _ = tokio::join!(poller, sweeper, pressure, lease_keeper);
    match admin_server.await {
        Ok(Err(error)) => Err(SidecarError::Admin(error)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use tower::ServiceExt;

    use super::*;

    #[tokio::test]
    async fn the_admin_port_answers_the_injected_probes() {
        for path in ["/healthz", "/readyz", "/metrics"] {
            let request = axum::http::Request::get(path).body(axum::body::Body::empty()).expect("request");
            let health = Arc::new(probes::AppHealth::new(Default::default()));
            let response = admin_router(
                Arc::new(SidecarMetrics::new()),
                health,
                overload::Protection::new(Arc::new(SidecarMetrics::new()), "/sys/fs/cgroup".into()),
                Arc::default(),
            )
            .oneshot(request)
            .await
            .expect("response");
            assert_eq!(response.status(), 200, "{path}");
        }
    }
}
