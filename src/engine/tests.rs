use super::*;
use crate::algorithm::Algorithm;

#[test]
fn bucket_quotas_are_their_capacity_over_the_refill_time() {
    let bucket = Limit::new(Algorithm::TokenBucket, 10, 1_000_000, Some(20), None).unwrap();
    assert_eq!((bucket.capacity(), quota_window(&bucket)), (20, 2_000_000));
    let window = Limit::new(Algorithm::FixedWindow, 100, 60_000_000, None, None).unwrap();
    assert_eq!((window.capacity(), quota_window(&window)), (100, 60_000_000));
}

#[test]
fn each_replica_enforces_its_share() {
    let limit = Limit::new(Algorithm::Gcra, 100, 1_000_000, Some(30), None).unwrap();
    let share = replica_share(&limit, 4);
    assert_eq!((share.requests(), share.burst(), share.per()), (25, 7, 1_000_000));
    let tiny = Limit::new(Algorithm::FixedWindow, 2, 1_000_000, None, None).unwrap();
    assert_eq!(replica_share(&tiny, 8).requests(), 1, "never zero");
    assert_eq!(replica_share(&limit, 1), limit);
}

/// A shared store whose denial cache answered: the first rule's cached denial, the second not
/// asked.
struct CachedDenial;

impl Store for CachedDenial {
    async fn check(&self, _: Option<Micros>, checks: &[RuleCheck<'_>]) -> Result<Verdict, StoreError> {
        let denial = Decision { allowed: false, remaining: 0, reset_after: 1_000, retry_after: Some(500), delay: 0 };
        let other = Decision {
            allowed: true,
            remaining: checks[1].limit.capacity(),
            reset_after: 0,
            retry_after: None,
            delay: 0,
        };
        Ok(Verdict { allowed: false, decisions: vec![denial, other], cached_denial: Some(0), at: None })
    }

    async fn settle_for(
        &self,
        _: &str,
        _: Option<Micros>,
        _: &[Settle<'_>],
        _: crate::algorithm::HoldId,
    ) -> Result<u64, StoreError> {
        Ok(0)
    }
}

#[tokio::test]
async fn rules_a_cached_denial_did_not_ask_are_marked_and_left_out_of_headers() {
    let policy = crate::policy::load_str(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  rules:\n  - {name: hot, algorithm: gcra, limit: {requests: 5, per: 1s}}\n  - {name: other, algorithm: gcra, limit: {requests: 50, per: 1s}}\n",
            std::path::Path::new("p.yaml"),
        )
        .unwrap();
    let snapshot = crate::policy::compile(policy.into_iter().map(|l| l.policy).collect()).snapshot;
    let engine = Engine::new(CachedDenial, Arc::new(crate::clock::SystemClock), Arc::new(Metrics::new()));
    engine.install(Arc::new(snapshot));
    let response = engine.check(&RequestView { namespace: "ns", ..RequestView::new("/") }, Holds::Returned).await;
    assert!(!response.allowed);
    assert_eq!((response.rules[0].not_decided, response.rules[1].not_decided), (false, true));
    let policy_header = response.headers.iter().find(|(k, _)| k == "RateLimit-Policy").map(|(_, v)| v.as_str());
    assert_eq!(policy_header, Some("\"p/hot\";q=5;w=1"), "only the rule that decided");
    let json = serde_json::to_value(&response).unwrap();
    assert_eq!(json["rules"][1]["notDecided"], true);
    assert!(json["rules"][0].get("notDecided").is_none());
}

#[test]
fn header_names_leave_out_the_namespace() {
    assert_eq!(header_name("tenant-acme/orders-api", "per-key"), "orders-api/per-key");
}

/// A shared store that can be taken away: the memory store behind a switch.
struct Switched {
    store: MemoryStore,
    down: std::sync::atomic::AtomicBool,
}

impl Store for Switched {
    async fn check(&self, now: Option<Micros>, checks: &[RuleCheck<'_>]) -> Result<Verdict, StoreError> {
        if self.down.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(StoreError::Unavailable("switched off".into()));
        }
        self.store.check(now, checks).await
    }

    async fn settle_for(
        &self,
        _: &str,
        _: Option<Micros>,
        _: &[Settle<'_>],
        _: crate::algorithm::HoldId,
    ) -> Result<u64, StoreError> {
        Ok(0)
    }
}

/// A shaping rule's queue survives a store failure whole: the local fallback continues the
/// queue the store had promised (not a second queue beside it), and once the store is back the
/// key stays local until the departures it promised have gone (the store's queue end is stale).
#[tokio::test]
async fn a_store_failure_neither_doubles_nor_overlaps_a_shaping_queue() {
    let policy = crate::policy::load_str(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  egress:\n  - {name: bank, destination: \"http://bank\", listenPort: 15100, limit: {requests: 10, per: 1s, maxDelay: 5s}}\n",
        std::path::Path::new("p.yaml"),
    )
    .unwrap();
    let snapshot = crate::policy::compile(policy.into_iter().map(|l| l.policy).collect()).snapshot;
    let t0 = 1_700_000_000_000_000;
    let clock = crate::clock::FakeClock::new(t0);
    let shared = Switched { store: MemoryStore::with_clock(1_000, Arc::new(clock.clone())), down: false.into() };
    let local = Arc::new(MemoryStore::with_clock(1_000, Arc::new(clock.clone())));
    let engine = Engine::new(shared, Arc::new(clock.clone()), Arc::new(Metrics::new())).with_local_fallback(local, 1);
    engine.install(Arc::new(snapshot));
    let request = RequestView { namespace: "ns", egress: Some("bank"), ..RequestView::new("/") };
    let delay = |r: &CheckResponse| {
        assert!(r.allowed, "{r:?}");
        r.delay_ms
    };
    // The store promises departures 0, 100, …, 400 ms.
    for i in 0..5 {
        assert_eq!(delay(&engine.check(&request, Holds::Returned).await), i * 100);
    }
    // Away: the next departs at 500 ms, after the store's queue, not at once beside it.
    engine.store().down.store(true, std::sync::atomic::Ordering::Relaxed);
    let during = engine.check(&request, Holds::Returned).await;
    assert_eq!((delay(&during), during.rules[0].store_failure), (500, Some("localFallback")));
    // Back 10 ms later: the local queue (up to 600 ms) has not drained, so it goes on locally
    // (the store would say 490 ms, the slot the fallback gave away).
    engine.store().down.store(false, std::sync::atomic::Ordering::Relaxed);
    clock.advance(10_000);
    assert_eq!(delay(&engine.check(&request, Holds::Returned).await), 590);
    // Once the local departures are past, the store decides again.
    clock.advance(800_000);
    let after = engine.check(&request, Holds::Returned).await;
    assert_eq!((delay(&after), after.rules[0].store_failure), (0, None));
}
