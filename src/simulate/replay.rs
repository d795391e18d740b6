//! Replaying arrivals through a compiled snapshot and the real memory store, on a simulated
//! clock: each arrival is decided at its own `now`, nothing sleeps.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::hash::Hasher;
use std::net::{IpAddr, Ipv6Addr};

use serde::Serialize;

use super::SimulateError;
use super::arrivals::Arrival;
use super::stats::{Bound, max_admitted_in_any_window, theoretical_bound};
use crate::algorithm::{Decision, HoldId, Micros};
use crate::api::check::CheckRequest;
use crate::clock::FakeClock;
use crate::duration::MICROS_PER_MS;
use crate::engine::leases::QuotaLeases;
use crate::policy::{CompiledRule, DEFAULT_NAMESPACE, Matched, RequestView, Snapshot};
use crate::request::names::StrMap;
use crate::rule::RuleCheck;
use crate::store::memory::MemoryStore;
use crate::store::{LeaseOp, LeaseStore, Settle, Store};

/// Where the simulated trace starts: the first multiple of every rule's `per` after this, so
/// that trace time 0 is a window boundary of every rule and timestamps look like real ones.
const EPOCH_AROUND: Micros = 1_700_000_000_000_000;
/// Simulated times must stay well inside what the algorithms compute exactly (2^53).
const LATEST_START: Micros = 1 << 51;

#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// Trace time 0 is this long after a window boundary of every rule (`--start`).
    pub start_offset: Micros,
    /// Width of a timeline bucket; `None`: about a hundredth of the trace, rounded to 1-2-5.
    pub bucket: Option<Micros>,
    /// How long each request is in progress when its arrival does not say (`--hold`): what a
    /// `concurrency` rule's slot is held for.
    pub hold: Option<Micros>,
    /// Enforcers the arrivals are spread over, round robin (`--holders`): each holds quota
    /// leases of `consistency: leased` rules as an endpoint replica does; 0 decides every
    /// request at the store, as one exact enforcer.
    pub holders: usize,
}

/// What one simulation measured.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SimulationReport {
    /// The simulated Unix time of trace time 0, in microseconds.
    pub start_unix_micros: Micros,
    /// How long after a window boundary of every rule trace time 0 falls (`--start`).
    #[serde(skip)]
    pub start_offset: Micros,
    pub arrivals: u64,
    /// From trace time 0 to the last arrival.
    pub duration_ms: f64,
    pub bucket_ms: f64,
    pub rules: Vec<RuleReport>,
    /// `--compare`: the same traffic through every algorithm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compare: Option<Vec<super::comparison::Comparison>>,
    /// `--holders`: how the leased rules' requests were decided across the holders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leases: Option<LeaseReplay>,
}

/// What the holders of a `--holders` replay did.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseReplay {
    pub holders: usize,
    /// Requests of leased rules decided from a slice held, refused by a holder (the store had
    /// nothing left), and decided by the store.
    pub admitted_locally: u64,
    pub refused_locally: u64,
    pub to_store: u64,
    /// Store calls: exact decisions, renewals and settles.
    pub store_calls: u64,
}

/// One rule's numbers. Request counts are requests; `maxAdmittedInAnyWindow` and `bound` are
/// cost (equal to requests when every cost is 1).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuleReport {
    pub policy: String,
    pub rule: String,
    pub algorithm: &'static str,
    pub requests: u64,
    pub per_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_delay_ms: Option<u64>,
    pub shadow: bool,
    /// Arrivals this rule matched.
    pub offered: u64,
    /// Of those, the ones this rule consumed for (the request was admitted).
    pub admitted: u64,
    /// `offered − admitted`: refused by this rule or by another rule of the same request.
    pub denied: u64,
    /// Refused by this rule's own decision (for a shadow rule: would have been).
    pub denied_by_rule: u64,
    /// The cost admitted: for a rule whose cost is known after the response (`responseCost`),
    /// the actual costs (the trace's cost column), charged when each response ends.
    pub admitted_cost: u64,
    /// For a `responseCost` rule: the estimates its admissions reserved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_cost: Option<u64>,
    /// Distinct keys the rule counted.
    pub keys: u64,
    /// Admitted with a shaping delay (leakyBucket with maxDelay).
    pub shaped: u64,
    pub max_shaping_delay_ms: f64,
    pub mean_shaping_delay_ms: f64,
    /// The most admitted cost of one key in any window of `per` (sliding, half-open, exact to
    /// the microsecond); for a `responseCost` rule, of actual costs by admission time: above
    /// `requests`, the overspend its estimates allowed.
    pub max_admitted_in_any_window: u64,
    /// Its theoretical limit for this algorithm as Sluice implements it; `null` if none.
    pub bound: Option<u64>,
    pub bound_formula: &'static str,
    /// For a `consistency: leased` rule: its declared `maxOvershoot`, which the holders may
    /// add to `bound` (only when a holder fails to settle; a replay's holders never do).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_bound: Option<u64>,
    /// A shaping rule's departures (what a `spec.egress` destination sees): the most leaving
    /// in any window of `per`, its bound, and the longest queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub departures: Option<Departures>,
    /// A `deferIfLimited` rule's queue: what was accepted instead of refused, and how it drained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deferral: Option<DeferralReport>,
    /// Most consecutive refusals of one key.
    pub longest_denial_run: u64,
    /// From the first to the last refusal of that run.
    pub longest_denial_run_ms: f64,
    /// Time to recover after a burst: the longest time one key spent refused, from its first
    /// refusal to its next admission; `null` when nothing was refused.
    pub recovery_ms: Option<f64>,
    /// Keys still refused at their last arrival (their recovery is not in the trace).
    pub unrecovered_keys: u64,
    pub timeline: Timeline,
}

/// A shaping rule's departures: what the requests it admits do once their wait is over.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Departures {
    /// The most departing in any window of `per` (sliding, half-open).
    pub most_in_any_window: u64,
    /// Departures evenly spaced one interval apart: `1 + floor((per − 1µs) / interval)`.
    pub bound: u64,
    /// The most requests waiting for their departure at once.
    pub longest_queue: u64,
}

/// What a `deferIfLimited` rule's queue did with the refused writes of the trace.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeferralReport {
    /// Refused arrivals queued instead.
    pub accepted: u64,
    /// Refused arrivals the key's queue had no room for (`maxQueued`): refused.
    pub refused_full: u64,
    /// Queued writes replayed (each checked like an arrival, and admitted).
    pub delivered: u64,
    /// Still queued when the replay stopped (a day after the last arrival).
    pub left: u64,
    /// The most queued for one key at once.
    pub longest_queue: u64,
    /// From acceptance to replay.
    pub delay_p50_ms: f64,
    pub delay_p99_ms: f64,
    pub delay_max_ms: f64,
    /// Trace time of the last replay, when everything was delivered.
    pub drained_ms: Option<f64>,
}

/// The replay of a `deferIfLimited` rule's queues: per key, the refused arrivals (trace time of
/// acceptance, arrival index) in order, and when each non-empty queue is tried next.
struct Deferrals {
    /// The rule's index in the tallies, and its `maxQueued`.
    rule: usize,
    max_queued: u64,
    queues: HashMap<Option<String>, std::collections::VecDeque<(Micros, usize)>>,
    /// (simulated time, key) of each non-empty queue's next try.
    tries: BinaryHeap<Reverse<(Micros, Option<String>)>>,
    accepted: u64,
    refused_full: u64,
    delays: Vec<Micros>,
    longest_queue: u64,
    queued: u64,
    last_delivery: Micros,
}

/// Per time bucket of the report's `bucketMs`, from trace time 0.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Timeline {
    pub offered: Vec<u64>,
    pub admitted: Vec<u64>,
    pub denied: Vec<u64>,
    /// The lowest remaining quota any decision of the rule reported in the bucket (`null`:
    /// no traffic).
    pub remaining: Vec<Option<u64>>,
    /// The longest shaping delay of the bucket's admissions, whole milliseconds rounded up
    /// (leakyBucket with maxDelay; 0 otherwise).
    pub max_delay_ms: Vec<u64>,
    /// A shaping rule's departures per bucket: when its admitted requests leave, after their
    /// wait (what the downstream sees; a `spec.egress` destination's arrivals). Empty for
    /// other rules; departures after the last bucket count in it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub departed: Vec<u64>,
    /// A shaping rule's queue: the most admitted requests waiting for their departure at any
    /// admission in the bucket. Empty for other rules.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub queue: Vec<u64>,
    /// A `deferIfLimited` rule's writes replayed per bucket (checked like arrivals and
    /// admitted); replays after the last bucket count in it. Empty for other rules.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replayed: Vec<u64>,
    /// A `deferIfLimited` rule's queued writes, the most at once in the bucket. Empty for other
    /// rules.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deferred: Vec<u64>,
}

/// The template's headers with the keyed headers replaced by the arrival's key value.
struct KeyedHeaders<'a> {
    base: &'a BTreeMap<String, String>,
    keyed: &'a [String],
    value: Option<&'a str>,
}

impl StrMap for KeyedHeaders<'_> {
    fn get_str(&self, key: &str) -> Option<&str> {
        match self.value {
            Some(value) if self.keyed.iter().any(|k| k == key) => Some(value),
            _ => self.base.get(key).map(String::as_str),
        }
    }
}

/// A key value that is not an IP address, as a stable client address: `fd00::/8` followed by a
/// 64-bit FNV-1a hash of the value, so distinct keys get distinct addresses in practice.
pub fn synthetic_client_ip(value: &str) -> IpAddr {
    match value.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => {
            let mut hasher = Fnv1a::default();
            hasher.write(value.as_bytes());
            IpAddr::V6(Ipv6Addr::from((0xfd00_u128 << 112) | u128::from(hasher.finish())))
        }
    }
}

struct Fnv1a(u64);
impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}
impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The simulated Unix time of trace time 0: a common boundary of every rule's windows (a
/// multiple of each `per`), near [`EPOCH_AROUND`], plus `offset`.
pub fn start_time(rules: &[&CompiledRule], offset: Micros) -> Result<Micros, SimulateError> {
    let mut lcm: u64 = 1;
    for rule in rules {
        let per = rule.limit().per();
        lcm = (lcm / gcd(lcm, per))
            .checked_mul(per)
            .filter(|&l| l <= LATEST_START)
            .ok_or(SimulateError::NoCommonBoundary)?;
    }
    let near = EPOCH_AROUND.div_ceil(lcm) * lcm;
    let base = if near <= LATEST_START { near } else { lcm };
    base.checked_add(offset).filter(|&t| t <= LATEST_START).ok_or(SimulateError::NoCommonBoundary)
}

/// A 1-2-5 step at least `raw` and at least 1 ms.
fn nice_bucket(raw: Micros) -> Micros {
    let mut step = MICROS_PER_MS;
    loop {
        for factor in [1, 2, 5] {
            if step * factor >= raw {
                return step * factor;
            }
        }
        step *= 10;
    }
}

#[derive(Default)]
struct KeyTrack {
    /// Admitted (time, cost), in time order.
    admitted: Vec<(Micros, u64)>,
    /// First refusal of the current run, and its length.
    run_start: Option<Micros>,
    run_length: u64,
}

struct RuleTally<'s> {
    rule: &'s CompiledRule,
    keys: HashMap<String, KeyTrack>,
    offered: u64,
    admitted: u64,
    denied_by_rule: u64,
    admitted_cost: u64,
    reserved_cost: u64,
    shaped: u64,
    delay_total: Micros,
    delay_max: Micros,
    longest_run: (u64, Micros),
    recovery: Option<Micros>,
    timeline: Timeline,
    /// A `concurrency` rule's requests in progress per key, and the most seen for one key.
    in_flight: HashMap<String, u64>,
    max_in_flight: u64,
    /// A shaping rule's admitted requests not yet departed: their departure times.
    waiting: BinaryHeap<Reverse<Micros>>,
    /// The timeline's bucket width (µs).
    bucket_width: Micros,
    /// A shaping rule's departure times, with their costs.
    departures: Vec<(Micros, u64)>,
    /// A `deferIfLimited` rule's queue, once replayed.
    deferral: Option<DeferralReport>,
}

impl RuleTally<'_> {
    fn started(&mut self, key: &str) {
        let count = self.in_flight.entry(key.to_string()).or_insert(0);
        *count += 1;
        self.max_in_flight = self.max_in_flight.max(*count);
    }

    fn ended(&mut self, key: &str) {
        if let Some(count) = self.in_flight.get_mut(key) {
            *count = count.saturating_sub(1);
        }
    }

    /// One decision of this rule at trace time `at` (denial runs and recovery are measured on
    /// trace time, the same durations as on the simulated clock).
    /// A shaping rule's admission at `at` leaving after `delay`: counted where it departs, and
    /// in the queue of those waiting.
    fn departs(&mut self, at: Micros, delay: Micros, bucket: usize) {
        while self.waiting.peek().is_some_and(|Reverse(leaves)| *leaves <= at) {
            self.waiting.pop();
        }
        let width = self.bucket_width.max(1);
        let last = self.timeline.departed.len().saturating_sub(1);
        let leaves_in = (((at + delay) / width) as usize).min(last);
        if let Some(count) = self.timeline.departed.get_mut(leaves_in) {
            *count += 1;
        }
        if delay > 0 {
            self.waiting.push(Reverse(at + delay));
        }
        self.departures.push((at + delay, 1));
        if let Some(most) = self.timeline.queue.get_mut(bucket) {
            *most = (*most).max(self.waiting.len() as u64);
        }
    }

    /// A queued write of `key` replayed and admitted at trace time `at`: it counts in the key's
    /// windows like an admitted arrival (what the application sees is both together).
    fn replayed(&mut self, key: &str, at: Micros, cost: u64, bucket: Micros) {
        self.keys.entry(key.to_string()).or_default().admitted.push((at, cost));
        let series = &mut self.timeline.replayed;
        let slot = ((at / bucket.max(1)) as usize).min(series.len().saturating_sub(1));
        if let Some(count) = series.get_mut(slot) {
            *count += 1;
        }
    }

    fn record(&mut self, key: &str, at: Micros, cost: u64, decision: &Decision, consumed: bool, bucket: usize) {
        self.offered += 1;
        self.timeline.offered[bucket] += 1;
        if consumed && self.rule.limit().shapes() {
            self.departs(at, decision.delay, bucket);
        }
        let slot = &mut self.timeline.remaining[bucket];
        *slot = Some(slot.map_or(decision.remaining, |r| r.min(decision.remaining)));
        if !decision.allowed {
            self.denied_by_rule += 1;
        }
        if !self.keys.contains_key(key) {
            self.keys.insert(key.to_string(), KeyTrack::default());
        }
        let Some(track) = self.keys.get_mut(key) else { return };
        if consumed {
            self.admitted += 1;
            self.admitted_cost += cost;
            self.timeline.admitted[bucket] += 1;
            if decision.delay > 0 {
                let slot = &mut self.timeline.max_delay_ms[bucket];
                *slot = (*slot).max(decision.delay.div_ceil(MICROS_PER_MS));
                self.shaped += 1;
                self.delay_total += decision.delay;
                self.delay_max = self.delay_max.max(decision.delay);
            }
            track.admitted.push((at, cost));
            if let Some(start) = track.run_start.take() {
                self.recovery = Some(self.recovery.unwrap_or(0).max(at - start));
            }
            track.run_length = 0;
        } else {
            self.timeline.denied[bucket] += 1;
            let start = *track.run_start.get_or_insert(at);
            track.run_length += 1;
            if (track.run_length, at - start) > self.longest_run {
                self.longest_run = (track.run_length, at - start);
            }
        }
    }

    fn report(self) -> RuleReport {
        let limit = self.rule.limit();
        // For a concurrency rule the column is the most in progress at once for one key.
        let max_in_window = if limit.algorithm().holds() {
            self.max_in_flight
        } else {
            self.keys.values().map(|track| max_admitted_in_any_window(&track.admitted, limit.per())).max().unwrap_or(0)
        };
        let unrecovered: Vec<&KeyTrack> = self.keys.values().filter(|t| t.run_start.is_some()).collect();
        let Bound { value, formula } = theoretical_bound(limit);
        let ms = |micros: Micros| micros as f64 / MICROS_PER_MS as f64;
        RuleReport {
            policy: self.rule.policy().to_string(),
            rule: self.rule.name().to_string(),
            algorithm: self.rule.algorithm().name(),
            requests: limit.requests(),
            per_ms: limit.per() / MICROS_PER_MS,
            burst: self.rule.algorithm().uses_burst().then(|| limit.burst()),
            max_delay_ms: limit.max_delay().map(|d| d / MICROS_PER_MS),
            shadow: !self.rule.enforce(),
            offered: self.offered,
            admitted: self.admitted,
            denied: self.offered - self.admitted,
            denied_by_rule: self.denied_by_rule,
            admitted_cost: self.admitted_cost,
            reserved_cost: self.rule.response_cost().map(|_| self.reserved_cost),
            keys: self.keys.len() as u64,
            shaped: self.shaped,
            max_shaping_delay_ms: ms(self.delay_max),
            mean_shaping_delay_ms: if self.shaped == 0 { 0.0 } else { ms(self.delay_total) / self.shaped as f64 },
            max_admitted_in_any_window: max_in_window,
            departures: self.rule.limit().shapes().then(|| {
                let mut departures = self.departures.clone();
                departures.sort_unstable();
                Departures {
                    most_in_any_window: max_admitted_in_any_window(&departures, limit.per()),
                    bound: 1 + (limit.per() - 1) / limit.interval(),
                    longest_queue: self.timeline.queue.iter().copied().max().unwrap_or(0),
                }
            }),
            bound: value,
            bound_formula: formula,
            lease_bound: self.rule.leasing().map(|l| l.max_overshoot),
            deferral: self.deferral,
            longest_denial_run: self.longest_run.0,
            longest_denial_run_ms: ms(self.longest_run.1),
            recovery_ms: self.recovery.map(ms),
            unrecovered_keys: unrecovered.len() as u64,
            timeline: self.timeline,
        }
    }
}

/// What a request holds under one rule until its response ends: the rule's index and the rule,
/// the key, the estimate it reserved, and the actual cost its settle charges.
type Held<'r> = (usize, &'r CompiledRule, String, u64, u64);

/// Replays `arrivals` (sorted by time) through `snapshot` with a fresh memory store: each one is
/// the `template` request with the arrival's key and cost, decided at its own simulated time.
///
/// The key value of an arrival replaces the value of every header that a rule of the request's
/// namespace keys on, and becomes the client IP (itself if it is an IP address, else
/// [`synthetic_client_ip`]) when a rule keys on `clientIP`. Arrivals without a key keep the
/// template's values.
pub fn replay(
    snapshot: &Snapshot,
    template: &CheckRequest,
    arrivals: &[Arrival],
    options: &ReplayOptions,
) -> Result<SimulationReport, SimulateError> {
    let namespace = template.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
    // An egress call (`"egress"` in the request) is decided by the namespace's egress entries.
    let policies = snapshot.namespace_policies(namespace);
    let rules: Vec<&CompiledRule> = match template.egress {
        Some(_) => policies.iter().flat_map(|p| p.egress().iter().map(|e| &e.rule)).collect(),
        None => policies.iter().flat_map(|p| p.rules()).collect(),
    };
    if rules.is_empty() {
        return Err(SimulateError::NoRules(namespace.to_string()));
    }
    if let Some(holding) = rules.iter().find(|r| r.limit().holds())
        && options.hold.is_none()
        && arrivals.iter().any(|a| a.hold.is_none())
    {
        return Err(SimulateError::Concurrency(holding.identity().to_string()));
    }
    let start = start_time(&rules, options.start_offset)?;
    let mut keyed: Vec<String> = rules.iter().flat_map(|r| r.keyed_headers()).map(str::to_string).collect();
    keyed.sort();
    keyed.dedup();
    let keys_on_client_ip = rules.iter().any(|r| r.keys_on_client_ip());

    let duration = arrivals.last().map_or(0, |a| a.at);
    // A trace shorter than a rule's window (a burst at one instant) still gets buckets a window
    // can be read in: about a hundredth of the shortest `per`.
    let shortest_per = rules.iter().map(|r| r.limit().per()).min().unwrap_or(0);
    let bucket =
        options.bucket.filter(|&b| b > 0).unwrap_or_else(|| nice_bucket(duration.max(shortest_per).div_ceil(100)));
    let buckets = (duration / bucket) as usize + 1;
    // A write a `deferIfLimited` rule matches: its refusals are queued and replayed.
    let deferring = deferring_rule(snapshot, template, namespace).map(|rule| rule.identity());
    let empty_timeline = |rule: &CompiledRule| {
        let shaping = if rule.limit().shapes() { buckets } else { 0 };
        Timeline {
            offered: vec![0; buckets],
            admitted: vec![0; buckets],
            denied: vec![0; buckets],
            remaining: vec![None; buckets],
            max_delay_ms: vec![0; buckets],
            departed: vec![0; shaping],
            queue: vec![0; shaping],
            replayed: vec![0; if deferring == Some(rule.identity()) { buckets } else { 0 }],
            deferred: vec![0; if deferring == Some(rule.identity()) { buckets } else { 0 }],
        }
    };
    let index: HashMap<&str, usize> = rules.iter().enumerate().map(|(i, r)| (r.identity(), i)).collect();
    let mut deferrals = deferring.and_then(|identity| {
        let rule = *index.get(identity)?;
        Some(Deferrals {
            rule,
            max_queued: rules[rule].defer()?.max_queued,
            queues: HashMap::new(),
            tries: BinaryHeap::new(),
            accepted: 0,
            refused_full: 0,
            delays: Vec::new(),
            longest_queue: 0,
            queued: 0,
            last_delivery: 0,
        })
    });
    let mut tallies: Vec<RuleTally<'_>> = rules
        .iter()
        .map(|&rule| RuleTally {
            rule,
            keys: HashMap::new(),
            offered: 0,
            admitted: 0,
            denied_by_rule: 0,
            admitted_cost: 0,
            reserved_cost: 0,
            shaped: 0,
            delay_total: 0,
            delay_max: 0,
            longest_run: (0, 0),
            recovery: None,
            timeline: empty_timeline(rule),
            in_flight: HashMap::new(),
            max_in_flight: 0,
            waiting: BinaryHeap::new(),
            bucket_width: bucket,
            departures: Vec::new(),
            deferral: None,
        })
        .collect();
    let requester = Requester { template, namespace, keyed: &keyed, keys_on_client_ip };

    // Every decision passes its simulated `now`; the holders and their grants read `clock`,
    // set to each arrival's time.
    let clock = FakeClock::new(start);
    let store = MemoryStore::with_clock(1 << 40, std::sync::Arc::new(clock.clone()));
    let holders: Vec<QuotaLeases> = (0..options.holders).map(|_| QuotaLeases::new(1 << 20)).collect();
    let leasing = CountedStore { store: &store, calls: std::sync::atomic::AtomicU64::new(0) };
    let mut exact_calls = 0u64;
    let mut matched: Vec<Matched<'_>> = Vec::new();
    let mut decisions: Vec<Decision> = Vec::new();
    // Requests in progress that hold a concurrency slot: when each ends, and what it holds.
    let mut ending: BinaryHeap<Reverse<(Micros, HoldId)>> = BinaryHeap::new();
    // A reservation's rule (a cost known after the response) settles to the arrival's cost.
    let mut holding: HashMap<HoldId, Vec<Held<'_>>> = HashMap::new();
    for (n, arrival) in arrivals.iter().enumerate() {
        let now = start + arrival.at;
        clock.set(now);
        for holder in &holders {
            futures::executor::block_on(crate::engine::leasing::settle_due(holder, &leasing, &clock, false));
        }
        while let Some(&Reverse((end, hold))) = ending.peek()
            && end <= now
        {
            ending.pop();
            for (i, rule, key, reserved, actual) in holding.remove(&hold).unwrap_or_default() {
                let settle =
                    Settle { rule: rule.id(), limit: rule.limit(), key: key.as_bytes(), cost: actual, reserved };
                store.settle_at(end, &[settle], hold);
                if rule.algorithm().holds() {
                    tallies[i].ended(&key);
                }
            }
        }
        if let Some(deferrals) = deferrals.as_mut() {
            deferrals.replay_due(now, start, bucket, &store, snapshot, &requester, arrivals, &index, &mut tallies);
        }
        let headers = requester.headers(arrival);
        let request = requester.view(arrival, &headers);
        snapshot.resolve(&request, &mut matched);
        if matched.is_empty() {
            continue;
        }
        // A request's hold id (odd, never 0), as the engine gives one to a request that holds.
        let hold = ((n as u64) << 1) | 1;
        let checks: Vec<RuleCheck<'_>> = matched.iter().map(|m| RuleCheck { hold, ..m.check() }).collect();
        let from_slices = holders.get(n % holders.len().max(1)).and_then(|holder| {
            futures::executor::block_on(crate::engine::leasing::decide(
                holder, &leasing, &clock, namespace, &matched, None,
            ))
        });
        let allowed = match from_slices {
            Some(verdict) => {
                decisions.clear();
                decisions.extend(verdict.decisions);
                verdict.allowed
            }
            None => {
                exact_calls += 1;
                store.check_into(now, &checks, &mut decisions)
            }
        };
        let slot = (arrival.at / bucket) as usize;
        let mut held = Vec::new();
        for (m, decision) in matched.iter().zip(&decisions) {
            let Some(&i) = index.get(m.rule.identity()) else { continue };
            // The store consumes for a rule only when the request is admitted and the rule
            // itself admits (a shadow rule that would refuse consumes nothing).
            let consumed = allowed && decision.allowed;
            // A reservation's estimate is what admission took; what the rule charges is the
            // arrival's actual cost, settled when its response ends.
            let actual = arrival.cost.or(template.cost).unwrap_or(1);
            let charged = if m.rule.response_cost().is_some() { actual } else { m.cost };
            if consumed && m.rule.response_cost().is_some() {
                tallies[i].reserved_cost += m.cost;
            }
            tallies[i].record(&m.key, arrival.at, charged, decision, consumed, slot);
            if consumed && m.rule.algorithm().holds() && m.cost > 0 {
                tallies[i].started(&m.key);
                held.push((i, m.rule, m.key.clone(), 0, 0));
            } else if consumed && m.rule.response_cost().is_some() {
                held.push((i, m.rule, m.key.clone(), m.cost, actual));
            }
        }
        if !held.is_empty() {
            let length = arrival.hold.or(options.hold).unwrap_or(0);
            ending.push(Reverse((now + length, hold)));
            holding.insert(hold, held);
        }
        if !allowed && let Some(deferrals) = deferrals.as_mut() {
            let retry = decisions.iter().filter(|d| !d.allowed).filter_map(|d| d.retry_after).max();
            deferrals.offer(arrival, n, now, retry, bucket, &mut tallies);
        }
    }
    // What is still queued drains after the trace, for at most a day.
    if let Some(deferrals) = deferrals.as_mut() {
        let until = start + duration + 86_400_000_000;
        deferrals.replay_due(until, start, bucket, &store, snapshot, &requester, arrivals, &index, &mut tallies);
        tallies[deferrals.rule].deferral = Some(deferrals.report());
    }
    Ok(SimulationReport {
        start_unix_micros: start,
        start_offset: options.start_offset,
        arrivals: arrivals.len() as u64,
        duration_ms: duration as f64 / MICROS_PER_MS as f64,
        bucket_ms: bucket as f64 / MICROS_PER_MS as f64,
        rules: tallies.into_iter().map(RuleTally::report).collect(),
        compare: None,
        leases: (!holders.is_empty()).then(|| {
            let total = |f: fn(&QuotaLeases) -> u64| holders.iter().map(f).sum::<u64>();
            LeaseReplay {
                holders: holders.len(),
                admitted_locally: total(|h| h.status().admitted_locally),
                refused_locally: total(|h| h.status().refused_locally),
                to_store: total(|h| h.status().to_store),
                store_calls: exact_calls + leasing.calls.load(std::sync::atomic::Ordering::Relaxed),
            }
        }),
    })
}

/// The first `deferIfLimited` rule the template matches, when it is a write.
fn deferring_rule<'s>(snapshot: &'s Snapshot, template: &CheckRequest, namespace: &str) -> Option<&'s CompiledRule> {
    let headers = &template.headers;
    let request = RequestView {
        namespace,
        labels: &template.labels,
        method: &template.method,
        path: &template.path,
        host: template.host.as_deref(),
        client_ip: template.client_ip,
        headers,
        cost: 1,
        fields: &template.request_fields,
        descriptor: None,
        egress: template.egress.as_deref(),
        max_wait: None,
    };
    template.egress.is_none().then(|| snapshot.defer_for(&request)).flatten()
}

/// Builds each arrival's request: the template with the arrival's key and cost.
struct Requester<'a> {
    template: &'a CheckRequest,
    namespace: &'a str,
    keyed: &'a [String],
    keys_on_client_ip: bool,
}

impl<'a> Requester<'a> {
    fn headers(&self, arrival: &'a Arrival) -> KeyedHeaders<'a> {
        KeyedHeaders { base: &self.template.headers, keyed: self.keyed, value: arrival.key.as_deref() }
    }

    fn view<'r>(&'r self, arrival: &'r Arrival, headers: &'r KeyedHeaders<'r>) -> RequestView<'r> {
        let template = self.template;
        let client_ip = match (&arrival.key, self.keys_on_client_ip) {
            (Some(key), true) => Some(synthetic_client_ip(key)),
            _ => template.client_ip,
        };
        RequestView {
            namespace: self.namespace,
            labels: &template.labels,
            method: &template.method,
            path: &template.path,
            host: template.host.as_deref(),
            client_ip,
            headers,
            cost: arrival.cost.or(template.cost).unwrap_or(1),
            fields: &template.request_fields,
            descriptor: None,
            egress: template.egress.as_deref(),
            max_wait: template.deadline_ms.map(|ms| ms.saturating_mul(MICROS_PER_MS)),
        }
    }
}

impl Deferrals {
    /// A refused arrival `n` at simulated time `now`: queued when its key has room, tried
    /// again after `retry` (the refusal's).
    fn offer(
        &mut self,
        arrival: &Arrival,
        n: usize,
        now: Micros,
        retry: Option<Micros>,
        bucket: Micros,
        tallies: &mut [RuleTally<'_>],
    ) {
        let queue = self.queues.entry(arrival.key.clone()).or_default();
        if queue.len() as u64 >= self.max_queued {
            self.refused_full += 1;
            return;
        }
        queue.push_back((arrival.at, n));
        if queue.len() == 1 {
            self.tries.push(Reverse((now + retry.unwrap_or(1).max(1), arrival.key.clone())));
        }
        self.longest_queue = self.longest_queue.max(queue.len() as u64);
        self.accepted += 1;
        self.queued += 1;
        self.note_depth(arrival.at, bucket, tallies);
    }

    fn note_depth(&self, at: Micros, bucket: Micros, tallies: &mut [RuleTally<'_>]) {
        let series = &mut tallies[self.rule].timeline.deferred;
        let slot = ((at / bucket.max(1)) as usize).min(series.len().saturating_sub(1));
        if let Some(most) = series.get_mut(slot) {
            *most = (*most).max(self.queued);
        }
    }

    /// Replays what is due up to simulated time `until`, in time order: the head of a key's
    /// queue is checked like its arrival; admitted, it is delivered (and the next one tried at
    /// once), refused, tried again after the refusal's `retry_after`.
    #[allow(clippy::too_many_arguments)]
    fn replay_due<'s>(
        &mut self,
        until: Micros,
        start: Micros,
        bucket: Micros,
        store: &MemoryStore,
        snapshot: &'s Snapshot,
        requester: &Requester<'_>,
        arrivals: &[Arrival],
        index: &HashMap<&str, usize>,
        tallies: &mut [RuleTally<'s>],
    ) {
        let mut matched: Vec<Matched<'_>> = Vec::new();
        let mut decisions: Vec<Decision> = Vec::new();
        while let Some(Reverse((at, _))) = self.tries.peek()
            && *at <= until
        {
            let Some(Reverse((at, key))) = self.tries.pop() else { break };
            let Some(&(accepted, n)) = self.queues.get(&key).and_then(|q| q.front()) else { continue };
            let arrival = &arrivals[n];
            let headers = requester.headers(arrival);
            let request = requester.view(arrival, &headers);
            snapshot.resolve(&request, &mut matched);
            let checks: Vec<RuleCheck<'_>> = matched.iter().map(|m| m.check()).collect();
            let allowed = store.check_into(at, &checks, &mut decisions);
            if !allowed {
                let retry = decisions.iter().filter(|d| !d.allowed).filter_map(|d| d.retry_after).max();
                self.tries.push(Reverse((at + retry.unwrap_or(1_000_000).max(1), key)));
                continue;
            }
            let trace_at = at.saturating_sub(start);
            for (m, decision) in matched.iter().zip(&decisions) {
                let Some(&i) = index.get(m.rule.identity()) else { continue };
                if decision.allowed {
                    tallies[i].replayed(&m.key, trace_at, m.cost, bucket);
                }
            }
            if let Some(queue) = self.queues.get_mut(&key) {
                queue.pop_front();
                if queue.is_empty() {
                    self.queues.remove(&key);
                } else {
                    self.tries.push(Reverse((at, key)));
                }
            }
            self.queued -= 1;
            self.delays.push(trace_at.saturating_sub(accepted));
            self.last_delivery = trace_at;
            self.note_depth(trace_at, bucket, tallies);
        }
    }

    fn report(&mut self) -> DeferralReport {
        self.delays.sort_unstable();
        let ms = |micros: Micros| micros as f64 / MICROS_PER_MS as f64;
        let at = |q: f64| {
            let last = self.delays.len().saturating_sub(1);
            self.delays.get(((last as f64) * q).round() as usize).copied().map_or(0.0, ms)
        };
        DeferralReport {
            accepted: self.accepted,
            refused_full: self.refused_full,
            delivered: self.delays.len() as u64,
            left: self.queued,
            longest_queue: self.longest_queue,
            delay_p50_ms: at(0.5),
            delay_p99_ms: at(0.99),
            delay_max_ms: self.delays.last().copied().map_or(0.0, ms),
            drained_ms: (self.queued == 0 && !self.delays.is_empty()).then(|| ms(self.last_delivery)),
        }
    }
}

/// The replay's store as the holders see it: the memory store, its calls counted.
struct CountedStore<'a> {
    store: &'a MemoryStore,
    calls: std::sync::atomic::AtomicU64,
}

impl LeaseStore for CountedStore<'_> {
    async fn lease(
        &self,
        namespace: &str,
        ops: &[LeaseOp<'_>],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, crate::store::StoreError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.store.lease_for(namespace, None, ops).await
    }
}

impl SimulationReport {
    /// The per-rule table for a terminal.
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let boundary = match self.start_offset {
            0 => "a window boundary of every rule".to_string(),
            offset => format!("{} after a window boundary of every rule", crate::duration::HumanDuration(offset)),
        };
        let _ = writeln!(
            out,
            "{} arrivals over {:.3} s (trace time 0 = Unix {:.6} s, {boundary})",
            self.arrivals,
            self.duration_ms / 1000.0,
            self.start_unix_micros as f64 / 1e6
        );
        // One column for the rule names, as wide as the longest, so every row lines up.
        let width = self.rules.iter().map(|r| r.policy.len() + r.rule.len() + 1).max().unwrap_or(0).max(24);
        let _ = writeln!(
            out,
            "{:<width$} {:<20} {:>9} {:>9} {:>9} {:>11} {:>9} {:>7} {:>11} {:>10} {:>11}",
            "rule",
            "algorithm",
            "offered",
            "admitted",
            "denied",
            "maxInWindow",
            "bound",
            "shaped",
            "maxDelayMs",
            "denialRun",
            "recoveryMs"
        );
        for r in &self.rules {
            let _ = writeln!(
                out,
                "{:<width$} {:<20} {:>9} {:>9} {:>9} {:>11} {:>9} {:>7} {:>11.3} {:>10} {:>11}",
                format!("{}/{}", r.policy, r.rule),
                r.algorithm,
                r.offered,
                r.admitted,
                r.denied,
                r.max_admitted_in_any_window,
                r.bound.map_or_else(|| "-".to_string(), |b| b.to_string()),
                r.shaped,
                r.max_shaping_delay_ms,
                r.longest_denial_run,
                r.recovery_ms.map_or_else(|| "-".to_string(), |ms| format!("{ms:.3}")),
            );
        }
        let _ = writeln!(out, "maxInWindow: most admitted cost of one key in any window of the rule's per; bound:");
        for r in &self.rules {
            let _ = writeln!(out, "  {}/{}: {}", r.policy, r.rule, r.bound_formula);
        }
        for r in &self.rules {
            if let Some(d) = &r.departures {
                let _ = writeln!(
                    out,
                    "{}/{}: departures (what the downstream sees): most in any {} ms {} against {} (one per interval); longest queue {}",
                    r.policy, r.rule, r.per_ms, d.most_in_any_window, d.bound, d.longest_queue
                );
            }
        }
        for r in &self.rules {
            if let Some(d) = &r.deferral {
                let drained = match d.drained_ms {
                    Some(ms) => format!("drained at {:.3} s", ms / 1000.0),
                    None => format!("{} still queued", d.left),
                };
                let _ = writeln!(
                    out,
                    "{}/{}: deferred writes: {} accepted instead of refused, {} refused (queue full); {} replayed within the limits, {:.0} ms after acceptance at the median, {:.0} ms at p99, {:.0} ms at most; longest queue {}; {drained}",
                    r.policy,
                    r.rule,
                    d.accepted,
                    d.refused_full,
                    d.delivered,
                    d.delay_p50_ms,
                    d.delay_p99_ms,
                    d.delay_max_ms,
                    d.longest_queue
                );
            }
        }
        for r in self.rules.iter().filter(|r| r.reserved_cost.is_some()) {
            let bound = r.bound.map_or_else(String::new, |b| format!(" (the algorithm alone allows up to {b})"));
            let _ = writeln!(
                out,
                "{}/{}: costs known after the response: reserved {} (estimates), charged {} (actual); most charged in one window {} against requests {}{bound}",
                r.policy,
                r.rule,
                r.reserved_cost.unwrap_or(0),
                r.admitted_cost,
                r.max_admitted_in_any_window,
                r.requests,
            );
        }
        if let Some(leases) = &self.leases {
            let _ = writeln!(
                out,
                "across {} holders: {} admitted from slices, {} refused by a holder, {} decided by the store; {} store calls for {} arrivals",
                leases.holders,
                leases.admitted_locally,
                leases.refused_locally,
                leases.to_store,
                leases.store_calls,
                self.arrivals
            );
            for r in self.rules.iter().filter(|r| r.lease_bound.is_some()) {
                let allowed = r.bound.map(|b| b + r.lease_bound.unwrap_or(0));
                let _ = writeln!(
                    out,
                    "{}/{}: leased, maxOvershoot {}: most in a window {} against {} allowed",
                    r.policy,
                    r.rule,
                    r.lease_bound.unwrap_or(0),
                    r.max_admitted_in_any_window,
                    allowed.map_or_else(|| "-".to_string(), |a| a.to_string()),
                );
            }
        }
        if let Some(compare) = &self.compare {
            out.push_str(&super::comparison::to_text(compare));
        }
        out
    }
}
