//! Every example policy loads and compiles without a rejection.

use std::path::Path;

#[test]
fn every_example_compiles() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/policies");
    let loaded = sluice::policy::load_paths(&[&dir]).unwrap_or_else(|e| panic!("{e}"));
    let files: std::collections::BTreeSet<_> = loaded.iter().map(|l| l.file.clone()).collect();
    assert!(files.len() >= 7, "expected one example per algorithm plus layered.yaml");
    let compiled = sluice::policy::compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    let algorithms: std::collections::BTreeSet<_> = compiled.snapshot.rules().map(|r| r.algorithm().name()).collect();
    assert_eq!(algorithms.len(), 6, "{algorithms:?}");
}

/// The gateway examples' policies (Sluice as Envoy's rate limit service) compile, live in the
/// domain the gateway configurations send, and only match descriptors; the Envoy example's
/// static token file loads.
#[test]
fn every_gateway_example_compiles_for_descriptors() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    for gateway in ["envoy", "istio", "contour", "emissary", "kgateway"] {
        let file = root.join(gateway).join("policies.yaml");
        let loaded = sluice::policy::load_paths(&[&file]).unwrap_or_else(|e| panic!("{e}"));
        assert!(!loaded.is_empty(), "{gateway}: no policies");
        let compiled = sluice::policy::compile(loaded.into_iter().map(|l| l.policy).collect());
        assert!(compiled.rejected.is_empty(), "{gateway}: {:?}", compiled.rejected);
        for policy in compiled.snapshot.policies() {
            assert_eq!(policy.namespace(), "gateway-limits", "{gateway}: the domain the gateway sends");
        }
        for source in compiled.snapshot.sources() {
            for rule in &source.spec.rules {
                let descriptor = rule.matches.as_ref().map_or(0, |m| m.descriptor.len());
                assert!(descriptor > 0, "{gateway}: rule {} does not match descriptors", rule.name);
            }
        }
    }
    let tokens = std::fs::read_to_string(root.join("envoy/tokens.yaml")).unwrap();
    let table = sluice::server::auth::TokenTable::parse(&tokens).unwrap_or_else(|e| panic!("envoy/tokens.yaml: {e}"));
    let envoy = std::fs::read_to_string(root.join("envoy/envoy.yaml")).unwrap();
    let token =
        envoy.split("Bearer ").nth(1).and_then(|rest| rest.split('"').next()).expect("envoy.yaml sends a token");
    let caller = table.lookup(token).expect("the token envoy.yaml sends is in tokens.yaml");
    assert!(caller.is_trusted(), "Envoy's token is a gateway's: {caller:?}");
}
