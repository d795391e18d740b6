//! Who is asking the enforcement endpoint, and what that caller may say.
//!
//! Callers present `X-Sluice-Authorization: Bearer <token>` (the client's own `Authorization`
//! belongs to the client: proxies forward it and rules may key on it). A verified token becomes
//! a [`Caller`]:
//!
//! - a **tenant** (a sidecar's ServiceAccount, or a static token bound to namespaces) may ask only
//!   about its own namespaces, may state its client's IP, and may not set a request's cost;
//! - a **gateway** (trusted explicitly by the platform team) may name any namespace, the cost and
//!   the client IP;
//! - with authentication off (`sluice serve` without `--tokens`) every caller is [`Caller::Open`]
//!   and trusted like a gateway.
//!
//! Verifiers ([`Authenticator`]) are tried in order: static tokens from a file
//! ([`StaticTokens`]), then, in the operator, the Kubernetes TokenReview API.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::HeaderMap;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::reload::SettledChange;
use crate::policy::DEFAULT_NAMESPACE;

/// The request header that carries the caller's credential.
pub use crate::request::headers::CREDENTIAL_HEADER as AUTHORIZATION_HEADER;
/// Static tokens shorter than this are refused: they would be guessable.
pub const MIN_STATIC_TOKEN_LEN: usize = 16;

/// A verified caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Authentication is off: trusted like a gateway.
    Open,
    /// A gateway serving many namespaces.
    Gateway { name: Arc<str> },
    /// A workload identity bound to namespaces (a ServiceAccount's is bound to its own).
    Tenant { name: Arc<str>, namespaces: Arc<[String]> },
}

impl Caller {
    /// Whether the caller may name any namespace, a request's cost and the client IP.
    pub fn is_trusted(&self) -> bool {
        matches!(self, Caller::Open | Caller::Gateway { .. })
    }

    /// Whether the caller may ask about `namespace`.
    pub fn may_use(&self, namespace: &str) -> bool {
        match self {
            Caller::Open | Caller::Gateway { .. } => true,
            Caller::Tenant { namespaces, .. } => namespaces.iter().any(|n| n == namespace),
        }
    }

    /// The namespace of a request that names none: a tenant's own when it has exactly one.
    pub fn default_namespace(&self) -> &str {
        match self {
            Caller::Tenant { namespaces, .. } if namespaces.len() == 1 => &namespaces[0],
            _ => DEFAULT_NAMESPACE,
        }
    }

    /// The namespace a request is about: the one it names, if the caller may use it, or the
    /// caller's own when it names none. A caller of several namespaces must name one: guessing
    /// `default` would decide (and spend) in a namespace it was never given.
    pub fn namespace_of<'a>(&'a self, requested: Option<&'a str>) -> Result<&'a str, Forbidden> {
        match requested {
            Some(namespace) => self.require_namespace(namespace).map(|()| namespace),
            None => match self {
                Caller::Tenant { namespaces, .. } if namespaces.len() != 1 => Err(Forbidden(format!(
                    "namespace: required: caller {} may ask about several namespaces ({})",
                    self.name(),
                    namespaces.join(", ")
                ))),
                _ => Ok(self.default_namespace()),
            },
        }
    }

    /// The namespaces the caller may see, or `None` for all of them.
    pub fn visible_namespaces(&self) -> Option<&[String]> {
        match self {
            Caller::Tenant { namespaces, .. } => Some(namespaces),
            _ => None,
        }
    }

    /// For messages and logs.
    pub fn name(&self) -> &str {
        match self {
            Caller::Open => "anonymous",
            Caller::Gateway { name } | Caller::Tenant { name, .. } => name,
        }
    }

    /// Refuses a request about `namespace` the caller may not use, naming both.
    pub fn require_namespace(&self, namespace: &str) -> Result<(), Forbidden> {
        if self.may_use(namespace) {
            return Ok(());
        }
        let allowed = self.visible_namespaces().map(|n| n.join(", ")).unwrap_or_default();
        Err(Forbidden(format!(
            "namespace {namespace:?}: caller {} may only ask about its own namespace ({allowed})",
            self.name()
        )))
    }
}

/// The caller is known but may not do what it asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("forbidden: {0}")]
pub struct Forbidden(pub String);

/// Why no caller could be established.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no credentials: send {AUTHORIZATION_HEADER}: Bearer <token>")]
    Missing,
    #[error("invalid credentials: {0}")]
    Invalid(String),
    /// The verifier could not be asked (the API server is away): not the caller's fault.
    #[error("cannot verify credentials now: {0}")]
    Unavailable(String),
}

pub type AuthFuture<'a> = Pin<Box<dyn Future<Output = Result<Option<Caller>, AuthError>> + Send + 'a>>;

/// Decides whom a bearer token belongs to.
pub trait Authenticator: Send + Sync + 'static {
    /// `Ok(None)` when this authenticator does not know the token (the next one may).
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a>;
}

/// The endpoint's authentication: off, or a list of verifiers tried in order.
#[derive(Clone, Default)]
pub struct Auth {
    verifiers: Vec<Arc<dyn Authenticator>>,
}

impl Auth {
    /// Every caller is [`Caller::Open`].
    pub fn off() -> Auth {
        Auth::default()
    }

    pub fn new(verifiers: Vec<Arc<dyn Authenticator>>) -> Auth {
        Auth { verifiers }
    }

    pub fn is_enabled(&self) -> bool {
        !self.verifiers.is_empty()
    }

    /// The caller of a request with these headers.
    pub async fn caller(&self, headers: &HeaderMap) -> Result<Caller, AuthError> {
        if self.verifiers.is_empty() {
            return Ok(Caller::Open);
        }
        let mut values = headers.get_all(AUTHORIZATION_HEADER).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return Err(if headers.contains_key(AUTHORIZATION_HEADER) {
                AuthError::Invalid(format!("{AUTHORIZATION_HEADER} sent more than once"))
            } else {
                AuthError::Missing
            });
        };
        let token = bearer_token(value.as_bytes())?;
        for verifier in &self.verifiers {
            if let Some(caller) = verifier.authenticate(token).await? {
                return Ok(caller);
            }
        }
        Err(AuthError::Invalid("unknown token".into()))
    }
}

/// The token of `Bearer <token>` (the scheme is case-insensitive, RFC 9110 §11.1).
fn bearer_token(value: &[u8]) -> Result<&str, AuthError> {
    let text = std::str::from_utf8(value).map_err(|_| AuthError::Invalid("not visible ASCII".into()))?.trim();
    let (scheme, token) = text.split_once(' ').unwrap_or((text, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Invalid(format!("{AUTHORIZATION_HEADER}: expected \"Bearer <token>\"")));
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(AuthError::Invalid(format!("{AUTHORIZATION_HEADER}: empty token")));
    }
    Ok(token)
}

/// SHA-256 of a token: how tokens are compared and cached, so no table holds them in clear.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The static token file (`sluice serve --tokens`, and gateway tokens in the operator).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TokenEntry {
    /// Who holds it, for logs and messages.
    name: String,
    /// The token itself, or
    #[serde(default)]
    token: Option<String>,
    /// its SHA-256 in hex (so the file need not hold the secret).
    #[serde(default)]
    sha256: Option<String>,
    /// Namespaces a tenant token may ask about.
    #[serde(default)]
    namespaces: Vec<String>,
    /// A gateway token: may name any namespace, the cost and the client IP.
    #[serde(default)]
    gateway: bool,
}

/// What a token file holds once checked: callers by token digest.
#[derive(Debug, Default)]
pub struct TokenTable {
    by_digest: HashMap<[u8; 32], Caller>,
}

impl TokenTable {
    /// Parses and checks a token file; every problem names the entry.
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let file: TokenFile = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        let mut by_digest = HashMap::new();
        for (i, entry) in file.tokens.into_iter().enumerate() {
            let at = format!("tokens[{i}]");
            if entry.name.trim().is_empty() {
                return Err(format!("{at}.name: required"));
            }
            let digest = match (&entry.token, &entry.sha256) {
                (Some(token), None) => {
                    if token.trim() != token || token.len() < MIN_STATIC_TOKEN_LEN {
                        return Err(format!(
                            "{at}.token: at least {MIN_STATIC_TOKEN_LEN} characters, no surrounding spaces"
                        ));
                    }
                    token_digest(token)
                }
                (None, Some(hex)) => parse_hex_digest(hex).ok_or_else(|| format!("{at}.sha256: 64 hex digits"))?,
                _ => return Err(format!("{at}: exactly one of token or sha256")),
            };
            let name: Arc<str> = entry.name.into();
            let caller = match (entry.gateway, entry.namespaces.is_empty()) {
                (true, true) => Caller::Gateway { name },
                (true, false) => return Err(format!("{at}: a gateway token may use every namespace; drop namespaces")),
                (false, true) => return Err(format!("{at}.namespaces: a tenant token needs at least one namespace")),
                (false, false) => {
                    if let Some(bad) = entry.namespaces.iter().find(|n| crate::policy::validate_dns_label(n).is_err()) {
                        return Err(format!("{at}.namespaces: {bad:?} is not a namespace name"));
                    }
                    Caller::Tenant { name, namespaces: entry.namespaces.into() }
                }
            };
            if by_digest.insert(digest, caller).is_some() {
                return Err(format!("{at}: the same token appears twice"));
            }
        }
        Ok(TokenTable { by_digest })
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The caller a static token names. A token shorter than [`MIN_STATIC_TOKEN_LEN`] names
    /// nobody, even when a `sha256` entry is the digest of one (the file cannot check what a
    /// digest was made from, so an empty or guessable token is refused here).
    pub fn lookup(&self, token: &str) -> Option<&Caller> {
        if token.len() < MIN_STATIC_TOKEN_LEN {
            return None;
        }
        self.by_digest.get(&token_digest(token))
    }
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim().as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// Static bearer tokens read from a file, reloaded when it changes (the last good table stays
/// in force when an edit is invalid, like policies).
pub struct StaticTokens {
    path: PathBuf,
    table: ArcSwap<TokenTable>,
    change: parking_lot::Mutex<SettledChange>,
}

#[derive(Debug, thiserror::Error)]
#[error("token file {path}: {message}")]
pub struct TokenFileError {
    pub path: PathBuf,
    pub message: String,
}

impl StaticTokens {
    /// Reads the file; a missing or invalid file is an error (start-up should fail on it).
    pub fn load(path: &Path) -> Result<StaticTokens, TokenFileError> {
        let (table, fingerprint) = read_table(path)?;
        Ok(StaticTokens {
            path: path.to_path_buf(),
            table: ArcSwap::from_pointee(table),
            change: parking_lot::Mutex::new(SettledChange::new(fingerprint)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn table(&self) -> Arc<TokenTable> {
        self.table.load_full()
    }

    /// Re-reads the file; once a change has stood still for one poll ([`SettledChange`]),
    /// `Ok(true)` when a new table went live. An invalid file keeps the current table.
    pub fn reload_if_changed(&self) -> Result<bool, TokenFileError> {
        let bytes = std::fs::read(&self.path)
            .map_err(|e| TokenFileError { path: self.path.clone(), message: e.to_string() })?;
        if !self.change.lock().poll(Sha256::digest(&bytes).to_vec()) {
            return Ok(false);
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| TokenFileError { path: self.path.clone(), message: "not UTF-8".into() })?;
        let table = TokenTable::parse(&text).map_err(|message| TokenFileError { path: self.path.clone(), message })?;
        self.table.store(Arc::new(table));
        Ok(true)
    }

    /// Polls the file every `interval` until `shutdown`.
    pub async fn watch(
        self: Arc<Self>,
        interval: std::time::Duration,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            let tokens = self.clone();
            match tokio::task::spawn_blocking(move || tokens.reload_if_changed()).await {
                Ok(Ok(true)) => {
                    tracing::info!(path = %self.path.display(), tokens = self.table().len(), "tokens reloaded")
                }
                Ok(Ok(false)) => {}
                Ok(Err(error)) => tracing::error!(%error, "token reload failed; keeping the last good tokens"),
                Err(join) => tracing::error!(%join, "token reload task failed"),
            }
        }
    }
}

fn read_table(path: &Path) -> Result<(TokenTable, Vec<u8>), TokenFileError> {
    let err = |message: String| TokenFileError { path: path.to_path_buf(), message };
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let fingerprint = Sha256::digest(&bytes).to_vec();
    let text = std::str::from_utf8(&bytes).map_err(|_| err("not UTF-8".into()))?;
    Ok((TokenTable::parse(text).map_err(err)?, fingerprint))
}

impl Authenticator for StaticTokens {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a> {
        let caller = self.table.load().lookup(token).cloned();
        Box::pin(std::future::ready(Ok(caller)))
    }
}

/// Authentication flags shared by `sluice serve` and `sluice operator`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct AuthArgs {
    /// YAML file of static bearer tokens, each bound to namespaces or marked as a gateway's
    /// (docs/security.md); reloaded when it changes. `sluice serve` without it has
    /// authentication off.
    #[arg(long = "tokens", env = "SLUICE_TOKENS_FILE")]
    pub tokens: Option<PathBuf>,
    /// X-Forwarded-For entries at the end of a gateway's ext_authz call that the gateway itself
    /// appended (1: the last entry is the client the gateway saw).
    #[arg(long, env = "SLUICE_GATEWAY_TRUSTED_HOPS", default_value_t = 1)]
    pub gateway_trusted_hops: usize,
}

impl AuthArgs {
    /// The static tokens, if a file was given (read now: a bad file fails start-up).
    pub fn static_tokens(&self) -> Result<Option<Arc<StaticTokens>>, TokenFileError> {
        self.tokens.as_deref().map(StaticTokens::load).transpose().map(|t| t.map(Arc::new))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_short_token_names_nobody_even_by_its_digest() {
        let hex = |token: &str| token_digest(token).iter().map(|b| format!("{b:02x}")).collect::<String>();
        let file = format!(
            "tokens:\n  - {{name: empty, sha256: {}, gateway: true}}\n  - {{name: short, sha256: {}, gateway: true}}\n  - {{name: long, sha256: {}, gateway: true}}\n",
            hex(""),
            hex("short"),
            hex("a-long-enough-token")
        );
        let table = TokenTable::parse(&file).unwrap();
        assert!(table.lookup("").is_none());
        assert!(table.lookup("short").is_none());
        assert!(table.lookup("a-long-enough-token").is_some());
    }

    use super::*;

    const FILE: &str = r#"
tokens:
  - name: tenant-a-sidecars
    token: aaaaaaaaaaaaaaaaaaaa
    namespaces: [tenant-a]
  - name: edge
    sha256: 6cd3556deb0da54bca060b4c39479839e4099838f6f3e1bce5d0d89d8e4e1d2b
    gateway: true
"#;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION_HEADER, value.parse().unwrap());
        h
    }

    #[tokio::test]
    async fn static_tokens_bind_namespaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.yaml");
        // sha256("gateway-token-0123") for the gateway entry.
        let file = FILE.replace(
            "6cd3556deb0da54bca060b4c39479839e4099838f6f3e1bce5d0d89d8e4e1d2b",
            &token_digest("gateway-token-0123").iter().map(|b| format!("{b:02x}")).collect::<String>(),
        );
        std::fs::write(&path, file).unwrap();
        let auth = Auth::new(vec![Arc::new(StaticTokens::load(&path).unwrap())]);
        let tenant = auth.caller(&headers("Bearer aaaaaaaaaaaaaaaaaaaa")).await.unwrap();
        assert!(tenant.may_use("tenant-a") && !tenant.may_use("tenant-b") && !tenant.is_trusted());
        assert_eq!(tenant.default_namespace(), "tenant-a");
        let gateway = auth.caller(&headers("bearer gateway-token-0123")).await.unwrap();
        assert!(gateway.is_trusted() && gateway.may_use("anything"));
        assert_eq!(auth.caller(&HeaderMap::new()).await, Err(AuthError::Missing));
        assert!(matches!(auth.caller(&headers("Bearer wrong-token-xxxxxxxx")).await, Err(AuthError::Invalid(_))));
        assert!(matches!(auth.caller(&headers("Basic abc")).await, Err(AuthError::Invalid(_))));
        assert!(tenant.require_namespace("tenant-b").unwrap_err().0.contains("tenant-a"));
    }

    #[test]
    fn bad_token_files_name_the_entry() {
        let err = |text: &str| TokenTable::parse(text).unwrap_err();
        assert!(err("tokens: [{name: a, token: short, namespaces: [x]}]").starts_with("tokens[0].token"));
        assert!(err("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa}]").starts_with("tokens[0].namespaces"));
        assert!(
            err("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa, gateway: true, namespaces: [x]}]").contains("gateway")
        );
        assert!(err("tokens: [{name: a, sha256: abc, gateway: true}]").starts_with("tokens[0].sha256"));
        assert!(err("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa, namespaces: [Bad_NS]}]").contains("Bad_NS"));
        let twice = "tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa, namespaces: [x]}, {name: b, token: aaaaaaaaaaaaaaaaaaaa, gateway: true}]";
        assert!(err(twice).starts_with("tokens[1]"));
        assert!(err("tokenz: []").contains("unknown field"));
    }

    #[test]
    fn an_invalid_edit_keeps_the_last_good_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.yaml");
        std::fs::write(&path, "tokens: [{name: a, token: aaaaaaaaaaaaaaaaaaaa, namespaces: [x]}]").unwrap();
        let tokens = StaticTokens::load(&path).unwrap();
        assert!(!tokens.reload_if_changed().unwrap(), "unchanged");
        std::fs::write(&path, "tokens: [{name: a, token: short}]").unwrap();
        assert!(!tokens.reload_if_changed().unwrap(), "a change is read twice alike before it counts");
        assert!(tokens.reload_if_changed().is_err());
        assert!(tokens.table().lookup("aaaaaaaaaaaaaaaaaaaa").is_some(), "still the old table");
        std::fs::write(&path, "tokens: [{name: b, token: bbbbbbbbbbbbbbbbbbbb, namespaces: [y]}]").unwrap();
        assert!(!tokens.reload_if_changed().unwrap());
        assert!(tokens.reload_if_changed().unwrap());
        assert!(tokens.table().lookup("aaaaaaaaaaaaaaaaaaaa").is_none());
        assert!(tokens.table().lookup("bbbbbbbbbbbbbbbbbbbb").is_some());
    }
}
