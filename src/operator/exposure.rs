//! The application's port is not a way around the sidecar: what the Lease holder keeps true.
//!
//! The injecting webhook labels each pod with the ports it admits ingress on
//! (`sluice.dev/ingress-ports`: the sidecar's, plus redirected and excluded ones) and annotates it
//! with the application ports only the sidecar may front (`sluice.dev/guarded-ports`, in the
//! `service` redirect mode). While this replica leads, it watches the metadata of pods labelled
//! for injection and the Services of the watched namespaces, and:
//!
//! - keeps one NetworkPolicy per namespace and port set (`sluice-ingress-<ports>`) that admits
//!   ingress to those pods only on those ports, so where the CNI enforces NetworkPolicy nothing
//!   reaches the application's own port from another pod;
//! - reports Services that send traffic to a guarded port by number (a numeric `targetPort`, or
//!   none, which means the port itself): they reach the application past the sidecar. A
//!   `Warning SidecarBypassed` Event on the Service, once per Service and port set, and the
//!   `sluice_services_bypassing_sidecar` gauge.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Service};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPort, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{PartialObjectMeta, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::FIELD_MANAGER;
use super::missing_sidecars::{EventNote, publish_event};
use crate::admission::inject::INJECT_LABEL;
use crate::admission::traffic::{GUARDED_PORTS_ANNOTATION, INGRESS_PORTS_LABEL, parse_ports};
use crate::telemetry::Metrics;

pub const BYPASS_REASON: &str = "SidecarBypassed";
/// NetworkPolicies the operator keeps per namespace at most: the label is the pods' to write, and
/// a namespace with more port sets than this is not one the webhook labelled.
pub const MAX_POLICIES_PER_NAMESPACE: usize = 32;
const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "sluice");

#[derive(Debug, Clone)]
pub struct ExposureConfig {
    /// Namespaces watched; empty: all.
    pub namespaces: Vec<String>,
    pub operator_namespace: String,
    pub identity: String,
    /// Keep the NetworkPolicies (`--sidecar-network-policy`).
    pub network_policies: bool,
}

/// A pod labelled for injection, as far as exposure is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectedPod {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// The [`INGRESS_PORTS_LABEL`] ports, when valid.
    pub ingress_ports: Option<Vec<u16>>,
    pub guarded_ports: Vec<u16>,
}

impl InjectedPod {
    pub fn from_meta(meta: &ObjectMeta, operator_namespace: &str) -> Option<InjectedPod> {
        let namespace = meta.namespace.clone()?;
        if namespace == operator_namespace || meta.deletion_timestamp.is_some() {
            return None;
        }
        let labels = meta.labels.clone().unwrap_or_default();
        let ingress_ports = labels.get(INGRESS_PORTS_LABEL).and_then(|v| parse_ports(v).ok()).filter(|p| !p.is_empty());
        let guarded_ports = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(GUARDED_PORTS_ANNOTATION))
            .and_then(|v| parse_ports(v).ok())
            .unwrap_or_default();
        Some(InjectedPod { namespace, labels, ingress_ports, guarded_ports })
    }
}

/// The NetworkPolicy's name for a port set.
pub fn policy_name(ports: &[u16]) -> String {
    format!("sluice-ingress-{}", ports.iter().map(u16::to_string).collect::<Vec<_>>().join("-"))
}

/// The NetworkPolicy admitting ingress to the pods labelled with `ports` only on those ports.
pub fn network_policy(namespace: &str, ports: &[u16]) -> NetworkPolicy {
    let value = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(".");
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(policy_name(ports)),
            namespace: Some(namespace.to_string()),
            labels: Some([(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())].into()),
            annotations: Some(
                [(
                    "sluice.dev/why".to_string(),
                    "Pods with the Sluice sidecar admit ingress only on the sidecar's ports (and those they exclude), so their application's port cannot be reached past the sidecar.".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some([(INGRESS_PORTS_LABEL.to_string(), value)].into()),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: None,
                ports: Some(
                    ports
                        .iter()
                        .map(|p| NetworkPolicyPort {
                            port: Some(IntOrString::Int(i32::from(*p))),
                            protocol: Some("TCP".into()),
                            ..Default::default()
                        })
                        .collect(),
                ),
            }]),
            ..Default::default()
        }),
    }
}

/// (namespace, ports) of every NetworkPolicy the pods need, at most
/// [`MAX_POLICIES_PER_NAMESPACE`] per namespace.
pub fn wanted_policies(pods: &[InjectedPod]) -> BTreeSet<(String, Vec<u16>)> {
    let mut wanted = BTreeSet::new();
    let mut per_namespace: BTreeMap<&str, usize> = BTreeMap::new();
    let sets: BTreeSet<(&str, &Vec<u16>)> =
        pods.iter().filter_map(|p| p.ingress_ports.as_ref().map(|ports| (p.namespace.as_str(), ports))).collect();
    for (namespace, ports) in sets {
        let count = per_namespace.entry(namespace).or_default();
        if *count < MAX_POLICIES_PER_NAMESPACE {
            *count += 1;
            wanted.insert((namespace.to_string(), ports.clone()));
        }
    }
    wanted
}

/// A Service that reaches guarded application ports by number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bypass {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// (Service port, the pod port it targets).
    pub ports: Vec<(i32, u16)>,
}

impl Bypass {
    /// The Event's name: one per Service and set of bypassing ports, whoever reports it.
    pub fn event_name(&self) -> String {
        let mut digest = Sha256::new();
        for (port, target) in &self.ports {
            digest.update(format!("{port}:{target};"));
        }
        let hash = digest.finalize();
        let short: String = hash.iter().take(4).map(|b| format!("{b:02x}")).collect();
        format!("sluice-sidecar-bypassed.{}.{short}", self.uid)
    }
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Services whose numeric target ports are guarded ports of a pod they select.
pub fn bypasses(services: &[Arc<Service>], pods: &[InjectedPod]) -> Vec<Bypass> {
    let mut found = Vec::new();
    for service in services {
        let (Some(namespace), Some(name), Some(uid)) =
            (&service.metadata.namespace, &service.metadata.name, &service.metadata.uid)
        else {
            continue;
        };
        let Some(spec) = &service.spec else { continue };
        let Some(selector) = &spec.selector else { continue };
        let guarded: BTreeSet<u16> = pods
            .iter()
            .filter(|p| &p.namespace == namespace && selects(selector, &p.labels))
            .flat_map(|p| p.guarded_ports.iter().copied())
            .collect();
        if guarded.is_empty() {
            continue;
        }
        let ports: Vec<(i32, u16)> = spec
            .ports
            .iter()
            .flatten()
            .filter(|p| p.protocol.as_deref().is_none_or(|p| p == "TCP"))
            .filter_map(|p| {
                let target = match &p.target_port {
                    None => p.port,
                    Some(IntOrString::Int(n)) => *n,
                    // A name resolves per pod: the guarded port has none (the sidecar took it).
                    Some(IntOrString::String(_)) => return None,
                };
                u16::try_from(target).ok().filter(|t| guarded.contains(t)).map(|t| (p.port, t))
            })
            .collect();
        if !ports.is_empty() {
            found.push(Bypass { namespace: namespace.clone(), name: name.clone(), uid: uid.clone(), ports });
        }
    }
    found
}

/// While this replica leads (`leading`), keeps the NetworkPolicies and reports bypassing
/// Services; ends when `stop` flips.
pub async fn watch_exposure(
    client: Client,
    config: ExposureConfig,
    metrics: Arc<Metrics>,
    leading: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) {
    let term = |mut leading, mut stop| {
        let (client, config, metrics) = (client.clone(), config.clone(), metrics.clone());
        async move {
            tracing::info!(
                network_policies = config.network_policies,
                "watching injected pods and Services for ways around the sidecar"
            );
            lead(&client, &config, &metrics, &mut leading, &mut stop).await;
        }
    };
    super::leader::each_term(leading, stop, term, || {
        metrics.services_bypassing_sidecar.set(0);
    })
    .await;
}

fn apis<K>(client: &Client, namespaces: &[String]) -> Vec<Api<K>>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    if namespaces.is_empty() {
        vec![Api::all(client.clone())]
    } else {
        namespaces.iter().map(|ns| Api::namespaced(client.clone(), ns)).collect()
    }
}

async fn lead(
    client: &Client,
    config: &ExposureConfig,
    metrics: &Metrics,
    leading: &mut watch::Receiver<bool>,
    stop: &mut watch::Receiver<bool>,
) {
    let pod_config = watcher::Config::default().labels(&format!("{INJECT_LABEL}=true")).any_semantic();
    let mut pod_stores: Vec<Store<PartialObjectMeta<Pod>>> = Vec::new();
    let mut service_stores: Vec<Store<Service>> = Vec::new();
    let mut streams = Vec::new();
    for api in apis::<PartialObjectMeta<Pod>>(client, &config.namespaces) {
        let (reader, writer) = reflector::store();
        pod_stores.push(reader);
        streams.push(
            watcher(api, pod_config.clone())
                .backoff(super::WatchBackoff::default())
                .reflect(writer)
                .map(|e| e.map(|_| ()))
                .boxed(),
        );
    }
    for api in apis::<Service>(client, &config.namespaces) {
        let (reader, writer) = reflector::store();
        service_stores.push(reader);
        let stream = watcher(api, watcher::Config::default().any_semantic())
            .backoff(super::WatchBackoff::default())
            .modify(|s| s.managed_fields_mut().clear())
            .reflect(writer);
        streams.push(stream.map(|e| e.map(|_| ())).boxed());
    }
    let mut events = futures::stream::select_all(streams);
    // What this term has done: policies applied, bypasses reported (by Event name).
    let mut applied: HashSet<(String, Vec<u16>)> = HashSet::new();
    let mut reported: HashSet<String> = HashSet::new();
    let mut dirty = false;
    // Whether the last pass wrote everything it meant to; only a failed write is retried on the
    // tick (recomputing from unchanged stores would find nothing new).
    let mut settled = true;
    let settle = Duration::from_millis(500);
    let mut retry = tokio::time::interval(Duration::from_secs(10));
    loop {
        let mut act = false;
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            changed = leading.changed() => if changed.is_err() || !*leading.borrow() { return },
            event = events.next() => match event {
                Some(Ok(())) => dirty = true,
                Some(Err(error)) => tracing::warn!(%error, "pod or Service watch failed; retrying"),
                None => return,
            },
            // Changes come in bursts (a rollout): act once they settle.
            _ = tokio::time::sleep(settle), if dirty => act = true,
            _ = retry.tick() => dirty |= !settled,
        }
        if !act {
            continue;
        }
        let ready = pod_stores.iter().all(|s| s.wait_until_ready().now_or_never().is_some())
            && service_stores.iter().all(|s| s.wait_until_ready().now_or_never().is_some());
        if ready {
            dirty = false;
            settled =
                reconcile(client, config, metrics, &pod_stores, &service_stores, &mut applied, &mut reported).await;
        }
    }
}

async fn reconcile(
    client: &Client,
    config: &ExposureConfig,
    metrics: &Metrics,
    pod_stores: &[Store<PartialObjectMeta<Pod>>],
    service_stores: &[Store<Service>],
    applied: &mut HashSet<(String, Vec<u16>)>,
    reported: &mut HashSet<String>,
) -> bool {
    let mut settled = true;
    let pods: Vec<InjectedPod> = pod_stores
        .iter()
        .flat_map(|s| s.state())
        .filter_map(|p| InjectedPod::from_meta(&p.metadata, &config.operator_namespace))
        .collect();
    let services: Vec<Arc<Service>> = service_stores.iter().flat_map(|s| s.state()).collect();

    if config.network_policies {
        for (namespace, ports) in wanted_policies(&pods) {
            if applied.contains(&(namespace.clone(), ports.clone())) {
                continue;
            }
            let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), &namespace);
            let name = policy_name(&ports);
            let params = PatchParams::apply(FIELD_MANAGER).force();
            match api.patch(&name, &params, &Patch::Apply(network_policy(&namespace, &ports))).await {
                Ok(_) => {
                    tracing::info!(%namespace, policy = %name, ?ports, "NetworkPolicy in place: injected pods admit ingress only on these ports");
                    metrics.network_policies_applied.inc();
                    applied.insert((namespace, ports));
                }
                Err(error) => {
                    settled = false;
                    tracing::warn!(%error, %namespace, policy = %name, "cannot apply the NetworkPolicy; retrying")
                }
            }
        }
    }

    let found = bypasses(&services, &pods);
    metrics.services_bypassing_sidecar.set(i64::try_from(found.len()).unwrap_or(i64::MAX));
    for bypass in found {
        let event_name = bypass.event_name();
        if reported.contains(&event_name) {
            continue;
        }
        let described: Vec<String> =
            bypass.ports.iter().map(|(port, target)| format!("port {port} → targetPort {target}")).collect();
        let note = EventNote {
            namespace: &bypass.namespace,
            name: &event_name,
            reason: BYPASS_REASON,
            action: "Audit",
            note: format!(
                "{} targets the application's port by number, past the injected sidecar: its traffic is not rate limited. \
                 Use the port's name as targetPort (the sidecar took the name over), or the iptables redirect mode.",
                described.join(", ")
            ),
            regarding: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(bypass.namespace.clone()),
                name: Some(bypass.name.clone()),
                uid: Some(bypass.uid.clone()),
                ..Default::default()
            },
        };
        match publish_event(client, &config.identity, note).await {
            Ok(created) => {
                if created {
                    metrics.sidecar_bypass_events.inc();
                    tracing::warn!(namespace = %bypass.namespace, service = %bypass.name, ports = %described.join(", "), "Service reaches the application past the sidecar");
                }
                reported.insert(event_name);
            }
            Err(error) => {
                settled = false;
                tracing::warn!(%error, service = %bypass.name, "cannot publish the SidecarBypassed event; retrying")
            }
        }
    }
    settled
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, labels: &[(&str, &str)], guarded: Option<&str>) -> InjectedPod {
        let meta = ObjectMeta {
            namespace: Some(namespace.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            annotations: guarded.map(|g| [(GUARDED_PORTS_ANNOTATION.to_string(), g.to_string())].into()),
            ..Default::default()
        };
        InjectedPod::from_meta(&meta, "sluice-system").expect("pod")
    }

    fn service(namespace: &str, name: &str, selector: &[(&str, &str)], ports: serde_json::Value) -> Arc<Service> {
        let selector: BTreeMap<String, String> = selector.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": namespace, "name": name, "uid": format!("uid-{name}")},
                "spec": {"selector": selector, "ports": ports},
            }))
            .expect("service"),
        )
    }

    #[test]
    fn numeric_target_ports_to_guarded_ports_are_bypasses() {
        let pods = [pod("t", &[("app", "web"), (INGRESS_PORTS_LABEL, "15080.15081")], Some("8080"))];
        let services = [
            service("t", "named", &[("app", "web")], serde_json::json!([{"port": 80, "targetPort": "http"}])),
            service(
                "t",
                "numeric",
                &[("app", "web")],
                serde_json::json!([{"port": 80, "targetPort": 8080}, {"port": 81, "targetPort": 15080}]),
            ),
            service("t", "implicit", &[("app", "web")], serde_json::json!([{"port": 8080}])),
            service("t", "udp", &[("app", "web")], serde_json::json!([{"port": 8080, "protocol": "UDP"}])),
            service("t", "other-app", &[("app", "db")], serde_json::json!([{"port": 8080}])),
            service("u", "other-namespace", &[("app", "web")], serde_json::json!([{"port": 8080}])),
            service("t", "no-selector", &[], serde_json::json!([{"port": 8080}])),
        ];
        let found = bypasses(&services, &pods);
        let names: Vec<_> = found.iter().map(|b| (b.name.as_str(), b.ports.clone())).collect();
        assert_eq!(names, [("numeric", vec![(80, 8080)]), ("implicit", vec![(8080, 8080)])]);
        assert_ne!(found[0].event_name(), found[1].event_name());
        assert!(found[0].event_name().starts_with("sluice-sidecar-bypassed.uid-numeric."));
    }

    #[test]
    fn iptables_pods_guard_nothing_by_name() {
        let pods = [pod("t", &[("app", "web")], None)];
        let services =
            [service("t", "numeric", &[("app", "web")], serde_json::json!([{"port": 80, "targetPort": 8080}]))];
        assert!(bypasses(&services, &pods).is_empty());
    }

    #[test]
    fn one_policy_per_namespace_and_port_set_bounded() {
        let mut pods = vec![
            pod("a", &[(INGRESS_PORTS_LABEL, "15080.15081")], None),
            pod("a", &[(INGRESS_PORTS_LABEL, "15080.15081")], None),
            pod("b", &[(INGRESS_PORTS_LABEL, "8080.15080.15081")], None),
            pod("b", &[(INGRESS_PORTS_LABEL, "not-ports")], None),
            pod("b", &[], None),
        ];
        for i in 0..40 {
            pods.push(pod("c", &[(INGRESS_PORTS_LABEL, &format!("{}.15080", 20000 + i))], None));
        }
        let wanted = wanted_policies(&pods);
        assert!(wanted.contains(&("a".into(), vec![15080, 15081])));
        assert!(wanted.contains(&("b".into(), vec![8080, 15080, 15081])));
        assert_eq!(wanted.iter().filter(|(ns, _)| ns == "b").count(), 1);
        assert_eq!(wanted.iter().filter(|(ns, _)| ns == "c").count(), MAX_POLICIES_PER_NAMESPACE);
    }

    #[test]
    fn the_policy_admits_only_its_ports_to_its_pods() {
        let policy = network_policy("t", &[8080, 15080, 15081]);
        let value = serde_json::to_value(&policy).expect("json");
        assert_eq!(value["apiVersion"], "networking.k8s.io/v1");
        assert_eq!(value["metadata"]["name"], "sluice-ingress-8080-15080-15081");
        assert_eq!(value["spec"]["podSelector"]["matchLabels"][INGRESS_PORTS_LABEL], "8080.15080.15081");
        assert_eq!(value["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
        assert_eq!(
            value["spec"]["ingress"],
            serde_json::json!([{"ports": [
                {"port": 8080, "protocol": "TCP"}, {"port": 15080, "protocol": "TCP"}, {"port": 15081, "protocol": "TCP"}
            ]}])
        );
    }
}
