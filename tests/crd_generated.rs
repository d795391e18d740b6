//! The committed CRD must be exactly what the code generates, so `kubectl apply -f crds/` installs
//! the schema the binary validates against.

use std::path::Path;

#[test]
fn committed_crd_matches_generated() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/ratelimitpolicy.yaml");
    let generated = sluice::policy::crd_yaml();
    if std::env::var_os("SLUICE_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write crds/ratelimitpolicy.yaml");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "crds/ratelimitpolicy.yaml is out of date with src/policy/crd.rs; regenerate it with\n\
         \n    SLUICE_BLESS=1 cargo test --test crd_generated\n\nand commit the result"
    );
}

#[test]
fn crd_has_names_columns_and_cel_rules() {
    let yaml = sluice::policy::crd_yaml();
    for needle in [
        "name: ratelimitpolicies.sluice.dev",
        "- rlp",
        "- sluice",
        "scope: Namespaced",
        "status: {}",
        ".status.conditions[?(@.type==\"Accepted\")].status",
        ".status.conditions[?(@.type==\"Enforced\")].status",
        "x-kubernetes-validations",
        "rule names must be unique",
        "x-kubernetes-list-type: map",
    ] {
        assert!(yaml.contains(needle), "CRD lacks {needle:?}");
    }
}

/// Kubernetes knows the integer formats `int32` and `int64` only; schemars' `uint16`, `uint32`
/// and `uint64` made the API server warn "unrecognized format" on every `kubectl apply`.
#[test]
fn crd_uses_only_integer_formats_kubernetes_knows() {
    let yaml = sluice::policy::crd_yaml();
    let unknown: Vec<&str> = yaml
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("format: ") && !matches!(*l, "format: int32" | "format: int64" | "format: date-time"))
        .collect();
    assert!(unknown.is_empty(), "formats the API server does not know: {unknown:?}");
}
