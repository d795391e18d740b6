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
