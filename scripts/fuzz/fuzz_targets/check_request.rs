//! The check API's JSON body (`POST /v1/check`, each check of `/v1/checks`, simulate's
//! `--request`): parsed, turned into the view every entry point decides on, and matched against
//! the example policies. Never a panic; a body that parses always yields a view.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sluice::policy::{Matched, Snapshot, compile, load_str};
use sluice::server::auth::Caller;
use sluice::api::check::CheckRequest;

static EXAMPLES: LazyLock<Snapshot> = LazyLock::new(|| {
    let yaml = include_str!("../../../examples/policies/layered.yaml");
    let loaded = load_str(yaml, std::path::Path::new("layered.yaml")).expect("the example parses");
    compile(loaded.into_iter().map(|l| l.policy).collect()).snapshot
});

fuzz_target!(|body: &[u8]| {
    let Ok(request) = CheckRequest::from_json(body) else { return };
    let view = request.view(&Caller::Open).expect("an open caller may name any namespace");
    let mut matched: Vec<Matched<'_>> = Vec::new();
    EXAMPLES.resolve(&view, &mut matched);
    for m in &matched {
        assert!(m.key.len() <= 4096, "keys are bounded");
    }
});
