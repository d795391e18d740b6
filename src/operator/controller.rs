//! Reflectors over RateLimitPolicy and the compile loop: every change recompiles the whole store
//! into one snapshot (a snapshot is a function of all policies, never patched one object at a
//! time) and swaps it into the engine.
//!
//! A policy whose current generation is invalid keeps its last accepted generation enforced: the
//! status writer persists each accepted spec in `status.lastAccepted`, and every replica (a
//! restarted or new one too) compiles that spec, validated again, in place of the invalid one.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::engine::Engine;
use crate::policy::layering::{self, Finding};
use crate::policy::{
    FieldError, LastAccepted, RateLimitPolicy, RateLimitPolicySpec, Snapshot, ValidationErrors, compile, validate,
};
use crate::store::Store as RateStore;

/// One reflector per watched namespace (or one over all), and a notification on every event.
pub struct Reflectors {
    pub readers: Vec<Store<RateLimitPolicy>>,
    pub changed: Arc<Notify>,
    pub task: JoinHandle<()>,
}

impl Reflectors {
    pub fn start(client: Client, namespaces: &[String], mut stop: watch::Receiver<bool>) -> Reflectors {
        let apis: Vec<Api<RateLimitPolicy>> = if namespaces.is_empty() {
            vec![Api::all(client)]
        } else {
            namespaces.iter().map(|ns| Api::namespaced(client.clone(), ns)).collect()
        };
        let changed = Arc::new(Notify::new());
        let mut readers = Vec::new();
        let mut streams = Vec::new();
        for api in apis {
            let (reader, writer) = reflector::store();
            readers.push(reader);
            // any_semantic: the initial list may be served from the API server's watch cache.
            // managedFields are dropped before they reach the store: they are never read and are
            // the bulk of each object.
            let stream = watcher(api, watcher::Config::default().any_semantic())
                .backoff(super::WatchBackoff::default())
                .modify(|p| {
                    p.managed_fields_mut().clear();
                })
                .reflect(writer);
            streams.push(stream.boxed());
        }
        let notify = changed.clone();
        let task = tokio::spawn(async move {
            let mut all = futures::stream::select_all(streams);
            loop {
                tokio::select! {
                    event = all.next() => match event {
                        Some(Ok(_)) => notify.notify_one(),
                        // The watcher retries with backoff by itself; the store keeps the last
                        // state meanwhile, so enforcement goes on unchanged.
                        Some(Err(error)) => tracing::warn!(%error, "policy watch failed; retrying"),
                        None => return,
                    },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
        Reflectors { readers, changed, task }
    }
}

/// What one compile produced, for the status writer.
#[derive(Debug, Default)]
pub struct CompileOutcome {
    /// Version of the snapshot this compile produced, which is now live in the engine.
    pub version: String,
    /// Every policy the reflectors held, with what the snapshot holds of it.
    pub policies: Vec<PolicyOutcome>,
}

/// One policy in a compile [`CompileOutcome`].
#[derive(Debug, Clone)]
pub struct PolicyOutcome {
    /// The object as the reflector held it (current generation, persisted status).
    pub policy: Arc<RateLimitPolicy>,
    /// Why the current generation was not accepted; `None` when it was.
    pub rejected: Option<ValidationErrors>,
    /// Which generation's rules the snapshot holds.
    pub enforced: Enforced,
    /// The layering report's findings about the rules of this policy the snapshot holds.
    pub layering: Vec<Finding>,
    /// What `status.lastAccepted` should hold: the current generation when it was accepted, else
    /// the newest accepted one known (persisted, or compiled by this replica before).
    pub last_accepted: Option<LastAccepted>,
}

/// Which rules of a policy a snapshot holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Enforced {
    /// The current generation's.
    Current,
    /// This earlier generation's (`status.lastAccepted`): the current one was not accepted.
    LastAccepted(i64),
    /// None. With a generation and errors: the last accepted generation, which cannot be enforced
    /// because it is not valid (any more); without: no generation was ever accepted.
    Nothing(Option<(i64, ValidationErrors)>),
}

/// Where the rules compiled for one policy come from.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    Current,
    LastAccepted(i64),
    Nothing,
}

/// What to compile for one policy: the choice, made before compiling.
#[derive(Debug)]
struct Choice {
    policy: Arc<RateLimitPolicy>,
    /// Why the current generation is invalid.
    rejected: Option<ValidationErrors>,
    source: Source,
    /// The policy to compile for `source`.
    input: Option<RateLimitPolicy>,
    /// Why `status.lastAccepted` cannot even be read.
    unreadable: Option<(i64, ValidationErrors)>,
}

/// The current generation when it is valid (`current` says whether it is); otherwise the last
/// accepted spec persisted in the policy's status, under the policy's own name and namespace, so
/// that its compiled rules, sources and content hash are exactly those of that generation. Every
/// replica reads the same status, so every replica chooses the same.
fn choose(policy: Arc<RateLimitPolicy>, current: Result<(), ValidationErrors>) -> Choice {
    let errors = match current {
        Ok(()) => {
            let input = Some((*policy).clone());
            return Choice { policy, rejected: None, source: Source::Current, input, unreadable: None };
        }
        Err(errors) => errors,
    };
    let mut choice = Choice { policy, rejected: Some(errors), source: Source::Nothing, input: None, unreadable: None };
    let Some(last) = usable_last_accepted(&choice.policy) else {
        return choice;
    };
    match serde_json::from_value::<RateLimitPolicySpec>(last.spec.clone()) {
        Ok(spec) => {
            let mut input = RateLimitPolicy::new(&choice.policy.name_any(), spec);
            input.metadata.namespace = choice.policy.metadata.namespace.clone();
            choice.source = Source::LastAccepted(last.generation);
            choice.input = Some(input);
        }
        Err(error) => {
            let errors = ValidationErrors {
                errors: vec![FieldError {
                    path: "status.lastAccepted.spec".to_string(),
                    message: format!("cannot be read: {error}"),
                }],
            };
            choice.unreadable = Some((last.generation, errors));
        }
    }
    choice
}

/// `status.lastAccepted`, unless it claims a generation not older than the current one (which no
/// operator writes).
fn usable_last_accepted(policy: &RateLimitPolicy) -> Option<&LastAccepted> {
    let last = policy.status.as_ref()?.last_accepted.as_ref()?;
    policy.metadata.generation.is_none_or(|current| last.generation < current).then_some(last)
}

/// `status.lastAccepted` of an accepted generation.
fn last_accepted_of(policy: &RateLimitPolicy) -> Option<LastAccepted> {
    Some(LastAccepted { generation: policy.metadata.generation?, spec: serde_json::to_value(&policy.spec).ok()? })
}

/// One compile's identity: each policy (uid and name), its generation and where its rules come
/// from. Status-only writes (ours) leave it unchanged, so they never cause a recompile or a
/// requeue — except one that persists the last accepted generation a rejected policy then falls
/// back to.
type Key = Vec<(String, Option<i64>, Source)>;

/// The compile loop's state between compiles.
#[derive(Debug, Default)]
pub struct Compiler {
    /// Whether each (uid, generation) seen is valid: a generation's spec never changes, so each
    /// is validated once, not at every compile.
    validity: HashMap<(String, Option<i64>), Result<(), ValidationErrors>>,
    /// By uid, the newest generation this replica accepted, for `status.lastAccepted` when the
    /// status writer has not persisted it yet (say a valid and an invalid update in quick
    /// succession). Only written to status, never compiled from: compiling only what is persisted
    /// keeps every replica enforcing the same.
    accepted: HashMap<String, Arc<RateLimitPolicy>>,
    last: Option<Key>,
    /// Replicas sharing each `localFallback` limit, for the layering report (0 is taken as 1).
    pub replicas: u32,
}

impl Compiler {
    /// Compiles `policies` (the reflectors' state): of each, the current generation when it is
    /// valid, else the last accepted one persisted in its status (validated again: if this
    /// operator no longer accepts it, nothing of the policy is enforced). `None` when that is
    /// exactly what the previous call compiled.
    pub fn run(&mut self, policies: Vec<Arc<RateLimitPolicy>>) -> Option<(Snapshot, CompileOutcome)> {
        let mut validity = HashMap::with_capacity(policies.len());
        let choices: Vec<Choice> = policies
            .into_iter()
            .map(|policy| {
                let key = (policy.uid().unwrap_or_default(), policy.metadata.generation);
                let valid = self.validity.remove(&key).unwrap_or_else(|| validate(&policy));
                validity.insert(key, valid.clone());
                choose(policy, valid)
            })
            .collect();
        self.validity = validity;
        let mut key: Key = choices
            .iter()
            .map(|c| {
                let id = format!("{}/{}", c.policy.uid().unwrap_or_default(), c.policy.qualified_name());
                (id, c.policy.metadata.generation, c.source.clone())
            })
            .collect();
        key.sort_by(|a, b| a.0.cmp(&b.0));
        if self.last.as_ref() == Some(&key) {
            return None;
        }
        self.last = Some(key);

        let compiled = compile(choices.iter().filter_map(|c| c.input.clone()).collect());
        let findings = layering::report(compiled.snapshot.sources(), self.replicas.max(1));
        let mut failed: HashMap<String, ValidationErrors> =
            compiled.rejected.into_iter().map(|r| (r.policy, r.errors)).collect();
        let mut outcomes = Vec::with_capacity(choices.len());
        for choice in choices {
            let uid = choice.policy.uid().unwrap_or_default();
            let (rejected, enforced) = match (choice.source, failed.remove(&choice.policy.qualified_name())) {
                (Source::Current, None) => {
                    self.accepted.insert(uid.clone(), choice.policy.clone());
                    (None, Enforced::Current)
                }
                // validate() passed but compile refused (they disagree, or a duplicate name).
                (Source::Current, Some(errors)) => (Some(errors), Enforced::Nothing(None)),
                (Source::LastAccepted(generation), None) => (choice.rejected, Enforced::LastAccepted(generation)),
                (Source::LastAccepted(generation), Some(errors)) => {
                    (choice.rejected, Enforced::Nothing(Some((generation, errors))))
                }
                (Source::Nothing, _) => (choice.rejected, Enforced::Nothing(choice.unreadable)),
            };
            let last_accepted = match enforced {
                Enforced::Current => last_accepted_of(&choice.policy),
                _ => self.newest_accepted(&uid, &choice.policy),
            };
            let qualified = choice.policy.qualified_name();
            let layering = findings.iter().filter(|f| f.policy == qualified).cloned().collect();
            outcomes.push(PolicyOutcome { policy: choice.policy, rejected, enforced, layering, last_accepted });
        }
        let live: HashSet<String> = outcomes.iter().map(|o| o.policy.uid().unwrap_or_default()).collect();
        self.accepted.retain(|uid, _| live.contains(uid));
        let version = compiled.snapshot.version().to_string();
        Some((compiled.snapshot, CompileOutcome { version, policies: outcomes }))
    }

    /// The newer of the persisted `status.lastAccepted` and the generation this replica last
    /// accepted, for a policy whose current generation is not accepted.
    fn newest_accepted(&self, uid: &str, policy: &RateLimitPolicy) -> Option<LastAccepted> {
        let persisted = policy.status.as_ref().and_then(|s| s.last_accepted.clone());
        let older_than_current = |g: i64| policy.metadata.generation.is_none_or(|current| g < current);
        let newer_than_persisted = |g: i64| persisted.as_ref().is_none_or(|l| g > l.generation);
        let remembered = self
            .accepted
            .get(uid)
            .and_then(|p| last_accepted_of(p))
            .filter(|l| older_than_current(l.generation) && newer_than_persisted(l.generation));
        remembered.or(persisted)
    }
}

/// Waits for the first full sync of every reflector, then compiles after each change (debounced)
/// and publishes each outcome. The engine is not loaded — /readyz answers 503 — until the first
/// compile of the fully synced store.
pub async fn compile_loop<S: RateStore>(
    engine: Arc<Engine<S>>,
    readers: Vec<Store<RateLimitPolicy>>,
    changed: Arc<Notify>,
    debounce: Duration,
    outcomes: watch::Sender<Option<Arc<CompileOutcome>>>,
    mut stop: watch::Receiver<bool>,
) {
    for reader in &readers {
        tokio::select! {
            ready = reader.wait_until_ready() => if ready.is_err() {
                tracing::error!("policy reflector stopped before its first sync");
                return;
            },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
    let mut compiler = Compiler { replicas: engine.fallback_replicas(), ..Compiler::default() };
    loop {
        let policies: Vec<Arc<RateLimitPolicy>> = readers.iter().flat_map(|r| r.state()).collect();
        let mut state = std::mem::take(&mut compiler);
        match tokio::task::spawn_blocking(move || {
            let result = state.run(policies);
            (state, result)
        })
        .await
        {
            Ok((state, result)) => {
                compiler = state;
                if let Some((snapshot, outcome)) = result {
                    install(&engine, snapshot, &outcome);
                    outcomes.send_replace(Some(Arc::new(outcome)));
                }
            }
            // The compiler's state went with the failed task; a fresh one compiles everything.
            Err(join) => engine.reload_failed(format!("compile task failed: {join}")),
        }
        tokio::select! {
            _ = changed.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Absorb a burst (one `kubectl apply -f dir/`) into one compile.
        loop {
            tokio::select! {
                _ = changed.notified() => continue,
                _ = tokio::time::sleep(debounce) => break,
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// Swaps `snapshot` into the engine unless it is the live one already (a policy falling back to
/// its last accepted generation leaves the version unchanged), and logs what fell back.
fn install<S: RateStore>(engine: &Engine<S>, snapshot: Snapshot, outcome: &CompileOutcome) {
    let mut fell_back = 0;
    for p in &outcome.policies {
        if let (Some(errors), Enforced::LastAccepted(enforced)) = (&p.rejected, &p.enforced) {
            fell_back += 1;
            tracing::debug!(
                policy = %p.policy.qualified_name(),
                generation = ?p.policy.metadata.generation,
                enforced,
                %errors,
                "generation not accepted; the last accepted generation stays enforced"
            );
        }
    }
    if !engine.is_loaded() || engine.live().snapshot.version() != snapshot.version() {
        tracing::info!(
            version = %snapshot.version(),
            rules = snapshot.rule_count(),
            rejected = outcome.policies.iter().filter(|p| p.rejected.is_some()).count(),
            last_accepted = fell_back,
            "snapshot installed"
        );
        engine.install(Arc::new(snapshot));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Policy `ns/p` (uid `u`) at `generation`: a fixed window of `requests` per minute,
    /// with a path regex (`(unclosed` makes it invalid for validate(), not for CEL).
    fn policy(generation: i64, requests: u64, regex: &str) -> RateLimitPolicy {
        let mut p: RateLimitPolicy = serde_json::from_value(json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": generation},
            "spec": {"rules": [{"name": "r", "algorithm": "fixedWindow", "limit": {"requests": requests, "per": "1m"},
                                "match": {"paths": [{"regex": regex}]}}]}
        }))
        .expect("policy");
        p.metadata.generation = Some(generation);
        p
    }

    fn valid(generation: i64, requests: u64) -> RateLimitPolicy {
        policy(generation, requests, "/.*")
    }

    fn invalid(generation: i64) -> RateLimitPolicy {
        policy(generation, 9, "(unclosed")
    }

    /// `p` with `status.lastAccepted` holding `accepted`'s generation and spec.
    fn persisted(mut p: RateLimitPolicy, accepted: &RateLimitPolicy) -> RateLimitPolicy {
        let last = last_accepted_of(accepted);
        p.status = Some(crate::policy::RateLimitPolicyStatus { last_accepted: last, ..Default::default() });
        p
    }

    fn run(compiler: &mut Compiler, policies: Vec<RateLimitPolicy>) -> (Snapshot, CompileOutcome) {
        compiler.run(policies.into_iter().map(Arc::new).collect()).expect("compiled")
    }

    fn requests(snapshot: &Snapshot) -> Vec<u64> {
        snapshot.rules().map(|r| r.limit().requests()).collect()
    }

    #[test]
    fn a_valid_generation_is_compiled_and_becomes_the_last_accepted() {
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![persisted(valid(2, 5), &valid(1, 1))]);
        assert_eq!(requests(&snapshot), [5]);
        let p = &outcome.policies[0];
        assert_eq!((p.rejected.as_ref(), &p.enforced), (None, &Enforced::Current));
        assert_eq!(p.last_accepted, last_accepted_of(&valid(2, 5)), "replaces the persisted spec");
        assert_eq!(outcome.version, snapshot.version());
    }

    #[test]
    fn an_invalid_generation_compiles_the_persisted_last_accepted_spec() {
        let accepted = valid(1, 1);
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![persisted(invalid(2), &accepted)]);
        assert_eq!(requests(&snapshot), [1]);
        let p = &outcome.policies[0];
        assert_eq!(p.enforced, Enforced::LastAccepted(1));
        let errors = p.rejected.as_ref().expect("generation 2 rejected").to_string();
        assert!(errors.contains("spec.rules[0].match.paths[0].regex"), "{errors}");
        assert_eq!(p.last_accepted, last_accepted_of(&accepted), "kept");
        // The version hashes what is enforced: the same as when generation 1 was current, on every
        // replica, and the sources a sidecar rebuilds from are that generation's.
        assert_eq!(snapshot.version(), compile(vec![accepted.clone()]).snapshot.version());
        assert_eq!(snapshot.sources()[0].spec, accepted.spec);
        assert_eq!(snapshot.sources()[0].qualified_name(), "ns/p");
    }

    #[test]
    fn an_invalid_generation_without_a_last_accepted_one_enforces_nothing() {
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![invalid(1)]);
        assert_eq!(snapshot.rule_count(), 0);
        let p = &outcome.policies[0];
        assert!(p.rejected.is_some());
        assert_eq!((&p.enforced, &p.last_accepted), (&Enforced::Nothing(None), &None));
    }

    #[test]
    fn a_last_accepted_spec_this_operator_refuses_enforces_nothing() {
        // Accepted by some other version: a regex this one refuses.
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![persisted(invalid(3), &invalid(2))]);
        assert_eq!(snapshot.rule_count(), 0);
        match &outcome.policies[0].enforced {
            Enforced::Nothing(Some((2, errors))) => {
                assert!(errors.to_string().contains("spec.rules[0].match.paths[0].regex"), "{errors}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(outcome.policies[0].last_accepted, last_accepted_of(&invalid(2)), "kept");

        // A spec that does not even deserialize.
        let mut p = invalid(3);
        let spec = json!({"rules": "not a list"});
        p.status = Some(crate::policy::RateLimitPolicyStatus {
            last_accepted: Some(LastAccepted { generation: 2, spec }),
            ..Default::default()
        });
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![p]);
        assert_eq!(snapshot.rule_count(), 0);
        match &outcome.policies[0].enforced {
            Enforced::Nothing(Some((2, errors))) => assert_eq!(errors.errors[0].path, "status.lastAccepted.spec"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_last_accepted_generation_not_older_than_the_current_one_is_ignored() {
        let (snapshot, outcome) = run(&mut Compiler::default(), vec![persisted(invalid(2), &valid(2, 1))]);
        assert_eq!(snapshot.rule_count(), 0);
        assert_eq!(outcome.policies[0].enforced, Enforced::Nothing(None));
    }

    #[test]
    fn the_current_generation_wins_over_the_persisted_one_when_valid() {
        let choice = choose(Arc::new(persisted(valid(3, 7), &valid(2, 1))), Ok(()));
        assert_eq!(choice.source, Source::Current);
        assert_eq!(choice.input.map(|p| p.spec), Some(valid(3, 7).spec));
        let choice = choose(Arc::new(persisted(invalid(3), &valid(2, 1))), Err(ValidationErrors::default()));
        assert_eq!(choice.source, Source::LastAccepted(2));
        assert_eq!(choice.input.map(|p| (p.qualified_name(), p.spec)), Some(("ns/p".into(), valid(2, 1).spec)));
    }

    #[test]
    fn status_only_changes_do_not_recompile_unless_they_change_what_is_enforced() {
        let mut compiler = Compiler::default();
        run(&mut compiler, vec![valid(1, 1)]);
        // Our own status write (lastAccepted of the current generation): nothing to do.
        assert!(compiler.run(vec![Arc::new(persisted(valid(1, 1), &valid(1, 1)))]).is_none());
        // An invalid update: falls back, same version as before.
        let (before, _) = run(&mut Compiler::default(), vec![valid(1, 1)]);
        let (after, _) = run(&mut compiler, vec![persisted(invalid(2), &valid(1, 1))]);
        assert_eq!(after.version(), before.version());
        assert!(compiler.run(vec![Arc::new(persisted(invalid(2), &valid(1, 1)))]).is_none());
    }

    #[test]
    fn a_generation_accepted_here_but_not_yet_persisted_is_handed_to_the_status_writer() {
        // A valid and an invalid update before the status writer persisted the valid one.
        let mut compiler = Compiler::default();
        run(&mut compiler, vec![persisted(valid(2, 3), &valid(1, 1))]);
        let (snapshot, outcome) = run(&mut compiler, vec![persisted(invalid(3), &valid(1, 1))]);
        // Compiled from what is persisted (so every replica agrees) ...
        assert_eq!(requests(&snapshot), [1]);
        assert_eq!(outcome.policies[0].enforced, Enforced::LastAccepted(1));
        // ... while the status writer is told to persist generation 2, which then is enforced.
        assert_eq!(outcome.policies[0].last_accepted, last_accepted_of(&valid(2, 3)));
        let (snapshot, outcome) = run(&mut compiler, vec![persisted(invalid(3), &valid(2, 3))]);
        assert_eq!(requests(&snapshot), [3]);
        assert_eq!(outcome.policies[0].enforced, Enforced::LastAccepted(2));
        // A fresh replica (no memory) compiles the same from the status alone.
        let (fresh, _) = run(&mut Compiler::default(), vec![persisted(invalid(3), &valid(2, 3))]);
        assert_eq!(fresh.version(), snapshot.version());
    }

    #[test]
    fn a_valid_update_after_a_fallback_replaces_it_and_a_deleted_policy_is_forgotten() {
        let mut compiler = Compiler::default();
        run(&mut compiler, vec![persisted(invalid(2), &valid(1, 1))]);
        let (snapshot, outcome) = run(&mut compiler, vec![persisted(valid(3, 5), &valid(1, 1))]);
        assert_eq!(requests(&snapshot), [5]);
        assert_eq!(outcome.policies[0].enforced, Enforced::Current);
        assert_eq!(outcome.policies[0].last_accepted, last_accepted_of(&valid(3, 5)));
        let (snapshot, outcome) = run(&mut compiler, vec![]);
        assert_eq!((snapshot.rule_count(), outcome.policies.len()), (0, 0));
        assert!(compiler.accepted.is_empty() && compiler.validity.is_empty());
    }

    #[test]
    fn each_generation_is_validated_once() {
        let mut compiler = Compiler::default();
        run(&mut compiler, vec![invalid(1)]);
        // A cached verdict is reused: poison it and see it used.
        compiler.validity.insert(("u".into(), Some(1)), Ok(()));
        compiler.last = None;
        let (_, outcome) = run(&mut compiler, vec![invalid(1)]);
        // compile() still refuses it, reported as not accepted.
        assert!(outcome.policies[0].rejected.is_some());
        assert_eq!(compiler.validity.len(), 1);
    }
}
