//! `--compare`: the same traffic through all six algorithms with equivalent parameters — the
//! design notes' "how many can pass in any window" table, filled in with measured numbers.

use super::SimulateError;
use super::arrivals::Arrival;
use super::comparison::{CompareRow, Comparison};
use super::replay::{ReplayOptions, replay};
use crate::algorithm::Algorithm;
use crate::api::check::CheckRequest;
use crate::policy::{RateLimitPolicy, compile};

/// The policies with every rule switched to `algorithm`: the same `requests` and `per`; the
/// rule's `burst` for the bucket algorithms when it had one (else their default, `requests`);
/// `maxDelay` only from a leakyBucket rule to the leakyBucket.
fn with_algorithm(sources: &[RateLimitPolicy], algorithm: Algorithm) -> Vec<RateLimitPolicy> {
    let mut policies = sources.to_vec();
    for rule in policies.iter_mut().flat_map(|p| p.spec.rules.iter_mut()) {
        if !(algorithm.uses_burst() && rule.algorithm.uses_burst()) {
            rule.limit.burst = None;
        }
        if !(algorithm == Algorithm::LeakyBucket && rule.algorithm == Algorithm::LeakyBucket) {
            rule.limit.max_delay = None;
        }
        rule.algorithm = algorithm;
    }
    policies
}

pub fn compare(
    sources: &[RateLimitPolicy],
    template: &CheckRequest,
    arrivals: &[Arrival],
    options: &ReplayOptions,
) -> Result<Vec<Comparison>, SimulateError> {
    let mut comparisons: Vec<Comparison> = Vec::new();
    for algorithm in Algorithm::ALL {
        let compiled = compile(with_algorithm(sources, algorithm));
        let report = replay(&compiled.snapshot, template, arrivals, options).ok();
        for source in sources {
            let namespace = source.metadata.namespace.clone().unwrap_or_else(|| "default".to_string());
            let policy = format!("{namespace}/{}", source.metadata.name.clone().unwrap_or_default());
            if template.namespace.as_deref().unwrap_or("default") != namespace {
                continue;
            }
            // A concurrency limit bounds requests in progress, not a rate: nothing to compare with.
            for rule in source.spec.rules.iter().filter(|r| !r.algorithm.holds()) {
                let measured =
                    report.as_ref().and_then(|r| r.rules.iter().find(|x| x.policy == policy && x.rule == rule.name));
                let row = match measured {
                    Some(r) => CompareRow {
                        algorithm: algorithm.name(),
                        offered: r.offered,
                        admitted: r.admitted,
                        denied: r.denied,
                        max_admitted_in_any_window: r.max_admitted_in_any_window,
                        bound: r.bound,
                        bound_formula: r.bound_formula,
                        skipped: None,
                    },
                    None => CompareRow {
                        algorithm: algorithm.name(),
                        offered: 0,
                        admitted: 0,
                        denied: 0,
                        max_admitted_in_any_window: 0,
                        bound: None,
                        bound_formula: "",
                        skipped: Some(
                            compiled
                                .rejected
                                .iter()
                                .find(|x| x.policy == policy)
                                .map_or_else(|| "not simulated".to_string(), |x| x.errors.to_string()),
                        ),
                    },
                };
                match comparisons.iter_mut().find(|c| c.policy == policy && c.rule == rule.name) {
                    Some(c) => c.rows.push(row),
                    None => comparisons.push(Comparison {
                        policy: policy.clone(),
                        rule: rule.name.clone(),
                        rows: vec![row],
                    }),
                }
            }
        }
    }
    Ok(comparisons)
}
