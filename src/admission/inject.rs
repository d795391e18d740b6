//! Sidecar injection for pods labelled `sluice.dev/inject: "true"`, as a pure function from the
//! pod to a JSON patch.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, DownwardAPIVolumeFile, DownwardAPIVolumeSource, EnvVar, EnvVarSource,
    ObjectFieldSelector, Pod, ProjectedVolumeSource, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};

pub const INJECT_LABEL: &str = "sluice.dev/inject";
pub const LISTEN_PORT_ANNOTATION: &str = "sluice.dev/listen-port";
pub const UPSTREAM_PORT_ANNOTATION: &str = "sluice.dev/upstream-port";
pub const CONTAINER_NAME: &str = "sluice-sidecar";
pub const PODINFO_VOLUME: &str = "sluice-podinfo";
/// Where the sidecar reads its pod's labels (downward API file, updated when labels change).
pub const PODINFO_PATH: &str = "/etc/sluice/podinfo";
pub const TOKEN_VOLUME: &str = "sluice-token";
/// Where the sidecar reads its projected ServiceAccount token (rotated by the kubelet).
pub const TOKEN_DIR: &str = "/var/run/secrets/sluice";
/// Lifetime asked for the projected token; the kubelet renews it at 80% of that.
pub const TOKEN_LIFETIME_SECONDS: i64 = 3600;

#[derive(Debug, Clone)]
pub struct InjectConfig {
    pub image: String,
    pub endpoint: String,
    pub listen_port: u16,
    pub upstream_port: u16,
    /// Never injected: the operator must not depend on itself to start.
    pub operator_namespace: String,
    /// With the endpoint verifying ServiceAccount tokens: the audience of the projected token the
    /// sidecar presents.
    pub token_audience: Option<String>,
    /// With the check API on TLS: the CA the sidecar verifies the endpoint against (PEM).
    pub endpoint_ca_pem: Option<String>,
}

fn port_annotation(pod: &Pod, name: &str, default: u16) -> u16 {
    pod.metadata.annotations.as_ref().and_then(|a| a.get(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() }
}

/// The patch that injects the sidecar, or None when the pod must be left alone: not labelled, in
/// the operator's namespace, or already injected (admission may run twice on one pod).
pub fn patch(pod: &Pod, namespace: &str, config: &InjectConfig) -> Option<Patch> {
    let labelled = pod.metadata.labels.as_ref().and_then(|l| l.get(INJECT_LABEL)).is_some_and(|v| v == "true");
    if !labelled || namespace == config.operator_namespace {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    if spec.containers.iter().any(|c| c.name == CONTAINER_NAME) {
        return None;
    }
    let listen = port_annotation(pod, LISTEN_PORT_ANNOTATION, config.listen_port);
    let upstream = port_annotation(pod, UPSTREAM_PORT_ANNOTATION, config.upstream_port);
    let mut env_vars = vec![
        env("SLUICE_ENDPOINT", &config.endpoint),
        env("SLUICE_LISTEN", &format!("0.0.0.0:{listen}")),
        env("SLUICE_UPSTREAM", &format!("http://127.0.0.1:{upstream}")),
        env("SLUICE_LABELS_FILE", &format!("{PODINFO_PATH}/labels")),
        EnvVar {
            name: "SLUICE_NAMESPACE".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector { field_path: "metadata.namespace".into(), ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    let mut mounts = vec![VolumeMount {
        name: PODINFO_VOLUME.into(),
        mount_path: PODINFO_PATH.into(),
        read_only: Some(true),
        ..Default::default()
    }];
    let mut volumes = vec![Volume {
        name: PODINFO_VOLUME.into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "labels".into(),
                field_ref: Some(ObjectFieldSelector { field_path: "metadata.labels".into(), ..Default::default() }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }];
    if let Some(ca) = &config.endpoint_ca_pem {
        env_vars.push(env("SLUICE_ENDPOINT_CA_PEM", ca));
    }
    if let Some(audience) = &config.token_audience {
        // The pod's own ServiceAccount, bound to Sluice's audience and short-lived: it proves the
        // sidecar's namespace to the endpoint and is useless against the API server.
        env_vars.push(env("SLUICE_TOKEN_FILE", &format!("{TOKEN_DIR}/token")));
        mounts.push(VolumeMount {
            name: TOKEN_VOLUME.into(),
            mount_path: TOKEN_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        });
        volumes.push(Volume {
            name: TOKEN_VOLUME.into(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some(audience.clone()),
                        expiration_seconds: Some(TOKEN_LIFETIME_SECONDS),
                        path: "token".into(),
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(config.image.clone()),
        args: Some(vec!["sidecar".into()]),
        ports: Some(vec![ContainerPort {
            name: Some("sluice-http".into()),
            container_port: i32::from(listen),
            ..Default::default()
        }]),
        env: Some(env_vars),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    let mut ops = vec![PatchOperation::Add(AddOperation {
        path: PointerBuf::from_tokens(["spec", "containers", "-"]),
        value: serde_json::to_value(container).ok()?,
    })];
    // A projected ServiceAccount token needs a named ServiceAccount. The API server's
    // ServiceAccount admission plugin names `default` before webhooks run; where it is off, say
    // what it would have.
    if config.token_audience.is_some() && spec.service_account_name.as_deref().is_none_or(str::is_empty) {
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["spec", "serviceAccountName"]),
            value: serde_json::Value::String("default".into()),
        }));
    }
    // JSON patch cannot append to an array that does not exist: create it when absent.
    match &spec.volumes {
        Some(v) if !v.is_empty() => {
            for volume in volumes {
                ops.push(PatchOperation::Add(AddOperation {
                    path: PointerBuf::from_tokens(["spec", "volumes", "-"]),
                    value: serde_json::to_value(volume).ok()?,
                }));
            }
        }
        _ => ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["spec", "volumes"]),
            value: serde_json::to_value(volumes).ok()?,
        })),
    }
    Some(Patch(ops))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> InjectConfig {
        InjectConfig {
            image: "sluice:test".into(),
            endpoint: "http://sluice:8080".into(),
            listen_port: 15080,
            upstream_port: 8080,
            operator_namespace: "sluice-system".into(),
            token_audience: Some("sluice".into()),
            endpoint_ca_pem: Some("-----BEGIN CERTIFICATE-----\n".into()),
        }
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

    fn apply(pod: &Pod, patch: &Patch) -> Pod {
        let mut value = serde_json::to_value(pod).expect("json");
        json_patch::patch(&mut value, patch).expect("patch applies");
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn labelled_pod_gets_the_sidecar_once() {
        let original = pod(true, serde_json::json!({"metadata": {"annotations": {UPSTREAM_PORT_ANNOTATION: "9000"}}}));
        let patch = patch(&original, "tenant", &config()).expect("injected");
        let injected = apply(&original, &patch);
        let spec = injected.spec.as_ref().expect("spec");
        let sidecar = spec.containers.iter().find(|c| c.name == CONTAINER_NAME).expect("sidecar");
        let env = sidecar.env.as_ref().expect("env");
        assert!(env.iter().any(|e| e.name == "SLUICE_UPSTREAM" && e.value.as_deref() == Some("http://127.0.0.1:9000")));
        assert!(spec.volumes.as_ref().is_some_and(|v| v.iter().any(|v| v.name == PODINFO_VOLUME)));
        let token = spec.volumes.as_ref().and_then(|v| v.iter().find(|v| v.name == TOKEN_VOLUME)).expect("token");
        let projection = token.projected.as_ref().and_then(|p| p.sources.as_ref()).expect("projected");
        let sa = projection[0].service_account_token.as_ref().expect("service account token");
        assert_eq!((sa.audience.as_deref(), sa.expiration_seconds), (Some("sluice"), Some(TOKEN_LIFETIME_SECONDS)));
        assert!(
            env.iter()
                .any(|e| e.name == "SLUICE_TOKEN_FILE" && e.value.as_deref() == Some("/var/run/secrets/sluice/token"))
        );
        // Idempotent: a second pass over the injected pod changes nothing.
        assert!(super::patch(&injected, "tenant", &config()).is_none());
    }

    #[test]
    fn unlabelled_and_operator_namespace_pods_are_untouched() {
        assert!(patch(&pod(false, serde_json::json!({})), "tenant", &config()).is_none());
        assert!(patch(&pod(true, serde_json::json!({})), "sluice-system", &config()).is_none());
    }

    #[test]
    fn existing_volumes_are_kept() {
        let original = pod(true, serde_json::json!({"spec": {"volumes": [{"name": "data", "emptyDir": {}}]}}));
        let injected = apply(&original, &patch(&original, "tenant", &config()).expect("injected"));
        let names: Vec<_> =
            injected.spec.expect("spec").volumes.expect("volumes").into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["data", PODINFO_VOLUME, TOKEN_VOLUME]);
    }
}
