//! The wire format of the decision library: the arguments each call sends (lua/check.lua's
//! KEYS/ARGV contract) and how its replies and Redis's errors are read.

use ::redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::library::{ARGS_PER_RULE, REPLY_PER_RULE};
use crate::algorithm::{Algorithm, Decision, Micros};
use crate::rule::RuleCheck;
use crate::rule::Verdict;
use crate::store::{LeaseOp, StoreError};

/// The script's algorithm codes (lua/check.lua).
pub fn algorithm_code(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::TokenBucket => 1,
        Algorithm::Gcra => 2,
        Algorithm::LeakyBucket => 3,
        Algorithm::FixedWindow => 4,
        Algorithm::SlidingWindowLog => 5,
        Algorithm::SlidingWindowCounter => 6,
        Algorithm::Concurrency => 7,
    }
}

/// ARGV of the decision call: `now` (or "" for Redis TIME), then per rule its parameters as one
/// text (which the library parses once per rule and keeps) and the cost.
pub fn script_args(now: Option<Micros>, checks: &[RuleCheck<'_>]) -> Vec<String> {
    let mut args = Vec::with_capacity(2 + ARGS_PER_RULE * checks.len());
    args.push(now.map_or_else(String::new, |n| n.to_string()));
    // Every check of a request carries the request's hold id (or none).
    let hold = checks.iter().map(|c| c.hold).find(|&h| h != 0);
    args.push(hold.map_or_else(String::new, |h| h.to_string()));
    for check in checks {
        args.push(rule_params(check.limit, check.enforce));
        args.push(check.cost.to_string());
    }
    args
}

/// A rule's parameters as the library takes them (lua/check.lua): "algorithm:requests:per_us:
/// burst:interval_us:max_delay_us:enforce", then ":ttl_us" for a rule that reserves.
pub fn rule_params(limit: &crate::algorithm::Limit, enforce: bool) -> String {
    use std::fmt::Write as _;
    let mut params = String::with_capacity(56);
    let _ = write!(
        params,
        "{}:{}:{}:{}:{}:{}:{}",
        algorithm_code(limit.algorithm()),
        limit.requests(),
        limit.per(),
        limit.burst(),
        limit.interval(),
        limit.max_delay().map_or(-1, |d| d as i64),
        u8::from(enforce)
    );
    if let Some(ttl) = limit.reservation_ttl() {
        let _ = write!(params, ":{ttl}");
    }
    if limit.leased() {
        params.push_str(":L");
    }
    params
}

/// ARGV of the lease call (lua/check.lua `lease`): `now`, then seven per key.
pub fn lease_args(now: Option<Micros>, ops: &[LeaseOp<'_>]) -> Vec<String> {
    let hold = |h: crate::algorithm::HoldId| if h == 0 { String::new() } else { h.to_string() };
    let mut args = Vec::with_capacity(1 + 7 * ops.len());
    args.push(now.map_or_else(String::new, |n| n.to_string()));
    for op in ops {
        args.push(rule_params(op.limit, true));
        let (settled, used) = op.settle.unwrap_or((0, 0));
        args.push(hold(settled));
        args.push(used.to_string());
        let ask = op.ask.unwrap_or(crate::algorithm::lease::LeaseAsk { hold: 0, want: 0, cap: 0, ttl: 0 });
        args.push(hold(ask.hold));
        args.push(ask.want.to_string());
        args.push(ask.cap.to_string());
        args.push(ask.ttl.to_string());
    }
    args
}

/// Interprets the lease call's reply: five integers per key (granted, lasts_us, remaining,
/// reset_after_us, live holds).
pub fn parse_lease_reply(reply: &Value, ops: usize) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array reply to lease, got {}", value_kind(reply))));
    };
    if items.len() != 5 * ops {
        return Err(StoreError::Protocol(format!("lease answered {} values for {ops} keys", items.len())));
    }
    let int = |v: &Value| match v {
        Value::Int(n) if *n >= 0 => Ok(*n as u64),
        other => Err(StoreError::Protocol(format!("lease answered {}", value_kind(other)))),
    };
    items
        .chunks(5)
        .map(|c| {
            let remaining = int(&c[2])?;
            Ok(crate::algorithm::lease::LeaseGrant {
                amount: int(&c[0])?,
                lasts: int(&c[1])?,
                holders: int(&c[4])?,
                after: Decision { allowed: true, remaining, reset_after: int(&c[3])?, retry_after: None, delay: 0 },
            })
        })
        .collect()
}

/// How many integers the decision of a request of `rules` rules answers.
pub fn reply_len(rules: usize) -> usize {
    2 + REPLY_PER_RULE * rules
}

/// Interprets the script's reply: `{allowed, then per rule: allowed, remaining, reset_after_us,
/// retry_after_us (-1 = none), delay_us, then the decision's now (µs)}`.
pub fn parse_reply(reply: &Value, rules: usize) -> Result<Verdict, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Protocol(format!("expected an array reply, got {}", value_kind(reply))));
    };
    let expected = reply_len(rules);
    if items.len() != expected {
        return Err(StoreError::Protocol(format!("expected {expected} values for {rules} rules, got {}", items.len())));
    }
    let ints = items
        .iter()
        .map(|v| match v {
            Value::Int(i) => Ok(*i),
            other => Err(StoreError::Protocol(format!("expected integers, got {}", value_kind(other)))),
        })
        .collect::<Result<Vec<i64>, _>>()?;
    let flag = |i: i64| match i {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(StoreError::Protocol(format!("expected 0 or 1, got {other}"))),
    };
    let count = |i: i64| u64::try_from(i).map_err(|_| StoreError::Protocol(format!("expected a count, got {i}")));
    let at = count(ints[expected - 1])?;
    let decisions = ints[1..expected - 1]
        .chunks_exact(REPLY_PER_RULE)
        .map(|d| {
            Ok(Decision {
                allowed: flag(d[0])?,
                remaining: count(d[1])?,
                reset_after: count(d[2])?,
                retry_after: if d[3] == -1 { None } else { Some(count(d[3])?) },
                delay: count(d[4])?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Verdict { allowed: flag(ints[0])?, decisions, cached_denial: None, at: Some(at) })
}

pub(super) fn value_kind(value: &Value) -> &'static str {
    match value {
        Value::Nil => "nil",
        Value::Int(_) => "an integer",
        Value::BulkString(_) | Value::SimpleString(_) | Value::VerbatimString { .. } => "a string",
        Value::Array(_) | Value::Set(_) => "an array",
        Value::Okay => "OK",
        Value::Map(_) | Value::Attribute { .. } => "a map",
        Value::Double(_) => "a double",
        Value::Boolean(_) => "a boolean",
        _ => "another type",
    }
}

/// Maps a client error to a store error, and says whether it means Redis is down or unreachable
/// (which counts towards opening the breaker) rather than a bad answer from a live server.
pub fn classify(error: &RedisError) -> (StoreError, bool) {
    let store_down = error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || matches!(
            error.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::AuthenticationFailed
                | ErrorKind::Server(
                    ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::BusyLoading
                        | ServerErrorKind::ReadOnly
                )
        )
        // A script running too long blocks the server for everyone.
        || error.code() == Some("BUSY")
        // Misconfigured credentials or permissions fail every call alike: as good as down (the
        // breaker opens and says so), never a string of one-off protocol errors.
        || refuses_us(error);
    // The error's Display never includes the URL, only the kind and server detail.
    let message = error.to_string();
    if store_down { (StoreError::Unavailable(message), true) } else { (StoreError::Protocol(message), false) }
}

/// Redis refuses our credentials, or a command or key the ACL user is not allowed: also inside
/// the decision code, where Redis 7.0 says so without an error code.
pub fn refuses_us(error: &RedisError) -> bool {
    if matches!(error.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM")) {
        return true;
    }
    let text = error.to_string();
    text.contains("user executing the script can't run this command")
        || text.contains("No permissions to access a key")
        || text.contains("no permissions to run the")
}
