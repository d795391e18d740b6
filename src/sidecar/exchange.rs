//! Asking the enforcement endpoint about a request: within `--endpoint-timeout`, batched
//! ([`super::batch`]), behind a circuit breaker, with `--on-endpoint-failure` for when it cannot
//! answer.
//!
//! The breaker is here because it guards every exchange a request waits for (the check, and the
//! first snapshot fetch before any check can be built): once the endpoint is known to be down,
//! requests stop paying the timeout and go straight to the fallback until a probe finds it back.
//! Apart from the snapshot cache and the settling, so that what "the endpoint is away" means is
//! decided in one place.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use super::batch::Checks;
use super::config::{Config, OnFailure};
use super::endpoint::{Endpoint, ExchangeFailure};
use super::metrics::SidecarMetrics;
use super::verdict::{Decision, EndpointError, Refusal};
use crate::api::check::CheckInput;
use crate::clock::Clock;
use crate::store::breaker::{Breaker, BreakerConfig, BreakerState};
use crate::telemetry::KindLabels;

/// Retry-After when refusing because the limiter is unreachable.
const FAILURE_RETRY_AFTER_SECS: u64 = 1;

/// What asking the endpoint about a request came to.
pub(super) enum Asked {
    /// The endpoint's decision (a refusal included, when it cannot decide the request as sent).
    Answered(Decision),
    /// The breaker is open or the exchange failed: the request is decided without the endpoint,
    /// and nothing it pushed can be trusted to be current.
    Unavailable,
}

/// The exchange with the endpoint: its client, the batched checks, the timeout, the breaker.
pub(super) struct EndpointExchange {
    pub endpoint: Arc<Endpoint>,
    checks: Checks,
    pub timeout: Duration,
    on_failure: OnFailure,
    breaker: Breaker,
    /// The breaker's time and the check timings.
    clock: Arc<dyn Clock>,
    metrics: Arc<SidecarMetrics>,
}

impl EndpointExchange {
    pub fn new(
        config: &Config,
        endpoint: Arc<Endpoint>,
        clock: Arc<dyn Clock>,
        metrics: Arc<SidecarMetrics>,
    ) -> EndpointExchange {
        let checks = Checks::new(endpoint.clone(), config.endpoint_batches, config.endpoint_timeout, metrics.clone());
        EndpointExchange {
            endpoint,
            checks,
            timeout: config.endpoint_timeout,
            on_failure: config.on_failure,
            breaker: Breaker::new(BreakerConfig::default()),
            clock,
            metrics,
        }
    }

    /// The endpoint's decision on `input`, behind the breaker and within the timeout.
    pub async fn ask(&self, input: &CheckInput<'_>) -> Asked {
        let started = self.clock.now();
        let error = match self.breaker.try_acquire(started) {
            None => {
                self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "breaker_open" }).inc();
                None
            }
            Some(permit) => {
                let outcome = match tokio::time::timeout(self.timeout, self.check(input)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(EndpointError::Timeout(self.timeout)),
                };
                let now = self.clock.now();
                match outcome {
                    Ok(decision) => {
                        permit.success(now);
                        self.metrics.check_seconds.observe(now.saturating_sub(started) as f64 / 1e6);
                        self.metrics.breaker_open.set(0);
                        return Asked::Answered(decision);
                    }
                    Err(EndpointError::Rejected(status, detail)) => {
                        // The endpoint is fine; this request cannot be decided as sent, and
                        // forwarding it unchecked would be a bypass.
                        permit.success(now);
                        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "rejected" }).inc();
                        let status = if status == StatusCode::PAYLOAD_TOO_LARGE {
                            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
                        } else {
                            StatusCode::BAD_REQUEST
                        };
                        return Asked::Answered(Decision::Refuse(Refusal::new(status, endpoint_reason(&detail))));
                    }
                    Err(error) => {
                        permit.failure(now);
                        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: error.kind() }).inc();
                        Some(error)
                    }
                }
            }
        };
        self.publish_breaker_state();
        if let Some(error) = &error {
            tracing::debug!(%error, "endpoint check failed; falling back");
        }
        Asked::Unavailable
    }

    /// Runs `fetch` (an exchange a request waits for) behind the breaker and within the timeout,
    /// so that a dead endpoint costs the breaker's few waits, not one per request; `None` while
    /// the breaker is open.
    pub async fn through_breaker<T>(
        &self,
        fetch: impl Future<Output = Result<T, ExchangeFailure>>,
    ) -> Option<Result<T, ExchangeFailure>> {
        let permit = self.breaker.try_acquire(self.clock.now())?;
        let outcome = tokio::time::timeout(self.timeout, fetch)
            .await
            .unwrap_or_else(|_| Err(ExchangeFailure::Unavailable(format!("no answer within {:?}", self.timeout))));
        match &outcome {
            Ok(_) => {
                permit.success(self.clock.now());
            }
            Err(_) => {
                permit.failure(self.clock.now());
            }
        }
        self.publish_breaker_state();
        Some(outcome)
    }

    /// The decision for a request the endpoint could not be asked about and that nothing cached
    /// decides: `--on-endpoint-failure`.
    pub fn failure_mode(&self) -> Decision {
        match self.on_failure {
            OnFailure::Allow => Decision::Allow { delay: Duration::ZERO, headers: Vec::new(), lease: None },
            OnFailure::Deny => Decision::Deny {
                retry_after_secs: Some(FAILURE_RETRY_AFTER_SECS),
                retry_after_ms: Some(FAILURE_RETRY_AFTER_SECS * 1000),
                headers: Vec::new(),
                declared: None,
            },
        }
    }

    fn publish_breaker_state(&self) {
        let open = self.breaker.state(self.clock.now()) != BreakerState::Closed;
        self.metrics.breaker_open.set(i64::from(open));
    }

    async fn check(&self, input: &CheckInput<'_>) -> Result<Decision, EndpointError> {
        let body =
            serde_json::to_vec(input).map_err(|e| EndpointError::Rejected(StatusCode::BAD_REQUEST, e.to_string()))?;
        self.checks.check(body).await
    }
}

/// The endpoint's `{"error": "…"}` message, or its body as text.
pub(super) fn endpoint_reason(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| body.chars().take(200).collect())
}
