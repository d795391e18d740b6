//! The policy documents tenants write: YAML → validate → compile, as `sluice serve` and the
//! webhook do. Never a panic: any document is either refused with its errors or compiled.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::policy::validate::warnings;
use sluice::policy::{compile, load_str};

fuzz_target!(|text: &str| {
    if text.len() > 64 * 1024 {
        return;
    }
    let Ok(loaded) = load_str(text, std::path::Path::new("fuzz.yaml")) else { return };
    for l in &loaded {
        let _ = warnings(&l.policy);
    }
    let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
    for rejected in &compiled.rejected {
        assert!(!rejected.errors.errors.is_empty(), "a refusal names its errors");
    }
});
