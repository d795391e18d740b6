//! The conformance runner: feeds tests/vectors/conformance.yaml to any [`Store`] and reports every
//! decision that differs. Shared by the memory and Redis test binaries.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;
use sluice::algorithm::{Algorithm, Decision, Limit, Micros};
use sluice::clock::FakeClock;
use sluice::duration::{HumanDuration, parse_duration};
use sluice::engine::Engine;
use sluice::rule::{RuleCheck, RuleId};
use sluice::store::keys::DEFAULT_TAG;
use sluice::store::memory::MemoryStore;
use sluice::store::{Settle, Store};
use sluice::telemetry::Metrics;

/// A Unix time aligned to a whole day, so every window up to a day starts here.
pub const T0: Micros = 1_699_920_000_000_000;

pub const VECTORS: &str = include_str!("../vectors/conformance.yaml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vector {
    pub name: String,
    pub rules: indexmap_like::Ordered<RuleSpec>,
    pub steps: Vec<Step>,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleSpec {
    pub algorithm: Algorithm,
    pub requests: u64,
    pub per: String,
    pub burst: Option<u64>,
    pub max_delay: Option<String>,
    #[serde(default)]
    pub mode: Option<String>,
    /// The rule's cost is known after the response: admission reserves it for this long.
    #[serde(default)]
    pub reserve_for: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub at: String,
    #[serde(default = "one")]
    pub cost: u64,
    #[serde(default = "one")]
    pub repeat: u64,
    pub key: Option<String>,
    pub rules: Option<Vec<String>>,
    /// The request's hold id (reservations and concurrency slots); 0: none.
    #[serde(default)]
    pub hold: u64,
    /// Instead of a check: settle `hold` at `cost` (its actual cost) in the selected rules.
    #[serde(default)]
    pub settle: bool,
    /// For a settle: the estimate the hold reserved, as its lease would say; by default the cost
    /// of the last admitted step under that hold (1 when none was: a hold the store must look
    /// for).
    pub reserved: Option<u64>,
    pub expect: Expect,
}

fn one() -> u64 {
    1
}

#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Expect {
    pub allowed: Option<bool>,
    pub admitted: Option<u64>,
    pub rule_allowed: Option<bool>,
    pub remaining: Option<u64>,
    pub retry_after: Option<String>,
    pub reset_after: Option<String>,
    pub delay: Option<String>,
    /// For a settle step: how many holds it found.
    pub found: Option<u64>,
    #[serde(default)]
    pub rules: BTreeMap<String, RuleExpect>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleExpect {
    pub allowed: Option<bool>,
    pub remaining: Option<u64>,
    pub retry_after: Option<String>,
    pub reset_after: Option<String>,
    pub delay: Option<String>,
}

/// A map that keeps the YAML's order (rules are checked in declared order).
pub mod indexmap_like {
    use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

    pub struct Ordered<V>(pub Vec<(String, V)>);

    impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V2<V>(std::marker::PhantomData<V>);
            impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
                type Value = Ordered<V>;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a map of rule name to rule")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = map.next_entry()? {
                        out.push((k, v));
                    }
                    Ok(Ordered(out))
                }
            }
            d.deserialize_map(V2(std::marker::PhantomData))
        }
    }
}

pub fn load() -> Vec<Vector> {
    serde_yaml::from_str(VECTORS).expect("tests/vectors/conformance.yaml parses")
}

fn micros(text: &str) -> Micros {
    parse_duration(text).unwrap_or_else(|e| panic!("bad duration in vectors: {e}"))
}

fn expect_retry(text: &str) -> Option<Micros> {
    if text == "never" { None } else { Some(micros(text)) }
}

pub struct CompiledRule {
    pub name: String,
    pub id: RuleId,
    pub limit: Limit,
    pub enforce: bool,
}

pub fn compile_rules(vector_index: usize, vector: &Vector) -> Vec<CompiledRule> {
    vector
        .rules
        .0
        .iter()
        .enumerate()
        .map(|(i, (name, spec))| CompiledRule {
            name: name.clone(),
            // Distinct ids per vector, so one store can run every vector without interference.
            id: ((vector_index as u64 + 1) << 16) | i as u64,
            limit: Limit::new(
                spec.algorithm,
                spec.requests,
                micros(&spec.per),
                spec.burst,
                spec.max_delay.as_deref().map(micros),
            )
            .and_then(|limit| match &spec.reserve_for {
                Some(ttl) => limit.reserving(micros(ttl)),
                None => Ok(limit),
            })
            .unwrap_or_else(|e| panic!("{}: rule {name}: {e}", vector.name)),
            enforce: spec.mode.as_deref() != Some("shadow"),
        })
        .collect()
}

fn compare(failures: &mut Vec<String>, context: &str, field: &str, want: String, got: String) {
    if want != got {
        failures.push(format!("{context}: {field}: expected {want}, got {got}"));
    }
}

fn compare_rule(failures: &mut Vec<String>, context: &str, want: &RuleExpect, got: &Decision) {
    let show = |d: Option<Micros>| d.map_or("never".to_string(), |d| HumanDuration(d).to_string());
    if let Some(w) = want.allowed {
        compare(failures, context, "allowed", w.to_string(), got.allowed.to_string());
    }
    if let Some(w) = want.remaining {
        compare(failures, context, "remaining", w.to_string(), got.remaining.to_string());
    }
    if let Some(w) = &want.retry_after {
        compare(failures, context, "retryAfter", show(expect_retry(w)), show(got.retry_after));
    }
    if let Some(w) = &want.reset_after {
        compare(failures, context, "resetAfter", show(Some(micros(w))), show(Some(got.reset_after)));
    }
    if let Some(w) = &want.delay {
        compare(failures, context, "delay", show(Some(micros(w))), show(Some(got.delay)));
    }
}

/// Runs every vector against `store`; returns a description of each mismatch (empty = pass).
pub async fn run<S: Store>(store: &S) -> Vec<String> {
    run_vectors(store, &load()).await
}

pub async fn run_vectors<S: Store>(store: &S, vectors: &[Vector]) -> Vec<String> {
    let mut failures = Vec::new();
    for (vi, vector) in vectors.iter().enumerate() {
        let rules = compile_rules(vi, vector);
        // The estimate each hold id reserved when admitted (what its lease would carry).
        let mut reserved: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        for (si, step) in vector.steps.iter().enumerate() {
            let key = step.key.clone().unwrap_or_else(|| "k".to_string());
            let selected: Vec<&CompiledRule> = match &step.rules {
                None => rules.iter().collect(),
                Some(names) => names
                    .iter()
                    .map(|n| {
                        rules.iter().find(|r| &r.name == n).unwrap_or_else(|| panic!("{}: no rule {n}", vector.name))
                    })
                    .collect(),
            };
            let checks: Vec<RuleCheck<'_>> = selected
                .iter()
                .map(|r| RuleCheck {
                    rule: r.id,
                    limit: &r.limit,
                    key: key.as_bytes(),
                    cost: step.cost,
                    enforce: r.enforce,
                    hold: step.hold,
                })
                .collect();
            let now = T0 + micros(&step.at);
            let context = format!("{} / step {} (at {})", vector.name, si + 1, step.at);
            if step.settle {
                let settles: Vec<Settle<'_>> = selected
                    .iter()
                    .map(|r| Settle {
                        rule: r.id,
                        limit: &r.limit,
                        key: key.as_bytes(),
                        cost: step.cost,
                        reserved: step.reserved.or_else(|| reserved.get(&step.hold).copied()).unwrap_or(1),
                    })
                    .collect();
                match store.settle_for(DEFAULT_TAG, Some(now), &settles, step.hold).await {
                    Ok(found) => {
                        if let Some(want) = step.expect.found {
                            compare(&mut failures, &context, "found", want.to_string(), found.to_string());
                        }
                    }
                    Err(e) => failures.push(format!("{context}: store error on settle: {e}")),
                }
                continue;
            }
            let mut admitted = 0;
            let mut last = None;
            for _ in 0..step.repeat {
                match store.check(Some(now), &checks).await {
                    Ok(verdict) => {
                        admitted += verdict.allowed as u64;
                        if verdict.allowed && step.hold != 0 {
                            reserved.insert(step.hold, step.cost);
                        }
                        last = Some(verdict);
                    }
                    Err(e) => {
                        failures.push(format!("{context}: store error: {e}"));
                        break;
                    }
                }
            }
            let Some(verdict) = last else { continue };
            let e = &step.expect;
            if let Some(w) = e.allowed {
                compare(&mut failures, &context, "allowed", w.to_string(), verdict.allowed.to_string());
            }
            if let Some(w) = e.admitted {
                compare(&mut failures, &context, "admitted", w.to_string(), admitted.to_string());
            }
            let single = RuleExpect {
                allowed: e.rule_allowed,
                remaining: e.remaining,
                retry_after: e.retry_after.clone(),
                reset_after: e.reset_after.clone(),
                delay: e.delay.clone(),
            };
            if selected.len() == 1 {
                compare_rule(&mut failures, &context, &single, &verdict.decisions[0]);
            } else if single.remaining.is_some() || single.retry_after.is_some() || single.delay.is_some() {
                failures.push(format!("{context}: per-rule fields at top level need exactly one rule"));
            }
            for (name, want) in &e.rules {
                match selected.iter().position(|r| &r.name == name) {
                    Some(i) => {
                        compare_rule(&mut failures, &format!("{context} rule {name}"), want, &verdict.decisions[i])
                    }
                    None => failures.push(format!("{context}: expectation for unchecked rule {name}")),
                }
            }
        }
    }
    failures
}

/// One policy per vector, in namespace `v<index>`; `selects(rule)` gives each rule's `match` and
/// `key` lines (how the entry point under test tells the vector's rules and keys apart).
pub fn policies(vectors: &[Vector], selects: fn(&str) -> String) -> String {
    let mut yaml = String::new();
    for (vi, vector) in vectors.iter().enumerate() {
        yaml.push_str(&format!(
            "---\napiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: vector, namespace: v{vi}}}\nspec:\n  rules:\n"
        ));
        for (name, spec) in &vector.rules.0 {
            let mut limit = format!("requests: {}, per: {}", spec.requests, spec.per);
            if let Some(burst) = spec.burst {
                limit.push_str(&format!(", burst: {burst}"));
            }
            if let Some(delay) = &spec.max_delay {
                limit.push_str(&format!(", maxDelay: {delay}"));
            }
            let mode = spec.mode.as_deref().unwrap_or("enforce");
            yaml.push_str(&format!(
                "  - name: {name}\n{}    algorithm: {}\n    limit: {{{limit}}}\n    mode: {mode}\n",
                selects(name),
                serde_json::to_value(spec.algorithm).unwrap().as_str().unwrap()
            ));
            // A reservation's estimate is the step's cost, sent as the request field `cost`.
            if let Some(ttl) = &spec.reserve_for {
                let capacity = spec.burst.unwrap_or(spec.requests);
                yaml.push_str(&format!(
                    "    responseCost: {{header: x-sluice-cost, reservationTtl: {ttl}, estimate: {{requestField: cost, cap: {capacity}}}}}\n"
                ));
            }
        }
    }
    yaml
}

/// An engine on a fake clock at [`T0`] (memory store) enforcing [`policies`] of `vectors`, for
/// the suites that drive an API instead of the store.
pub fn engine_for(vectors: &[Vector], selects: fn(&str) -> String) -> (Arc<Engine<Arc<MemoryStore>>>, FakeClock) {
    let loaded = sluice::policy::load_str(&policies(vectors, selects), std::path::Path::new("vectors.yaml")).unwrap();
    let compiled = sluice::policy::compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    let clock = FakeClock::new(T0);
    let shared_clock = Arc::new(clock.clone());
    let store = Arc::new(MemoryStore::with_clock(100_000, shared_clock.clone()));
    let engine = Arc::new(Engine::new(store, shared_clock, Arc::new(Metrics::new())));
    engine.install(Arc::new(compiled.snapshot));
    (engine, clock)
}
