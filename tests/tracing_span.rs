//! The `check` span: present with the snapshot and rule count when `sluice::check=debug` asks
//! for it, absent at `info`.
//!
//! Its own test binary because tracing caches each callsite's interest process-wide: in the
//! library's test binary another thread checking without a subscriber could cache the span as
//! uninteresting between this test's rebuild and its check (it did, once, in CI).

use std::sync::{Arc, Mutex};

use sluice::engine::{Engine, Holds};
use sluice::policy::RequestView;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;
use tracing_subscriber::layer::SubscriberExt;

/// The spans' names and fields as a subscriber sees them.
#[derive(Default, Clone)]
struct SpanFields(Arc<Mutex<Vec<String>>>);

struct Visitor<'a>(&'a mut Vec<String>);

impl tracing::field::Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push(format!("{}={value:?}", field.name()));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for SpanFields {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = self.0.lock().expect("not poisoned");
        fields.push(format!("span {}", attrs.metadata().name()));
        attrs.record(&mut Visitor(&mut fields));
    }
    fn on_record(
        &self,
        _: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        values.record(&mut Visitor(&mut self.0.lock().expect("not poisoned")));
    }
}

fn traced_check(filter: &str) -> Vec<String> {
    let policy = sluice::policy::load_str(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 5, per: 1s}}\n",
        std::path::Path::new("p.yaml"),
    )
    .unwrap();
    let snapshot = sluice::policy::compile(policy.into_iter().map(|l| l.policy).collect()).snapshot;
    let version = snapshot.version().to_string();
    let engine =
        Engine::new(Arc::new(MemoryStore::new(16)), Arc::new(sluice::clock::SystemClock), Arc::new(Metrics::new()));
    engine.install(Arc::new(snapshot));
    let fields = SpanFields::default();
    let subscriber =
        tracing_subscriber::registry().with(tracing_subscriber::EnvFilter::new(filter)).with(fields.clone());
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        let request = RequestView { namespace: "ns", ..RequestView::new("/") };
        let response = futures::executor::block_on(engine.check(&request, Holds::Returned));
        assert!(response.allowed);
    });
    let recorded = fields.0.lock().expect("not poisoned").clone();
    recorded.into_iter().map(|f| f.replace(&version, "VERSION")).collect()
}

#[test]
fn checks_run_in_a_span_with_the_snapshot_and_rule_count_only_when_asked() {
    assert_eq!(
        traced_check("sluice::check=debug"),
        ["span check", "namespace=\"ns\"", "snapshot=\"VERSION\"", "rules=1", "allowed=true"]
    );
    assert!(traced_check("info").is_empty(), "no span at info");
}
