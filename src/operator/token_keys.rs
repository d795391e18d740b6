//! The keys hold tokens are signed with ([`crate::engine::hold`]), shared by every replica
//! through one Secret, so a sidecar may settle at any replica what another admitted.
//!
//! The first replica to start creates the Secret with one random key (256 bits); every replica
//! reads it before it serves and re-reads it every [`RELOAD_INTERVAL`]. Its `keys` field holds one
//! key per line: the first signs, each verifies. To rotate, put a new key on the second line and
//! wait a reload, move it first and wait another, then remove the old one once the longest
//! `reservationTtl` of the policies has passed (its tokens are then all settled or run out).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::watch;

use super::Error;
use crate::engine::Engine;
use crate::engine::hold::TokenKeys;
use crate::store::Store;

/// The Secret's field that holds the keys.
pub const KEYS_FIELD: &str = "keys";
/// How often every replica re-reads the Secret.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(15);

/// The Secret's keys, creating the Secret with a random key when it does not exist yet.
pub async fn shared(client: &Client, namespace: &str, name: &str) -> Result<TokenKeys, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    if let Some(secret) = api.get_opt(name).await? {
        return parse(&secret, name);
    }
    let secret: [u8; 32] = rand::random();
    let text = format!("{}\n", base64::engine::general_purpose::STANDARD.encode(secret));
    let created = Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.to_string()), ..Default::default() },
        data: Some(BTreeMap::from([(KEYS_FIELD.to_string(), ByteString(text.into_bytes()))])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &created).await {
        Ok(secret) => {
            tracing::info!(secret = name, "generated the key hold tokens are signed with");
            parse(&secret, name)
        }
        // Another replica created it first: use theirs.
        Err(kube::Error::Api(e)) if e.code == 409 => parse(&api.get(name).await?, name),
        Err(e) => Err(e.into()),
    }
}

fn parse(secret: &Secret, name: &str) -> Result<TokenKeys, Error> {
    let text = secret
        .data
        .as_ref()
        .and_then(|data| data.get(KEYS_FIELD))
        .map(|bytes| String::from_utf8_lossy(&bytes.0).into_owned())
        .ok_or_else(|| Error::IncompleteSecret(name.to_string(), KEYS_FIELD))?;
    TokenKeys::parse(&text).map_err(|error| Error::TokenKeys(name.to_string(), error))
}

/// Reads (or creates) the Secret and installs its keys in `engine`; says why when it cannot (the
/// keys in force stay: until a first read succeeds, this replica's own random key, so a settle
/// sent to another replica is refused and its holds run out by themselves).
pub async fn install<S: Store>(client: &Client, namespace: &str, name: &str, engine: &Engine<S>, first: bool) -> bool {
    match shared(client, namespace, name).await {
        Ok(keys) => {
            engine.set_token_keys(keys);
            true
        }
        Err(error) if first => {
            tracing::error!(
                secret = name,
                %error,
                "cannot read or create the hold token keys: this replica signs with a key of its own, so settles sent to other replicas are refused until it can"
            );
            false
        }
        Err(error) => {
            tracing::warn!(secret = name, %error, "could not re-read the hold token keys; the last ones stay in force");
            false
        }
    }
}

/// Re-reads the Secret every [`RELOAD_INTERVAL`] until `stop` flips (`read_once`: the first read
/// at start succeeded).
pub async fn follow<S: Store>(
    client: Client,
    namespace: String,
    name: String,
    engine: Arc<Engine<S>>,
    mut read_once: bool,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
            _ = stop.changed() => return,
        }
        read_once |= install(&client, &namespace, &name, &engine, !read_once).await;
    }
}
