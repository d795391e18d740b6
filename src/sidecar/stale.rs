//! Stale-if-limited reads (`staleIfLimited` on a rule): the last good response of each URL a
//! rule with it matches, kept in this pod, so that a limited `GET` or `HEAD` gets that response
//! (marked `Age` and `Sluice-Stale: limited`) instead of the refusal.
//!
//! HTTP's caching rules decide what may be kept (RFC 9111): only a 200, never a response marked
//! `Cache-Control: no-store`, `private` or `no-cache`, one that sets a cookie, one whose `Vary`
//! is `*`, or one to a request carrying `Authorization` or `Cookie` (a response for one user is
//! never served to another), or a request saying `no-store`. A response varying on request
//! headers is served only to a request with the same values. Bounded in bytes per pod (least
//! recently used first out) and per entry (the rule's `maxEntryBytes`); a per-pod cache is what
//! users of a sidecar expect, and nothing is shared across replicas.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};

/// What makes two requests the same resource: host and path with query.
pub type CacheKey = (String, String);

/// One kept response.
#[derive(Clone, Debug)]
pub struct Kept {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub stored: Instant,
    /// The request headers the response varies on, with the values it was made for.
    vary: Vec<(HeaderName, Option<HeaderValue>)>,
    /// When a read last went on to refresh it (`revalidateEvery`).
    revalidated: Option<Instant>,
}

impl Kept {
    fn bytes(&self) -> usize {
        self.body.len() + self.headers.iter().map(|(k, v)| k.as_str().len() + v.len() + 32).sum::<usize>() + 256
    }
}

/// The kept responses of this pod, at most `budget` bytes.
pub struct StaleCache {
    budget: usize,
    inner: parking_lot::Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<CacheKey, (Kept, u64)>,
    /// Last use → key, oldest first.
    order: BTreeMap<u64, CacheKey>,
    tick: u64,
    bytes: usize,
}

/// Whether a request may have its response kept and be served a kept one: a read, without
/// credentials, not refusing storage itself.
pub fn cacheable_request(method: &Method, headers: &HeaderMap) -> bool {
    (method == Method::GET || method == Method::HEAD)
        && !headers.contains_key(header::AUTHORIZATION)
        && !headers.contains_key(header::COOKIE)
        && !cache_control_has(headers, &["no-store"])
}

/// The response's `Vary` names when it may be kept; `None` when it may not.
pub fn keepable_response(status: StatusCode, headers: &HeaderMap) -> Option<Vec<HeaderName>> {
    if status != StatusCode::OK
        || headers.contains_key(header::SET_COOKIE)
        || cache_control_has(headers, &["no-store", "private", "no-cache"])
    {
        return None;
    }
    let mut names = Vec::new();
    for value in headers.get_all(header::VARY) {
        for name in value.to_str().ok()?.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return None;
            }
            names.push(HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).ok()?);
        }
    }
    Some(names)
}

fn cache_control_has(headers: &HeaderMap, directives: &[&str]) -> bool {
    headers.get_all(header::CACHE_CONTROL).iter().filter_map(|v| v.to_str().ok()).any(|v| {
        v.split(',')
            .map(|d| d.split('=').next().unwrap_or("").trim().to_ascii_lowercase())
            .any(|d| directives.contains(&d.as_str()))
    })
}

impl StaleCache {
    pub fn new(budget: usize) -> StaleCache {
        StaleCache { budget, inner: parking_lot::Mutex::new(Inner::default()) }
    }

    /// Keeps a response to a request with `request_headers` (what its `Vary` names are read
    /// from), dropping the least recently used ones while over the budget.
    pub fn keep(
        &self,
        key: CacheKey,
        request_headers: &HeaderMap,
        status: StatusCode,
        headers: HeaderMap,
        vary: Vec<HeaderName>,
        body: Bytes,
    ) {
        let vary = vary.into_iter().map(|name| (name.clone(), request_headers.get(&name).cloned())).collect();
        let kept = Kept { status, headers, body, stored: Instant::now(), vary, revalidated: None };
        let size = kept.bytes();
        if size > self.budget {
            return;
        }
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        if let Some((old, tick)) = inner.entries.remove(&key) {
            inner.order.remove(&tick);
            inner.bytes -= old.bytes();
        }
        while inner.bytes + size > self.budget {
            let Some((_, oldest)) = inner.order.pop_first() else { break };
            if let Some((gone, _)) = inner.entries.remove(&oldest) {
                inner.bytes -= gone.bytes();
            }
        }
        inner.tick += 1;
        inner.order.insert(inner.tick, key.clone());
        inner.entries.insert(key, (kept, inner.tick));
        inner.bytes += size;
    }

    /// The kept response for `key` a request with `request_headers` may get, at most
    /// `max_stale` old, with its age.
    pub fn serve(&self, key: &CacheKey, request_headers: &HeaderMap, max_stale: Duration) -> Option<(Kept, Duration)> {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let (kept, tick) = inner.entries.get_mut(key)?;
        let age = kept.stored.elapsed();
        if age > max_stale || kept.vary.iter().any(|(name, value)| request_headers.get(name) != value.as_ref()) {
            return None;
        }
        inner.order.remove(tick);
        inner.tick += 1;
        *tick = inner.tick;
        inner.order.insert(inner.tick, key.clone());
        Some((kept.clone(), age))
    }

    /// Whether a read of `key` may go on to the application now to refresh its kept response:
    /// yes once per `every` (counted from when it was kept or last refreshed), and the time is
    /// taken at once, so concurrent reads send one.
    pub fn claim_revalidation(&self, key: &CacheKey, every: Duration) -> bool {
        let mut inner = self.inner.lock();
        let Some((kept, _)) = inner.entries.get_mut(key) else { return false };
        let last = kept.revalidated.map_or(kept.stored, |at| at.max(kept.stored));
        if last.elapsed() < every {
            return false;
        }
        kept.revalidated = Some(Instant::now());
        true
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v))).collect()
    }

    #[test]
    fn only_shareable_successful_reads_are_kept() {
        assert!(cacheable_request(&Method::GET, &HeaderMap::new()));
        assert!(cacheable_request(&Method::HEAD, &HeaderMap::new()));
        assert!(!cacheable_request(&Method::POST, &HeaderMap::new()));
        assert!(!cacheable_request(&Method::GET, &headers(&[("authorization", "Bearer x")])));
        assert!(!cacheable_request(&Method::GET, &headers(&[("cookie", "s=1")])));
        assert!(!cacheable_request(&Method::GET, &headers(&[("cache-control", "no-store")])));
        assert_eq!(keepable_response(StatusCode::OK, &HeaderMap::new()), Some(vec![]));
        assert_eq!(keepable_response(StatusCode::NOT_FOUND, &HeaderMap::new()), None);
        for refused in ["no-store", "private", "no-cache", "max-age=60, Private"] {
            let cc = HeaderValue::from_str(refused).unwrap();
            let mut h = HeaderMap::new();
            h.insert(header::CACHE_CONTROL, cc);
            assert_eq!(keepable_response(StatusCode::OK, &h), None, "{refused}");
        }
        assert_eq!(keepable_response(StatusCode::OK, &headers(&[("set-cookie", "s=1")])), None);
        assert_eq!(keepable_response(StatusCode::OK, &headers(&[("vary", "*")])), None);
        assert_eq!(
            keepable_response(StatusCode::OK, &headers(&[("vary", "Accept-Language, accept-encoding")])),
            Some(vec![HeaderName::from_static("accept-language"), HeaderName::from_static("accept-encoding")])
        );
    }

    #[test]
    fn one_revalidation_per_interval_is_claimed() {
        let cache = StaleCache::new(1 << 20);
        let key: CacheKey = ("h".into(), "/a".into());
        assert!(!cache.claim_revalidation(&key, Duration::ZERO), "nothing kept");
        cache.keep(key.clone(), &HeaderMap::new(), StatusCode::OK, HeaderMap::new(), Vec::new(), Bytes::from("x"));
        assert!(!cache.claim_revalidation(&key, Duration::from_secs(60)), "kept just now");
        assert!(cache.claim_revalidation(&key, Duration::ZERO));
        assert!(!cache.claim_revalidation(&key, Duration::from_secs(60)), "claimed just now");
    }

    #[test]
    fn vary_age_and_the_byte_budget_are_respected() {
        let cache = StaleCache::new(4_000);
        let key = |p: &str| ("shop".to_string(), p.to_string());
        let english = headers(&[("accept-language", "en")]);
        let vary = vec![HeaderName::from_static("accept-language")];
        cache.keep(key("/a"), &english, StatusCode::OK, HeaderMap::new(), vary, Bytes::from(vec![b'a'; 1_000]));
        assert!(cache.serve(&key("/a"), &english, Duration::from_secs(60)).is_some());
        assert!(cache.serve(&key("/a"), &headers(&[("accept-language", "fr")]), Duration::from_secs(60)).is_none());
        assert!(cache.serve(&key("/a"), &HeaderMap::new(), Duration::from_secs(60)).is_none());
        assert!(cache.serve(&key("/a"), &english, Duration::ZERO).is_none(), "older than maxStale");
        // Over the budget the least recently used goes first.
        cache.keep(key("/b"), &HeaderMap::new(), StatusCode::OK, HeaderMap::new(), vec![], Bytes::from(vec![0; 1_000]));
        assert!(cache.serve(&key("/a"), &english, Duration::from_secs(60)).is_some());
        cache.keep(key("/c"), &HeaderMap::new(), StatusCode::OK, HeaderMap::new(), vec![], Bytes::from(vec![0; 1_500]));
        assert!(cache.serve(&key("/b"), &HeaderMap::new(), Duration::from_secs(60)).is_none(), "the oldest went");
        assert!(cache.serve(&key("/a"), &english, Duration::from_secs(60)).is_some());
        assert!(cache.bytes() <= 4_000);
        cache.keep(
            key("/huge"),
            &HeaderMap::new(),
            StatusCode::OK,
            HeaderMap::new(),
            vec![],
            Bytes::from(vec![0; 5_000]),
        );
        assert!(cache.serve(&key("/huge"), &HeaderMap::new(), Duration::from_secs(60)).is_none());
    }
}
