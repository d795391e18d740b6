use super::*;

fn config() -> InjectConfig {
    InjectConfig {
        image: "sluice:test".into(),
        endpoint: "http://sluice:8080".into(),
        listen_port: 15080,
        upstream_port: 8080,
        admin_port: 15081,
        resources: Resources {
            cpu_request: Some("50m".into()),
            cpu_limit: None,
            memory_request: Some("64Mi".into()),
            memory_limit: Some("256Mi".into()),
        },
        operator_namespace: "sluice-system".into(),
        token_audience: Some("sluice".into()),
        endpoint_ca_pem: Some("-----BEGIN CERTIFICATE-----\n".into()),
        traffic: TrafficDefaults::default(),
        sidecar_kind: SidecarKind::Classic,
    }
}

fn native_config() -> InjectConfig {
    InjectConfig { sidecar_kind: SidecarKind::Native, ..config() }
}

fn pod(labelled: bool, extra: serde_json::Value) -> Pod {
    let mut value = serde_json::json!({
        "metadata": {"name": "p", "labels": {"app": "a"}},
        "spec": {"containers": [{"name": "app", "image": "app"}]}
    });
    if labelled {
        value["metadata"]["labels"][INJECT_LABEL] = "true".into();
    }
    json_patch::merge(&mut value, &extra);
    serde_json::from_value(value).expect("pod")
}

fn annotated(annotations: serde_json::Value) -> Pod {
    pod(true, serde_json::json!({"metadata": {"annotations": annotations}}))
}

fn apply(pod: &Pod, patch: &Patch) -> Pod {
    let mut value = serde_json::to_value(pod).expect("json");
    json_patch::patch(&mut value, patch).expect("patch applies");
    serde_json::from_value(value).expect("pod")
}

/// The injected pod and its sidecar container (classic, the cluster default of [`config`]).
fn inject(pod: &Pod) -> (Pod, Container, Vec<String>) {
    inject_with(pod, &config())
}

/// The injected pod and its sidecar container, native or classic.
fn inject_with(pod: &Pod, config: &InjectConfig) -> (Pod, Container, Vec<String>) {
    let injection = patch(pod, "tenant", config);
    assert_eq!(injection.outcome, PodOutcome::Injected);
    let injected = apply(pod, injection.patch.as_ref().expect("patch"));
    let spec = injected.spec.as_ref().expect("spec");
    let sidecar =
        spec.containers.iter().chain(spec.init_containers.iter().flatten()).find(|c| c.name == CONTAINER_NAME);
    let sidecar = sidecar.cloned().expect("sidecar");
    (injected, sidecar, injection.warnings)
}

fn init_names(pod: &Pod) -> Vec<String> {
    pod.spec.iter().flat_map(|s| s.init_containers.iter().flatten()).map(|c| c.name.clone()).collect()
}

fn container_names(pod: &Pod) -> Vec<String> {
    pod.spec.iter().flat_map(|s| s.containers.iter()).map(|c| c.name.clone()).collect()
}

fn kind_annotation(pod: &Pod) -> Option<String> {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(SIDECAR_KIND_ANNOTATION)).cloned()
}

#[test]
fn a_classic_sidecar_is_a_container_next_to_the_app() {
    let (injected, sidecar, warnings) = inject(&web_pod(serde_json::json!({})));
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
    assert!(init_names(&injected).is_empty());
    assert_eq!((sidecar.restart_policy, sidecar.startup_probe), (None, None), "as before native sidecars");
    assert_eq!(kind_annotation(&injected).as_deref(), Some("classic"));
}

#[test]
fn a_native_sidecar_is_a_restartable_init_container_with_a_startup_probe() {
    let (classic_pod, classic, _) = inject(&web_pod(serde_json::json!({})));
    let (injected, native, warnings) = inject_with(&web_pod(serde_json::json!({})), &native_config());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(container_names(&injected), ["app"]);
    assert_eq!(init_names(&injected), [CONTAINER_NAME]);
    assert_eq!(native.restart_policy.as_deref(), Some("Always"));
    // The kubelet starts what follows once this passes: the proxy's listener is bound then.
    let startup = native.startup_probe.clone().expect("startupProbe");
    let get = startup.http_get.clone().expect("httpGet");
    assert_eq!((get.path.as_deref(), get.port), (Some("/healthz"), IntOrString::Int(15081)));
    assert_eq!((startup.period_seconds, startup.failure_threshold), (Some(1), Some(NATIVE_STARTUP_FAILURES)));
    // Everything else is the classic container's: ports, probes, resources, securityContext, env.
    let same = Container { restart_policy: None, startup_probe: None, ..native.clone() };
    assert_eq!(same, classic);
    assert!(native.liveness_probe.is_some() && native.readiness_probe.is_some());
    // The app's side is the same too: its port's name taken over, its probes moved.
    assert_eq!(
        injected.spec.as_ref().expect("spec").containers,
        classic_pod.spec.as_ref().expect("spec").containers[..1]
    );
    assert_eq!(kind_annotation(&injected).as_deref(), Some("native"));
    // Injected once: a second admission finds it among the init containers.
    assert_eq!(super::patch(&injected, "tenant", &native_config()).outcome, PodOutcome::Skipped);
    assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped);
}

#[test]
fn a_native_sidecar_goes_after_the_redirect_and_before_the_pods_own_init_containers() {
    let with_init = |annotations: serde_json::Value| {
        let mut value = serde_json::to_value(web_pod(annotations)).expect("json");
        value["spec"]["initContainers"] =
            serde_json::json!([{"name": "migrate", "image": "app"}, {"name": "seed", "image": "app"}]);
        serde_json::from_value::<Pod>(value).expect("pod")
    };
    let iptables = serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"});
    let cases = [
        (web_pod(serde_json::json!({})), vec![CONTAINER_NAME]),
        (web_pod(iptables.clone()), vec![traffic::INIT_CONTAINER_NAME, CONTAINER_NAME]),
        (with_init(serde_json::json!({})), vec![CONTAINER_NAME, "migrate", "seed"]),
        (with_init(iptables), vec![traffic::INIT_CONTAINER_NAME, CONTAINER_NAME, "migrate", "seed"]),
    ];
    for (pod, order) in cases {
        let (injected, _, warnings) = inject_with(&pod, &native_config());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(init_names(&injected), order);
        let spec = injected.spec.as_ref().expect("spec");
        for init in spec.init_containers.iter().flatten() {
            // Only the sidecar keeps running; the redirect and the pod's own run to completion.
            let restartable = init.restart_policy.as_deref() == Some("Always");
            assert_eq!(restartable, init.name == CONTAINER_NAME, "{}", init.name);
        }
        assert_eq!(container_names(&injected), ["app"]);
    }
    // Classic with the redirect: the init container alone, still first.
    let (injected, _, _) = inject(&with_init(serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"})));
    assert_eq!(init_names(&injected), [traffic::INIT_CONTAINER_NAME, "migrate", "seed"]);
    assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
}

#[test]
fn the_pods_annotation_overrides_the_cluster_kind_both_ways() {
    let native = annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "native"}));
    let (injected, sidecar, warnings) = inject_with(&native, &config());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        (init_names(&injected), sidecar.restart_policy.as_deref()),
        (vec![CONTAINER_NAME.to_string()], Some("Always"))
    );
    let classic = annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "classic"}));
    let (injected, sidecar, warnings) = inject_with(&classic, &native_config());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(container_names(&injected), ["app", CONTAINER_NAME]);
    assert_eq!((init_names(&injected).len(), sidecar.restart_policy), (0, None));
    assert_eq!(kind_annotation(&injected).as_deref(), Some("classic"));
}

#[test]
fn an_unknown_kind_is_warned_about_and_the_cluster_kind_used() {
    for (config, expected) in [(native_config(), "native"), (config(), "classic")] {
        let (injected, _, warnings) =
            inject_with(&annotated(serde_json::json!({SIDECAR_KIND_ANNOTATION: "sidecar"})), &config);
        assert_eq!(
            warnings,
            [format!("{SIDECAR_KIND_ANNOTATION}: \"sidecar\" is not native or classic; using {expected}")]
        );
        assert_eq!(kind_annotation(&injected).as_deref(), Some(expected));
    }
}

#[test]
fn a_native_sidecar_of_the_pods_own_is_only_stamped() {
    let original = pod(
        true,
        serde_json::json!({"spec": {"initContainers": [{"name": CONTAINER_NAME, "image": "mine:2", "restartPolicy": "Always"}]}}),
    );
    let injection = patch(&original, "tenant", &native_config());
    assert_eq!(injection.outcome, PodOutcome::Annotated);
    let stamped = apply(&original, injection.patch.as_ref().expect("patch"));
    assert_eq!(
        (container_names(&stamped), init_names(&stamped)),
        (vec!["app".to_string()], vec![CONTAINER_NAME.to_string()])
    );
    let annotations = stamped.metadata.annotations.expect("annotations");
    assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("mine:2"));
}

#[test]
fn a_native_sidecar_clashes_with_the_pods_init_containers_ports() {
    let original = pod(
        true,
        serde_json::json!({"spec": {"initContainers": [{"name": "warm", "image": "app", "ports": [{"containerPort": 15080}]}]}}),
    );
    let (_, _, warnings) = inject_with(&original, &native_config());
    assert!(warnings.len() == 1 && warnings[0].contains("container warm already uses port 15080"), "{warnings:?}");
    // A classic sidecar starts after the init containers are done.
    let (_, _, warnings) = inject(&original);
    assert!(warnings.is_empty(), "{warnings:?}");
}

fn env_value(c: &Container, name: &str) -> Option<String> {
    c.env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone())
}

fn quantities(map: &Option<BTreeMap<String, Quantity>>) -> Vec<(String, String)> {
    map.iter().flatten().map(|(k, v)| (k.clone(), v.0.clone())).collect()
}

#[test]
fn labelled_pod_gets_the_sidecar_once() {
    let original = pod(true, serde_json::json!({"metadata": {"annotations": {UPSTREAM_PORT_ANNOTATION: "9000"}}}));
    let (injected, sidecar, warnings) = inject(&original);
    assert!(warnings.is_empty(), "{warnings:?}");
    let spec = injected.spec.as_ref().expect("spec");
    assert_eq!(env_value(&sidecar, "SLUICE_UPSTREAM").as_deref(), Some("http://127.0.0.1:9000"));
    assert!(spec.volumes.as_ref().is_some_and(|v| v.iter().any(|v| v.name == PODINFO_VOLUME)));
    let token = spec.volumes.as_ref().and_then(|v| v.iter().find(|v| v.name == TOKEN_VOLUME)).expect("token");
    let projection = token.projected.as_ref().and_then(|p| p.sources.as_ref()).expect("projected");
    let sa = projection[0].service_account_token.as_ref().expect("service account token");
    assert_eq!((sa.audience.as_deref(), sa.expiration_seconds), (Some("sluice"), Some(TOKEN_LIFETIME_SECONDS)));
    assert_eq!(env_value(&sidecar, "SLUICE_TOKEN_FILE").as_deref(), Some("/var/run/secrets/sluice/token"));
    // Stamped, so a labelled pod without the stamp is known to have slipped past the webhook.
    let annotations = injected.metadata.annotations.as_ref().expect("annotations");
    assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("sluice:test"));
    assert_eq!(annotations.get(UPSTREAM_PORT_ANNOTATION).map(String::as_str), Some("9000"), "kept");
    // Idempotent: a second pass over the injected pod changes nothing.
    assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped);
}

#[test]
fn the_sidecar_passes_pod_security_restricted() {
    let (_, sidecar, _) = inject(&pod(true, serde_json::json!({})));
    let sc = sidecar.security_context.expect("securityContext");
    assert_eq!(sc.run_as_non_root, Some(true));
    assert!(sc.run_as_user.is_some_and(|u| u != 0), "non-root user");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]));
    assert_eq!(sc.seccomp_profile.map(|p| p.type_).as_deref(), Some("RuntimeDefault"));
}

#[test]
fn the_sidecar_has_default_resources_and_probes_on_its_admin_port() {
    let (_, sidecar, _) = inject(&pod(true, serde_json::json!({})));
    let resources = sidecar.resources.clone().expect("resources");
    assert_eq!(quantities(&resources.requests), [("cpu".into(), "50m".into()), ("memory".into(), "64Mi".into())]);
    assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
    assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:15081"));
    for (probe, path) in [(&sidecar.liveness_probe, "/healthz"), (&sidecar.readiness_probe, "/readyz")] {
        let get = probe.as_ref().and_then(|p| p.http_get.clone()).expect("httpGet probe");
        assert_eq!((get.path.as_deref(), get.port), (Some(path), IntOrString::Int(15081)));
    }
    let ports: Vec<_> = sidecar.ports.iter().flatten().map(|p| (p.name.clone(), p.container_port)).collect();
    assert_eq!(ports, [(Some("sluice-http".into()), 15080), (Some("sluice-admin".into()), 15081)]);
}

#[test]
fn annotations_override_ports_and_resources() {
    let original = annotated(serde_json::json!({
        ADMIN_PORT_ANNOTATION: "19000", LISTEN_PORT_ANNOTATION: "19001",
        CPU_REQUEST_ANNOTATION: "0.25", CPU_LIMIT_ANNOTATION: "1", MEMORY_REQUEST_ANNOTATION: "100M",
        MEMORY_LIMIT_ANNOTATION: "1Gi",
    }));
    let (_, sidecar, warnings) = inject(&original);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:19000"));
    assert_eq!(env_value(&sidecar, "SLUICE_LISTEN").as_deref(), Some("0.0.0.0:19001"));
    let get = sidecar.readiness_probe.and_then(|p| p.http_get).expect("probe");
    assert_eq!(get.port, IntOrString::Int(19000));
    let resources = sidecar.resources.expect("resources");
    assert_eq!(quantities(&resources.requests), [("cpu".into(), "0.25".into()), ("memory".into(), "100M".into())]);
    assert_eq!(quantities(&resources.limits), [("cpu".into(), "1".into()), ("memory".into(), "1Gi".into())]);
}

#[test]
fn bad_annotations_fall_back_to_the_defaults_with_warnings() {
    let original = annotated(serde_json::json!({
        ADMIN_PORT_ANNOTATION: "70000", CPU_REQUEST_ANNOTATION: "lots", MEMORY_LIMIT_ANNOTATION: "-1Gi",
    }));
    let (_, sidecar, warnings) = inject(&original);
    assert_eq!(env_value(&sidecar, "SLUICE_ADMIN_LISTEN").as_deref(), Some("0.0.0.0:15081"));
    let resources = sidecar.resources.expect("resources");
    assert_eq!(quantities(&resources.requests), [("cpu".into(), "50m".into()), ("memory".into(), "64Mi".into())]);
    assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(warnings[0].contains(ADMIN_PORT_ANNOTATION) && warnings[0].contains("using 15081"), "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains(CPU_REQUEST_ANNOTATION) && w.contains("\"lots\"")));
    assert!(warnings.iter().any(|w| w.contains(MEMORY_LIMIT_ANNOTATION) && w.contains("using 256Mi")));
}

#[test]
fn a_request_above_its_limit_never_reaches_the_api_server() {
    // Only the request annotated, above the default limit: the request falls back.
    let (_, sidecar, warnings) = inject(&annotated(serde_json::json!({MEMORY_REQUEST_ANNOTATION: "1Gi"})));
    let resources = sidecar.resources.expect("resources");
    assert_eq!(quantities(&resources.requests)[1], ("memory".into(), "64Mi".into()));
    assert_eq!(quantities(&resources.limits), [("memory".to_string(), "256Mi".to_string())]);
    assert!(warnings.len() == 1 && warnings[0].contains("above its limit"), "{warnings:?}");
    // Only the limit annotated, below the default request: the limit falls back.
    let (_, sidecar, _) = inject(&annotated(serde_json::json!({MEMORY_LIMIT_ANNOTATION: "10Mi"})));
    assert_eq!(quantities(&sidecar.resources.expect("resources").limits), [("memory".into(), "256Mi".into())]);
    // Both annotated and inconsistent: both fall back.
    let (_, sidecar, _) =
        inject(&annotated(serde_json::json!({CPU_REQUEST_ANNOTATION: "2", CPU_LIMIT_ANNOTATION: "500m"})));
    let resources = sidecar.resources.expect("resources");
    assert_eq!(quantities(&resources.requests)[0], ("cpu".into(), "50m".into()));
    assert!(quantities(&resources.limits).iter().all(|(k, _)| k != "cpu"));
    // Equal values in different notations are consistent.
    let (_, _, warnings) =
        inject(&annotated(serde_json::json!({MEMORY_REQUEST_ANNOTATION: "1Gi", MEMORY_LIMIT_ANNOTATION: "1024Mi"})));
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn port_clashes_are_warned_about() {
    let original = pod(
        true,
        serde_json::json!({"spec": {"containers": [{"name": "app", "image": "app", "ports": [{"containerPort": 15081}]}]}}),
    );
    let (_, _, warnings) = inject(&original);
    assert!(warnings.len() == 1 && warnings[0].contains("container app already uses port 15081"), "{warnings:?}");
    let (_, _, warnings) = inject(&annotated(serde_json::json!({LISTEN_PORT_ANNOTATION: "15081"})));
    assert!(warnings.iter().any(|w| w.contains("will not start")), "{warnings:?}");
}

#[test]
fn a_pod_with_a_sidecar_of_its_own_is_only_stamped() {
    let original = pod(
        true,
        serde_json::json!({"spec": {"containers": [{"name": "app", "image": "app"}, {"name": CONTAINER_NAME, "image": "mine:1"}]}}),
    );
    let injection = patch(&original, "tenant", &config());
    assert_eq!(injection.outcome, PodOutcome::Annotated);
    let stamped = apply(&original, injection.patch.as_ref().expect("patch"));
    assert_eq!(stamped.spec.as_ref().expect("spec").containers.len(), 2);
    let annotations = stamped.metadata.annotations.expect("annotations");
    assert_eq!(annotations.get(INJECTED_ANNOTATION).map(String::as_str), Some("mine:1"));
}

#[test]
fn unlabelled_and_operator_namespace_pods_are_untouched() {
    assert!(patch(&pod(false, serde_json::json!({})), "tenant", &config()).patch.is_none());
    assert!(patch(&pod(true, serde_json::json!({})), "sluice-system", &config()).patch.is_none());
}

#[test]
fn existing_volumes_are_kept() {
    let original = pod(true, serde_json::json!({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}}));
    let (injected, _, _) = inject(&original);
    let names: Vec<_> = injected.spec.expect("spec").volumes.expect("volumes").into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["data", PODINFO_VOLUME, TOKEN_VOLUME]);
}

fn web_pod(annotations: serde_json::Value) -> Pod {
    pod(
        true,
        serde_json::json!({
            "metadata": {"annotations": annotations},
            "spec": {"containers": [{
                "name": "app", "image": "app",
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}}
            }]}
        }),
    )
}

#[test]
fn service_mode_hands_the_ports_name_to_the_sidecar() {
    let (injected, sidecar, warnings) = inject(&web_pod(serde_json::json!({})));
    assert!(warnings.is_empty(), "{warnings:?}");
    let spec = injected.spec.as_ref().expect("spec");
    let app = &spec.containers[0];
    let app_port = &app.ports.as_ref().expect("ports")[0];
    assert_eq!((app_port.name.as_deref(), app_port.container_port), (None, 8080), "the app's port lost its name");
    let ports: Vec<_> = sidecar.ports.iter().flatten().map(|p| (p.name.clone(), p.container_port)).collect();
    assert_eq!(ports[0], (Some("http".into()), 15080), "targetPort: http now reaches the sidecar");
    let probe = app.readiness_probe.as_ref().and_then(|p| p.http_get.clone()).expect("probe");
    assert_eq!((probe.path.as_deref(), probe.port), (Some("/app-health/app/readyz"), IntOrString::Int(15081)));
    let probes = env_value(&sidecar, "SLUICE_APP_PROBES").expect("the sidecar knows the probe");
    let probes = crate::sidecar::probes::parse(&probes).expect("valid");
    assert_eq!(probes["/app-health/app/readyz"].port, 8080);
    assert!(spec.init_containers.is_none(), "no privilege in service mode");
    let annotations = injected.metadata.annotations.as_ref().expect("annotations");
    assert_eq!(annotations.get(traffic::REDIRECT_ANNOTATION).map(String::as_str), Some("service"));
    assert_eq!(annotations.get(traffic::GUARDED_PORTS_ANNOTATION).map(String::as_str), Some("8080"));
    let labels = injected.metadata.labels.as_ref().expect("labels");
    assert_eq!(labels.get(traffic::INGRESS_PORTS_LABEL).map(String::as_str), Some("15080.15081"));
    assert_eq!(super::patch(&injected, "tenant", &config()).outcome, PodOutcome::Skipped, "once");
}

#[test]
fn iptables_mode_adds_a_narrow_init_container_first() {
    let original = web_pod(serde_json::json!({traffic::REDIRECT_ANNOTATION: "iptables"}));
    let mut with_init = serde_json::to_value(&original).expect("json");
    with_init["spec"]["initContainers"] = serde_json::json!([{"name": "migrate", "image": "app"}]);
    let with_init: Pod = serde_json::from_value(with_init).expect("pod");
    for pod in [original, with_init] {
        let (injected, sidecar, warnings) = inject(&pod);
        assert!(warnings.is_empty(), "{warnings:?}");
        let spec = injected.spec.as_ref().expect("spec");
        let init = &spec.init_containers.as_ref().expect("init containers")[0];
        assert_eq!(init.name, traffic::INIT_CONTAINER_NAME);
        assert_eq!(env_value(init, "SLUICE_REDIRECT_PORTS").as_deref(), Some("8080"));
        assert_eq!(env_value(init, "SLUICE_REDIRECT_TO_PORT").as_deref(), Some("15080"));
        let sc = init.security_context.as_ref().expect("securityContext");
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert_eq!(caps.add.as_deref(), Some(&["NET_ADMIN".to_string(), "NET_RAW".to_string()][..]));
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
        assert_eq!(
            (sc.privileged, sc.allow_privilege_escalation, sc.read_only_root_filesystem),
            (Some(false), Some(false), Some(true))
        );
        assert!(spec.volumes.iter().flatten().any(|v| v.name == traffic::XTABLES_VOLUME));
        assert_eq!(spec.containers[0].ports.as_ref().expect("ports")[0].name.as_deref(), Some("http"), "name kept");
        assert_eq!(env_value(&sidecar, "SLUICE_INBOUND_PORTS").as_deref(), Some("8080"));
        let labels = injected.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels.get(traffic::INGRESS_PORTS_LABEL).map(String::as_str), Some("8080.15080.15081"));
        // The sidecar and the app get no capability.
        assert_eq!(sidecar.security_context.and_then(|s| s.capabilities).and_then(|c| c.add), None);
    }
}

#[test]
fn quantities_parse_as_the_api_server_reads_them() {
    let q = |s| quantity_nanos(s);
    assert_eq!(q("1"), Some(1_000_000_000));
    assert_eq!(q("100m"), Some(100_000_000));
    assert_eq!(q("0.1"), q("100m"));
    assert_eq!(q("1Ki"), Some(1024 * 1_000_000_000));
    assert_eq!(q("1Gi"), q("1024Mi"));
    assert_eq!(q("1e3"), q("1k"));
    assert_eq!(q("1E"), Some(10u128.pow(27)));
    assert_eq!(q("1n"), Some(1));
    assert_eq!(q("0.1n"), Some(1), "rounded up to nano precision");
    assert_eq!(q(".5"), Some(500_000_000));
    assert_eq!(q("+2"), q("2"));
    for bad in ["", "abc", "-1", "1.2.3", "1Kb", "1 Gi", "Gi", ".", "1e", "1e+", "1ee3", "1e1000"] {
        assert_eq!(q(bad), None, "{bad:?}");
    }
    assert!(
        Resources { memory_request: Some("2Gi".into()), memory_limit: Some("1Gi".into()), ..Default::default() }
            .check()
            .is_err()
    );
    assert!(Resources { cpu_request: Some("x".into()), ..Default::default() }.check().is_err());
    assert!(config().resources.check().is_ok());
}
