//! Getting a decision for a request: from the enforcement endpoint when it answers in time
//! ([`super::exchange`], behind its breaker), otherwise from the cached snapshot (local fallback,
//! [`super::snapshot`]), otherwise from `--on-endpoint-failure`. Some requests need no exchange
//! at all: those no rule applies to and those decided from leased slices, while the cached
//! snapshot is exactly the endpoint's.
//!
//! The `Decider` composes those parts; what it holds of its own is what only deciding needs (the
//! leased slices, the decision metrics). What admitted requests hold is settled by
//! [`super::settling`]; overload protection is the proxy's, configured by each snapshot the cache
//! installs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use tokio::sync::watch;

use super::config::Config;
use super::endpoint::Endpoint;
use super::exchange::{Asked, EndpointExchange};
use super::metrics::{DecisionLabels, SidecarMetrics};
use super::settling::{Settling, response_costs};
use super::snapshot::{HeaderFilter, OnInstall, SNAPSHOT_WAIT, SnapshotCache};
pub use super::verdict::{Decision, EndpointError, HeaderList, Refusal};
use super::verdict::{Held, decision_of};
use crate::api::check::CheckInput;
use crate::clock::{Clock, SystemClock};
use crate::engine::{CheckResponse, Holds, SettleCost, WithoutStore};
use crate::policy::response_cost::ResponseCost;
use crate::request::headers::UsedHeaderProblem;
use crate::telemetry::KindLabels;

/// Keys of leased rules a sidecar follows for slices (its pod's hot keys are few).
const LOCAL_LEASE_KEYS: usize = 16_384;

/// Most bytes of header values one check carries: with the 8 KiB path bound, a check stays below
/// the endpoint's 64 KiB body limit unless its Host is huge (the request head's own limit is
/// far larger); the endpoint refuses such a check as too large, and the sidecar answers 431.
pub const MAX_CHECK_HEADER_BYTES: usize = 16 * 1024;

/// Who decided, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Endpoint,
    /// A slice of the key's quota held here (`consistency: leased`): no call at all.
    Lease,
    Local,
    FailureMode,
    /// No rule of the live snapshot applies: allowed without asking (see `Decider::without_endpoint`).
    NoRule,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Endpoint => "endpoint",
            Source::Lease => "lease",
            Source::Local => "local",
            Source::FailureMode => "failure_mode",
            Source::NoRule => "no_rule",
        }
    }
}

pub struct Decider {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// The endpoint's snapshot, cached: which headers a check carries, and the local fallback.
    pub snapshots: Arc<SnapshotCache>,
    /// Asking the endpoint, behind its breaker.
    exchange: EndpointExchange,
    /// Giving back what admitted requests held.
    settling: Settling,
    /// Slices of hot keys' quota held for this pod (`consistency: leased` rules), granted by
    /// the endpoint.
    leases: crate::engine::leases::QuotaLeases,
    /// The leases' time.
    clock: Arc<dyn Clock>,
    metrics: Arc<SidecarMetrics>,
}

impl Decider {
    /// `on_install` is told of each snapshot as it goes in (the proxy's overload protection
    /// follows it).
    pub fn new(
        config: &Config,
        metrics: Arc<SidecarMetrics>,
        on_install: OnInstall,
    ) -> Result<Decider, super::SidecarError> {
        Decider::with_clock(config, metrics, Arc::new(SystemClock), on_install)
    }

    /// [`Decider::new`] on `clock` (the process's clock, or a test's).
    pub fn with_clock(
        config: &Config,
        metrics: Arc<SidecarMetrics>,
        clock: Arc<dyn Clock>,
        on_install: OnInstall,
    ) -> Result<Decider, super::SidecarError> {
        let endpoint = Arc::new(Endpoint::new(config, SNAPSHOT_WAIT)?);
        Ok(Decider {
            namespace: config.namespace.clone(),
            labels: config.labels.clone(),
            snapshots: Arc::new(SnapshotCache::new(
                config,
                endpoint.clone(),
                clock.clone(),
                metrics.clone(),
                on_install,
            )),
            exchange: EndpointExchange::new(config, endpoint.clone(), clock.clone(), metrics.clone()),
            settling: Settling::new(endpoint, config.endpoint_timeout, clock.clone(), metrics.clone()),
            leases: crate::engine::leases::QuotaLeases::new(LOCAL_LEASE_KEYS),
            clock,
            metrics,
        })
    }

    /// Settles what an admitted request held, once its response has ended (or its client gone):
    /// concurrency slots are given back, reservations charged `cost`; with the endpoint, or with
    /// the local engine that admitted it. A settle that fails is logged and left to the holds,
    /// which run out by themselves.
    pub async fn settle(&self, held: Held, cost: SettleCost) {
        self.settling.settle(self.snapshots.local(), held, cost).await;
    }

    /// How the costs of what `held` holds are read from the response: each rule's name and its
    /// `responseCost`, from the cached snapshot (empty for concurrency slots alone).
    pub fn response_costs(&self, held: &Held) -> Vec<(String, Arc<ResponseCost>)> {
        response_costs(self.snapshots.local(), held)
    }

    /// The request headers a check should carry, under the names the snapshot gave (a value sent
    /// as `X_API_KEY` goes as `x-api-key`); `None` while no snapshot has said which (the first one
    /// is fetched here, once, within the endpoint timeout).
    ///
    /// A used header sent more than once (under one spelling or several), or not UTF-8, is
    /// refused with 400 (no single value says which bucket it belongs to); used headers over
    /// [`MAX_CHECK_HEADER_BYTES`] with 431.
    pub async fn check_headers(&self, headers: &HeaderMap) -> Result<Option<BTreeMap<String, String>>, Refusal> {
        let filter = self.snapshots.header_filter(&self.exchange).await;
        let HeaderFilter::Only(names) = &**filter else { return Ok(None) };
        crate::request::headers::check_used_headers(headers, names).map_err(|problem| match problem {
            UsedHeaderProblem::Malformed(detail) => Refusal::new(StatusCode::BAD_REQUEST, detail),
            UsedHeaderProblem::TooLarge(detail) => Refusal::new(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, detail),
        })?;
        let mut out = BTreeMap::new();
        let mut bytes = 0;
        for name in names {
            // Under the name the snapshot gave, whichever spelling (`x_api_key`) the client used.
            if let Some(value) = crate::request::headers::used_header_value(headers, name) {
                bytes += name.len() + value.len();
                out.insert(name.clone(), value.to_string());
            }
        }
        if bytes > MAX_CHECK_HEADER_BYTES {
            return Err(Refusal::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the rate-limited headers take {bytes} bytes, more than {MAX_CHECK_HEADER_BYTES}"),
            ));
        }
        Ok(Some(out))
    }

    /// The decision for a request that could not be put to the endpoint (no snapshot yet says
    /// what a check must carry): `--on-endpoint-failure`.
    pub fn undecidable(&self) -> Decision {
        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "no_snapshot" }).inc();
        let decision = self.exchange.failure_mode();
        self.count(Source::FailureMode, &decision);
        decision
    }

    /// The endpoint this sidecar asks (the egress path asks it on its own: [`super::egress`]).
    pub(super) fn endpoint(&self) -> &Arc<super::endpoint::Endpoint> {
        &self.exchange.endpoint
    }

    pub async fn decide(&self, input: &CheckInput<'_>) -> Decision {
        if let Some((source, decision)) = self.without_endpoint(input).await {
            self.count(source, &decision);
            return decision;
        }
        match self.exchange.ask(input).await {
            Asked::Answered(decision) => {
                self.count(Source::Endpoint, &decision);
                return decision;
            }
            // An endpoint that cannot be asked cannot be trusted to push either: the held
            // snapshot request may be just as stuck, so until it answers again, every request
            // is asked about.
            Asked::Unavailable => self.snapshots.set_pushed(false),
        }
        let (source, decision) = self.fallback(input).await;
        self.count(source, &decision);
        decision
    }

    /// A request decided here with the endpoint's answer, without the exchange, while the
    /// cached snapshot is exactly the endpoint's (same version): one that no rule applies to is
    /// allowed with no headers, while the snapshot is also kept current by a held snapshot
    /// request (so a new or changed policy reaches this pod as soon as the endpoint installs
    /// it); one whose every rule is `consistency: leased` is decided from the slices held here
    /// (renewed from the endpoint when the table asks). Otherwise, and for a request the
    /// endpoint would refuse as malformed, `None`: the endpoint is asked as always.
    async fn without_endpoint(&self, input: &CheckInput<'_>) -> Option<(Source, Decision)> {
        if !self.snapshots.is_exact() || crate::api::check::check_path(input.path).is_err() {
            return None;
        }
        let view = input.view();
        let endpoint = &*self.exchange.endpoint;
        match self
            .snapshots
            .local()
            .check_without_store(&view, &self.leases, endpoint, Some(self.exchange.timeout))
            .await
        {
            WithoutStore::NoRule if self.snapshots.is_pushed() => {
                Some((Source::NoRule, Decision::Allow { delay: Duration::ZERO, headers: Vec::new(), lease: None }))
            }
            WithoutStore::FromLeases(response) => Some((Source::Lease, from_engine(response))),
            WithoutStore::NoRule | WithoutStore::AskTheStore => None,
        }
    }

    /// Settles this pod's slices as they end, until `shutdown`; then gives every one back.
    pub async fn keep_leases(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        crate::engine::leasing::keep(&self.leases, &*self.exchange.endpoint, &*self.clock, shutdown).await;
    }

    fn count(&self, source: Source, decision: &Decision) {
        let result = match decision {
            Decision::Allow { .. } => "allow",
            Decision::Deny { .. } => "deny",
            Decision::Refuse(_) => "refuse",
        };
        self.metrics.decisions.get_or_create(&DecisionLabels { source: source.name(), result }).inc();
    }

    async fn fallback(&self, input: &CheckInput<'_>) -> (Source, Decision) {
        let local = self.snapshots.local();
        if local.is_loaded() {
            return (Source::Local, from_engine(local.check(&input.view(), Holds::Returned).await));
        }
        (Source::FailureMode, self.exchange.failure_mode())
    }
}

fn from_engine(response: CheckResponse) -> Decision {
    let headers = response.headers.iter().map(|(k, v)| (k.as_ref(), v.as_str()));
    decision_of(
        response.allowed,
        response.retry_after_ms,
        response.delay_ms,
        headers,
        response.lease.clone().map(Held::Local),
        response.status,
        response.body.as_deref(),
    )
}
