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
//!
//! A flood of junk tokens must not cost the API server a review each, nor push the sidecars'
//! verdicts out of the cache:
//! - a token that cannot be one the API server would accept for us (not a JWT, another audience,
//!   expired) is refused without a review;
//! - accepted and refused verdicts live in separate caches, each bounded, so refused tokens only
//!   ever evict refused tokens;
//! - reviews of tokens not in the cache draw on a budget (a token bucket, `REVIEWS_PER_SECOND`
//!   with a burst of `REVIEW_BURST`); past it a new token is answered 503 (retry) until the budget
//!   refills, while every token already accepted keeps being served from the cache.

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
    /// Most cached verdicts of each kind (accepted, refused).
    pub max_entries: usize,
    /// Reviews of uncached tokens per second, sustained, and in a burst.
    pub reviews_per_second: f64,
    pub review_burst: f64,
}

impl ReviewConfig {
    pub fn new(audience: String, gateways: HashSet<String>) -> ReviewConfig {
        ReviewConfig {
            audience,
            gateways,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(10),
            max_entries: 10_000,
            reviews_per_second: REVIEWS_PER_SECOND,
            review_burst: REVIEW_BURST,
        }
    }
}

/// Sustained TokenReviews per second for tokens not in the cache: far above what sidecars
/// starting or rotating their tokens need (one review per pod per hour, and per cache period).
pub const REVIEWS_PER_SECOND: f64 = 50.0;
pub const REVIEW_BURST: f64 = 200.0;

type Verdict = Result<Caller, AuthError>;

struct Cached {
    verdict: Verdict,
    expires_at: Micros,
}

/// Accepted and refused verdicts, each bounded on its own: refused tokens (anyone can make
/// them up) never take an accepted token's place.
#[derive(Default)]
pub struct VerdictCache {
    accepted: HashMap<[u8; 32], Cached>,
    refused: HashMap<[u8; 32], Cached>,
}

impl VerdictCache {
    fn get(&self, digest: &[u8; 32], now: Micros) -> Option<Verdict> {
        self.accepted
            .get(digest)
            .or_else(|| self.refused.get(digest))
            .filter(|c| c.expires_at > now)
            .map(|c| c.verdict.clone())
    }

    fn insert(&mut self, digest: [u8; 32], verdict: Verdict, expires_at: Micros, now: Micros, max_entries: usize) {
        let map = if verdict.is_ok() { &mut self.accepted } else { &mut self.refused };
        if map.len() >= max_entries {
            map.retain(|_, c| c.expires_at > now);
            if map.len() >= max_entries {
                // Still full of live verdicts: the one expiring first goes (a scan, only when a
                // cache of this size is full).
                if let Some(oldest) = map.iter().min_by_key(|(_, c)| c.expires_at).map(|(k, _)| *k) {
                    map.remove(&oldest);
                }
            }
        }
        map.insert(digest, Cached { verdict, expires_at });
    }

    pub fn len(&self) -> (usize, usize) {
        (self.accepted.len(), self.refused.len())
    }
}

/// A token bucket on the clock's microseconds: the review budget.
struct Budget {
    tokens: f64,
    updated: Micros,
}

impl Budget {
    fn take(&mut self, now: Micros, rate: f64, burst: f64) -> bool {
        let elapsed = now.saturating_sub(self.updated) as f64 / 1e6;
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.updated = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

pub struct TokenReviewer {
    api: Api<TokenReview>,
    config: ReviewConfig,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    cache: Mutex<VerdictCache>,
    budget: Mutex<Budget>,
    in_flight: Mutex<HashMap<[u8; 32], Arc<Review>>>,
}

/// One review in flight, shared by the requests that present the same token meanwhile: the
/// verdict and until when it may be reused.
type Review = OnceCell<(Verdict, Micros)>;

impl TokenReviewer {
    pub fn new(client: Client, config: ReviewConfig, clock: Arc<dyn Clock>, metrics: Arc<Metrics>) -> TokenReviewer {
        let budget = Budget { tokens: config.review_burst, updated: clock.now() };
        TokenReviewer {
            api: Api::all(client),
            config,
            clock,
            metrics,
            cache: Mutex::new(VerdictCache::default()),
            budget: Mutex::new(budget),
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    async fn verify(&self, token: &str) -> Verdict {
        let digest = token_digest(token);
        let now = self.clock.now();
        if let Some(hit) = self.cache.lock().get(&digest, now) {
            return hit;
        }
        if let Err(why) = plausible(token, &self.config.audience, now) {
            self.count("refused_unreviewed");
            let verdict = Err(AuthError::Invalid(why));
            let expires_at = now + self.config.negative_ttl.as_micros() as Micros;
            self.cache.lock().insert(digest, verdict.clone(), expires_at, now, self.config.max_entries);
            return verdict;
        }
        let joining = self.in_flight.lock().contains_key(&digest);
        if !joining && !self.budget.lock().take(now, self.config.reviews_per_second, self.config.review_burst) {
            self.count("throttled");
            return Err(AuthError::Unavailable("too many new tokens to review at once; retry shortly".into()));
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
        let now = self.clock.now();
        self.cache.lock().insert(digest, verdict, expires_at, now, self.config.max_entries);
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

/// Whether `token` could be one the API server accepts for `audience`: a JWT whose (unverified)
/// claims name the audience and have not expired. Anything else is refused without a review; the
/// API server remains the only judge of the rest (signature, pod, ServiceAccount).
fn plausible(token: &str, audience: &str, now: Micros) -> Result<(), String> {
    let parts: Vec<&str> = token.split('.').collect();
    if parts.len() != 3 || parts.iter().any(|p| p.is_empty()) {
        return Err("not a ServiceAccount token (a JWT)".into());
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(parts[1].trim_end_matches('='))
        .map_err(|_| "not a ServiceAccount token (a JWT)".to_string())?;
    let claims: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "not a ServiceAccount token (a JWT)".to_string())?;
    let for_us = match claims.get("aud") {
        Some(serde_json::Value::String(aud)) => aud == audience,
        Some(serde_json::Value::Array(auds)) => auds.iter().any(|a| a.as_str() == Some(audience)),
        _ => false,
    };
    if !for_us {
        return Err(format!("token is not for audience {audience:?}"));
    }
    match claims.get("exp").and_then(serde_json::Value::as_u64).and_then(|e| e.checked_mul(1_000_000)) {
        Some(exp) if exp > now => Ok(()),
        Some(_) => Err("token expired".into()),
        None => Err("token has no expiry".into()),
    }
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

    fn jwt(claims: serde_json::Value) -> String {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims.to_string());
        format!("eyJhbGciOiJSUzI1NiJ9.{payload}.c2lnbmF0dXJl")
    }

    #[test]
    fn only_plausible_tokens_are_sent_for_review() {
        let now = 1_700_000_000_000_000;
        assert!(plausible(&jwt(serde_json::json!({"aud": ["sluice"], "exp": 1_700_000_100})), "sluice", now).is_ok());
        assert!(plausible(&jwt(serde_json::json!({"aud": "sluice", "exp": 1_700_000_100})), "sluice", now).is_ok());
        for (token, why) in [
            ("junk-token-0123456789".to_string(), "JWT"),
            ("a.b".to_string(), "JWT"),
            ("a.!!!.c".to_string(), "JWT"),
            (jwt(serde_json::json!({"aud": ["https://kubernetes.default.svc"], "exp": 1_700_000_100})), "audience"),
            (jwt(serde_json::json!({"aud": ["sluice"], "exp": 1_600_000_000})), "expired"),
            (jwt(serde_json::json!({"aud": ["sluice"]})), "expiry"),
        ] {
            let error = plausible(&token, "sluice", now).expect_err(&token);
            assert!(error.contains(why), "{token}: {error}");
        }
    }

    #[test]
    fn a_flood_of_refused_tokens_never_evicts_an_accepted_one() {
        let mut cache = VerdictCache::default();
        let now = 1_000;
        let sidecar =
            Caller::Tenant { name: "tenant-a/default".into(), namespaces: vec!["tenant-a".to_string()].into() };
        cache.insert([1; 32], Ok(sidecar), now + 60_000_000, now, 100);
        for i in 0..10_000u32 {
            let mut digest = [0; 32];
            digest[..4].copy_from_slice(&i.to_le_bytes());
            digest[31] = 2;
            cache.insert(digest, Err(AuthError::Invalid("junk".into())), now + 10_000_000, now, 100);
        }
        assert!(cache.get(&[1; 32], now).is_some_and(|v| v.is_ok()), "the sidecar's verdict survived");
        assert_eq!(cache.len(), (1, 100), "each kind bounded on its own");
        assert!(cache.get(&[1; 32], now + 60_000_001).is_none(), "and expires as before");
    }

    #[test]
    fn the_review_budget_refills_at_its_rate() {
        let mut budget = Budget { tokens: 2.0, updated: 0 };
        assert!(budget.take(0, 50.0, 2.0) && budget.take(0, 50.0, 2.0));
        assert!(!budget.take(0, 50.0, 2.0), "the burst is spent");
        assert!(!budget.take(10_000, 50.0, 2.0), "half a review refilled in 10 ms");
        assert!(budget.take(20_000, 50.0, 2.0), "one in 20 ms");
        assert!(budget.take(10_000_000, 50.0, 2.0) && budget.take(10_000_000, 50.0, 2.0));
        assert!(!budget.take(10_000_000, 50.0, 2.0), "never above the burst");
    }

    #[test]
    fn expiry_is_read_from_the_payload() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp": 1700000000, "sub": "x"}"#);
        assert_eq!(token_expiry(&format!("h.{payload}.s")), Some(1_700_000_000_000_000));
        assert_eq!(token_expiry("opaque"), None);
    }
}
