//! Each policy's status: what it should say (a pure function of the policy and the compile
//! outcome) and the leader-only writer that applies it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

use super::FIELD_MANAGER;
use super::controller::Outcome;
use crate::policy::{RateLimitPolicy, RateLimitPolicyStatus};

pub const ACCEPTED: &str = "Accepted";
pub const ENFORCED: &str = "Enforced";

/// The status `policy` should have after `outcome`, keeping each condition's
/// lastTransitionTime when its status did not change.
pub fn desired(policy: &RateLimitPolicy, outcome: &Outcome, now: Time) -> RateLimitPolicyStatus {
    let generation = policy.metadata.generation;
    let previous = policy.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let condition = |type_: &str, ok: bool, reason: &str, message: String| {
        let status = if ok { "True" } else { "False" };
        let since = previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| now.clone());
        Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message,
            observed_generation: generation,
            last_transition_time: since,
        }
    };
    match outcome.rejected.get(&policy.qualified_name()) {
        Some(errors) => RateLimitPolicyStatus {
            conditions: vec![
                condition(ACCEPTED, false, "Invalid", errors.to_string()),
                condition(
                    ENFORCED,
                    false,
                    "NotAccepted",
                    format!("not enforced: the policy is invalid; snapshot {} does not contain it", outcome.version),
                ),
            ],
            observed_generation: generation,
            snapshot: None,
        },
        None => RateLimitPolicyStatus {
            conditions: vec![
                condition(ACCEPTED, true, "Valid", "the policy is valid and compiled".to_string()),
                // The outcome is published only after its snapshot was installed, so this
                // generation's rules are live when this is written.
                condition(ENFORCED, true, "Live", format!("rules are live in snapshot {}", outcome.version)),
            ],
            observed_generation: generation,
            snapshot: Some(outcome.version.clone()),
        },
    }
}

/// Status without timestamps: two statuses that only differ in lastTransitionTime say the same.
fn essence(status: &RateLimitPolicyStatus) -> impl PartialEq + use<> {
    let conditions: Vec<_> = status
        .conditions
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone(), c.message.clone(), c.observed_generation))
        .collect();
    (conditions, status.observed_generation, status.snapshot.clone())
}

/// While this replica leads, brings every policy's status in line with the latest outcome.
/// Writes are skipped when the object already says it (or this leader already wrote it), so the
/// watch events of our own writes end here instead of looping.
pub async fn status_loop(
    client: Client,
    identity: String,
    mut outcomes: watch::Receiver<Option<Arc<Outcome>>>,
    mut leading: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter { controller: FIELD_MANAGER.to_string(), instance: Some(identity.clone()) },
    );
    // uid → what this leader last wrote for it.
    let mut written: HashMap<String, (Option<i64>, RateLimitPolicyStatus)> = HashMap::new();
    let mut retry: Option<tokio::time::Instant> = None;
    loop {
        let is_leader = *leading.borrow_and_update();
        let outcome = outcomes.borrow_and_update().clone();
        if !is_leader {
            written.clear();
            retry = None;
        } else if let Some(outcome) = outcome {
            let failed = apply_all(&client, &recorder, &outcome, &mut written).await;
            retry = failed.then(|| tokio::time::Instant::now() + Duration::from_secs(1));
        }
        let retry_at = retry;
        tokio::select! {
            _ = outcomes.changed() => {}
            changed = leading.changed() => {
                if changed.is_err() { return; }
                tracing::info!(%identity, leader = *leading.borrow(), "leadership changed");
            }
            _ = async move {
                match retry_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Applies the status of every policy in `outcome`; true when some write failed.
async fn apply_all(
    client: &Client,
    recorder: &Recorder,
    outcome: &Outcome,
    written: &mut HashMap<String, (Option<i64>, RateLimitPolicyStatus)>,
) -> bool {
    let mut failed = false;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    for policy in &outcome.policies {
        let uid = policy.uid().unwrap_or_default();
        let status = desired(policy, outcome, now.clone());
        let already = policy.status.as_ref().is_some_and(|s| essence(s) == essence(&status))
            || written.get(&uid).is_some_and(|(_, w)| essence(w) == essence(&status));
        if already {
            continue;
        }
        let namespace = policy.namespace().unwrap_or_default();
        let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), &namespace);
        // Server-side apply needs apiVersion and kind in the body (kube-rs/kube#1086).
        let body = serde_json::json!({
            "apiVersion": RateLimitPolicy::api_version(&()),
            "kind": RateLimitPolicy::kind(&()),
            "status": status,
        });
        match api
            .patch_status(&policy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&body))
            .await
        {
            Ok(_) => {
                tracing::debug!(policy = %policy.qualified_name(), "status written");
                // An Event per verdict, not per write: a new snapshot version rewrites every
                // policy's Enforced message, which is no news about this policy.
                if verdict(policy.status.as_ref()) != verdict(Some(&status)) {
                    publish_event(recorder, policy, &status, outcome).await;
                }
                written.insert(uid, (policy.metadata.generation, status));
            }
            // Deleted since the compile: the next outcome no longer lists it.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(error) => {
                tracing::warn!(policy = %policy.qualified_name(), %error, "status write failed; retrying");
                failed = true;
            }
        }
    }
    let live: std::collections::HashSet<String> =
        outcome.policies.iter().map(|p| p.uid().unwrap_or_default()).collect();
    written.retain(|uid, _| live.contains(uid));
    failed
}

/// The Accepted condition's status and the generation it judged.
fn verdict(status: Option<&RateLimitPolicyStatus>) -> Option<(String, Option<i64>)> {
    let accepted = status?.conditions.iter().find(|c| c.type_ == ACCEPTED)?;
    Some((accepted.status.clone(), accepted.observed_generation))
}

async fn publish_event(
    recorder: &Recorder,
    policy: &RateLimitPolicy,
    status: &RateLimitPolicyStatus,
    outcome: &Outcome,
) {
    let accepted = status.conditions.iter().find(|c| c.type_ == ACCEPTED);
    let (type_, reason, note) = match accepted {
        Some(c) if c.status == "True" => {
            (EventType::Normal, "Accepted", format!("enforced in snapshot {}", outcome.version))
        }
        Some(c) => (EventType::Warning, "Rejected", c.message.clone()),
        None => return,
    };
    let event =
        Event { type_, reason: reason.to_string(), note: Some(note), action: "Compile".to_string(), secondary: None };
    if let Err(error) = recorder.publish(&event, &policy.object_ref(&())).await {
        tracing::warn!(policy = %policy.qualified_name(), %error, "cannot publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FieldError, ValidationErrors};

    fn policy(generation: i64) -> RateLimitPolicy {
        let mut p: RateLimitPolicy = serde_yaml::from_str(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  rules:\n    - name: r\n      algorithm: fixedWindow\n      limit: {requests: 1, per: 1s}\n",
        )
        .expect("policy parses");
        p.metadata.generation = Some(generation);
        p
    }

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(seconds).expect("valid time"))
    }

    #[test]
    fn accepted_policy_is_enforced_in_the_outcome_version() {
        let outcome = Outcome { version: "abc".into(), ..Default::default() };
        let status = desired(&policy(3), &outcome, at(10));
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.snapshot.as_deref(), Some("abc"));
        let enforced = status.conditions.iter().find(|c| c.type_ == ENFORCED).expect("Enforced");
        assert_eq!(enforced.status, "True");
        assert!(enforced.message.contains("abc"));
    }

    #[test]
    fn rejected_policy_names_the_field_and_is_not_enforced() {
        let mut outcome = Outcome { version: "abc".into(), ..Default::default() };
        outcome.rejected.insert(
            "ns/p".into(),
            ValidationErrors {
                errors: vec![FieldError { path: "spec.rules[0].limit.per".into(), message: "bad".into() }],
            },
        );
        let status = desired(&policy(1), &outcome, at(10));
        let accepted = status.conditions.iter().find(|c| c.type_ == ACCEPTED).expect("Accepted");
        assert_eq!((accepted.status.as_str(), accepted.reason.as_str()), ("False", "Invalid"));
        assert!(accepted.message.contains("spec.rules[0].limit.per"));
        assert_eq!(status.snapshot, None);
    }

    #[test]
    fn transition_time_is_kept_while_the_status_holds() {
        let outcome = Outcome { version: "v1".into(), ..Default::default() };
        let mut p = policy(1);
        p.status = Some(desired(&p, &outcome, at(10)));
        let again = desired(&p, &Outcome { version: "v2".into(), ..Default::default() }, at(20));
        assert!(again.conditions.iter().all(|c| c.last_transition_time == at(10)));
        assert!(essence(&again) != essence(p.status.as_ref().expect("status")));
    }
}
