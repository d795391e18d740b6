//! Pods that asked for the sidecar and run without it, made visible.
//!
//! The injecting webhook's failurePolicy is `Ignore` (a down operator never blocks pods), so a
//! pod created while no replica answered starts without the sidecar: unlimited, silently. The
//! webhook stamps every pod it injects with `sluice.dev/injected`; the Lease holder watches the
//! metadata of pods labelled `sluice.dev/inject=true` (metadata only, and only the unstamped ones
//! are remembered, so memory stays small in large clusters) and, for each labelled pod without
//! the stamp, reads that one pod to make sure it has no `sluice-sidecar` container (pods injected
//! before the stamp existed, or given the sidecar by hand, do), then reports it: a
//! `Warning SidecarMissing` Event on the pod, once (the Event's name is derived from the pod's
//! UID, so a later leader's create is refused as a duplicate), and the
//! `sluice_pods_without_sidecar` gauge.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{PartialObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

use super::FIELD_MANAGER;
use crate::admission::inject::{CONTAINER_NAME, INJECT_LABEL, INJECTED_ANNOTATION};
use crate::telemetry::Metrics;

pub const REASON: &str = "SidecarMissing";

/// What the audit watches.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Namespaces whose pods are watched; empty: all.
    pub namespaces: Vec<String>,
    /// Never injected, so never reported.
    pub operator_namespace: String,
    /// This replica's identity (the Events' reportingInstance).
    pub identity: String,
}

/// A labelled pod without the stamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspect {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

/// What reading the pod said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not read yet.
    Unchecked,
    /// It has the sidecar after all (injected before the stamp existed, or by hand).
    HasSidecar,
    /// No sidecar; `reported` once its Event exists.
    Missing { reported: bool },
}

/// The labelled pod `meta` describes when it lacks the stamp (and is not being deleted, nor in
/// the operator's namespace).
pub fn suspect(meta: &ObjectMeta, operator_namespace: &str) -> Option<Suspect> {
    let labelled = meta.labels.as_ref().and_then(|l| l.get(INJECT_LABEL)).is_some_and(|v| v == "true");
    let stamped = meta.annotations.as_ref().is_some_and(|a| a.contains_key(INJECTED_ANNOTATION));
    let namespace = meta.namespace.clone()?;
    if !labelled || stamped || meta.deletion_timestamp.is_some() || namespace == operator_namespace {
        return None;
    }
    Some(Suspect { uid: meta.uid.clone()?, namespace, name: meta.name.clone()? })
}

/// The unstamped labelled pods of every watched stream (one per namespace, or one for all) and
/// what is known about each. Pure: fed watch events and verdicts.
#[derive(Debug, Default)]
pub struct Tracker {
    /// uid → (stream, pod, verdict).
    suspects: HashMap<String, (usize, Suspect, Verdict)>,
    /// A stream's relist in progress: its pods so far (the previous view stays in force until
    /// the relist is complete).
    relisting: HashMap<usize, HashMap<String, (usize, Suspect, Verdict)>>,
}

impl Tracker {
    pub fn apply(&mut self, stream: usize, event: watcher::Event<PartialObjectMeta<Pod>>, operator_namespace: &str) {
        match event {
            watcher::Event::Init => {
                self.relisting.insert(stream, HashMap::new());
            }
            watcher::Event::InitApply(pod) => {
                if let Some(s) = suspect(&pod.metadata, operator_namespace) {
                    let verdict = self.suspects.get(&s.uid).map_or(Verdict::Unchecked, |(_, _, v)| *v);
                    self.relisting.entry(stream).or_default().insert(s.uid.clone(), (stream, s, verdict));
                }
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.remove(&stream).unwrap_or_default();
                self.suspects.retain(|_, (from, _, _)| *from != stream);
                self.suspects.extend(listed);
            }
            watcher::Event::Apply(pod) => match suspect(&pod.metadata, operator_namespace) {
                Some(s) => {
                    self.suspects.entry(s.uid.clone()).or_insert((stream, s, Verdict::Unchecked));
                }
                None => self.forget(pod.metadata.uid.as_deref()),
            },
            watcher::Event::Delete(pod) => self.forget(pod.metadata.uid.as_deref()),
        }
    }

    fn forget(&mut self, uid: Option<&str>) {
        if let Some(uid) = uid {
            self.suspects.remove(uid);
        }
    }

    /// A pod to read, or to report again after a failed Event.
    pub fn next(&self) -> Option<Suspect> {
        self.suspects
            .values()
            .find(|(_, _, v)| matches!(v, Verdict::Unchecked | Verdict::Missing { reported: false }))
            .map(|(_, s, _)| s.clone())
    }

    /// Records what reading `uid` said; None: the pod is gone (or was replaced).
    pub fn record(&mut self, uid: &str, verdict: Option<Verdict>) {
        match verdict {
            None => self.forget(Some(uid)),
            Some(verdict) => {
                if let Some(entry) = self.suspects.get_mut(uid) {
                    entry.2 = verdict;
                }
            }
        }
    }

    /// Pods known to run without the sidecar.
    pub fn missing(&self) -> usize {
        self.suspects.values().filter(|(_, _, v)| matches!(v, Verdict::Missing { .. })).count()
    }
}

/// While this replica leads (`leading`), watches labelled pods and reports those without the
/// sidecar; ends when `stop` flips.
pub async fn audit(
    client: Client,
    config: AuditConfig,
    metrics: Arc<Metrics>,
    leading: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) {
    let term = |mut leading, mut stop| {
        let (client, config, metrics) = (client.clone(), config.clone(), metrics.clone());
        async move {
            tracing::info!(namespaces = ?config.namespaces, "watching labelled pods for missing sidecars");
            lead(&client, &config, &metrics, &mut leading, &mut stop).await;
        }
    };
    super::leader::each_term(leading, stop, term, || {
        metrics.pods_without_sidecar.set(0);
    })
    .await;
}

async fn lead(
    client: &Client,
    config: &AuditConfig,
    metrics: &Metrics,
    leading: &mut watch::Receiver<bool>,
    stop: &mut watch::Receiver<bool>,
) {
    let selector = format!("{INJECT_LABEL}=true");
    let apis: Vec<Api<PartialObjectMeta<Pod>>> = if config.namespaces.is_empty() {
        vec![Api::all(client.clone())]
    } else {
        config.namespaces.iter().map(|ns| Api::namespaced(client.clone(), ns)).collect()
    };
    // Api<PartialObjectMeta<_>> lists and watches metadata only; lists may come from the API
    // server's watch cache (any semantic): a pod is read afresh before it is reported anyway.
    let watch_config = watcher::Config::default().labels(&selector).any_semantic();
    let mut events = futures::stream::select_all(apis.into_iter().enumerate().map(|(i, api)| {
        watcher(api, watch_config.clone()).backoff(super::WatchBackoff::default()).map(move |e| (i, e)).boxed()
    }));
    let mut tracker = Tracker::default();
    let mut pause: Option<Instant> = None;
    loop {
        let work = match pause {
            Some(until) if Instant::now() < until => None,
            _ => tracker.next(),
        };
        let resume = pause.filter(|_| work.is_none());
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            changed = leading.changed() => if changed.is_err() || !*leading.borrow() { return },
            event = events.next() => match event {
                Some((stream, Ok(event))) => tracker.apply(stream, event, &config.operator_namespace),
                // The watcher retries with backoff by itself.
                Some((_, Err(error))) => tracing::warn!(%error, "pod metadata watch failed; retrying"),
                None => return,
            },
            verdict = examine(client, config, metrics, work.clone()), if work.is_some() => {
                let suspect = work.unwrap_or_else(|| unreachable!("guarded by work.is_some()"));
                match verdict {
                    Ok(verdict) => {
                        if verdict == Some(Verdict::Missing { reported: false }) {
                            pause = Some(Instant::now() + Duration::from_secs(10));
                        }
                        tracker.record(&suspect.uid, verdict);
                    }
                    Err(error) => {
                        tracing::warn!(%error, namespace = %suspect.namespace, pod = %suspect.name, "cannot read the pod");
                        pause = Some(Instant::now() + Duration::from_secs(5));
                    }
                }
            },
            _ = async { if let Some(at) = resume { tokio::time::sleep_until(at).await } }, if resume.is_some() => pause = None,
        }
        metrics.pods_without_sidecar.set(i64::try_from(tracker.missing()).unwrap_or(i64::MAX));
    }
}

/// Reads the suspect pod and reports it when it has no sidecar; None when it is gone.
async fn examine(
    client: &Client,
    config: &AuditConfig,
    metrics: &Metrics,
    suspect: Option<Suspect>,
) -> Result<Option<Verdict>, kube::Error> {
    let Some(suspect) = suspect else { return Ok(None) };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &suspect.namespace);
    let Some(pod) = pods.get_opt(&suspect.name).await? else { return Ok(None) };
    if pod.metadata.uid.as_deref() != Some(suspect.uid.as_str()) {
        return Ok(None);
    }
    let spec = pod.spec.as_ref();
    let containers = spec.iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
    if containers.into_iter().any(|c| c.name == CONTAINER_NAME) {
        return Ok(Some(Verdict::HasSidecar));
    }
    let reported = report(client, config, &suspect).await;
    match &reported {
        Ok(true) => {
            metrics.sidecar_missing_events.inc();
            tracing::warn!(namespace = %suspect.namespace, pod = %suspect.name, "pod labelled for injection runs without the sidecar");
        }
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(%error, namespace = %suspect.namespace, pod = %suspect.name, "cannot publish the SidecarMissing event; retrying")
        }
    }
    Ok(Some(Verdict::Missing { reported: reported.is_ok() }))
}

/// The Event's name: one per pod, whoever reports it.
pub fn event_name(uid: &str) -> String {
    format!("sluice-sidecar-missing.{uid}")
}

/// An Event the leader publishes once: its name is derived from what it reports, so a later
/// leader's create of the same Event is refused as a duplicate.
pub struct EventNote<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub reason: &'a str,
    pub action: &'a str,
    pub note: String,
    pub regarding: ObjectReference,
}

/// Creates the Warning Event; false when it exists already (reported before).
pub async fn publish_event(client: &Client, identity: &str, event: EventNote<'_>) -> Result<bool, kube::Error> {
    let events: Api<Event> = Api::namespaced(client.clone(), event.namespace);
    let event = Event {
        metadata: ObjectMeta {
            name: Some(event.name.to_string()),
            namespace: Some(event.namespace.to_string()),
            ..Default::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        type_: Some("Warning".into()),
        reason: Some(event.reason.into()),
        action: Some(event.action.into()),
        note: Some(event.note),
        regarding: Some(event.regarding),
        reporting_controller: Some(FIELD_MANAGER.into()),
        reporting_instance: Some(identity.chars().take(128).collect()),
        ..Default::default()
    };
    match events.create(&PostParams::default(), &event).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates the pod's SidecarMissing Event; false when it exists already (reported before).
async fn report(client: &Client, config: &AuditConfig, suspect: &Suspect) -> Result<bool, kube::Error> {
    let name = event_name(&suspect.uid);
    let note = EventNote {
        namespace: &suspect.namespace,
        name: &name,
        reason: REASON,
        action: "Audit",
        note: format!(
            "labelled {INJECT_LABEL}=true but created without the {CONTAINER_NAME} container (the injecting webhook \
             was not called or failed, and its failurePolicy let the pod through): its traffic is not rate limited. \
             Recreate the pod (e.g. kubectl rollout restart) now that the operator answers."
        ),
        regarding: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(suspect.namespace.clone()),
            name: Some(suspect.name.clone()),
            uid: Some(suspect.uid.clone()),
            ..Default::default()
        },
    };
    publish_event(client, &config.identity, note).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, labelled: bool, stamped: bool) -> PartialObjectMeta<Pod> {
        let mut meta = ObjectMeta {
            name: Some(format!("pod-{uid}")),
            namespace: Some("tenant".into()),
            uid: Some(uid.into()),
            ..Default::default()
        };
        if labelled {
            meta.labels = Some([(INJECT_LABEL.to_string(), "true".to_string())].into());
        }
        if stamped {
            meta.annotations = Some([(INJECTED_ANNOTATION.to_string(), "sluice:1".to_string())].into());
        }
        PartialObjectMeta { types: None, metadata: meta, _phantom: Default::default() }
    }

    #[test]
    fn only_unstamped_labelled_pods_outside_the_operator_namespace_are_suspects() {
        assert!(suspect(&pod("a", true, false).metadata, "sluice-system").is_some());
        assert!(suspect(&pod("a", true, true).metadata, "sluice-system").is_none());
        assert!(suspect(&pod("a", false, false).metadata, "sluice-system").is_none());
        assert!(suspect(&pod("a", true, false).metadata, "tenant").is_none());
        let mut deleting = pod("a", true, false).metadata;
        deleting.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
        assert!(suspect(&deleting, "sluice-system").is_none());
    }

    #[test]
    fn the_tracker_remembers_suspects_only_and_keeps_verdicts_across_relists() {
        let mut t = Tracker::default();
        let ns = "sluice-system";
        t.apply(0, watcher::Event::Init, ns);
        t.apply(0, watcher::Event::InitApply(pod("a", true, false)), ns);
        t.apply(0, watcher::Event::InitApply(pod("b", true, true)), ns);
        assert!(t.next().is_none(), "nothing before the list is complete");
        t.apply(0, watcher::Event::InitDone, ns);
        assert_eq!(t.suspects.len(), 1, "stamped pods are not remembered");
        let next = t.next().expect("a to read");
        assert_eq!(next.uid, "a");
        t.record("a", Some(Verdict::Missing { reported: true }));
        assert_eq!((t.missing(), t.next()), (1, None));

        // A relist keeps what is known (no second report), and drops pods no longer listed.
        t.apply(1, watcher::Event::Init, ns);
        t.apply(1, watcher::Event::InitApply(pod("c", true, false)), ns);
        t.apply(1, watcher::Event::InitDone, ns);
        t.apply(0, watcher::Event::Init, ns);
        t.apply(0, watcher::Event::InitApply(pod("a", true, false)), ns);
        assert_eq!(t.missing(), 1, "the previous view holds during a relist");
        t.apply(0, watcher::Event::InitDone, ns);
        assert_eq!(t.missing(), 1);
        assert_eq!(t.next().map(|s| s.uid).as_deref(), Some("c"), "stream 1's pod is untouched by stream 0's relist");
        t.record("c", Some(Verdict::HasSidecar));
        assert_eq!((t.missing(), t.next()), (1, None));

        // Deleted, or stamped by an update: forgotten.
        t.apply(0, watcher::Event::Delete(pod("a", true, false)), ns);
        t.apply(1, watcher::Event::Apply(pod("c", true, true)), ns);
        assert_eq!((t.missing(), t.suspects.len()), (0, 0));

        // A failed report is retried; a vanished pod is forgotten.
        t.apply(0, watcher::Event::Apply(pod("d", true, false)), ns);
        t.record("d", Some(Verdict::Missing { reported: false }));
        assert_eq!(t.next().map(|s| s.uid).as_deref(), Some("d"));
        t.record("d", None);
        assert_eq!(t.suspects.len(), 0);
    }

    #[test]
    fn event_names_are_valid_and_one_per_pod() {
        let name = event_name("3f2a9c1e-5b7d-4e2f-9a1b-0c8d7e6f5a4b");
        assert!(
            name.len() <= 253
                && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        );
    }
}
