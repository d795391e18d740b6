//! Deciding from quota leases and settling them, for any holder: the endpoint (slices from
//! Redis) and the sidecar (slices from the endpoint). The bookkeeping is
//! [`crate::engine::leases`]; this is its I/O.

use std::time::Duration;

use super::leases::{Due, LeasedCheck, Local, QuotaLeases, Renewal};
use crate::clock::Clock;
use crate::policy::Matched;
use crate::rule::Verdict;
use crate::store::{LeaseOp, LeaseStore, StoreError};

/// The verdict of a request whose every rule is `consistency: leased` and enforcing, from the
/// slices in `leases`, renewing them through `store` once if the table asks; `None` when the
/// store must decide (a rule not leased, a cold key, a bound taken by other holders).
pub async fn decide<L: LeaseStore>(
    leases: &QuotaLeases,
    store: &L,
    clock: &dyn Clock,
    namespace: &str,
    matched: &[Matched<'_>],
    store_budget: Option<Duration>,
) -> Option<Verdict> {
    let mut checks = Vec::with_capacity(matched.len());
    for m in matched {
        let leasing = m.rule.leasing().filter(|_| m.rule.enforce())?;
        checks.push(LeasedCheck {
            rule: m.rule.id(),
            limit: m.rule.limit(),
            key: m.key.as_bytes(),
            cost: m.cost,
            leasing,
        });
    }
    let mut local = leases.decide(namespace, &checks, clock.now(), true);
    if let Local::Renew(renewals) = &local {
        renew(leases, store, clock, namespace, &checks, renewals, store_budget).await;
        local = leases.decide(namespace, &checks, clock.now(), false);
    }
    match local {
        Local::Admitted { decisions, ahead } => {
            // Admitted from slices running low: the next ones are asked for now, before the
            // answer, so this request's concurrent neighbours keep spending the current ones.
            if !ahead.is_empty() {
                renew(leases, store, clock, namespace, &checks, &ahead, store_budget).await;
            }
            Some(Verdict { allowed: true, decisions, cached_denial: None, at: None })
        }
        Local::Refused { by, decision } => Some(Verdict::refused_by(by, decision, checks.iter().map(|c| c.limit))),
        Local::Renew(_) | Local::Store => None,
    }
}

/// Runs `renewals` against the store (within `store_budget`) and hands the grants to the table.
async fn renew<L: LeaseStore>(
    leases: &QuotaLeases,
    store: &L,
    clock: &dyn Clock,
    namespace: &str,
    checks: &[LeasedCheck<'_>],
    renewals: &[Renewal],
    store_budget: Option<Duration>,
) {
    let ops: Vec<LeaseOp<'_>> = renewals
        .iter()
        .map(|r| {
            let c = &checks[r.index];
            LeaseOp { rule: c.rule, limit: c.limit, key: c.key, settle: r.settle, ask: Some(r.ask) }
        })
        .collect();
    let sent_at = clock.now();
    let asking = store.lease(namespace, &ops);
    let outcome = match store_budget {
        None => asking.await,
        Some(budget) => {
            tokio::time::timeout(budget, asking).await.unwrap_or(Err(StoreError::Timeout(budget.as_millis() as u64)))
        }
    };
    if let Err(error) = &outcome {
        tracing::debug!(namespace, %error, "quota lease renewal failed; the store decides");
    }
    let grants = match &outcome {
        Ok(grants) if grants.len() == ops.len() => Ok(grants.as_slice()),
        _ => Err(()),
    };
    leases.renewed(checks, renewals, grants, sent_at, clock.now());
}

/// Settles the slices at their end (or all of them: `all`, when the holder stops).
pub async fn settle_due<L: LeaseStore>(leases: &QuotaLeases, store: &L, clock: &dyn Clock, all: bool) {
    let due = leases.due(clock.now(), all);
    if due.is_empty() {
        return;
    }
    let mut by_namespace: std::collections::BTreeMap<&str, Vec<&Due>> = std::collections::BTreeMap::new();
    for d in &due {
        by_namespace.entry(&d.namespace).or_default().push(d);
    }
    for (namespace, due) in by_namespace {
        let ops: Vec<LeaseOp<'_>> = due
            .iter()
            .map(|d| LeaseOp { rule: d.rule, limit: &d.limit, key: &d.key, settle: Some((d.hold, d.spent)), ask: None })
            .collect();
        // A settle that fails leaves the slice to end in the store by itself: its unspent units
        // come back then, its spent ones are not counted (the bound covers them).
        if let Err(error) = store.lease(namespace, &ops).await {
            tracing::debug!(namespace, %error, slices = ops.len(), "settling quota leases failed");
        }
    }
}

/// Settles slices as they end, every 10 ms, until `shutdown`; then gives back every slice held.
pub async fn keep<L: LeaseStore>(
    leases: &QuotaLeases,
    store: &L,
    clock: &dyn Clock,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => settle_due(leases, store, clock, false).await,
            _ = shutdown.changed() => break,
        }
    }
    settle_due(leases, store, clock, true).await;
}
