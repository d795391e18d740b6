//! `sluice simulate --trace` files: any text is arrivals in time order or an error naming the
//! line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::simulate::parse_trace;

fuzz_target!(|text: &str| {
    if let Ok(arrivals) = parse_trace(text) {
        assert!(arrivals.windows(2).all(|w| w[0].at <= w[1].at), "sorted by time");
    }
});
