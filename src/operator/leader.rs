//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager: kube has none built in,
//! kube-rs/kube#485). Every replica enforces; only the leader writes status.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Result;

/// Joins the election; the receiver says whether this replica leads now. Dropping every receiver
/// ends the election task, which releases the Lease if held.
///
/// Leading means more than kube-lease-manager's word: it keeps calling itself the holder while the
/// API server is unreachable (a failed renewal is retried, not reported), so a partitioned leader
/// would go on leading after its Lease expired and another replica took it. The receiver turns
/// false once the Lease, as last read from the API server, is about to expire (see
/// [`may_lead_for`]), and true again only when a read shows this replica's renewal.
pub async fn elect(
    client: Client,
    namespace: &str,
    name: &str,
    identity: &str,
    duration: Duration,
) -> Result<(watch::Receiver<bool>, JoinHandle<kube_lease_manager::Result<LeaseManager>>)> {
    let seconds = duration.as_secs().max(2);
    // Renew a third of the duration before expiry: one missed renewal (a slow API server) does
    // not lose leadership, and a dead leader is replaced within `duration`.
    let grace = (seconds / 3).max(1);
    let manager = LeaseManagerBuilder::new(client.clone(), name)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(seconds)
        .with_grace(grace)
        .with_field_manager(lease_field_manager(identity))
        .build()
        .await?;
    let (held, election) = manager.watch().await;
    let (leading, receiver) = watch::channel(false);
    let confirm = Confirmation {
        leases: Api::namespaced(client, namespace),
        name: name.to_string(),
        identity: identity.to_string(),
        // Half the grace: the library renews `grace` before expiry, so a renewal that takes up to
        // half of it still lands before this replica would stop.
        margin: Duration::from_millis(grace * 500),
        every: Duration::from_millis((grace * 250).clamp(250, 2000)),
    };
    tokio::spawn(confirm.run(held, leading));
    Ok((receiver, election))
}

/// How much longer the replica `identity` may act as leader at `now`, judging by `lease` as the
/// API server showed it: until `margin` before the Lease expires if it names `identity`, else not
/// at all. Stopping before expiry means two replicas never act at once (on one clock; replicas'
/// clocks may differ by less than `margin`).
pub fn may_lead_for(lease: &Lease, identity: &str, now: Timestamp, margin: Duration) -> Option<Duration> {
    let spec = lease.spec.as_ref()?;
    if spec.holder_identity.as_deref() != Some(identity) {
        return None;
    }
    let renewed = spec.renew_time.as_ref().or(spec.acquire_time.as_ref())?.0;
    let lasts = Duration::from_secs(u64::try_from(spec.lease_duration_seconds?).ok()?);
    let elapsed = now.duration_since(renewed).as_secs_f64().max(0.0);
    let left = lasts.saturating_sub(margin).as_secs_f64() - elapsed;
    (left > 0.0).then(|| Duration::from_secs_f64(left))
}

/// Reads the Lease while the library says this replica holds it, and forwards "leading" only while
/// the last read vouches for it.
struct Confirmation {
    leases: Api<Lease>,
    name: String,
    identity: String,
    margin: Duration,
    every: Duration,
}

impl Confirmation {
    async fn run(self, mut held: watch::Receiver<bool>, leading: watch::Sender<bool>) {
        let mut until: Option<tokio::time::Instant> = None;
        let mut read_at = tokio::time::Instant::now();
        loop {
            let holds = *held.borrow_and_update();
            let now = tokio::time::Instant::now();
            if !holds {
                until = None;
            } else if now >= read_at {
                read_at = now + self.every;
                // A read that fails or hangs vouches for nothing: the last good one runs out.
                if let Ok(Ok(lease)) = tokio::time::timeout(self.every, self.leases.get_opt(&self.name)).await {
                    until = lease
                        .and_then(|l| may_lead_for(&l, &self.identity, Timestamp::now(), self.margin))
                        .map(|left| tokio::time::Instant::now() + left);
                }
            }
            let acting = holds && until.is_some_and(|u| tokio::time::Instant::now() < u);
            let changed = leading.send_if_modified(|l| std::mem::replace(l, acting) != acting);
            if changed && !acting && holds {
                tracing::warn!(identity = %self.identity, "stopped leading: the Lease could not be renewed in time");
            }
            let wake = match (holds, until) {
                (false, _) => None,
                (true, Some(u)) if acting => Some(u.min(read_at)),
                (true, _) => Some(read_at),
            };
            tokio::select! {
                _ = leading.closed() => return,
                changed = held.changed() => {
                    if changed.is_err() {
                        leading.send_replace(false);
                        return;
                    }
                    read_at = tokio::time::Instant::now();
                }
                _ = async move {
                    match wake {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

/// Each replica applies the Lease as its own field manager: an orphaned Lease is taken by a
/// server-side apply without resourceVersion, and only a second manager's apply of
/// `holderIdentity` conflicts. Under one shared manager two replicas starting together both
/// "took" it and both led until the loser's first renewal, writing status and events twice.
pub fn lease_field_manager(identity: &str) -> String {
    // The API server refuses a field manager longer than 128 bytes.
    let mut name = format!("{}-lease-{identity}", super::FIELD_MANAGER);
    let mut end = name.len().min(128);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// Runs `term` for every term this replica leads (`leading` true), until `stop` flips; `term`
/// gets the two receivers, to end its work when the term or the process ends, and whatever it
/// measured as leader is reset by `after_term` (the others report 0, so sums and maxima over
/// replicas stay right).
pub async fn each_term<T, Fut>(
    mut leading: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
    mut term: T,
    after_term: impl Fn(),
) where
    T: FnMut(watch::Receiver<bool>, watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            led = leading.wait_for(|l| *l) => if led.is_err() { return },
        }
        term(leading.clone(), stop.clone()).await;
        after_term();
        if *stop.borrow() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn lease(holder: &str, renewed: Timestamp, seconds: i32) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                renew_time: Some(MicroTime(renewed)),
                lease_duration_seconds: Some(seconds),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        }
    }

    #[test]
    fn a_holder_may_lead_until_the_margin_before_expiry() {
        let renewed: Timestamp = "2026-12-03T10:00:00Z".parse().expect("time");
        let margin = Duration::from_secs(1);
        let at = |secs: i64| renewed + k8s_openapi::jiff::SignedDuration::from_secs(secs);
        let l = lease("a", renewed, 6);
        assert_eq!(may_lead_for(&l, "a", at(0), margin), Some(Duration::from_secs(5)));
        assert_eq!(may_lead_for(&l, "a", at(4), margin), Some(Duration::from_secs(1)));
        assert_eq!(may_lead_for(&l, "a", at(5), margin), None, "within the margin");
        assert_eq!(may_lead_for(&l, "a", at(60), margin), None, "expired");
        assert_eq!(may_lead_for(&l, "b", at(0), margin), None, "held by another");
        // A renewal stamped ahead of this clock counts from now, never beyond the duration.
        assert_eq!(may_lead_for(&l, "a", at(-3), margin), Some(Duration::from_secs(5)));
        let mut unnamed = l.clone();
        unnamed.spec.as_mut().expect("spec").holder_identity = None;
        assert_eq!(may_lead_for(&unnamed, "a", at(0), margin), None);
        assert_eq!(may_lead_for(&Lease::default(), "a", at(0), margin), None);
    }
}
