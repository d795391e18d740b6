//! Sidecar injection against a real kube-apiserver + etcd (e2e/control-plane.sh): the injected
//! container passes Pod Security `restricted`, the webhook certificate rotates without the API
//! server ever distrusting a replica, and pods that slipped past the webhook are reported.
//!
//! The operators run as user `sluice-operator`, bound only to deploy/rbac.yaml's roles, which
//! allow the webhook configurations named `sluice` and the Secret `sluice-webhook-tls` only: the
//! tests share those names, so they take turns (this binary has its own control plane).
//! The webhooks are registered at https://127.0.0.1:<port>, so these tests need the local
//! control plane (not SLUICE_E2E_KUBECONFIG).

#[path = "support/control_plane.rs"]
mod control_plane;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use control_plane::{ControlPlane, Operator, control_plane, eventually, free_port};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

const SIDECAR: &str = "sluice-sidecar";
const SECRET: &str = "sluice-webhook-tls";

/// One test at a time: they share the webhook configuration and the Secret.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The control plane; the README test command builds it, so its absence fails the test.
fn cluster() -> &'static ControlPlane {
    assert!(
        std::env::var_os("SLUICE_E2E_KUBECONFIG").is_none(),
        "these tests register webhooks at https://127.0.0.1: unset SLUICE_E2E_KUBECONFIG"
    );
    control_plane().unwrap_or_else(|reason| panic!("no control plane: {reason} (scripts/test.sh builds it)"))
}

async fn namespace(client: &Client, name: &str, labels: Value) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).expect("ns");
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {name}: {e}"),
    }
}

/// A pod webhook as the chart defines it (failurePolicy Ignore), for the namespaces labelled
/// `sluice-e2e=<scope>` and pods matching `selector`.
fn hook(name: &str, port: u16, scope: &str, selector: Value) -> Value {
    json!({
        "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "failurePolicy": "Ignore", "reinvocationPolicy": "Never", "timeoutSeconds": 5,
        "namespaceSelector": {"matchLabels": {"sluice-e2e": scope}},
        "objectSelector": {"matchLabels": selector},
        "clientConfig": {"url": format!("https://127.0.0.1:{port}/mutate-pod")},
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    })
}

/// A fresh MutatingWebhookConfiguration `sluice` (no caBundle yet) with `hooks`.
fn mutating_configuration(cp: &ControlPlane, hooks: Vec<Value>) {
    cp.kubectl(&["delete", "mutatingwebhookconfiguration", "sluice", "--ignore-not-found"], None);
    let config = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "sluice"}, "webhooks": hooks
    });
    cp.kubectl(&["create", "-f", "-"], Some(&config.to_string()));
}

fn delete_secret(cp: &ControlPlane) {
    cp.kubectl(&["-n", "sluice-system", "delete", "secret", SECRET, "--ignore-not-found"], None);
}

fn operator(cp: &ControlPlane, identity: &str, ns: &str, lease: &str, port: u16, extra: &[&str]) -> Operator {
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--namespaces",
        ns,
        "--lease-name",
        lease,
        "--lease-duration",
        "6s",
        "--webhook-listen",
        &listen,
        "--webhook-host",
        "127.0.0.1",
        "--sidecar-image",
        "sluice:e2e",
    ];
    args.extend_from_slice(extra);
    Operator::start(&cp.operator_kubeconfig, identity, &args)
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("http client")
}

async fn ready(op: &Operator) {
    eventually("operator /readyz", Duration::from_secs(30), || async {
        let status = http().get(op.url("/readyz")).send().await.map_err(|e| e.to_string())?.status();
        if status == 200 { Ok(()) } else { Err(format!("{status}")) }
    })
    .await;
}

/// The value of an unlabelled metric on the operator's /metrics.
async fn metric(op: &Operator, name: &str) -> Option<f64> {
    let text = http().get(op.url("/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn metric_becomes(op: &Operator, name: &str, value: f64, what: &str) {
    eventually(what, Duration::from_secs(30), || async {
        let seen = metric(op, name).await;
        if seen == Some(value) { Ok(()) } else { Err(format!("{name} = {seen:?}")) }
    })
    .await;
}

fn pod(name: &str, labels: Value, annotations: Value, containers: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"containers": containers}
    }))
    .expect("pod")
}

/// An application container Pod Security `restricted` admits.
fn restricted_app() -> Value {
    json!({"name": "app", "image": "app:1", "securityContext": {
        "runAsNonRoot": true, "runAsUser": 1000, "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}
    }})
}

/// The injected sidecar, native (an init container) or classic (a container).
fn sidecar(pod: &Pod) -> Option<Container> {
    let spec = pod.spec.as_ref()?;
    spec.containers.iter().chain(spec.init_containers.iter().flatten()).find(|c| c.name == SIDECAR).cloned()
}

fn quantities(map: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>) -> String {
    map.iter().flatten().map(|(k, v)| format!("{k}={}", v.0)).collect::<Vec<_>>().join(",")
}

/// Creates labelled pods named `<prefix>-<n>` until one comes back injected (the API server may
/// call the webhook before it trusts the caBundle just written: failurePolicy Ignore then lets
/// the pod through uninjected; those are deleted).
async fn injected_pod(pods: &Api<Pod>, prefix: &str, make: impl Fn(&str) -> Pod) -> Pod {
    let mut n = 0;
    eventually("an injected pod", Duration::from_secs(30), || {
        n += 1;
        let name = format!("{prefix}-{n}");
        let pod = make(&name);
        async move {
            let created = pods.create(&PostParams::default(), &pod).await.map_err(|e| e.to_string())?;
            if sidecar(&created).is_some() {
                Ok(created)
            } else {
                let _ = pods.delete(&name, &DeleteParams::default()).await;
                Err("created without the sidecar".into())
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restricted_namespace_admits_the_injected_pod_with_resources_and_probes() {
    let _serial = SERIAL.lock().await;
    let cp = cluster();
    let client = cp.client().await;
    let ns = "inject-restricted";
    namespace(
        &client,
        ns,
        json!({"sluice-e2e": "restricted", "pod-security.kubernetes.io/enforce": "restricted",
               "pod-security.kubernetes.io/enforce-version": "latest"}),
    )
    .await;
    let port = free_port();
    mutating_configuration(
        cp,
        vec![hook("inject.sluice.dev", port, "restricted", json!({"sluice.dev/inject": "true"}))],
    );
    // Token review on: the injected pod also carries the projected token volume.
    let op = operator(cp, "restricted-1", ns, "e2e-inject-restricted", port, &["--token-review=true"]);
    ready(&op).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let labels = json!({"app": "web", "sluice.dev/inject": "true"});

    // Pod Security is enforced here: an application container that is not restricted is refused.
    let loose = pod("loose", labels.clone(), json!({}), json!([{"name": "app", "image": "app:1"}]));
    let err = pods.create(&PostParams::default(), &loose).await.expect_err("refused by Pod Security").to_string();
    assert!(err.contains("violates PodSecurity") && err.contains("restricted"), "{err}");

    // A restricted application gets a sidecar the same policy admits.
    let admitted =
        injected_pod(&pods, "strict", |name| pod(name, labels.clone(), json!({}), json!([restricted_app()]))).await;
    let sidecar = sidecar(&admitted).expect("sidecar");
    // --sidecar-kind auto against this API server (1.29 or later): a native sidecar, which
    // restricted admits as it admits the classic one.
    assert!(op.logs().contains("injected sidecars are native"), "{}", op.logs());
    let init = admitted.spec.as_ref().and_then(|s| s.init_containers.clone()).unwrap_or_default();
    assert_eq!(init.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), [SIDECAR]);
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    let startup = sidecar.startup_probe.as_ref().and_then(|p| p.http_get.clone()).expect("startup probe");
    assert_eq!((startup.path.as_deref(), startup.port), (Some("/healthz"), IntOrString::Int(15081)));
    let sc = sidecar.security_context.clone().expect("securityContext");
    assert_eq!(
        (sc.run_as_non_root, sc.allow_privilege_escalation, sc.read_only_root_filesystem),
        (Some(true), Some(false), Some(true))
    );
    assert!(sc.run_as_user.is_some_and(|u| u != 0));
    assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]));
    assert_eq!(sc.seccomp_profile.map(|p| p.type_).as_deref(), Some("RuntimeDefault"));
    let resources = sidecar.resources.clone().expect("resources");
    assert_eq!(quantities(&resources.requests), "cpu=50m,memory=64Mi");
    assert_eq!(quantities(&resources.limits), "memory=256Mi");
    for (probe, path) in [(&sidecar.liveness_probe, "/healthz"), (&sidecar.readiness_probe, "/readyz")] {
        let get = probe.as_ref().and_then(|p| p.http_get.clone()).unwrap_or_else(|| panic!("{path} probe"));
        assert_eq!((get.path.as_deref(), get.port), (Some(path), IntOrString::Int(15081)));
    }
    let env = |name: &str| sidecar.env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone());
    assert_eq!(env("SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:15081"));
    let stamp = admitted.metadata.annotations.as_ref().and_then(|a| a.get("sluice.dev/injected")).cloned();
    assert_eq!(stamp.as_deref(), Some("sluice:e2e"));
    let volumes = admitted.spec.as_ref().and_then(|s| s.volumes.clone()).unwrap_or_default();
    assert!(volumes.iter().any(|v| v.name == "sluice-token" && v.projected.is_some()), "{volumes:?}");

    // Per-pod annotations: good ones are used; bad ones (not a quantity, a request above its
    // limit, no port) fall back to the defaults with warnings, and the pod is still valid.
    let tuned = pod(
        "tuned",
        labels.clone(),
        json!({"sluice.dev/sidecar-memory-request": "128Mi", "sluice.dev/sidecar-memory-limit": "1Gi",
               "sluice.dev/admin-port": "19090"}),
        json!([restricted_app()]),
    );
    let tuned = pods.create(&PostParams::default(), &tuned).await.expect("tuned pod");
    let tuned = control_plane_sidecar(&tuned, &op);
    assert_eq!(quantities(&tuned.resources.as_ref().expect("resources").limits), "memory=1Gi");
    assert_eq!(tuned.readiness_probe.and_then(|p| p.http_get).map(|g| g.port), Some(IntOrString::Int(19090)));
    let bad = pod(
        "bad-annotations",
        labels.clone(),
        json!({"sluice.dev/sidecar-memory-request": "lots", "sluice.dev/sidecar-cpu-request": "2",
               "sluice.dev/sidecar-cpu-limit": "1", "sluice.dev/admin-port": "99999"}),
        json!([restricted_app()]),
    );
    let out = cp.kubectl(&["-n", ns, "create", "-f", "-"], Some(&serde_json::to_string(&bad).expect("json")));
    assert!(out.contains("Warning:") && out.contains("sluice.dev/sidecar-memory-request"), "{out}");
    assert!(out.contains("above its limit") && out.contains("sluice.dev/admin-port"), "{out}");
    let bad = pods.get("bad-annotations").await.expect("the pod was created");
    let bad = control_plane_sidecar(&bad, &op);
    let resources = bad.resources.clone().expect("resources");
    assert_eq!(quantities(&resources.requests), "cpu=50m,memory=64Mi");
    assert_eq!(quantities(&resources.limits), "memory=256Mi");
    assert_eq!(bad.liveness_probe.and_then(|p| p.http_get).map(|g| g.port), Some(IntOrString::Int(15081)));
    let admissions = metric(&op, "sluice_injection_warnings_total").await;
    assert!(admissions.is_some_and(|w| w >= 3.0), "warnings counted: {admissions:?}");

    // Per pod, classic: a container next to the application's, admitted the same.
    let classic =
        pod("classic", labels.clone(), json!({"sluice.dev/sidecar-kind": "classic"}), json!([restricted_app()]));
    let classic = pods.create(&PostParams::default(), &classic).await.expect("classic pod");
    let names: Vec<_> = classic.spec.as_ref().expect("spec").containers.iter().map(|c| c.name.clone()).collect();
    assert_eq!(names, ["app", SIDECAR]);
    assert_eq!(control_plane_sidecar(&classic, &op).restart_policy, None);
    // An unknown kind: a warning naming it, and the cluster's kind.
    let odd = pod("odd-kind", labels.clone(), json!({"sluice.dev/sidecar-kind": "sidecar"}), json!([restricted_app()]));
    let out = cp.kubectl(&["-n", ns, "create", "-f", "-"], Some(&serde_json::to_string(&odd).expect("json")));
    assert!(out.contains("Warning:") && out.contains("\"sidecar\" is not native or classic; using native"), "{out}");
}

/// The sidecar of a pod created once the webhook was known to answer.
fn control_plane_sidecar(pod: &Pod, op: &Operator) -> Container {
    sidecar(pod).unwrap_or_else(|| panic!("no sidecar in {:?}; operator logs:\n{}", pod.spec, op.logs()))
}

/// Whether `bundle` (PEM CAs) verifies `cert` (PEM), by openssl.
fn openssl_verifies(bundle: &[u8], cert: &[u8]) -> bool {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("bundle.pem"), bundle).expect("write");
    std::fs::write(dir.path().join("cert.pem"), cert).expect("write");
    let out = std::process::Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(dir.path().join("bundle.pem"))
        .arg(dir.path().join("cert.pem"))
        .output()
        .expect("openssl runs");
    out.status.success()
}

/// Whether https://127.0.0.1:`port` presents a certificate `ca` (PEM) verifies, by curl.
fn serves_certificate_of(port: u16, ca: &[u8]) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.pem"), ca).expect("write");
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(dir.path().join("ca.pem"))
        .arg(format!("https://127.0.0.1:{port}/mutate-pod"))
        .output()
        .expect("curl runs");
    if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).to_string()) }
}

fn secret_field(secret: &Secret, key: &str) -> Vec<u8> {
    secret.data.as_ref().and_then(|d| d.get(key)).map(|b| b.0.clone()).unwrap_or_default()
}

fn bundles(config: &MutatingWebhookConfiguration) -> Vec<Vec<u8>> {
    config
        .webhooks
        .iter()
        .flatten()
        .map(|h| h.client_config.ca_bundle.clone().map(|b| b.0).unwrap_or_default())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_rotation_never_reverts_the_ca_bundle_and_every_replica_keeps_injecting() {
    let _serial = SERIAL.lock().await;
    let cp = cluster();
    let client = cp.client().await;
    let ns = "inject-rotation";
    namespace(&client, ns, json!({"sluice-e2e": "rotation"})).await;
    delete_secret(cp);
    // One webhook per replica, so pods prove that each of them is trusted.
    let (port_a, port_b) = (free_port(), free_port());
    mutating_configuration(
        cp,
        vec![
            hook("a.inject.sluice.dev", port_a, "rotation", json!({"sluice.dev/inject": "true", "e2e-replica": "a"})),
            hook("b.inject.sluice.dev", port_b, "rotation", json!({"sluice.dev/inject": "true", "e2e-replica": "b"})),
        ],
    );
    let lease = "e2e-inject-rotation";
    let a = operator(cp, "rotation-a", ns, lease, port_a, &[]);
    let mut b = operator(cp, "rotation-b", ns, lease, port_b, &[]);
    ready(&a).await;
    ready(&b).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let labelled = |replica: &str| json!({"app": "web", "sluice.dev/inject": "true", "e2e-replica": replica});
    let plain =
        |name: &str, replica: &str| pod(name, labelled(replica), json!({}), json!([{"name": "app", "image": "app:1"}]));
    injected_pod(&pods, "warmup-a", |n| plain(n, "a")).await;
    injected_pod(&pods, "warmup-b", |n| plain(n, "b")).await;

    let secrets: Api<Secret> = Api::namespaced(client.clone(), "sluice-system");
    let old = secrets.get(SECRET).await.expect("the first Secret");
    let old_ca = secret_field(&old, "ca.crt");
    let configs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let before = bundles(&configs.get("sluice").await.expect("configuration"));
    assert!(before.iter().all(|b| openssl_verifies(b, &secret_field(&old, "tls.crt"))), "caBundle trusts the Secret");
    assert!(before.iter().all(|b| *b == before[0]), "one bundle for both hooks");

    // Poll caBundle every second for 40 s while the CA rotates.
    let poller = tokio::spawn({
        let configs = configs.clone();
        async move {
            let mut seen = Vec::new();
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(40) {
                if let Ok(config) = configs.get("sluice").await {
                    seen.push((started.elapsed(), bundles(&config)));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            seen
        }
    });

    // Rotate: delete the Secret, restart one replica. Pods keep coming through the other.
    secrets.delete(SECRET, &DeleteParams::default()).await.expect("delete the Secret");
    let mut created = Vec::new();
    let mut create = |replica: &'static str| {
        let name = format!("during-{replica}-{}", created.len());
        created.push(name.clone());
        let pod = plain(&name, replica);
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &pod).await.expect("pod created") }
    };
    create("a").await;
    assert!(b.terminate().success(), "b stops gracefully");
    create("a").await;
    let b = operator(cp, "rotation-b", ns, lease, port_b, &[]);
    ready(&b).await;
    while !poller.is_finished() {
        create("a").await;
        create("b").await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let seen = poller.await.expect("poller");

    let new = secrets.get(SECRET).await.expect("the new Secret");
    let (new_ca, new_cert) = (secret_field(&new, "ca.crt"), secret_field(&new, "tls.crt"));
    assert_ne!(new_ca, old_ca, "a new CA");
    // The bundle changed exactly once, to one that verifies the new serving certificate (and
    // still the old one, which the other replica served until it re-read the Secret), and never
    // went back.
    let mut changes: Vec<&Vec<Vec<u8>>> = Vec::new();
    for (_, bundle) in &seen {
        if changes.last() != Some(&bundle) {
            changes.push(bundle);
        }
    }
    let times: Vec<_> = seen.iter().map(|(t, b)| (t.as_secs(), b.iter().map(Vec::len).collect::<Vec<_>>())).collect();
    assert_eq!(changes.first().copied(), Some(&before), "{times:?}");
    assert_eq!(changes.len(), 2, "caBundle changed once: {times:?}");
    for bundle in changes[1] {
        assert!(openssl_verifies(bundle, &new_cert), "the new bundle verifies the new serving certificate");
        assert!(openssl_verifies(bundle, &secret_field(&old, "tls.crt")), "and, for a while, the old one");
    }
    eprintln!("caBundle samples (second, bytes per hook): {times:?}");

    // Both replicas serve the new CA's certificate by now (or within one more re-read).
    for (name, port) in [("a", port_a), ("b", port_b)] {
        eventually(&format!("replica {name} serves the new certificate"), Duration::from_secs(20), || async {
            serves_certificate_of(port, &new_ca)
        })
        .await;
    }
    // Every labelled pod created meanwhile got the sidecar.
    let list = pods.list(&ListParams::default()).await.expect("pods");
    let missing: Vec<_> = list
        .items
        .iter()
        .filter(|p| sidecar(p).is_none())
        .filter_map(|p| p.metadata.name.clone())
        .filter(|n| created.contains(n))
        .collect();
    assert!(missing.is_empty(), "created without the sidecar: {missing:?}\nA:\n{}\nB:\n{}", a.logs(), b.logs());
    assert!(created.len() >= 20, "{} pods created during the rotation", created.len());
}

async fn missing_events(client: &Client, ns: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&ListParams::default()).await.expect("events");
    list.items.into_iter().filter(|e| e.reason.as_deref() == Some("SidecarMissing")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_created_while_the_operator_was_down_is_reported_once() {
    let _serial = SERIAL.lock().await;
    let cp = cluster();
    let client = cp.client().await;
    let ns = "inject-audit";
    namespace(&client, ns, json!({"sluice-e2e": "audit"})).await;
    // Nothing listens there yet: failurePolicy Ignore lets the pods through without the sidecar.
    let port = free_port();
    mutating_configuration(cp, vec![hook("inject.sluice.dev", port, "audit", json!({"sluice.dev/inject": "true"}))]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let app = json!([{"name": "app", "image": "app:1"}]);
    let labelled = json!({"app": "web", "sluice.dev/inject": "true"});
    let naked = pods.create(&PostParams::default(), &pod("naked", labelled.clone(), json!({}), app.clone())).await;
    let naked = naked.expect("created while the operator is down");
    assert!(sidecar(&naked).is_none());
    // Written with the sidecar by hand: not missing, though unstamped.
    let own = json!([{"name": "app", "image": "app:1"}, {"name": SIDECAR, "image": "sluice:mine"}]);
    pods.create(&PostParams::default(), &pod("own", labelled.clone(), json!({}), own)).await.expect("own sidecar");
    pods.create(&PostParams::default(), &pod("unlabelled", json!({"app": "web"}), json!({}), app.clone()))
        .await
        .expect("unlabelled");

    let mut op = operator(cp, "audit-1", ns, "e2e-inject-audit", port, &[]);
    ready(&op).await;
    let injected = injected_pod(&pods, "injected", |n| pod(n, labelled.clone(), json!({}), app.clone())).await;
    let events = eventually("a SidecarMissing event", Duration::from_secs(30), || async {
        let events = missing_events(&client, ns).await;
        if events.is_empty() { Err(format!("none yet; logs:\n{}", op.logs())) } else { Ok(events) }
    })
    .await;
    let about = |e: &Event| e.regarding.as_ref().and_then(|r| r.name.clone()).unwrap_or_default();
    assert_eq!(events.iter().map(about).collect::<Vec<_>>(), ["naked"], "only the pod without the sidecar");
    let event = &events[0];
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert_eq!(event.regarding.as_ref().and_then(|r| r.uid.clone()), naked.metadata.uid);
    assert_eq!(
        (event.reporting_controller.as_deref(), event.reporting_instance.as_deref()),
        (Some("sluice-operator"), Some("audit-1"))
    );
    assert!(event.note.as_deref().is_some_and(|n| n.contains("not rate limited")), "{:?}", event.note);
    metric_becomes(&op, "sluice_pods_without_sidecar", 1.0, "the gauge counts it").await;
    assert_eq!(metric(&op, "sluice_sidecar_missing_events_total").await, Some(1.0));
    assert!(injected.metadata.annotations.is_some_and(|a| a.contains_key("sluice.dev/injected")));

    // A new leader finds the same pod and does not report it again. The old one releases the
    // Lease on SIGTERM (the audit and the certificate follower let go of the election too).
    assert!(op.terminate().success(), "{}", op.logs());
    let leases: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    let holder = leases.get("e2e-inject-audit").await.expect("lease").spec.and_then(|s| s.holder_identity);
    assert!(holder.as_deref() != Some("audit-1"), "still held by {holder:?}");
    let op = operator(cp, "audit-2", ns, "e2e-inject-audit", port, &[]);
    ready(&op).await;
    metric_becomes(&op, "sluice_pods_without_sidecar", 1.0, "the new leader counts it").await;
    assert_eq!(missing_events(&client, ns).await.len(), 1, "reported once");
    assert_eq!(metric(&op, "sluice_sidecar_missing_events_total").await, Some(0.0));

    // Gone once the pod is.
    pods.delete("naked", &DeleteParams::default()).await.expect("delete");
    metric_becomes(&op, "sluice_pods_without_sidecar", 0.0, "the gauge drops").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_not_naming_the_webhook_host_is_replaced_keeping_its_ca() {
    let _serial = SERIAL.lock().await;
    let cp = cluster();
    let client = cp.client().await;
    let ns = "inject-replace";
    namespace(&client, ns, json!({"sluice-e2e": "replace"})).await;
    // A pair the operator made (its CA's key included), but for another name.
    let pair = sluice::admission::certs::generate(&["sluice-webhook.elsewhere.svc".to_string()]).expect("certs");
    delete_secret(cp);
    let mut data = BTreeMap::new();
    for (key, value) in [("ca.crt", &pair.ca_pem), ("tls.crt", &pair.cert_pem), ("tls.key", &pair.key_pem)] {
        data.insert(key.to_string(), k8s_openapi::ByteString(value.clone().into_bytes()));
    }
    data.insert("ca.key".into(), k8s_openapi::ByteString(pair.ca_key_pem.clone().expect("CA key").into_bytes()));
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(SECRET.into()), ..Default::default() },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "sluice-system");
    secrets.create(&PostParams::default(), &secret).await.expect("the stale Secret");
    let port = free_port();
    mutating_configuration(cp, vec![hook("inject.sluice.dev", port, "replace", json!({"sluice.dev/inject": "true"}))]);

    // The operator (under deploy/rbac.yaml: update of this Secret only) replaces the serving
    // certificate at startup, from the same CA, and serves it.
    let op = operator(cp, "replace-1", ns, "e2e-inject-replace", port, &[]);
    ready(&op).await;
    let replaced = secrets.get(SECRET).await.expect("Secret");
    assert_eq!(secret_field(&replaced, "ca.crt"), pair.ca_pem.as_bytes(), "same CA");
    let cert = String::from_utf8(secret_field(&replaced, "tls.crt")).expect("PEM");
    assert_ne!(cert, pair.cert_pem, "a new serving certificate");
    let names = sluice::admission::certs::inspect(&cert).expect("certificate").names;
    assert!(sluice::admission::certs::covers(&names, "127.0.0.1"), "{names:?}");
    assert!(sluice::admission::certs::covers(&names, "sluice-webhook.elsewhere.svc"), "keeps its names: {names:?}");
    serves_certificate_of(port, pair.ca_pem.as_bytes()).expect("served, verified by the CA for 127.0.0.1");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let labels = json!({"app": "web", "sluice.dev/inject": "true"});
    injected_pod(&pods, "after-replace", |n| {
        pod(n, labels.clone(), json!({}), json!([{"name": "app", "image": "app:1"}]))
    })
    .await;
    assert_eq!(metric(&op, "sluice_certificate_renewals_total{reason=\"hosts\"}").await, Some(1.0));
    let expiry = metric(&op, "sluice_certificate_expiry_timestamp_seconds").await.expect("expiry gauge");
    let year_from_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("time").as_secs_f64()
        + 365.0 * 86400.0;
    assert!((expiry - year_from_now).abs() < 3600.0, "a year's validity: {expiry}");
}

/// The two redirect modes as the real API server admits them, the NetworkPolicy the leader keeps
/// for injected pods (under deploy/rbac.yaml), and a Service that reaches the application's port
/// by number reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_pods_are_reachable_only_through_the_sidecar() {
    let _serial = SERIAL.lock().await;
    let cp = cluster();
    let client = cp.client().await;
    let (ns, strict) = ("inject-paths", "inject-paths-restricted");
    namespace(&client, ns, json!({"sluice-e2e": "paths"})).await;
    namespace(
        &client,
        strict,
        json!({"sluice-e2e": "paths", "pod-security.kubernetes.io/enforce": "restricted",
               "pod-security.kubernetes.io/enforce-version": "latest"}),
    )
    .await;
    let port = free_port();
    mutating_configuration(cp, vec![hook("inject.sluice.dev", port, "paths", json!({"sluice.dev/inject": "true"}))]);
    let op = operator(cp, "paths-1", &format!("{ns},{strict}"), "e2e-inject-paths", port, &[]);
    ready(&op).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let labels = json!({"app": "web", "sluice.dev/inject": "true"});
    let app = json!([{"name": "app", "image": "app:1", "ports": [{"name": "http", "containerPort": 8080}],
                      "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}}}]);

    // service mode (the default): the API server accepts the renamed ports and moved probe.
    let web = injected_pod(&pods, "web", |n| pod(n, labels.clone(), json!({}), app.clone())).await;
    let spec = web.spec.as_ref().expect("spec");
    let port_names: Vec<_> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten().map(|p| (c.name.clone(), p.name.clone())))
        .collect();
    assert!(port_names.contains(&(SIDECAR.into(), Some("http".into()))), "{port_names:?}");
    assert!(port_names.contains(&("app".into(), None)), "{port_names:?}");
    let probe = spec.containers[0].readiness_probe.as_ref().and_then(|p| p.http_get.clone()).expect("probe");
    assert_eq!((probe.path.as_deref(), probe.port), (Some("/app-health/app/readyz"), IntOrString::Int(15081)));

    // iptables mode: the init container is admitted where Pod Security allows NET_ADMIN...
    let annotations = json!({"sluice.dev/redirect": "iptables"});
    let redirected =
        injected_pod(&pods, "redirected", |n| pod(n, labels.clone(), annotations.clone(), app.clone())).await;
    let init = redirected.spec.as_ref().and_then(|s| s.init_containers.clone()).unwrap_or_default();
    // The redirect first, to completion; then the (native) sidecar.
    assert_eq!(init.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["sluice-init", SIDECAR]);
    let labels_of = |p: &Pod| p.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels_of(&redirected).get("sluice.dev/ingress-ports").map(String::as_str), Some("8080.15080.15081"));
    // ...and refused, loudly, where it does not: the pod never runs unprotected.
    let strict_pods: Api<Pod> = Api::namespaced(client.clone(), strict);
    let err = eventually("a refusal naming the capability", Duration::from_secs(30), || async {
        let attempt = pod("privileged", labels.clone(), annotations.clone(), json!([restricted_app()]));
        match strict_pods.create(&PostParams::default(), &attempt).await {
            Err(e) if e.to_string().contains("NET_ADMIN") => Ok(e.to_string()),
            Err(e) => Err(e.to_string()),
            Ok(created) => {
                let _ = strict_pods.delete("privileged", &DeleteParams::default()).await;
                Err(format!("admitted (injected: {})", sidecar(&created).is_some()))
            }
        }
    })
    .await;
    assert!(err.contains("violates PodSecurity") && err.contains("sluice-init"), "{err}");

    // The leader's NetworkPolicies admit each port set only.
    let policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy> = Api::namespaced(client.clone(), ns);
    for (name, ports) in [
        ("sluice-ingress-15080-15081", vec![15080, 15081]),
        ("sluice-ingress-8080-15080-15081", vec![8080, 15080, 15081]),
    ] {
        let policy = eventually("the NetworkPolicy", Duration::from_secs(30), || async {
            policies.get(name).await.map_err(|e| format!("{e}; logs:\n{}", op.logs()))
        })
        .await;
        let spec = policy.spec.expect("spec");
        let open: Vec<_> = spec
            .ingress
            .iter()
            .flatten()
            .flat_map(|r| r.ports.iter().flatten())
            .filter_map(|p| p.port.clone())
            .collect();
        assert_eq!(open, ports.into_iter().map(IntOrString::Int).collect::<Vec<_>>());
        assert_eq!(spec.policy_types.as_deref(), Some(&["Ingress".to_string()][..]));
    }

    // A Service by number past the sidecar is reported once; one by name is not.
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), ns);
    for (name, target) in [("by-name", json!("http")), ("by-number", json!(8080))] {
        let service = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": target}]}
        }))
        .expect("service");
        services.create(&PostParams::default(), &service).await.expect("service");
    }
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let bypassed = eventually("a SidecarBypassed event", Duration::from_secs(30), || async {
        let list = events.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
        let found: Vec<String> = list
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("SidecarBypassed"))
            .filter_map(|e| e.regarding.as_ref().and_then(|r| r.name.clone()))
            .collect();
        if found.is_empty() { Err(format!("none yet; logs:\n{}", op.logs())) } else { Ok(found) }
    })
    .await;
    assert_eq!(bypassed, ["by-number"]);
    metric_becomes(&op, "sluice_services_bypassing_sidecar", 1.0, "the gauge counts it").await;
    services.delete("by-number", &DeleteParams::default()).await.expect("delete");
    metric_becomes(&op, "sluice_services_bypassing_sidecar", 0.0, "the gauge drops").await;
}
