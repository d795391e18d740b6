//! Path normalization, which every rule's path match and key reads: normalizing twice changes
//! nothing, the result is a path, and borrowing (the fast path) means nothing needed changing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::policy::path::normalize;

fuzz_target!(|path: &str| {
    let once = normalize(path);
    let twice = normalize(&once);
    assert_eq!(once, twice, "normalizing {path:?} twice");
    if path.starts_with('/') {
        assert!(once.starts_with('/'), "{path:?} -> {once:?}");
    }
});
