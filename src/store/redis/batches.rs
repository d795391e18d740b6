//! Concurrent requests' decisions in one Redis call ([`crate::store::batching`]): while every call is
//! under way, the requests that arrive wait, and the first call to finish takes them to Redis in
//! one FCALL of `decide_many` (lua/check.lua). Redis runs them one after the other, exactly as that
//! many calls in a row, so every decision and guarantee is a single call's; what is shared is the
//! cost of the call itself (reading, parsing and answering it, and the function's entry): about a
//! quarter of what a one-rule decision costs Redis once deep queues fill the calls. Off by default
//! (`--redis-batches 0`): a request that waits for a call to end waits on Redis's round trip, which
//! costs more than it saves while Redis has CPU to spare (docs/benchmarks.md).
//!
//! Only on a single Redis: on a cluster a call must keep to one slot, and the requests of a batch
//! are in many.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ::redis::{ErrorKind, RedisError, Value};

use super::codec::reply_len;
use super::library::{LIBRARY_SOURCE, MANY_FUNCTION_NAME, function_missing, functions_unsupported};
use super::primary::Primary;
use crate::store::batching::{Batcher, Exchange, Pending};

/// One request's decision: its keys, and `decide`'s arguments (now, hold, then two per rule).
pub(super) struct Decide {
    pub keys: Vec<Vec<u8>>,
    pub args: Vec<String>,
}

/// How a batched decision went.
pub(super) enum Outcome {
    /// The request's own reply, as `decide` would have given it.
    Reply(Value),
    Failed(RedisError),
    /// Redis has no Functions: decide this request on its own (EVALSHA); it comes back whole.
    Unbatched(Decide),
}

pub(super) type Batches = Batcher<FunctionCalls>;

pub(super) fn batches(
    primary: Primary,
    functions: Arc<AtomicBool>,
    max_in_flight: usize,
    timeout: Duration,
) -> Batches {
    let calls = FunctionCalls { primary, functions, timeout, calls: AtomicU64::new(0), decisions: AtomicU64::new(0) };
    Batcher::new(calls, max_in_flight)
}

/// Decides one request in the next call.
pub(super) async fn decide(batches: &Arc<Batches>, request: Decide) -> Outcome {
    batches
        .submit(request)
        .await
        .unwrap_or_else(|| Outcome::Failed(RedisError::from((ErrorKind::Client, "the batched call was dropped"))))
}

pub(super) struct FunctionCalls {
    primary: Primary,
    /// The store's: cleared once Redis says it has no Functions.
    functions: Arc<AtomicBool>,
    timeout: Duration,
    /// Calls made, and the decisions they carried (for metrics: their ratio is the mean batch).
    pub calls: AtomicU64,
    pub decisions: AtomicU64,
}

impl Exchange for FunctionCalls {
    type Request = Decide;
    type Answer = Outcome;
    /// A call's size stays far below what Redis reads at once.
    const MAX_REQUESTS: usize = 64;
    const MAX_WEIGHT: usize = 256;

    fn weight(request: &Decide) -> usize {
        request.keys.len()
    }

    async fn call(&self, batch: Vec<Pending<Decide, Outcome>>) {
        if !self.functions.load(Ordering::Relaxed) {
            return unbatched(batch);
        }
        let mut fcall = ::redis::cmd("FCALL");
        let keys: usize = batch.iter().map(|p| p.request.keys.len()).sum();
        fcall.arg(&*MANY_FUNCTION_NAME).arg(keys);
        for pending in &batch {
            fcall.arg(&pending.request.keys);
        }
        fcall.arg(batch.len());
        for pending in &batch {
            // `decide`'s arguments: now, hold, then the rules'; `decide_many` wants the rule
            // count between the hold and the rules.
            let Decide { keys, args } = &pending.request;
            fcall.arg(&args[0]).arg(&args[1]).arg(keys.len()).arg(&args[2..]);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.decisions.fetch_add(batch.len() as u64, Ordering::Relaxed);
        let result = match tokio::time::timeout(self.timeout, self.query(&fcall)).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from((ErrorKind::Io, "the batched call timed out"))),
        };
        match result {
            Ok(Value::Array(values)) => deliver(batch, values),
            Ok(other) => {
                let error =
                    RedisError::from((ErrorKind::UnexpectedReturnType, "a batched call's reply is not an array"));
                tracing::debug!(reply = ?other, "unexpected batched reply");
                fail(batch, &error)
            }
            Err(error) if functions_unsupported(&error) => {
                self.functions.store(false, Ordering::Relaxed);
                unbatched(batch)
            }
            Err(error) => fail(batch, &error),
        }
    }
}

impl FunctionCalls {
    /// FCALL, loading the library first when Redis lacks it.
    async fn query(&self, fcall: &::redis::Cmd) -> Result<Value, RedisError> {
        let mut manager = self.primary.manager().await?;
        let result = match fcall.query_async(&mut manager).await {
            Err(error) if function_missing(&error) => {
                let mut load = ::redis::cmd("FUNCTION");
                load.arg("LOAD").arg("REPLACE").arg(&*LIBRARY_SOURCE);
                load.query_async::<Value>(&mut manager).await?;
                fcall.query_async(&mut manager).await
            }
            result => result,
        };
        self.primary.heard(&result);
        result
    }
}

/// Splits the concatenated replies: 2 + 5 per rule each.
fn deliver(batch: Vec<Pending<Decide, Outcome>>, values: Vec<Value>) {
    let expected: usize = batch.iter().map(|p| reply_len(p.request.keys.len())).sum();
    if values.len() != expected {
        let error = RedisError::from((ErrorKind::UnexpectedReturnType, "a batched call's reply has the wrong length"));
        return fail(batch, &error);
    }
    let mut values = values.into_iter();
    for pending in batch {
        let reply: Vec<Value> = values.by_ref().take(reply_len(pending.request.keys.len())).collect();
        pending.answer(Outcome::Reply(Value::Array(reply)));
    }
}

fn fail(batch: Vec<Pending<Decide, Outcome>>, error: &RedisError) {
    for pending in batch {
        pending.answer(Outcome::Failed(error.clone()));
    }
}

fn unbatched(batch: Vec<Pending<Decide, Outcome>>) {
    for pending in batch {
        let (request, replier) = pending.into_parts();
        replier.answer(Outcome::Unbatched(request));
    }
}
