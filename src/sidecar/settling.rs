//! Settling what an admitted request held once its response has ended: concurrency slots given
//! back, reservations charged what the response cost, with whoever admitted it (the endpoint, or
//! the local engine while the endpoint was away).
//!
//! Apart from deciding because it runs after the response, off the request's path (the proxy
//! spawns it when the response body is dropped), and a failure here changes no decision: the
//! holds run out by themselves.

use std::sync::Arc;
use std::time::Duration;

use super::endpoint::Endpoint;
use super::exchange::endpoint_reason;
use super::metrics::{ResultLabels, SidecarMetrics};
use super::verdict::Held;
use crate::clock::Clock;
use crate::engine::hold::Hold;
use crate::engine::{Engine, SettleCost};
use crate::policy::response_cost::ResponseCost;
use crate::store::memory::MemoryStore;

pub(super) struct Settling {
    endpoint: Arc<Endpoint>,
    /// How long the endpoint has to take a settle: `--endpoint-timeout`.
    timeout: Duration,
    /// Settle timings.
    clock: Arc<dyn Clock>,
    metrics: Arc<SidecarMetrics>,
}

impl Settling {
    pub fn new(
        endpoint: Arc<Endpoint>,
        timeout: Duration,
        clock: Arc<dyn Clock>,
        metrics: Arc<SidecarMetrics>,
    ) -> Settling {
        Settling { endpoint, timeout, clock, metrics }
    }

    /// Settles `held` with cost `cost`: with the endpoint, or with `local` (the engine of the
    /// cached snapshot, which admitted it). A settle that fails is logged and left to the holds.
    pub async fn settle(&self, local: &Engine<Arc<MemoryStore>>, held: Held, cost: SettleCost) {
        let started = self.clock.now();
        let outcome = match held {
            Held::Local(token) => match local.verify_hold(&token) {
                Ok(lease) => local.settle(&lease, &cost).await.map(|_| ()).map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            },
            Held::Endpoint(token) => {
                let body = serde_json::to_vec(&crate::api::settle::SettleBody::new(token, &cost)).unwrap_or_default();
                match tokio::time::timeout(self.timeout, self.endpoint.post(&self.endpoint.settle_uri, body.into()))
                    .await
                {
                    Ok(Ok((status, _))) if status.is_success() => Ok(()),
                    Ok(Ok((status, body))) => {
                        Err(format!("endpoint answered {status}: {}", endpoint_reason(&String::from_utf8_lossy(&body))))
                    }
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err(format!("no answer within {:?}", self.timeout)),
                }
            }
        };
        self.metrics.settle_seconds.observe(self.clock.now().saturating_sub(started) as f64 / 1e6);
        match outcome {
            Ok(()) => {
                self.metrics.releases.get_or_create(&ResultLabels { result: "released" }).inc();
            }
            Err(reason) => {
                self.metrics.releases.get_or_create(&ResultLabels { result: "failed" }).inc();
                tracing::warn!(%reason, "could not settle a request's holds; they run out by themselves");
            }
        }
    }
}

/// How the costs of what `held` holds are read from the response: each rule's name and its
/// `responseCost`, from `local`'s snapshot (empty for concurrency slots alone).
pub(super) fn response_costs(local: &Engine<Arc<MemoryStore>>, held: &Held) -> Vec<(String, Arc<ResponseCost>)> {
    let (Held::Endpoint(token) | Held::Local(token)) = held;
    match Hold::read_unverified(token) {
        Ok(lease) => local.response_costs(&lease),
        Err(_) => Vec::new(),
    }
}
