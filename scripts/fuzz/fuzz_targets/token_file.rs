//! `sluice serve --tokens` files: any text is a token table or an error naming the entry, and a
//! table never lets an empty or short token through, whatever digests it holds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::server::auth::{MIN_STATIC_TOKEN_LEN, TokenTable};

fuzz_target!(|text: &str| {
    if let Ok(table) = TokenTable::parse(text) {
        assert!(table.lookup("").is_none());
        assert!(table.lookup(&"x".repeat(MIN_STATIC_TOKEN_LEN - 1)).is_none());
    }
});
