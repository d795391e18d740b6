//! The lease a caller hands back to `POST /v1/release`: anything decodes to a lease or an error,
//! and a lease's token decodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::server::lease::Lease;

fuzz_target!(|token: &str| {
    if let Ok(lease) = Lease::from_token(token) {
        assert_eq!(Lease::from_token(&lease.token()), Ok(lease.clone()));
        assert!(lease.hold != 0 && !lease.held.is_empty());
    }
});
