//! The enforcement engine: the live snapshot, the store, and the rules for turning a check
//! request into a decision. No HTTP here; the axum layer and the sidecar both sit on top.

pub mod deferred;
pub mod headers;
pub mod hold;
pub(crate) mod json;
pub mod leases;
pub mod leasing;

/// The most a single check may cost; keeps every store's arithmetic exact.
pub const MAX_COST: u64 = u32::MAX as u64;

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;

use self::headers::{RuleHeader, RuleHeaderInput, rate_limit_headers, retry_after};
use self::leases::QuotaLeases;
use crate::algorithm::{Decision, Limit, Micros};
use crate::clock::Clock;
use crate::duration::MICROS_PER_MS;
use crate::policy::FailureMode;
use crate::policy::{Descriptor, Matched, RequestView, Snapshot};
use crate::rule::Verdict;
use crate::rule::{RuleCheck, RuleId};
use crate::store::memory::MemoryStore;
use crate::store::{LeaseOp, LeaseStore, Settle, Store, StoreError};
use crate::telemetry::{Metrics, ModeLabels, RuleCounters};

/// Headers to add to the response, in order: Sluice's own (static names) and declared ones.
pub type ResponseHeaders = Vec<(std::borrow::Cow<'static, str>, String)>;

/// One key's lease operation asked by a holder elsewhere ([`Engine::lease_for_holder`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderLease {
    pub rule: RuleId,
    pub key: String,
    /// The slice to settle: its hold id and the units spent from it.
    pub settle: Option<(crate::algorithm::HoldId, u64)>,
    /// The slice wanted: its hold id (never 0) and units.
    pub ask: Option<(crate::algorithm::HoldId, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HolderLeaseError {
    /// What the holder asked for is not a lease it may have.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Store(StoreError),
}

/// What [`Engine::check_without_store`] could decide.
#[derive(Debug)]
pub enum WithoutStore {
    /// No rule applies: allowed, with no headers.
    NoRule,
    /// Decided from quota leases.
    FromLeases(CheckResponse),
    /// Only the store can decide it.
    AskTheStore,
}

/// What the check API answers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CheckResponse {
    pub allowed: bool,
    pub status: u16,
    pub retry_after_ms: Option<u64>,
    pub delay_ms: u64,
    /// The rate-limit headers, and a refusing rule's declared `refusal` headers.
    #[serde(serialize_with = "ordered_map")]
    pub headers: ResponseHeaders,
    /// A refusing rule's declared `refusal` body: what to answer instead of the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<Arc<str>>,
    pub rules: Vec<RuleResult>,
    /// The snapshot version that decided (empty before the first load).
    pub snapshot: Arc<str>,
    /// What the admitted request holds (its concurrency rules' slots), to give back to
    /// `POST /v1/release` when it ends ([`hold`]); only from entry points that can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    /// An admission with a wait (`delayMs`): the slots it took, which `POST /v1/cancel` gives
    /// back if the caller leaves before departing ([`parse_slot`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
}

/// What a lease's reservations settle to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleCost {
    /// The cost is unknown (the response could not be read): what was reserved.
    AsReserved,
    /// The request failed: each rule's `responseCost.onFailure`.
    Failed,
    /// The response's cost: per rule name, else `all`, else what was reserved.
    Actual { all: Option<u64>, by_rule: std::collections::BTreeMap<String, u64> },
}

/// Whether the entry point can give back what a request holds (a concurrency rule's slot) when
/// the request ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// Its caller gives back what an admitted request holds, as a hold token ([`hold`]).
    Returned,
    /// No release signal reaches it (ext_authz, the rate limit service): rules that hold are not
    /// decided there, and `sluice_holding_rules_skipped_total{api}` counts them under this name.
    Skipped(&'static str),
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RuleResult {
    pub policy: Arc<str>,
    pub rule: Arc<str>,
    pub allowed: bool,
    pub shadow: bool,
    pub limit: u64,
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: Option<u64>,
    /// The window `limit` is stated over (RateLimit-Policy's `w`), for the rate limit
    /// service's `requests_per_unit`.
    #[serde(skip)]
    pub quota_window_ms: u64,
    /// Set when the shared store failed and the rule's `onStoreFailure` decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_failure: Option<&'static str>,
    /// The request was refused from the shared store's denial cache by another rule, without
    /// asking the store: this rule was not decided (`allowed` only says it refused nothing, and
    /// `remaining` is its limit, not its state).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub not_decided: bool,
    /// `policy` and `rule` as the answer's JSON writes them (`{"policy":…,"rule":…`), made once
    /// per snapshot from this rule's names by [`json::names_json`]; `None` writes them from the
    /// two fields. Only the engine sets it, so it always says what `policy` and `rule` say.
    #[serde(skip)]
    pub(crate) names_json: Option<Arc<str>>,
}

pub(super) fn ordered_map<S: serde::Serializer>(
    pairs: &[(std::borrow::Cow<'static, str>, String)],
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(pairs.len()))?;
    for (k, v) in pairs {
        map.serialize_entry(k, v)?;
    }
    map.end()
}

fn ceil_ms(micros: Micros) -> u64 {
    micros.div_ceil(MICROS_PER_MS)
}

/// `Retry-After` (whole seconds, rounded up) of a wait of `retry_after_ms` plus up to `jitter`
/// at random, so clients refused together spread their retries; `retryAfterMs` stays exact.
fn jitter_retry_after(headers: &mut ResponseHeaders, retry_after_ms: u64, jitter: Micros) {
    let spread = rand::random_range(0..=jitter.div_ceil(MICROS_PER_MS));
    let seconds = (retry_after_ms + spread).div_ceil(1000).max(1).to_string();
    match headers.iter_mut().find(|(name, _)| name.eq_ignore_ascii_case("retry-after")) {
        Some((_, value)) => *value = seconds,
        None => headers.push((std::borrow::Cow::Borrowed("Retry-After"), seconds)),
    }
}

/// A decision on several rate limit descriptors at once (Envoy's `ShouldRateLimit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorsChecked {
    /// The decision on the whole request: every rule any descriptor matched, decided together.
    pub response: CheckResponse,
    /// For each descriptor, in order: the indices in `response.rules` of the rules it matched.
    /// A rule that two descriptors reach with the same key is one counter, charged their
    /// summed cost, and listed under both.
    pub rules_of: Vec<Vec<usize>>,
}

/// Per-rule things resolved once per snapshot rather than per request.
struct RuleExtras {
    /// The rule's `RateLimit-Policy` and `RateLimit` parts that no decision changes.
    header: RuleHeader,
    /// Its names as its result's JSON begins ([`RuleResult::names_json`]).
    names_json: Arc<str>,
    counters: RuleCounters,
    /// This replica's share of the limit, enforced locally while the shared store is away.
    fallback_limit: Limit,
    /// The rule's limit and name, and its `responseCost`, for settling a lease by rule id.
    limit: Limit,
    name: String,
    response_cost: Option<Arc<crate::policy::response_cost::ResponseCost>>,
}

/// Where `onStoreFailure: localFallback` rules are decided while the shared store fails.
struct LocalFallback {
    store: Arc<MemoryStore>,
    replicas: u32,
}

/// The limit one of `replicas` replicas enforces alone: `requests` and `burst` divided among
/// them (rounded down, at least 1), the same period. Falls back to the whole limit if the share
/// cannot be represented.
fn replica_share(limit: &Limit, replicas: u32) -> Limit {
    if replicas <= 1 {
        return limit.clone();
    }
    let share = |n: u64| (n / u64::from(replicas)).max(1);
    let burst = limit.algorithm().uses_burst().then(|| share(limit.burst()));
    let shared = Limit::new(limit.algorithm(), share(limit.requests()), limit.per(), burst, limit.max_delay());
    match (shared, limit.reservation_ttl()) {
        (Ok(shared), None) => shared,
        (Ok(shared), Some(ttl)) => shared.reserving(ttl).unwrap_or_else(|_| limit.clone()),
        (Err(_), _) => limit.clone(),
    }
}

/// Where each shaping rule's queue ends, per key (leaky buckets with `maxDelay`: `spec.egress`
/// budgets): what a store failure must not overlap. Departures already promised by the shared
/// store are continued by the local fallback rather than doubled by a second queue beside
/// them, and once the store is back a key whose local queue still has departures ahead stays
/// local until it has drained (the store's own queue end is stale by then).
#[derive(Default)]
struct ShapingTails {
    /// The queue end the shared store last answered, by rule and key.
    shared: HashMap<(RuleId, Box<[u8]>), Micros>,
    /// The queue end the local fallback has promised, by rule and key.
    local: HashMap<(RuleId, Box<[u8]>), Micros>,
}

/// Keys a [`ShapingTails`] map follows before it forgets those whose queue has drained.
const MAX_SHAPING_TAILS: usize = 10_000;

impl ShapingTails {
    fn note(map: &mut HashMap<(RuleId, Box<[u8]>), Micros>, rule: RuleId, key: &[u8], tail: Micros, now: Micros) {
        if map.len() >= MAX_SHAPING_TAILS {
            map.retain(|_, t| *t > now);
            if map.len() >= MAX_SHAPING_TAILS {
                map.clear();
            }
        }
        let entry = map.entry((rule, key.into())).or_insert(tail);
        *entry = (*entry).max(tail);
    }
}

/// A snapshot with what the engine derives from it.
pub struct Live {
    pub snapshot: Arc<Snapshot>,
    /// The snapshot's version, shared by every response it decides.
    version: Arc<str>,
    /// Unix microseconds when it went live.
    pub loaded_at: Micros,
    extras: HashMap<RuleId, RuleExtras, BuildHasherDefault<crate::rule::PrehashedHasher>>,
}

/// Why the most recent reload did not go live.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ReloadError {
    pub at: Micros,
    pub message: String,
}

/// What a snapshot long-poll waits for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotEvents {
    /// Snapshots installed so far.
    pub installs: u64,
    pub stopping: bool,
}

pub struct Engine<S> {
    live: ArcSwap<Live>,
    /// Wakes snapshot long-polls (`GET /v1/snapshot?wait=…`): on every install, and once when
    /// the process stops.
    events: tokio::sync::watch::Sender<SnapshotEvents>,
    loaded: std::sync::atomic::AtomicBool,
    last_error: Mutex<Option<ReloadError>>,
    store: S,
    fallback: Option<LocalFallback>,
    /// Slices of hot keys' quota held here, for `consistency: leased` rules; `None` when the
    /// store is this process's memory (every decision is local already).
    leases: Option<QuotaLeases>,
    /// What hold tokens are signed and verified with ([`hold`]).
    token_keys: ArcSwap<self::hold::TokenKeys>,
    /// Shaping rules' queue ends, so a store failure neither doubles nor overlaps a queue.
    tails: Mutex<ShapingTails>,
    /// The queues of `deferIfLimited` rules, as last read ([`Engine::keep_queue_stats`]).
    queues: Mutex<Vec<crate::store::queue::QueueStatus>>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl<S: Store> Engine<S> {
    pub fn new(store: S, clock: Arc<dyn Clock>, metrics: Arc<Metrics>) -> Engine<S> {
        let snapshot = Arc::new(Snapshot::default());
        let empty = Live { version: snapshot.version().into(), snapshot, loaded_at: 0, extras: HashMap::default() };
        Engine {
            live: ArcSwap::from_pointee(empty),
            events: tokio::sync::watch::Sender::new(SnapshotEvents::default()),
            loaded: std::sync::atomic::AtomicBool::new(false),
            last_error: Mutex::new(None),
            store,
            fallback: None,
            leases: None,
            token_keys: ArcSwap::from_pointee(self::hold::TokenKeys::random()),
            tails: Mutex::new(ShapingTails::default()),
            queues: Mutex::new(Vec::new()),
            clock,
            metrics,
        }
    }

    /// Signs hold tokens with `keys` from now on (and verifies with them alone): replicas that
    /// settle each other's tokens share them. Without this, a random key of this process.
    pub fn set_token_keys(&self, keys: self::hold::TokenKeys) {
        self.token_keys.store(Arc::new(keys));
    }

    /// The lease a hold token carries, once its signature and bounds are checked.
    pub fn verify_hold(&self, token: &str) -> Result<self::hold::Hold, self::hold::HoldError> {
        self::hold::Hold::verify(token, &self.token_keys.load())
    }

    /// Lets `consistency: leased` rules decide hot keys from slices of their quota held here
    /// (following at most `max_keys` keys). Without this every rule is decided exactly.
    pub fn with_quota_leases(mut self, max_keys: usize) -> Engine<S> {
        self.leases = Some(QuotaLeases::new(max_keys));
        self
    }

    /// How many replicas share each `localFallback` limit (1 without a fallback).
    pub fn fallback_replicas(&self) -> u32 {
        self.fallback.as_ref().map_or(1, |f| f.replicas)
    }

    /// Rules with `onStoreFailure: localFallback` are decided in `store` while the shared store
    /// fails, each at 1/`replicas` of its limit. Without this they fail open.
    pub fn with_local_fallback(mut self, store: Arc<MemoryStore>, replicas: u32) -> Engine<S> {
        self.fallback = Some(LocalFallback { store, replicas: replicas.max(1) });
        self
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The store's self-description, with this process's memory in it: the local fallback's
    /// keys and evictions when the store is shared (a shared store holds no keys here).
    pub fn store_status(&self) -> crate::store::StoreStatus {
        let mut status = self.store.status();
        if let Some(fallback) = &self.fallback {
            let memory = fallback.store.status();
            status.live_keys = memory.live_keys;
            status.live_units = memory.live_units;
            status.evicted_keys = memory.evicted_keys;
            status.evicted_keys_by_namespace = memory.evicted_keys_by_namespace;
        }
        if let Some(leases) = &self.leases {
            status.quota_leases = Some(leases.status());
        }
        status.deferred_queues = self.queues.lock().clone();
        status
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Swaps `snapshot` in atomically; requests in flight finish on the one they started with.
    pub fn install(&self, snapshot: Arc<Snapshot>) {
        let mut extras = HashMap::default();
        for rule in snapshot.rules().chain(snapshot.egress_rules()) {
            extras.insert(
                rule.id(),
                RuleExtras {
                    header: RuleHeader::new(
                        &header_name(rule.policy(), rule.name()),
                        rule.limit().capacity(),
                        quota_window(rule.limit()),
                    ),
                    names_json: json::names_json(rule.policy(), rule.name()),
                    counters: self.metrics.rule_counters(rule.policy(), rule.name(), rule.response_cost().is_some()),
                    fallback_limit: replica_share(rule.limit(), self.fallback.as_ref().map_or(1, |f| f.replicas)),
                    limit: rule.limit().clone(),
                    name: rule.name().to_string(),
                    response_cost: rule.response_cost().cloned(),
                },
            );
        }
        self.metrics.retain_rules(
            snapshot
                .rules()
                .chain(snapshot.egress_rules())
                .map(|r| (r.policy().to_string(), r.name().to_string()))
                .collect(),
        );
        let now = self.clock.now();
        self.metrics.snapshot_rules.set(snapshot.rule_count() as i64);
        self.metrics.snapshot_loaded_seconds.set(now as f64 / 1e6);
        self.live.store(Arc::new(Live { version: snapshot.version().into(), snapshot, loaded_at: now, extras }));
        self.loaded.store(true, std::sync::atomic::Ordering::Release);
        self.events.send_modify(|events| events.installs += 1);
        *self.last_error.lock() = None;
        self.metrics.reloads.get_or_create(&crate::telemetry::ResultLabels { result: "success" }).inc();
    }

    /// Records a reload that failed; the live snapshot stays.
    pub fn reload_failed(&self, message: String) {
        self.metrics.reloads.get_or_create(&crate::telemetry::ResultLabels { result: "error" }).inc();
        *self.last_error.lock() = Some(ReloadError { at: self.clock.now(), message });
    }

    pub fn is_loaded(&self) -> bool {
        self.loaded.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Installs and the stop, for a caller waiting for the snapshot to change. Subscribe before
    /// reading [`Engine::live`], so that no install between the two goes unseen.
    pub fn snapshot_events(&self) -> tokio::sync::watch::Receiver<SnapshotEvents> {
        self.events.subscribe()
    }

    /// The process is stopping: snapshot long-polls answer now instead of holding a graceful
    /// stop for their whole wait.
    pub fn stop_snapshot_waits(&self) {
        self.events.send_modify(|events| events.stopping = true);
    }

    pub fn live(&self) -> Arc<Live> {
        self.live.load_full()
    }

    pub fn last_error(&self) -> Option<ReloadError> {
        self.last_error.lock().clone()
    }

    /// Decides one request against the live snapshot. Every entry point (check API, ext_authz,
    /// the sidecar's local fallback) builds the borrowed view from what it parsed, without
    /// copying.
    ///
    /// With `sluice::check=debug` logging, each check is decided in a `check` span naming its
    /// namespace, the snapshot version and the number of rules it matched (the store's and the
    /// failure modes' logs come inside it). Otherwise the span costs one level comparison: the
    /// traced path is out of line and boxed, so the hot path's future stays as it is.
    pub async fn check(&self, request: &RequestView<'_>, holds: Holds) -> CheckResponse {
        let started = Instant::now();
        let live = self.live.load();
        let mut matched: Vec<Matched<'_>> = Vec::new();
        live.snapshot.resolve(request, &mut matched);
        if let Holds::Skipped(api) = holds {
            self.skip_holding_rules(&mut matched, api);
        }
        let leased = holds == Holds::Returned;
        let response = if tracing::enabled!(target: "sluice::check", tracing::Level::DEBUG) {
            Box::pin(self.decide_traced(&live, request.namespace, &matched, leased, request.max_wait)).await
        } else {
            self.decide(&live, request.namespace, &matched, None, leased, request.max_wait).await
        };
        self.metrics.check_seconds.observe(started.elapsed().as_secs_f64());
        response
    }

    /// Drops the rules whose admission would hold capacity nobody can give back, counting them.
    fn skip_holding_rules(&self, matched: &mut Vec<Matched<'_>>, api: &'static str) {
        let before = matched.len();
        matched.retain(|m| !m.rule.limit().algorithm().holds());
        let skipped = before - matched.len();
        if skipped > 0 {
            self.metrics
                .holding_rules_skipped
                .get_or_create(&crate::telemetry::ApiLabels { api })
                .inc_by(skipped as u64);
        }
    }

    /// The `responseCost` of each rule a lease holds a reservation under, with the rule's name.
    pub fn response_costs(
        &self,
        lease: &self::hold::Hold,
    ) -> Vec<(String, Arc<crate::policy::response_cost::ResponseCost>)> {
        let live = self.live.load();
        lease
            .held
            .iter()
            .filter_map(|(rule, _)| live.extras.get(rule))
            .filter_map(|extras| Some((extras.name.clone(), extras.response_cost.clone()?)))
            .collect()
    }

    /// Settles what a lease holds (`POST /v1/settle`, `POST /v1/release`): concurrency slots are
    /// given back, reservations replaced by `cost`'s actual costs, in the shared store or, for a
    /// lease taken while it was down, in this replica's memory. Idempotent. A rule no longer in
    /// the snapshot is left to its reservation's ttl. Returns how many holds were found.
    pub async fn settle(&self, lease: &self::hold::Hold, cost: &SettleCost) -> Result<u64, StoreError> {
        let live = self.live.load();
        let local = lease.local && self.fallback.is_some();
        let mut settles = Vec::with_capacity(lease.held.len());
        let mut counted = Vec::with_capacity(lease.held.len());
        for (i, (rule, key)) in lease.held.iter().enumerate() {
            let Some(extras) = live.extras.get(rule) else { continue };
            let reserved = lease.reserved.get(i).copied().unwrap_or(0);
            let actual = match (&extras.response_cost, cost) {
                (None, _) => 0,
                (Some(_), SettleCost::AsReserved) => reserved,
                (Some(rc), SettleCost::Failed) => rc.on_failure,
                (Some(_), SettleCost::Actual { all, by_rule }) => {
                    by_rule.get(&extras.name).copied().or(*all).unwrap_or(reserved)
                }
            };
            let limit = if local { &extras.fallback_limit } else { &extras.limit };
            settles.push(Settle { rule: *rule, limit, key: key.as_bytes(), cost: actual, reserved });
            counted.push((extras, reserved, actual));
        }
        let found = match (&self.fallback, local) {
            (Some(fallback), true) => fallback.store.settle_at(self.clock.now(), &settles, lease.hold),
            _ => self.store.settle_for(&lease.namespace, None, &settles, lease.hold).await?,
        };
        // Which holds were gone is known per call, not per rule: with every hold found, each
        // settled; with none, each had run out. (A lease's holds run out together.)
        for (extras, reserved, actual) in counted {
            if let Some(counters) = &extras.counters.reservations {
                if found > 0 {
                    counters.settled.inc_by(actual);
                } else {
                    counters.expired.inc_by(reserved);
                }
            }
        }
        Ok(found)
    }

    /// Gives back the slots a waiting request took (`POST /v1/cancel`, an abandoned wait): the
    /// request is resolved as its check was, and each shaping rule named in `slot` gives back
    /// its slot in the shared store if it is still the last one taken and not yet due
    /// ([`crate::algorithm::give_back`]). A rule no longer in the snapshot, or a slot another
    /// request has queued behind, stays taken. Returns how many slots went back.
    pub async fn cancel(&self, request: &RequestView<'_>, slot: &[(RuleId, Micros)]) -> Result<u64, StoreError> {
        let live = self.live.load();
        let mut matched: Vec<Matched<'_>> = Vec::new();
        live.snapshot.resolve(request, &mut matched);
        let cancels: Vec<crate::store::Cancel<'_>> = matched
            .iter()
            .filter(|m| m.rule.limit().shapes())
            .filter_map(|m| {
                let (_, until) = slot.iter().find(|(id, _)| *id == m.rule.id())?;
                Some(crate::store::Cancel {
                    rule: m.rule.id(),
                    limit: m.rule.limit(),
                    key: m.key.as_bytes(),
                    cost: m.cost,
                    until: *until,
                })
            })
            .collect();
        if cancels.is_empty() {
            return Ok(0);
        }
        let given = self.store.cancel_for(request.namespace, None, &cancels).await?;
        self.metrics.slots_given_back.inc_by(given);
        Ok(given)
    }

    #[inline(never)]
    #[cold]
    async fn decide_traced(
        &self,
        live: &Live,
        namespace: &str,
        matched: &[Matched<'_>],
        leased: bool,
        max_wait: Option<Micros>,
    ) -> CheckResponse {
        use tracing::Instrument;
        let span = tracing::debug_span!(
            target: "sluice::check",
            "check",
            namespace,
            snapshot = live.snapshot.version(),
            rules = matched.len(),
            allowed = tracing::field::Empty,
        );
        let response = self.decide(live, namespace, matched, None, leased, max_wait).instrument(span.clone()).await;
        span.record("allowed", response.allowed);
        response
    }

    /// Decides the descriptors of one Envoy rate limit request in `namespace` (its domain), each
    /// with its cost, all at once: the request is admitted only if every enforcing rule of every
    /// descriptor admits it, and a denial consumes nothing anywhere. When the store has not
    /// answered within `store_budget`, each rule's `onStoreFailure` decides, so a caller's
    /// deadline shorter than the store's own still gets the policy's answer.
    ///
    /// A counter several descriptors reach is decided once: with `sum_repeated` (a gateway, which
    /// may set costs) at the sum of their costs, capped at [`MAX_COST`]; otherwise at its
    /// cost once, so repeating a descriptor is no way for a tenant to set a price.
    ///
    /// A rule whose cost is known after the response (`responseCost`) is told that cost by Envoy
    /// once the stream is done (`hits_addend` with `apply_on_stream_done`): a descriptor of cost
    /// above 0 reaching it is such a report, charged in full whatever is left (debt, as a settle
    /// charges), and the request is decided at cost 0 for it. Its admission is a descriptor of
    /// cost 0 (`hits_addend: 0`), refused while the key is in debt.
    pub async fn check_descriptors(
        &self,
        namespace: &str,
        descriptors: &[(&dyn Descriptor, u64)],
        store_budget: Option<Duration>,
        sum_repeated: bool,
    ) -> DescriptorsChecked {
        let started = Instant::now();
        let live = self.live.load();
        let mut matched: Vec<Matched<'_>> = Vec::new();
        let mut rules_of = Vec::with_capacity(descriptors.len());
        let mut found = Vec::new();
        for &(descriptor, cost) in descriptors {
            live.snapshot.resolve(&RequestView::descriptor(namespace, descriptor, cost), &mut found);
            let mut indices = Vec::with_capacity(found.len());
            for m in found.drain(..) {
                // The rate limit service has no release signal: a slot taken here would be held
                // until its lease ran out.
                if m.rule.limit().algorithm().holds() {
                    self.metrics.holding_rules_skipped.get_or_create(&crate::telemetry::ApiLabels { api: "rls" }).inc();
                    continue;
                }
                // One counter is decided once per request, whichever descriptors reach it.
                match matched.iter().position(|c| c.rule.id() == m.rule.id() && c.key == m.key) {
                    Some(i) => {
                        matched[i].cost = if sum_repeated {
                            matched[i].cost.saturating_add(m.cost).min(MAX_COST)
                        } else {
                            matched[i].cost.max(m.cost)
                        };
                        indices.push(i);
                    }
                    None => {
                        indices.push(matched.len());
                        matched.push(m);
                    }
                }
            }
            rules_of.push(indices);
        }
        let reported: Vec<u64> = matched
            .iter_mut()
            .map(|m| if m.rule.response_cost().is_some() { std::mem::take(&mut m.cost) } else { 0 })
            .collect();
        if reported.iter().any(|&cost| cost > 0) {
            self.charge_reports(&live, namespace, &matched, &reported).await;
        }
        let response = self.decide(&live, namespace, &matched, store_budget, false, None).await;
        self.metrics.check_seconds.observe(started.elapsed().as_secs_f64());
        DescriptorsChecked { response, rules_of }
    }

    /// Charges the costs Envoy reported after responses (`reported[i]` for `matched[i]`, 0: none)
    /// as settles of reservations of 0: in full, even past the limit. A store that fails loses
    /// the charge (logged): the report's answer is not Envoy's to act on, the stream is over.
    async fn charge_reports(&self, live: &Live, namespace: &str, matched: &[Matched<'_>], reported: &[u64]) {
        let charges: Vec<Settle<'_>> = matched
            .iter()
            .zip(reported)
            .filter(|(_, cost)| **cost > 0)
            .map(|(m, &cost)| Settle {
                rule: m.rule.id(),
                limit: m.rule.limit(),
                key: m.key.as_bytes(),
                cost,
                reserved: 0,
            })
            .collect();
        // Any id but 0: nothing is held under it, a reservation of 0 is charged without one.
        let hold = rand::random::<u64>() | 1;
        match self.store.settle_for(namespace, None, &charges, hold).await {
            Ok(_) => {
                for charge in &charges {
                    let counters = live.extras.get(&charge.rule).and_then(|e| e.counters.reservations.as_ref());
                    if let Some(counters) = counters {
                        counters.settled.inc_by(charge.cost);
                    }
                }
            }
            Err(error) => tracing::warn!(namespace, %error, "costs reported after the response were not charged"),
        }
    }

    /// `leased`: the caller settles what an admitted request holds (it gets a lease); otherwise a
    /// rule whose cost is known after the response consumes its cost at once.
    async fn decide(
        &self,
        live: &Live,
        namespace: &str,
        matched: &[Matched<'_>],
        store_budget: Option<Duration>,
        leased: bool,
        max_wait: Option<Micros>,
    ) -> CheckResponse {
        if matched.is_empty() {
            return CheckResponse {
                allowed: true,
                status: 200,
                retry_after_ms: None,
                delay_ms: 0,
                headers: Vec::new(),
                body: None,
                rules: Vec::new(),
                snapshot: live.version.clone(),
                lease: None,
                slot: None,
            };
        }
        // The request's hold id, when a rule holds and the caller settles: only entry points that
        // settle reach here with concurrency rules ([`Holds`]).
        let hold = if leased && matched.iter().any(|m| m.rule.limit().holds()) { rand::random::<u64>() | 1 } else { 0 };
        // A caller with a deadline nearer than a shaping rule's maxDelay is refused at once rather
        // than admitted to wait past it: that rule decides with the shorter longest wait.
        let waits: Vec<Option<Limit>> = matched
            .iter()
            .map(|m| max_wait.filter(|_| m.rule.limit().shapes()).map(|w| m.rule.limit().waiting_at_most(w)))
            .collect();
        let checks: Vec<RuleCheck<'_>> = matched
            .iter()
            .zip(&waits)
            .map(|(m, wait)| {
                let check = RuleCheck { hold, ..m.rule.check(m.key.as_bytes(), m.cost) };
                match wait {
                    Some(limit) => RuleCheck { limit, ..check },
                    None => check,
                }
            })
            .collect();
        // Only a request whose every rule is leased can be decided from slices: the others skip
        // the table altogether (no lookup, no allocation).
        let from_leases = match &self.leases {
            Some(leases) if hold == 0 && matched.iter().all(|m| m.rule.leasing().is_some()) => {
                self::leasing::decide(leases, &self.store, &*self.clock, namespace, matched, store_budget).await
            }
            _ => None,
        };
        let shaping = matched.iter().any(|m| m.rule.limit().shapes());
        let (verdict, failed, now) = match from_leases {
            Some(verdict) => (verdict, false, self.clock.now()),
            // A shaping key whose local queue (promised while the store was away) still has
            // departures ahead stays local until it drains: the store's queue end is stale.
            None if shaping && self.draining_locally(matched) => {
                let now = self.clock.now();
                (self.failure_modes(live, namespace, matched, &checks, now), true, now)
            }
            None => {
                let deciding = self.store.check_for(namespace, None, &checks);
                let outcome = match store_budget {
                    None => deciding.await,
                    Some(budget) => tokio::time::timeout(budget, deciding)
                        .await
                        .unwrap_or(Err(StoreError::Timeout(budget.as_millis() as u64))),
                };
                let now = self.clock.now();
                match outcome {
                    Ok(verdict) => {
                        if shaping {
                            self.note_tails(matched, &verdict);
                        }
                        (verdict, false, now)
                    }
                    Err(error) => (self.on_store_failure(live, namespace, matched, &checks, &error, now), true, now),
                }
            }
        };
        self.respond(live, namespace, matched, &checks, &verdict, failed, now)
    }

    /// Decides `request` without asking the store, when that gives the store's answer: no rule
    /// of the live snapshot applies to it (allowed, no headers, no state touched), or every rule
    /// it matches is `consistency: leased` and the slices held in `leases` (renewed through
    /// `store`), or a dry key, can answer. The sidecar's fast path: such a request costs no call.
    pub async fn check_without_store<L: LeaseStore>(
        &self,
        request: &RequestView<'_>,
        leases: &QuotaLeases,
        store: &L,
        budget: Option<Duration>,
    ) -> WithoutStore {
        let live = self.live.load();
        let mut matched: Vec<Matched<'_>> = Vec::new();
        live.snapshot.resolve(request, &mut matched);
        if matched.is_empty() {
            return WithoutStore::NoRule;
        }
        let Some(verdict) =
            self::leasing::decide(leases, store, &*self.clock, request.namespace, &matched, budget).await
        else {
            return WithoutStore::AskTheStore;
        };
        let checks: Vec<RuleCheck<'_>> = matched.iter().map(|m| m.rule.check(m.key.as_bytes(), m.cost)).collect();
        WithoutStore::FromLeases(self.respond(
            &live,
            request.namespace,
            &matched,
            &checks,
            &verdict,
            false,
            self.clock.now(),
        ))
    }

    /// The answer to a request from its rules' verdict.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        &self,
        live: &Live,
        namespace: &str,
        matched: &[Matched<'_>],
        checks: &[RuleCheck<'_>],
        verdict: &Verdict,
        failed: bool,
        now: Micros,
    ) -> CheckResponse {
        let hold = checks.first().map_or(0, |c| c.hold);
        let mut header_inputs = Vec::with_capacity(matched.len());
        let mut rules = Vec::with_capacity(matched.len());
        let mut delay = 0;
        for (i, ((m, check), decision)) in matched.iter().zip(checks).zip(&verdict.decisions).enumerate() {
            let extras = live.extras.get(&m.rule.id());
            let shadow = !check.enforce;
            // Refused from the denial cache by another rule: this one was not asked, so it is
            // neither counted nor shown in headers, and `rules` says so.
            let not_decided = verdict.cached_denial.is_some_and(|by| by != i);
            if let (Some(extras), false) = (extras, not_decided) {
                let counter = match (decision.allowed, shadow) {
                    (true, _) => &extras.counters.allowed,
                    (false, false) => &extras.counters.limited,
                    (false, true) => &extras.counters.would_limit,
                };
                counter.inc();
            }
            if verdict.allowed && !shadow {
                delay = delay.max(decision.delay);
            }
            if let (Some(extras), false) = (extras, not_decided) {
                header_inputs.push(RuleHeaderInput { header: &extras.header, shadow, decision });
            }
            let (policy, rule) = m.rule.shared_names();
            rules.push(RuleResult {
                policy,
                rule,
                allowed: decision.allowed,
                shadow,
                limit: m.rule.limit().capacity(),
                remaining: decision.remaining,
                reset_ms: ceil_ms(decision.reset_after),
                retry_after_ms: decision.retry_after.map(ceil_ms),
                quota_window_ms: ceil_ms(quota_window(m.rule.limit())),
                store_failure: failed.then(|| m.rule.on_store_failure().name()),
                not_decided,
                names_json: extras.map(|e| e.names_json.clone()),
            });
        }
        let allowed = verdict.allowed;
        let lease = (allowed && hold != 0).then(|| {
            // A concurrency rule asked at cost 0 holds no slot; a reservation of 0 (reportAfter)
            // is still settled to its actual cost.
            let holding: Vec<&Matched<'_>> = matched
                .iter()
                .zip(&verdict.decisions)
                .filter(|(m, d)| {
                    m.rule.limit().holds() && d.allowed && (m.cost > 0 || m.rule.response_cost().is_some())
                })
                .map(|(m, _)| m)
                .collect();
            for m in &holding {
                if let Some(counters) = live.extras.get(&m.rule.id()).and_then(|e| e.counters.reservations.as_ref()) {
                    counters.reserved.inc_by(m.cost);
                }
            }
            let held = holding.iter().map(|m| (m.rule.id(), m.key.clone())).collect();
            let reserved = holding.iter().map(|m| if m.rule.response_cost().is_some() { m.cost } else { 0 }).collect();
            let local = failed && self.fallback.is_some();
            (!holding.is_empty()).then(|| {
                self::hold::Hold { namespace: namespace.to_string(), hold, held, reserved, local }
                    .token(&self.token_keys.load())
            })
        });
        let mut headers = rate_limit_headers(&header_inputs, allowed, now);
        // The first enforcing rule that refused says what the refused request gets.
        let refusing = (!allowed)
            .then(|| matched.iter().zip(checks).zip(&verdict.decisions).find(|((_, c), d)| c.enforce && !d.allowed))
            .flatten()
            .map(|((m, _), _)| m.rule);
        let retry_after_ms = if allowed { None } else { retry_after(&header_inputs).map(ceil_ms) };
        let refusal = refusing.and_then(|rule| rule.refusal());
        if let (Some(rule), Some(ms)) = (refusing, retry_after_ms)
            && rule.retry_after_jitter() > 0
        {
            jitter_retry_after(&mut headers, ms, rule.retry_after_jitter());
        }
        if let Some(refusal) = refusal {
            headers.extend(refusal.headers.iter().map(|(k, v)| (std::borrow::Cow::Owned(k.clone()), v.clone())));
        }
        CheckResponse {
            allowed,
            status: if allowed { 200 } else { refusal.map_or(429, |r| r.status) },
            retry_after_ms,
            delay_ms: if allowed { ceil_ms(delay) } else { 0 },
            headers,
            body: refusal.and_then(|r| r.body.clone()),
            rules,
            snapshot: live.version.clone(),
            lease: lease.flatten(),
            slot: if allowed && delay > 0 && !failed { slot_of(matched, verdict) } else { None },
        }
    }

    /// Settles and grants quota leases for a holder elsewhere (a sidecar holding slices for its
    /// pod: `POST /v1/leases`), in `namespace`, which the caller was verified to act in. The
    /// terms come from this endpoint's snapshot, never from the holder: each rule must be a
    /// `consistency: leased` rule of `namespace`, its bound caps the key's slices, its staleness
    /// their life, and one slice is at most a quarter of the bound.
    pub async fn lease_for_holder(
        &self,
        namespace: &str,
        asks: &[HolderLease],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, HolderLeaseError> {
        let live = self.live.load();
        let policies = live.snapshot.namespace_policies(namespace);
        let mut ops = Vec::with_capacity(asks.len());
        for (i, ask) in asks.iter().enumerate() {
            let rule = policies.iter().flat_map(|p| p.rules()).find(|r| r.id() == ask.rule).ok_or_else(|| {
                HolderLeaseError::Refused(format!("leases[{i}].rule: no rule {} in namespace {namespace}", ask.rule))
            })?;
            let leasing = rule.leasing().ok_or_else(|| {
                HolderLeaseError::Refused(format!("leases[{i}].rule: {} is not consistency: leased", rule.identity()))
            })?;
            let ask_terms = ask.ask.map(|(hold, want)| crate::algorithm::lease::LeaseAsk {
                hold,
                want: want.clamp(1, leasing.max_overshoot.div_ceil(4)),
                cap: leasing.max_overshoot,
                ttl: leasing.staleness,
            });
            ops.push(LeaseOp {
                rule: rule.id(),
                limit: rule.limit(),
                key: ask.key.as_bytes(),
                settle: ask.settle,
                ask: ask_terms,
            });
        }
        self.store.lease_for(namespace, None, &ops).await.map_err(HolderLeaseError::Store)
    }

    /// Settles the slices at their end, until `shutdown`; then gives back every slice held.
    pub async fn keep_leases(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) {
        if let Some(leases) = &self.leases {
            self::leasing::keep(leases, &self.store, &*self.clock, shutdown).await;
        }
    }

    /// Each rule decides by its `onStoreFailure` when the store could not: `allow` admits,
    /// `deny` refuses, `localFallback` asks this replica's memory with its share of the limit.
    /// Notes where the shaping rules of a request the shared store admitted left their queues.
    fn note_tails(&self, matched: &[Matched<'_>], verdict: &Verdict) {
        let (Some(at), true) = (verdict.at, verdict.allowed) else { return };
        let mut tails = self.tails.lock();
        for (m, d) in matched.iter().zip(&verdict.decisions) {
            if m.rule.limit().shapes() && d.allowed {
                ShapingTails::note(&mut tails.shared, m.rule.id(), m.key.as_bytes(), at + d.reset_after, at);
            }
        }
    }

    /// Whether a shaping `localFallback` rule of the request has local departures still ahead.
    fn draining_locally(&self, matched: &[Matched<'_>]) -> bool {
        if self.fallback.is_none() {
            return false;
        }
        let now = self.clock.now();
        let tails = self.tails.lock();
        matched.iter().any(|m| {
            m.rule.limit().shapes()
                && m.rule.on_store_failure() == FailureMode::LocalFallback
                && tails.local.get(&(m.rule.id(), m.key.as_bytes().into())).is_some_and(|&tail| tail > now)
        })
    }

    /// The request is still all-or-nothing: if an enforcing `deny` rule refuses, the local
    /// rules consume nothing.
    fn on_store_failure(
        &self,
        live: &Live,
        namespace: &str,
        matched: &[Matched<'_>],
        checks: &[RuleCheck<'_>],
        error: &StoreError,
        now: Micros,
    ) -> Verdict {
        self.metrics.store_errors.get_or_create(&crate::telemetry::KindLabels { kind: error.kind() }).inc();
        self.failure_modes(live, namespace, matched, checks, now)
    }

    /// Each rule's `onStoreFailure` decides the request (`localFallback` in this replica's
    /// memory, continuing a shaping rule's queue where the store left it).
    fn failure_modes(
        &self,
        live: &Live,
        namespace: &str,
        matched: &[Matched<'_>],
        checks: &[RuleCheck<'_>],
        now: Micros,
    ) -> Verdict {
        let fail_open = |c: &RuleCheck<'_>| Decision {
            allowed: true,
            remaining: c.limit.capacity(),
            reset_after: 0,
            retry_after: None,
            delay: 0,
        };
        let modes: Vec<FailureMode> = matched.iter().map(|m| m.rule.on_store_failure()).collect();
        let mut decisions: Vec<Decision> = checks
            .iter()
            .zip(&modes)
            .map(|(c, &mode)| {
                self.metrics.store_fallbacks.get_or_create(&ModeLabels { mode: mode.name() }).inc();
                match mode {
                    // Retry once the breaker's probe may have found the store again.
                    FailureMode::Deny => Decision {
                        allowed: false,
                        remaining: 0,
                        reset_after: 0,
                        retry_after: Some(crate::duration::MICROS_PER_SECOND),
                        delay: 0,
                    },
                    FailureMode::Allow | FailureMode::LocalFallback => fail_open(c),
                }
            })
            .collect();
        let denied_outright = checks.iter().zip(&decisions).any(|(c, d)| c.enforce && !d.allowed);
        if let (Some(fallback), false) = (&self.fallback, denied_outright) {
            let local: Vec<usize> = (0..checks.len()).filter(|&i| modes[i] == FailureMode::LocalFallback).collect();
            if !local.is_empty() {
                let local_checks: Vec<RuleCheck<'_>> = local
                    .iter()
                    .map(|&i| {
                        let limit = live.extras.get(&checks[i].rule).map_or(checks[i].limit, |e| &e.fallback_limit);
                        RuleCheck { limit, ..checks[i] }
                    })
                    .collect();
                for &i in &local {
                    if checks[i].limit.shapes() {
                        let tail = self.tails.lock().shared.get(&(checks[i].rule, checks[i].key.into())).copied();
                        if let Some(tail) = tail {
                            fallback.store.continue_queue_at(namespace, now, checks[i].rule, checks[i].key, tail);
                        }
                    }
                }
                let local_verdict = fallback.store.check_scoped_at(namespace, now, &local_checks);
                if local_verdict.allowed && local.iter().any(|&i| checks[i].limit.shapes()) {
                    let mut tails = self.tails.lock();
                    for (&i, d) in local.iter().zip(&local_verdict.decisions) {
                        if checks[i].limit.shapes() && d.allowed {
                            ShapingTails::note(
                                &mut tails.local,
                                checks[i].rule,
                                checks[i].key,
                                now + d.reset_after,
                                now,
                            );
                        }
                    }
                }
                for (&i, decision) in local.iter().zip(local_verdict.decisions) {
                    decisions[i] = decision;
                }
            }
        }
        Verdict { at: Some(now), ..Verdict::from_decisions(checks, decisions) }
    }
}

/// The slots an admission with a wait took, as `POST /v1/cancel` takes them back: for each
/// shaping rule that delayed, its id (hex) and the state its admission set (µs), `id:until`,
/// comma-separated. `None` when the store did not say when it decided.
fn slot_of(matched: &[Matched<'_>], verdict: &Verdict) -> Option<String> {
    let at = verdict.at?;
    let slots: Vec<String> = matched
        .iter()
        .zip(&verdict.decisions)
        .filter(|(m, d)| m.rule.limit().shapes() && d.delay > 0)
        .map(|(m, d)| format!("{:x}:{}", m.rule.id(), at.saturating_add(d.reset_after)))
        .collect();
    (!slots.is_empty()).then(|| slots.join(","))
}

/// A slot token ([`slot_of`]) read back: (rule id, until) pairs; `None` when malformed.
pub fn parse_slot(text: &str) -> Option<Vec<(RuleId, Micros)>> {
    if text.is_empty() || text.len() > 4096 {
        return None;
    }
    text.split(',')
        .map(|part| {
            let (id, until) = part.split_once(':')?;
            Some((RuleId::from_str_radix(id, 16).ok()?, until.parse::<Micros>().ok()?))
        })
        .collect()
}

/// The window a quota is stated over in `RateLimit-Policy`: `per` for window algorithms; for
/// buckets, the time to refill the whole capacity (`burst` at `requests` per `per`), so that the
/// quota `q` is the capacity and `remaining` never exceeds it.
fn quota_window(limit: &Limit) -> Micros {
    if limit.algorithm().uses_burst() { limit.burst() * limit.interval() } else { limit.per() }
}

/// The quota name clients see in `RateLimit-Policy`: `policy/rule`, without the namespace the
/// client already knows.
fn header_name(policy: &str, rule: &str) -> String {
    let policy_name = policy.rsplit_once('/').map_or(policy, |(_, name)| name);
    format!("{policy_name}/{rule}")
}

#[cfg(test)]
mod tests;
