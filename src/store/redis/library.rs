//! The decision code as Redis runs it: the Lua files of `lua/` as one Functions library (and as
//! a script for Redis before 7.0), the names it registers, the shape of its reply, and how Redis
//! says it lacks them. Shared by the store's single calls and its batches.

use std::sync::LazyLock;

use ::redis::RedisError;

/// The decision code: the shared prelude, one file per algorithm, then `decide` (lua/check.lua).
pub const DECISION_CODE: &str = concat!(
    include_str!("../../../lua/common.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/gcra.lua"),
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_window_log.lua"),
    include_str!("../../../lua/sliding_window_counter.lua"),
    include_str!("../../../lua/concurrency.lua"),
    include_str!("../../../lua/reservation.lua"),
    include_str!("../../../lua/check.lua"),
    include_str!("../../../lua/deferred.lua"),
);

/// `sluice_` and 16 hex digits of the code's SHA-256: the library's name and its function's.
pub static FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(DECISION_CODE.as_bytes());
    format!("sluice_{}", digest[..8].iter().map(|b| format!("{b:02x}")).collect::<String>())
});

/// [`FUNCTION_NAME`] with `_many`: `decide_many`, several requests in one call.
pub static MANY_FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_many", &*FUNCTION_NAME));

/// [`FUNCTION_NAME`] with `_settle`: `settle`, a request's holds given back or settled.
pub static SETTLE_FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_settle", &*FUNCTION_NAME));

/// [`FUNCTION_NAME`] with `_cancel`: `cancel`, shaped slots whose callers went away given back.
pub static CANCEL_FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_cancel", &*FUNCTION_NAME));

/// [`FUNCTION_NAME`] with `_deferred`: `deferred`, the queues of `deferIfLimited` rules.
pub static DEFERRED_FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_deferred", &*FUNCTION_NAME));

/// [`FUNCTION_NAME`] with `_lease`: `lease`, a holder's quota leases settled and granted.
pub static LEASE_FUNCTION_NAME: LazyLock<String> = LazyLock::new(|| format!("{}_lease", &*FUNCTION_NAME));

/// What FUNCTION LOAD takes: the code registering `decide` as [`FUNCTION_NAME`], `decide_many`
/// as [`MANY_FUNCTION_NAME`] and `settle` as [`SETTLE_FUNCTION_NAME`].
pub static LIBRARY_SOURCE: LazyLock<String> = LazyLock::new(|| {
    let name = &*FUNCTION_NAME;
    let many = &*MANY_FUNCTION_NAME;
    let settle = &*SETTLE_FUNCTION_NAME;
    let lease = &*LEASE_FUNCTION_NAME;
    let cancel = &*CANCEL_FUNCTION_NAME;
    let deferred = &*DEFERRED_FUNCTION_NAME;
    format!(
        "#!lua name={name}\n{DECISION_CODE}\nredis.register_function('{name}', decide)\nredis.register_function('{many}', decide_many)\nredis.register_function('{settle}', settle)\nredis.register_function('{lease}', lease)\nredis.register_function('{cancel}', cancel)\nredis.register_function('{deferred}', deferred)\n"
    )
});

/// The same code as a script, for Redis before 7.0. Scripts that read TIME and then write must
/// ask for effects replication there.
pub static SCRIPT_SOURCE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{DECISION_CODE}\nif redis.replicate_commands then\n  redis.replicate_commands()\nend\nreturn decide(KEYS, ARGV)\n"
    )
});

/// `settle` as a script, for Redis before 7.0.
pub static SETTLE_SCRIPT_SOURCE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{DECISION_CODE}\nif redis.replicate_commands then\n  redis.replicate_commands()\nend\nreturn settle(KEYS, ARGV)\n"
    )
});

/// `cancel` as a script, for Redis before 7.0.
pub static CANCEL_SCRIPT_SOURCE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{DECISION_CODE}\nif redis.replicate_commands then\n  redis.replicate_commands()\nend\nreturn cancel(KEYS, ARGV)\n"
    )
});

/// `deferred` as a script, for Redis before 7.0.
pub static DEFERRED_SCRIPT_SOURCE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{DECISION_CODE}\nif redis.replicate_commands then\n  redis.replicate_commands()\nend\nreturn deferred(KEYS, ARGV)\n"
    )
});

/// `lease` as a script, for Redis before 7.0.
pub static LEASE_SCRIPT_SOURCE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{DECISION_CODE}\nif redis.replicate_commands then\n  redis.replicate_commands()\nend\nreturn lease(KEYS, ARGV)\n"
    )
});

/// Arguments the script takes per rule (see lua/check.lua).
pub const ARGS_PER_RULE: usize = 2;
/// Values the script returns per rule, after the overall flag.
pub const REPLY_PER_RULE: usize = 5;

/// Redis has no function by that name (never loaded here, or lost with a restart or failover).
pub fn function_missing(error: &RedisError) -> bool {
    error.to_string().contains("Function not found")
}

/// Redis before 7.0: FCALL is an unknown command.
pub fn functions_unsupported(error: &RedisError) -> bool {
    let text = error.to_string().to_ascii_lowercase();
    text.contains("unknown command") && text.contains("fcall")
}
