//! The one place time is read. Pure code takes `now` as an argument; the edge asks a [`Clock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::duration::Micros;

pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the Unix epoch.
    fn now(&self) -> Micros;
}

/// Wall-clock time. Windows are aligned to the epoch, so this is the real calendar clock, not a
/// monotonic one; the algorithms treat a backwards step as no time passing.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Micros {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as Micros)
    }
}

/// A clock the test moves by hand. Clones share one time.
#[derive(Clone, Debug, Default)]
pub struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    pub fn new(now: Micros) -> FakeClock {
        FakeClock(Arc::new(AtomicU64::new(now)))
    }
    pub fn set(&self, now: Micros) {
        self.0.store(now, Ordering::SeqCst);
    }
    pub fn advance(&self, by: Micros) {
        self.0.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Micros {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_clock_clones_share_time() {
        let clock = FakeClock::new(10);
        let other = clock.clone();
        clock.advance(5);
        assert_eq!(other.now(), 15);
        other.set(3);
        assert_eq!(clock.now(), 3);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now() > 1_577_836_800_000_000);
    }
}
