//! Webhook serving certificates: generated at startup (rcgen) unless the shared Secret already
//! holds a pair, so every replica serves a certificate the one caBundle vouches for.

use std::collections::BTreeMap;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use super::Error;

pub const CA_KEY: &str = "ca.crt";
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keypair {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A fresh CA and a serving certificate for `hosts` (DNS names or IP addresses) signed by it.
pub fn generate(hosts: &[String]) -> Result<Keypair, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "sluice-webhook-ca");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    // rcgen turns names that parse as IP addresses into IP SANs.
    let mut leaf = CertificateParams::new(hosts.to_vec())?;
    leaf.distinguished_name.push(DnType::CommonName, hosts.first().map(String::as_str).unwrap_or("sluice-webhook"));
    let leaf_key = KeyPair::generate()?;
    let cert = leaf.signed_by(&leaf_key, &issuer)?;
    Ok(Keypair { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: leaf_key.serialize_pem() })
}

fn from_secret(secret: &Secret) -> Result<Keypair, Error> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let data = secret.data.clone().unwrap_or_default();
    let field = |key: &'static str| -> Result<String, Error> {
        data.get(key)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .ok_or_else(|| Error::IncompleteSecret(name.clone(), key))
    };
    Ok(Keypair { ca_pem: field(CA_KEY)?, cert_pem: field(CERT_KEY)?, key_pem: field(KEY_KEY)? })
}

/// The keypair in Secret `namespace/name`, creating it if absent. Replicas starting together race
/// to create it; the losers (409 Conflict) read the winner's, so all serve one pair.
pub async fn shared_keypair(client: &Client, namespace: &str, name: &str, hosts: &[String]) -> Result<Keypair, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    if let Some(existing) = api.get_opt(name).await? {
        return from_secret(&existing);
    }
    let generated = generate(hosts)?;
    let mut data = BTreeMap::new();
    data.insert(CA_KEY.to_string(), ByteString(generated.ca_pem.clone().into_bytes()));
    data.insert(CERT_KEY.to_string(), ByteString(generated.cert_pem.clone().into_bytes()));
    data.insert(KEY_KEY.to_string(), ByteString(generated.key_pem.clone().into_bytes()));
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.to_string()), ..Default::default() },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(data),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(generated),
        Err(kube::Error::Api(e)) if e.code == 409 => from_secret(&api.get(name).await?),
        Err(e) => Err(e.into()),
    }
}

/// Sets the caBundle of every webhook in the named configurations (an empty name skips one, for
/// clusters where cert-manager injects it). A missing configuration is only logged: the chart may
/// install it after the operator starts, and [`follow_secret`] patches it when it appears.
/// Configurations that already carry the bundle are not written again.
pub async fn patch_ca_bundles(client: &Client, validating: &str, mutating: &str, ca: &[u8]) -> Result<(), Error> {
    let bundle = ByteString(ca.to_vec());
    if !validating.is_empty() {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        match api.get_opt(validating).await? {
            Some(mut config) => {
                if config.webhooks.iter().flatten().any(|h| h.client_config.ca_bundle.as_ref() != Some(&bundle)) {
                    for hook in config.webhooks.iter_mut().flatten() {
                        hook.client_config.ca_bundle = Some(bundle.clone());
                    }
                    let patch = serde_json::json!({"webhooks": config.webhooks});
                    api.patch(validating, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                }
            }
            None => tracing::warn!(name = validating, "ValidatingWebhookConfiguration not found; caBundle not set"),
        }
    }
    if !mutating.is_empty() {
        let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        match api.get_opt(mutating).await? {
            Some(mut config) => {
                if config.webhooks.iter().flatten().any(|h| h.client_config.ca_bundle.as_ref() != Some(&bundle)) {
                    for hook in config.webhooks.iter_mut().flatten() {
                        hook.client_config.ca_bundle = Some(bundle.clone());
                    }
                    let patch = serde_json::json!({"webhooks": config.webhooks});
                    api.patch(mutating, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                }
            }
            None => tracing::warn!(name = mutating, "MutatingWebhookConfiguration not found; caBundle not set"),
        }
    }
    Ok(())
}

/// Follows the Secret and hot-swaps the served certificate when someone replaces it (rotation by
/// deleting the Secret and restarting one replica, or by cert tooling writing it), and keeps the
/// webhook configurations' caBundle in step (they may be created after the operator starts, as
/// Helm does; `ca_bundles` holds the validating and mutating configuration names, empty to skip).
pub async fn follow_secret(
    client: Client,
    namespace: String,
    name: String,
    mut current: Keypair,
    tls: RustlsConfig,
    ca_bundles: (String, String),
) {
    let api: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    // Rotation is rare and not latency-sensitive; a slow poll costs a few GETs per interval.
    let mut ticker = tokio::time::interval(Duration::from_secs(15));
    ticker.tick().await;
    loop {
        ticker.tick().await;
        if let Err(error) = patch_ca_bundles(&client, &ca_bundles.0, &ca_bundles.1, current.ca_pem.as_bytes()).await {
            tracing::warn!(%error, "cannot keep the webhook configurations' caBundle current");
        }
        let Ok(Some(secret)) = api.get_opt(&name).await else { continue };
        let Ok(pair) = from_secret(&secret) else { continue };
        if pair != current {
            match tls.reload_from_pem(pair.cert_pem.clone().into_bytes(), pair.key_pem.clone().into_bytes()).await {
                Ok(()) => {
                    tracing::info!("webhook certificate reloaded from the Secret");
                    current = pair;
                }
                Err(error) => tracing::warn!(%error, "cannot load the webhook certificate from the Secret"),
            }
        }
    }
}
