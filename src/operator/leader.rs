//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager: kube has none built in,
//! kube-rs/kube#485). Every replica enforces; only the leader writes status.

use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Result;

/// Joins the election; the receiver says whether this replica leads now. Dropping every receiver
/// ends the election task, which releases the Lease if held.
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
    let manager = LeaseManagerBuilder::new(client, name)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(seconds)
        .with_grace(grace)
        .with_field_manager(lease_field_manager(identity))
        .build()
        .await?;
    Ok(manager.watch().await)
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
