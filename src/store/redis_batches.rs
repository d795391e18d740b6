//! Concurrent requests' decisions in one Redis call: while `max_in_flight` calls are under way,
//! the requests that arrive wait, and the first call to finish takes all of them to Redis in one
//! FCALL of `decide_many` (lua/check.lua). Redis runs them one after the other, exactly as that
//! many calls in a row, so every decision and guarantee is a single call's; what is shared is the
//! cost of the call itself (reading, parsing and answering it, and the function's entry), which
//! is most of what a decision costs Redis. An idle store sends each request at once, alone.
//!
//! Only on a single Redis: on a cluster a call must keep to one slot, and the requests of a batch
//! are in many.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ::redis::aio::ConnectionManager;
use ::redis::{ErrorKind, RedisError, Value};
use tokio::sync::oneshot;

use super::redis::{LIBRARY_SOURCE, MANY_FUNCTION_NAME, REPLY_PER_RULE, function_missing, functions_unsupported};

/// Requests per call, and their keys: a call's size stays far below what Redis reads at once.
const MAX_BATCH_REQUESTS: usize = 64;
const MAX_BATCH_KEYS: usize = 256;

/// How a batched decision went.
pub(super) enum Outcome {
    /// The request's own reply, as `decide` would have given it.
    Reply(Value),
    Failed(RedisError),
    /// Redis has no Functions: decide this request on its own (EVALSHA).
    Unbatched,
}

struct Waiting {
    keys: Vec<Vec<u8>>,
    /// `decide`'s arguments: now, then two per rule.
    args: Vec<String>,
    reply: oneshot::Sender<Outcome>,
}

struct Queue {
    waiting: Vec<Waiting>,
    in_flight: usize,
}

pub(super) struct Batches {
    manager: ConnectionManager,
    /// The store's: cleared once Redis says it has no Functions.
    functions: Arc<AtomicBool>,
    max_in_flight: usize,
    timeout: Duration,
    queue: parking_lot::Mutex<Queue>,
    /// Calls made, and the decisions they carried (for metrics: their ratio is the mean batch).
    pub calls: AtomicU64,
    pub decisions: AtomicU64,
}

impl Batches {
    pub fn new(
        manager: ConnectionManager,
        functions: Arc<AtomicBool>,
        max_in_flight: usize,
        timeout: Duration,
    ) -> Batches {
        Batches {
            manager,
            functions,
            max_in_flight: max_in_flight.max(1),
            timeout,
            queue: parking_lot::Mutex::new(Queue { waiting: Vec::new(), in_flight: 0 }),
            calls: AtomicU64::new(0),
            decisions: AtomicU64::new(0),
        }
    }

    /// Decides one request (its keys and `decide` arguments) in the next call.
    pub async fn decide(self: &Arc<Self>, keys: Vec<Vec<u8>>, args: Vec<String>) -> Outcome {
        let (reply, answer) = oneshot::channel();
        let batch = {
            let mut queue = self.queue.lock();
            queue.waiting.push(Waiting { keys, args, reply });
            if queue.in_flight < self.max_in_flight {
                queue.in_flight += 1;
                Some(take_batch(&mut queue.waiting))
            } else {
                None
            }
        };
        if let Some(batch) = batch {
            // Its own task: the call decides every request in it, so no one request's
            // cancellation (its client gone, its deadline) may drop it.
            tokio::spawn(self.clone().run(batch));
        }
        answer
            .await
            .unwrap_or_else(|_| Outcome::Failed(RedisError::from((ErrorKind::Client, "the batched call was dropped"))))
    }

    /// Calls Redis with `batch`, then with every batch that gathered meanwhile, until none waits.
    async fn run(self: Arc<Self>, mut batch: Vec<Waiting>) {
        let slot = InFlight(&self.queue);
        loop {
            self.call(batch).await;
            let next = {
                let mut queue = self.queue.lock();
                let next = take_batch(&mut queue.waiting);
                if next.is_empty() {
                    // Under the lock that saw the queue empty: a request queued after this finds
                    // the slot free and starts a call itself.
                    queue.in_flight -= 1;
                    std::mem::forget(slot);
                    return;
                }
                next
            };
            batch = next;
        }
    }

    async fn call(&self, batch: Vec<Waiting>) {
        if !self.functions.load(Ordering::Relaxed) {
            return unbatched(batch);
        }
        let mut fcall = ::redis::cmd("FCALL");
        let keys: usize = batch.iter().map(|w| w.keys.len()).sum();
        fcall.arg(&*MANY_FUNCTION_NAME).arg(keys);
        for waiting in &batch {
            fcall.arg(&waiting.keys);
        }
        fcall.arg(batch.len());
        for waiting in &batch {
            fcall.arg(&waiting.args[0]).arg(waiting.keys.len()).arg(&waiting.args[1..]);
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

    /// FCALL, loading the library first when Redis lacks it.
    async fn query(&self, fcall: &::redis::Cmd) -> Result<Value, RedisError> {
        let mut manager = self.manager.clone();
        match fcall.query_async(&mut manager).await {
            Err(error) if function_missing(&error) => {
                let mut load = ::redis::cmd("FUNCTION");
                load.arg("LOAD").arg("REPLACE").arg(&*LIBRARY_SOURCE);
                load.query_async::<Value>(&mut manager).await?;
                fcall.query_async(&mut manager).await
            }
            result => result,
        }
    }
}

/// Gives the call's slot back if its task ends abnormally (a panic), so that the store cannot
/// run out of calls; the normal end gives it back under the queue's lock itself.
struct InFlight<'a>(&'a parking_lot::Mutex<Queue>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
    }
}

/// The oldest waiting requests, as many as one call may carry.
fn take_batch(waiting: &mut Vec<Waiting>) -> Vec<Waiting> {
    // One whose deadline passed while it waited was answered by its failure mode already: sending
    // it now would spend its limit for a request that is gone.
    waiting.retain(|w| !w.reply.is_closed());
    let mut count = 0;
    let mut keys = 0;
    for w in waiting.iter() {
        if count == MAX_BATCH_REQUESTS || (count > 0 && keys + w.keys.len() > MAX_BATCH_KEYS) {
            break;
        }
        count += 1;
        keys += w.keys.len();
    }
    if count == waiting.len() {
        return std::mem::take(waiting);
    }
    let rest = waiting.split_off(count);
    std::mem::replace(waiting, rest)
}

/// Splits the concatenated replies: 1 + 5 per rule each.
fn deliver(batch: Vec<Waiting>, values: Vec<Value>) {
    let expected: usize = batch.iter().map(|w| 1 + REPLY_PER_RULE * w.keys.len()).sum();
    if values.len() != expected {
        let error = RedisError::from((ErrorKind::UnexpectedReturnType, "a batched call's reply has the wrong length"));
        return fail(batch, &error);
    }
    let mut values = values.into_iter();
    for waiting in batch {
        let reply: Vec<Value> = values.by_ref().take(1 + REPLY_PER_RULE * waiting.keys.len()).collect();
        // A receiver gone (its deadline passed) needs no answer.
        let _ = waiting.reply.send(Outcome::Reply(Value::Array(reply)));
    }
}

fn fail(batch: Vec<Waiting>, error: &RedisError) {
    for waiting in batch {
        let _ = waiting.reply.send(Outcome::Failed(error.clone()));
    }
}

fn unbatched(batch: Vec<Waiting>) {
    for waiting in batch {
        let _ = waiting.reply.send(Outcome::Unbatched);
    }
}
