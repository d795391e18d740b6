//! The hold token a caller hands back to `POST /v1/settle`: anything verifies to a lease or an
//! error, never a panic; whatever decodes (signed or not) is within bounds, re-signs to a token
//! that verifies to itself, and verifies under no other key.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sluice::engine::hold::{Hold, TokenKeys};

static KEYS: LazyLock<TokenKeys> = LazyLock::new(|| TokenKeys::parse("fuzz-key-0123456789abcdef").unwrap());
static OTHER: LazyLock<TokenKeys> = LazyLock::new(|| TokenKeys::parse("other-key-0123456789abcdef").unwrap());

fuzz_target!(|token: &str| {
    let _ = Hold::verify(token, &KEYS);
    if let Ok(lease) = Hold::read_unverified(token) {
        assert!(lease.hold != 0 && !lease.held.is_empty());
        let signed = lease.token(&KEYS);
        assert_eq!(Hold::verify(&signed, &KEYS), Ok(lease.clone()));
        assert!(Hold::verify(&signed, &OTHER).is_err());
    }
});
