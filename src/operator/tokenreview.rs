//! Verifying callers' ServiceAccount tokens with the Kubernetes TokenReview API.
//!
//! An injected sidecar presents a projected ServiceAccount token whose audience is Sluice's
//! (`--token-audience`). The API server checks signature, expiry, audience and that the pod and
//! ServiceAccount still exist; the answer's username `system:serviceaccount:NS:NAME` binds the
//! caller to namespace NS, unless NS/NAME is one of the configured gateways.
//!
//! Verdicts are cached by the token's SHA-256 (never the token itself) for a bounded time — never
//! past the token's own `exp` — and a bounded number of entries; concurrent first uses of one
//! token share one review, so the API server sees one TokenReview per token per cache period.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use parking_lot::Mutex;
use tokio::sync::OnceCell;

use crate::algorithm::Micros;
use crate::clock::Clock;
use crate::server::auth::{AuthError, AuthFuture, Authenticator, Caller, token_digest};
use crate::telemetry::{Metrics, ResultLabels};

/// Tunables of the verdict cache.
#[derive(Debug, Clone)]
pub struct ReviewConfig {
    /// The audience tokens must be issued for.
    pub audience: String,
    /// `namespace/name` of ServiceAccounts trusted as gateways.
    pub gateways: HashSet<String>,
    /// How long an accepted token's verdict is reused (capped by the token's expiry).
    pub ttl: Duration,
    /// How long a refused token's verdict is reused (so a flood of bad tokens costs the API
    /// server one review each per period).
    pub negative_ttl: Duration,
    /// Most cached verdicts.
    pub max_entries: usize,
}

impl ReviewConfig {
    pub fn new(audience: String, gateways: HashSet<String>) -> ReviewConfig {
        ReviewConfig {
            audience,
            gateways,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(10),
            max_entries: 10_000,
        }
    }
}

type Verdict = Result<Caller, AuthError>;

struct Cached {
    verdict: Verdict,
    expires_at: Micros,
}

pub struct TokenReviewer {
    api: Api<TokenReview>,
    config: ReviewConfig,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    cache: Mutex<HashMap<[u8; 32], Cached>>,
    in_flight: Mutex<HashMap<[u8; 32], Arc<Review>>>,
}

/// One review in flight, shared by the requests that present the same token meanwhile: the
/// verdict and until when it may be reused.
type Review = OnceCell<(Verdict, Micros)>;

impl TokenReviewer {
    pub fn new(client: Client, config: ReviewConfig, clock: Arc<dyn Clock>, metrics: Arc<Metrics>) -> TokenReviewer {
        TokenReviewer {
            api: Api::all(client),
            config,
            clock,
            metrics,
            cache: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    async fn verify(&self, token: &str) -> Verdict {
        let digest = token_digest(token);
        let now = self.clock.now();
        if let Some(hit) = self.cache.lock().get(&digest).filter(|c| c.expires_at > now) {
            return hit.verdict.clone();
        }
        let cell = self.in_flight.lock().entry(digest).or_default().clone();
        // The entry goes when this request is done or dropped (a client hanging up mid-review
        // must not leave entries behind: distinct tokens would grow the map without bound).
        let _in_flight = InFlight { reviewer: self, digest, cell: cell.clone() };
        let (verdict, expires_at) = cell.get_or_init(|| self.review(token)).await.clone();
        // Cached before the in-flight entry goes, so a request arriving in between finds it. An
        // outage is nobody's verdict: the next request asks again.
        if !matches!(verdict, Err(AuthError::Unavailable(_))) {
            self.remember(digest, verdict.clone(), expires_at);
        }
        verdict
    }

    fn remember(&self, digest: [u8; 32], verdict: Verdict, expires_at: Micros) {
        let mut cache = self.cache.lock();
        if cache.len() >= self.config.max_entries {
            let now = self.clock.now();
            cache.retain(|_, c| c.expires_at > now);
            if cache.len() >= self.config.max_entries {
                // Still full of live verdicts: start over rather than grow; each token costs one
                // more review.
                cache.clear();
            }
        }
        cache.insert(digest, Cached { verdict, expires_at });
    }

    /// One TokenReview, with the time its verdict may be reused until.
    async fn review(&self, token: &str) -> (Verdict, Micros) {
        let now = self.clock.now();
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.config.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = match self.api.create(&PostParams::default(), &review).await {
            Ok(answer) => answer,
            Err(error) => {
                self.count("error");
                tracing::warn!(%error, "TokenReview failed");
                return (Err(AuthError::Unavailable(format!("TokenReview: {error}"))), now);
            }
        };
        let verdict = self.interpret(answer);
        self.count(if verdict.is_ok() { "authenticated" } else { "rejected" });
        let ttl = if verdict.is_ok() { self.config.ttl } else { self.config.negative_ttl };
        let mut expires_at = now + ttl.as_micros() as Micros;
        if let (Ok(_), Some(exp)) = (&verdict, token_expiry(token)) {
            expires_at = expires_at.min(exp);
        }
        (verdict, expires_at)
    }

    fn interpret(&self, answer: TokenReview) -> Verdict {
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status.error.filter(|e| !e.is_empty()).unwrap_or_else(|| "token not accepted".into());
            return Err(AuthError::Invalid(why));
        }
        if !status.audiences.unwrap_or_default().contains(&self.config.audience) {
            return Err(AuthError::Invalid(format!("token is not for audience {:?}", self.config.audience)));
        }
        let username = status.user.and_then(|u| u.username).unwrap_or_default();
        caller_of(&username, &self.config.gateways)
    }

    fn count(&self, result: &'static str) {
        self.metrics.token_reviews.get_or_create(&ResultLabels { result }).inc();
    }
}

/// Removes a review's in-flight entry on drop, unless a newer review of the token took its place.
struct InFlight<'a> {
    reviewer: &'a TokenReviewer,
    digest: [u8; 32],
    cell: Arc<Review>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.reviewer.in_flight.lock();
        if in_flight.get(&self.digest).is_some_and(|current| Arc::ptr_eq(current, &self.cell)) {
            in_flight.remove(&self.digest);
        }
    }
}

impl Authenticator for TokenReviewer {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a> {
        Box::pin(async move { self.verify(token).await.map(Some) })
    }
}

/// `system:serviceaccount:NS:NAME` → a tenant of NS, or a gateway if NS/NAME is listed.
fn caller_of(username: &str, gateways: &HashSet<String>) -> Verdict {
    let Some((namespace, name)) = username.strip_prefix("system:serviceaccount:").and_then(|rest| rest.split_once(':'))
    else {
        return Err(AuthError::Invalid(format!("{username:?} is not a ServiceAccount")));
    };
    let qualified = format!("{namespace}/{name}");
    if gateways.contains(&qualified) {
        return Ok(Caller::Gateway { name: qualified.into() });
    }
    Ok(Caller::Tenant { name: qualified.into(), namespaces: vec![namespace.to_string()].into() })
}

/// The `exp` claim of a JWT in Unix microseconds, read without verifying (the API server has
/// verified it; this only keeps a cached verdict from outliving the token).
fn token_expiry(token: &str) -> Option<Micros> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("exp")?.as_u64()?.checked_mul(1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_accounts_become_tenants_or_gateways() {
        let gateways: HashSet<String> = ["gw/envoy".to_string()].into();
        let tenant = caller_of("system:serviceaccount:tenant-a:default", &gateways).unwrap();
        assert!(tenant.may_use("tenant-a") && !tenant.may_use("tenant-b"));
        assert!(caller_of("system:serviceaccount:gw:envoy", &gateways).unwrap().is_trusted());
        assert!(caller_of("alice", &gateways).is_err());
    }

    #[test]
    fn expiry_is_read_from_the_payload() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp": 1700000000, "sub": "x"}"#);
        assert_eq!(token_expiry(&format!("h.{payload}.s")), Some(1_700_000_000_000_000));
        assert_eq!(token_expiry("opaque"), None);
    }
}
