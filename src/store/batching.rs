//! Requests that wait while every call is busy go together in the next call: up to
//! `max_in_flight` calls are under way at once, the requests that arrive meanwhile queue, and the
//! first call to finish takes the queue (as much of it as one call may carry) in one more call.
//! An idle batcher sends each request at once, alone: batching adds no wait, it only fills the
//! calls that load makes wait anyway.
//!
//! Used for the Redis store's calls (`store::redis::batches`) and the sidecar's exchanges with the
//! endpoint (`sidecar::batch`); what a call is, and how its answer is split, is theirs.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::oneshot;

/// What one call carries and how it is made.
pub trait Exchange: Send + Sync + 'static {
    /// One request's part of a call.
    type Request: Send + 'static;
    /// What one request gets back.
    type Answer: Send + 'static;

    /// Requests per call.
    const MAX_REQUESTS: usize;
    /// The summed [`Exchange::weight`] of a call's requests (a first request always goes, whatever
    /// its weight).
    const MAX_WEIGHT: usize;

    /// A request's share of a call's size (keys, bytes).
    fn weight(request: &Self::Request) -> usize;

    /// Makes one call for `batch` and answers each of its requests.
    fn call(&self, batch: Vec<Pending<Self::Request, Self::Answer>>) -> impl Future<Output = ()> + Send;
}

/// A queued request and where its answer goes.
pub struct Pending<Q, A> {
    pub request: Q,
    reply: oneshot::Sender<A>,
}

impl<Q, A> Pending<Q, A> {
    /// A request whose caller is gone (its deadline passed) needs no answer, so sending never fails.
    pub fn answer(self, answer: A) {
        let _ = self.reply.send(answer);
    }

    /// Splits off the request, keeping where its answer goes.
    pub fn into_parts(self) -> (Q, Replier<A>) {
        (self.request, Replier(self.reply))
    }
}

/// Where one request's answer goes, once its request was taken out.
pub struct Replier<A>(oneshot::Sender<A>);

impl<A> Replier<A> {
    pub fn answer(self, answer: A) {
        let _ = self.0.send(answer);
    }
}

struct Queue<Q, A> {
    waiting: Vec<Pending<Q, A>>,
    /// Calls under way; each one, when done, takes the next batch from `waiting`.
    in_flight: usize,
}

pub struct Batcher<E: Exchange> {
    exchange: E,
    max_in_flight: usize,
    queue: parking_lot::Mutex<Queue<E::Request, E::Answer>>,
}

impl<E: Exchange> Batcher<E> {
    /// At least one call is always allowed.
    pub fn new(exchange: E, max_in_flight: usize) -> Batcher<E> {
        Batcher {
            exchange,
            max_in_flight: max_in_flight.max(1),
            queue: parking_lot::Mutex::new(Queue { waiting: Vec::new(), in_flight: 0 }),
        }
    }

    pub fn exchange(&self) -> &E {
        &self.exchange
    }

    /// `request`'s answer from the next call; `None` if the call that carried it ended without
    /// answering (its task panicked).
    pub async fn submit(self: &Arc<Self>, request: E::Request) -> Option<E::Answer> {
        let (reply, answer) = oneshot::channel();
        let batch = {
            let mut queue = self.queue.lock();
            queue.waiting.push(Pending { request, reply });
            if queue.in_flight < self.max_in_flight {
                queue.in_flight += 1;
                Some(take_batch::<E>(&mut queue.waiting))
            } else {
                None
            }
        };
        if let Some(batch) = batch {
            // Its own task: the call answers every request in it, so no one request's
            // cancellation (its client gone, its deadline) may drop it.
            tokio::spawn(self.clone().run(batch));
        }
        answer.await.ok()
    }

    /// Calls with `batch`, then with every batch that gathered meanwhile, until none waits.
    async fn run(self: Arc<Self>, mut batch: Vec<Pending<E::Request, E::Answer>>) {
        let slot = InFlight(&self.queue);
        loop {
            self.exchange.call(batch).await;
            let mut queue = self.queue.lock();
            batch = take_batch::<E>(&mut queue.waiting);
            if batch.is_empty() {
                // Under the lock that saw the queue empty: a request queued after this finds the
                // slot free and starts a call itself.
                queue.in_flight -= 1;
                std::mem::forget(slot);
                return;
            }
        }
    }
}

/// Gives the call's slot back if its task ends abnormally (a panic), so that the batcher cannot
/// run out of calls; the normal end gives it back under the queue's lock itself.
struct InFlight<'a, Q, A>(&'a parking_lot::Mutex<Queue<Q, A>>);

impl<Q, A> Drop for InFlight<'_, Q, A> {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
    }
}

/// The oldest waiting requests, as many as one call may carry.
fn take_batch<E: Exchange>(waiting: &mut Vec<Pending<E::Request, E::Answer>>) -> Vec<Pending<E::Request, E::Answer>> {
    // One whose deadline passed while it waited was answered by its failure mode already: sending
    // it now would spend its limit for a request that is gone.
    waiting.retain(|pending| !pending.reply.is_closed());
    let mut count = 0;
    let mut weight = 0;
    for pending in waiting.iter() {
        let next = E::weight(&pending.request);
        if count == E::MAX_REQUESTS || (count > 0 && weight + next > E::MAX_WEIGHT) {
            break;
        }
        count += 1;
        weight += next;
    }
    if count == waiting.len() {
        return std::mem::take(waiting);
    }
    let rest = waiting.split_off(count);
    std::mem::replace(waiting, rest)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Answers each request with its call's number after holding the call `hold`.
    struct Numbered {
        calls: AtomicUsize,
        hold: Duration,
        sizes: parking_lot::Mutex<Vec<usize>>,
    }

    impl Exchange for Numbered {
        type Request = usize;
        type Answer = usize;
        const MAX_REQUESTS: usize = 4;
        const MAX_WEIGHT: usize = 10;

        fn weight(request: &usize) -> usize {
            *request
        }

        async fn call(&self, batch: Vec<Pending<usize, usize>>) {
            let number = self.calls.fetch_add(1, Ordering::SeqCst);
            self.sizes.lock().push(batch.len());
            tokio::time::sleep(self.hold).await;
            for pending in batch {
                pending.answer(number);
            }
        }
    }

    fn batcher(hold: Duration, max_in_flight: usize) -> Arc<Batcher<Numbered>> {
        let exchange = Numbered { calls: AtomicUsize::new(0), hold, sizes: parking_lot::Mutex::new(Vec::new()) };
        Arc::new(Batcher::new(exchange, max_in_flight))
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_batcher_sends_each_request_alone() {
        let batcher = batcher(Duration::from_millis(1), 1);
        for expected in 0..3 {
            assert_eq!(batcher.submit(1).await, Some(expected));
        }
        assert_eq!(*batcher.exchange().sizes.lock(), vec![1, 1, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_that_wait_share_the_next_calls_within_their_bounds() {
        let batcher = batcher(Duration::from_millis(100), 1);
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(1).await }
        });
        tokio::task::yield_now().await;
        // Nine wait for the first call: by count (4) and weight (10) they fit in three more calls.
        let waiting: Vec<_> = [3, 3, 3, 3, 1, 1, 1, 1, 1]
            .into_iter()
            .map(|weight| {
                let batcher = batcher.clone();
                tokio::spawn(async move { batcher.submit(weight).await })
            })
            .collect();
        assert_eq!(first.await.unwrap(), Some(0));
        let mut answers = Vec::new();
        for waiting in waiting {
            answers.push(waiting.await.unwrap().unwrap());
        }
        assert_eq!(answers, vec![1, 1, 1, 2, 2, 2, 2, 3, 3]);
        assert_eq!(*batcher.exchange().sizes.lock(), vec![1, 3, 4, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_whose_caller_left_is_not_sent() {
        let batcher = batcher(Duration::from_millis(100), 1);
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(1).await }
        });
        tokio::task::yield_now().await;
        let gone = tokio::spawn({
            let batcher = batcher.clone();
            async move { tokio::time::timeout(Duration::from_millis(10), batcher.submit(1)).await }
        });
        let kept = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(1).await }
        });
        assert!(gone.await.unwrap().is_err());
        assert_eq!(first.await.unwrap(), Some(0));
        assert_eq!(kept.await.unwrap(), Some(1));
        assert_eq!(*batcher.exchange().sizes.lock(), vec![1, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_panics_gives_its_slot_back() {
        struct Panics;
        impl Exchange for Panics {
            type Request = bool;
            type Answer = ();
            const MAX_REQUESTS: usize = 1;
            const MAX_WEIGHT: usize = 1;
            fn weight(_: &bool) -> usize {
                1
            }
            async fn call(&self, batch: Vec<Pending<bool, ()>>) {
                for pending in batch {
                    if pending.request {
                        panic!("a call that fails abnormally");
                    }
                    pending.answer(());
                }
            }
        }
        let batcher = Arc::new(Batcher::new(Panics, 1));
        assert_eq!(batcher.submit(true).await, None);
        assert_eq!(batcher.submit(false).await, Some(()));
    }
}
