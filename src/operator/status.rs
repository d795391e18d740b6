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
use super::controller::{CompileOutcome, Enforced, PolicyOutcome};
use crate::policy::{RateLimitPolicy, RateLimitPolicyStatus};

pub const ACCEPTED: &str = "Accepted";
pub const ENFORCED: &str = "Enforced";
/// Whether the layering report finds nothing wrong with the policy's rules
/// ([`crate::policy::layering`]).
pub const LAYERING: &str = "LayeringConsistent";

/// The status the policy of `outcome` should have once `version` is live, keeping each
/// condition's lastTransitionTime when its status did not change.
///
/// Both conditions, and `observedGeneration`, carry the current generation: the one the operator
/// judged to write them (the Kubernetes convention: a condition with an older observedGeneration
/// is out of date). Which generation's rules are live is `enforcedGeneration`, also named by the
/// Enforced message.
pub fn desired(outcome: &PolicyOutcome, version: &str, now: Time) -> RateLimitPolicyStatus {
    let policy = &outcome.policy;
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
    let this = generation.map_or_else(|| "the current generation".to_string(), |g| format!("generation {g}"));
    let accepted = match &outcome.rejected {
        None => condition(ACCEPTED, true, "Valid", "the policy is valid and compiled".to_string()),
        Some(errors) => condition(ACCEPTED, false, "Invalid", errors.to_string()),
    };
    let not_accepted = match &outcome.rejected {
        Some(errors) => format!("{this} was not accepted: {errors}"),
        None => format!("{this} was not compiled"),
    };
    let absent = format!("nothing is enforced: snapshot {version} does not contain this policy");
    // The outcome is published only after its snapshot was installed, so what Enforced=True names
    // is live when this is written.
    let (enforced, enforced_generation) = match &outcome.enforced {
        Enforced::Current => {
            (condition(ENFORCED, true, "Live", format!("{this} is enforced in snapshot {version}")), generation)
        }
        Enforced::LastAccepted(g) => (
            condition(
                ENFORCED,
                true,
                "LastAccepted",
                format!("generation {g} is enforced in snapshot {version}; {not_accepted}"),
            ),
            Some(*g),
        ),
        Enforced::Nothing(None) => (
            condition(
                ENFORCED,
                false,
                "NotAccepted",
                format!("{absent}; no earlier generation was accepted, and {not_accepted}"),
            ),
            None,
        ),
        Enforced::Nothing(Some((g, errors))) => (
            condition(
                ENFORCED,
                false,
                "LastAcceptedInvalid",
                format!(
                    "{absent}; the last accepted generation {g} is not valid any more: {errors}; and {not_accepted}"
                ),
            ),
            None,
        ),
    };
    let layering = match outcome.layering.first() {
        None => condition(
            LAYERING,
            true,
            "Consistent",
            "no rule is unreachable, looser than a rule in front of it, a shadow rule that would change nothing, or a localFallback above its limit".to_string(),
        ),
        Some(first) => condition(
            LAYERING,
            false,
            reason_of(first.kind),
            outcome
                .layering
                .iter()
                .map(|f| format!("spec.rules[{}] ({}): {}: {}", f.index, f.rule, f.kind.name(), f.message))
                .collect::<Vec<_>>()
                .join("; "),
        ),
    };
    RateLimitPolicyStatus {
        conditions: vec![accepted, enforced, layering],
        observed_generation: generation,
        snapshot: enforced_generation.map(|_| version.to_string()),
        enforced_generation,
        // Always sent: server-side apply removes what the field manager no longer sends.
        last_accepted: outcome.last_accepted.clone(),
    }
}

/// A condition reason (CamelCase) for a layering finding's kind.
fn reason_of(kind: crate::policy::layering::Kind) -> &'static str {
    use crate::policy::layering::Kind;
    match kind {
        Kind::Unreachable => "Unreachable",
        Kind::LooserInner => "LooserInner",
        Kind::ShadowChangesNothing => "ShadowChangesNothing",
        Kind::FallbackExceedsLimit => "FallbackExceedsLimit",
    }
}

/// Status without timestamps: two statuses that only differ in lastTransitionTime say the same.
fn essence(status: &RateLimitPolicyStatus) -> impl PartialEq + use<> {
    let conditions: Vec<_> = status
        .conditions
        .iter()
        .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone(), c.message.clone(), c.observed_generation))
        .collect();
    (
        conditions,
        status.observed_generation,
        status.snapshot.clone(),
        status.enforced_generation,
        status.last_accepted.clone(),
    )
}

/// While this replica leads, brings every policy's status in line with the latest outcome.
/// Writes are skipped when the object already says it (or this leader already wrote it), so the
/// watch events of our own writes end here instead of looping.
pub async fn status_loop(
    client: Client,
    identity: String,
    mut outcomes: watch::Receiver<Option<Arc<CompileOutcome>>>,
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
            // Writes still in flight when leadership ends are dropped: the next leader writes.
            let mut term = leading.clone();
            tokio::select! {
                failed = apply_all(&client, &recorder, &outcome, &mut written) => {
                    retry = failed.then(|| tokio::time::Instant::now() + Duration::from_secs(1));
                }
                _ = term.wait_for(|l| !*l) => {}
            }
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
    outcome: &CompileOutcome,
    written: &mut HashMap<String, (Option<i64>, RateLimitPolicyStatus)>,
) -> bool {
    let mut failed = false;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    for entry in &outcome.policies {
        let policy = &entry.policy;
        let uid = policy.uid().unwrap_or_default();
        let status = desired(entry, &outcome.version, now.clone());
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
                    publish_event(recorder, policy, &status).await;
                }
                if let Some(finding) = new_layering_finding(policy.status.as_ref(), &status) {
                    publish_layering_event(recorder, policy, finding).await;
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
        outcome.policies.iter().map(|p| p.policy.uid().unwrap_or_default()).collect();
    written.retain(|uid, _| live.contains(uid));
    failed
}

/// The Accepted condition's status and the generation it judged.
fn verdict(status: Option<&RateLimitPolicyStatus>) -> Option<(String, Option<i64>)> {
    let accepted = status?.conditions.iter().find(|c| c.type_ == ACCEPTED)?;
    Some((accepted.status.clone(), accepted.observed_generation))
}

/// An Event for a new verdict: `Normal Accepted` or `Warning Rejected`, with the Enforced message
/// as the note (what is enforced now, and why the generation was not accepted).
async fn publish_event(recorder: &Recorder, policy: &RateLimitPolicy, status: &RateLimitPolicyStatus) {
    let find = |type_: &str| status.conditions.iter().find(|c| c.type_ == type_);
    let (type_, reason) = match find(ACCEPTED) {
        Some(c) if c.status == "True" => (EventType::Normal, "Accepted"),
        Some(_) => (EventType::Warning, "Rejected"),
        None => return,
    };
    let note = find(ENFORCED).map(|c| truncate(&c.message, MAX_NOTE).to_string());
    let event = Event { type_, reason: reason.to_string(), note, action: "Compile".to_string(), secondary: None };
    if let Err(error) = recorder.publish(&event, &policy.object_ref(&())).await {
        tracing::warn!(policy = %policy.qualified_name(), %error, "cannot publish event");
    }
}

/// The LayeringConsistent condition of `status` when it is False and says something the
/// `previous` status did not: worth an Event.
fn new_layering_finding<'a>(
    previous: Option<&RateLimitPolicyStatus>,
    status: &'a RateLimitPolicyStatus,
) -> Option<&'a Condition> {
    let find = |s: &RateLimitPolicyStatus| s.conditions.iter().find(|c| c.type_ == LAYERING).cloned();
    let now = status.conditions.iter().find(|c| c.type_ == LAYERING)?;
    let before = previous.and_then(find);
    let news = before.is_none_or(|b| b.status != now.status || b.message != now.message);
    (now.status == "False" && news).then_some(now)
}

/// A `Warning` Event naming what the layering report found.
async fn publish_layering_event(recorder: &Recorder, policy: &RateLimitPolicy, condition: &Condition) {
    let event = Event {
        type_: EventType::Warning,
        reason: condition.reason.clone(),
        note: Some(truncate(&condition.message, MAX_NOTE).to_string()),
        action: "Layering".to_string(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, &policy.object_ref(&())).await {
        tracing::warn!(policy = %policy.qualified_name(), %error, "cannot publish event");
    }
}

/// The API server refuses an Event whose note is longer (events.k8s.io/v1: 1 kB).
const MAX_NOTE: usize = 1024;

/// At most `max` bytes of `text`, cut at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::policy::{FieldError, LastAccepted, ValidationErrors};

    fn policy(generation: i64) -> RateLimitPolicy {
        let mut p: RateLimitPolicy = serde_yaml::from_str(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  rules:\n    - name: r\n      algorithm: fixedWindow\n      limit: {requests: 1, per: 1s}\n",
        )
        .expect("policy parses");
        p.metadata.generation = Some(generation);
        p
    }

    fn errors() -> ValidationErrors {
        ValidationErrors {
            errors: vec![FieldError { path: "spec.rules[0].match.paths[0].regex".into(), message: "bad".into() }],
        }
    }

    fn last(generation: i64) -> Option<LastAccepted> {
        Some(LastAccepted { generation, spec: serde_json::to_value(&policy(generation).spec).expect("spec") })
    }

    fn entry(p: RateLimitPolicy, rejected: Option<ValidationErrors>, enforced: Enforced) -> PolicyOutcome {
        PolicyOutcome { policy: Arc::new(p), rejected, enforced, layering: Vec::new(), last_accepted: last(1) }
    }

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(seconds).expect("valid time"))
    }

    fn find<'a>(status: &'a RateLimitPolicyStatus, type_: &str) -> &'a Condition {
        status.conditions.iter().find(|c| c.type_ == type_).expect("condition")
    }

    #[test]
    fn accepted_policy_is_enforced_in_the_outcome_version() {
        let status = desired(&entry(policy(3), None, Enforced::Current), "abc", at(10));
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.snapshot.as_deref(), Some("abc"));
        assert_eq!(status.enforced_generation, Some(3));
        assert_eq!(status.last_accepted, last(1), "what the outcome says is persisted");
        let enforced = find(&status, ENFORCED);
        assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("True", "Live"));
        assert_eq!(enforced.message, "generation 3 is enforced in snapshot abc");
        assert_eq!(find(&status, ACCEPTED).status, "True");
    }

    #[test]
    fn rejected_policy_names_the_field_and_is_not_enforced() {
        let status = desired(&entry(policy(1), Some(errors()), Enforced::Nothing(None)), "abc", at(10));
        let accepted = find(&status, ACCEPTED);
        assert_eq!((accepted.status.as_str(), accepted.reason.as_str()), ("False", "Invalid"));
        assert!(accepted.message.contains("spec.rules[0].match.paths[0].regex"));
        let enforced = find(&status, ENFORCED);
        assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("False", "NotAccepted"));
        assert_eq!(
            enforced.message,
            "nothing is enforced: snapshot abc does not contain this policy; no earlier generation was accepted, \
             and generation 1 was not accepted: spec.rules[0].match.paths[0].regex: bad"
        );
        assert_eq!((status.snapshot, status.enforced_generation), (None, None));
    }

    #[test]
    fn rejected_generation_keeps_the_last_accepted_one_enforced() {
        let status = desired(&entry(policy(4), Some(errors()), Enforced::LastAccepted(3)), "abc", at(10));
        let accepted = find(&status, ACCEPTED);
        assert_eq!((accepted.status.as_str(), accepted.reason.as_str()), ("False", "Invalid"));
        let enforced = find(&status, ENFORCED);
        assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("True", "LastAccepted"));
        assert_eq!(
            enforced.message,
            "generation 3 is enforced in snapshot abc; generation 4 was not accepted: \
             spec.rules[0].match.paths[0].regex: bad"
        );
        // Both conditions judge the current generation; the live one is enforcedGeneration.
        assert!(status.conditions.iter().all(|c| c.observed_generation == Some(4)));
        assert_eq!(status.observed_generation, Some(4));
        assert_eq!(status.enforced_generation, Some(3));
        assert_eq!(status.snapshot.as_deref(), Some("abc"));
        assert_eq!(status.last_accepted, last(1));
    }

    #[test]
    fn an_invalid_last_accepted_generation_enforces_nothing() {
        let gone = Enforced::Nothing(Some((3, errors())));
        let status = desired(&entry(policy(4), Some(errors()), gone), "abc", at(10));
        let enforced = find(&status, ENFORCED);
        assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("False", "LastAcceptedInvalid"));
        assert!(enforced.message.contains("the last accepted generation 3 is not valid any more"), "{enforced:?}");
        assert!(enforced.message.contains("generation 4 was not accepted"), "{enforced:?}");
        assert_eq!((status.snapshot, status.enforced_generation), (None, None));
        assert_eq!(status.last_accepted, last(1), "kept, not erased");
    }

    #[test]
    fn transition_time_is_kept_while_the_status_holds() {
        let mut p = policy(1);
        p.status = Some(desired(&entry(p.clone(), None, Enforced::Current), "v1", at(10)));
        let again = desired(&entry(p.clone(), None, Enforced::Current), "v2", at(20));
        assert!(again.conditions.iter().all(|c| c.last_transition_time == at(10)));
        assert!(essence(&again) != essence(p.status.as_ref().expect("status")));
        // Accepted turns False at 30; Enforced stays True (the last accepted generation) and keeps
        // its time.
        p.status = Some(again);
        p.metadata.generation = Some(2);
        let rejected = desired(&entry(p, Some(errors()), Enforced::LastAccepted(1)), "v2", at(30));
        assert_eq!(find(&rejected, ACCEPTED).last_transition_time, at(30));
        assert_eq!(find(&rejected, ENFORCED).last_transition_time, at(10));
    }

    #[test]
    fn event_notes_are_cut_at_a_character_boundary() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate(&"x".repeat(2000), MAX_NOTE).len(), MAX_NOTE);
    }

    #[test]
    fn the_layering_report_sets_its_condition_and_news_of_it_make_an_event() {
        use crate::policy::layering::{Finding, Kind};
        let clean = desired(&entry(policy(1), None, Enforced::Current), "v1", at(10));
        assert_eq!(find(&clean, LAYERING).status, "True");
        assert_eq!(new_layering_finding(None, &clean), None);
        let mut outcome = entry(policy(1), None, Enforced::Current);
        outcome.layering = vec![Finding {
            kind: Kind::Unreachable,
            policy: "ns/p".into(),
            index: 0,
            rule: "r".into(),
            other: Some(("ns/edge".into(), "per-ip".into())),
            message: "it can never refuse a request".into(),
        }];
        let found = desired(&outcome, "v2", at(20));
        let condition = find(&found, LAYERING);
        assert_eq!((condition.status.as_str(), condition.reason.as_str()), ("False", "Unreachable"));
        assert_eq!(condition.message, "spec.rules[0] (r): unreachable: it can never refuse a request");
        assert!(new_layering_finding(Some(&clean), &found).is_some());
        // Written again (a new snapshot version): no news, no second Event.
        assert_eq!(new_layering_finding(Some(&found), &desired(&outcome, "v3", at(30))), None);
    }
}
