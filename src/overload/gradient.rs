//! The adaptive concurrency limit: Netflix's Gradient2 (concurrency-limits,
//! `Gradient2Limit`), chosen over the alternatives for the failure modes it avoids.
//!
//! Each window (at least `window` long and `min_samples` responses) gives one latency sample,
//! the window's mean. A long-term exponential average of those samples is the latency the
//! application has when it is not queueing; the gradient `tolerance × long / short`, clamped to
//! `[0.5, 1]`, says how much of the recent latency is queueing. The new limit is
//! `limit × gradient + queue`, smoothed, within `[min_limit, max_limit]`.
//!
//! - **No minRTT re-measurement.** Envoy's gradient filter re-measures its minimum latency by
//!   dropping to a tiny limit every interval, shedding a burst of requests each time; Gradient2
//!   compares against the long average and never does.
//! - **A slow drift upwards is undone.** When the long average is more than twice the recent
//!   latency (the application got faster, or the long average grew during an overload), it
//!   decays toward the recent one, so the limit does not stay high on stale latency.
//! - **No runaway while under-used.** The limit only grows while the application is actually
//!   using at least half of it: at 0.7× of capacity the limit holds instead of climbing to
//!   `max_limit` (from which a later overload would need many windows to come down).
//! - **Refusals do not bias the estimate.** Only responses of the application are samples: a
//!   request the sidecar shed, a failed connection and a stream (WebSocket, server-sent events,
//!   whose duration is the client's) are not.
//! - **Pressure from the container**: when its cgroup reports CPU or memory pressure past the
//!   configured thresholds, a window lowers the limit by a tenth and never raises it.

use crate::duration::Micros;

#[derive(Clone, Debug, PartialEq)]
pub struct GradientConfig {
    pub initial_limit: f64,
    pub min_limit: f64,
    pub max_limit: f64,
    /// How much queueing latency is tolerated before the limit comes down: 1.2 lets the recent
    /// latency reach 1.2× the long average (Netflix's default is 1.5; scripts/bench/overload.sh
    /// measured 1.2 keeping p99 under 2× the unloaded one at 4× overload, at the same goodput).
    pub tolerance: f64,
    /// Weight of each window's new limit (0.2: a window moves the limit a fifth of the way).
    pub smoothing: f64,
    /// Samples the long average spans (an exponential average over about this many windows).
    pub long_window: f64,
    /// A window lasts at least this long…
    pub window: Micros,
    /// …and holds at least this many responses.
    pub min_samples: u32,
}

impl Default for GradientConfig {
    fn default() -> Self {
        GradientConfig {
            initial_limit: 20.0,
            min_limit: 4.0,
            max_limit: 1000.0,
            tolerance: 1.2,
            smoothing: 0.2,
            long_window: 600.0,
            window: 500_000,
            min_samples: 10,
        }
    }
}

/// What a window concluded, for metrics and the admin endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Estimate {
    pub limit: f64,
    /// The long-term average latency, milliseconds.
    pub long_latency_ms: f64,
    /// The last window's mean latency, milliseconds.
    pub short_latency_ms: f64,
    pub gradient: f64,
}

#[derive(Clone, Debug)]
pub struct Gradient {
    config: GradientConfig,
    limit: f64,
    /// Long average, microseconds; 0 before the first window.
    long: f64,
    window_start: Option<Micros>,
    window_sum: u64,
    window_count: u32,
    /// The most requests in flight seen during the window.
    window_peak: u32,
    last: Estimate,
}

impl Gradient {
    pub fn new(config: GradientConfig) -> Gradient {
        let limit = config.initial_limit.clamp(config.min_limit, config.max_limit);
        Gradient {
            config,
            limit,
            long: 0.0,
            window_start: None,
            window_sum: 0,
            window_count: 0,
            window_peak: 0,
            last: Estimate { limit, ..Estimate::default() },
        }
    }

    /// The limit now, whole requests (at least 1).
    pub fn limit(&self) -> u32 {
        (self.limit.floor() as u32).max(1)
    }

    pub fn estimate(&self) -> Estimate {
        self.last
    }

    /// Notes that `in_flight` requests are under way (called as each is admitted).
    pub fn observe_in_flight(&mut self, in_flight: u32) {
        self.window_peak = self.window_peak.max(in_flight);
    }

    /// One response of the application that took `latency`, at `now`; `pressure` says whether
    /// the container is past its CPU or memory threshold. Returns the new estimate when this
    /// sample closed a window.
    pub fn sample(&mut self, now: Micros, latency: Micros, pressure: bool) -> Option<Estimate> {
        let start = *self.window_start.get_or_insert(now);
        self.window_sum = self.window_sum.saturating_add(latency);
        self.window_count += 1;
        if now.saturating_sub(start) < self.config.window || self.window_count < self.config.min_samples {
            return None;
        }
        let short = (self.window_sum as f64 / self.window_count as f64).max(1.0);
        let peak = self.window_peak;
        self.window_start = Some(now);
        self.window_sum = 0;
        self.window_count = 0;
        self.window_peak = 0;
        Some(self.update(short, peak, pressure))
    }

    fn update(&mut self, short: f64, peak: u32, pressure: bool) -> Estimate {
        let c = &self.config;
        self.long = if self.long == 0.0 { short } else { self.long + (short - self.long) / c.long_window };
        if self.long / short > 2.0 {
            self.long *= 0.95;
        }
        let gradient = (c.tolerance * self.long / short).clamp(0.5, 1.0);
        let limit = if pressure {
            self.limit * 0.9
        } else if (peak as f64) < self.limit / 2.0 {
            // Not using half of it: no evidence the application could take more.
            self.limit
        } else {
            let queue = self.limit.sqrt().max(1.0);
            let target = self.limit * gradient + queue;
            self.limit * (1.0 - c.smoothing) + target * c.smoothing
        };
        self.limit = limit.clamp(c.min_limit, c.max_limit);
        self.last = Estimate {
            limit: self.limit,
            long_latency_ms: self.long / 1000.0,
            short_latency_ms: short / 1000.0,
            gradient,
        };
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window of `n` responses of `latency` µs with `in_flight` requests under way.
    fn window(g: &mut Gradient, now: &mut Micros, n: u32, latency: Micros, in_flight: u32) -> Option<Estimate> {
        let mut out = None;
        for i in 0..n {
            g.observe_in_flight(in_flight);
            *now += 600_000 / u64::from(n);
            out = g.sample(*now, latency, false).or(out);
            if i == n - 1 && out.is_none() {
                *now += 600_000;
                out = g.sample(*now, latency, false);
            }
        }
        out
    }

    #[test]
    fn steady_latency_at_full_use_grows_the_limit_slowly() {
        let mut g = Gradient::new(GradientConfig::default());
        let mut now = 0;
        let first = g.limit();
        for _ in 0..20 {
            let limit = g.limit();
            window(&mut g, &mut now, 20, 10_000, limit);
        }
        assert!(g.limit() > first, "grows by about sqrt(limit) × smoothing a window: {}", g.limit());
        assert!(g.limit() < 200, "not a runaway: {}", g.limit());
    }

    #[test]
    fn an_idle_application_does_not_grow_the_limit() {
        let mut g = Gradient::new(GradientConfig::default());
        let mut now = 0;
        for _ in 0..50 {
            window(&mut g, &mut now, 20, 10_000, 3);
        }
        assert_eq!(g.limit(), 20, "3 in flight of 20: no evidence for more");
    }

    #[test]
    fn queueing_latency_brings_the_limit_down_within_seconds() {
        let mut g = Gradient::new(GradientConfig { initial_limit: 100.0, ..GradientConfig::default() });
        let mut now = 0;
        for _ in 0..30 {
            window(&mut g, &mut now, 20, 10_000, 100);
        }
        let before = g.limit();
        // Latency quadruples: requests queue in the application.
        let mut windows = 0;
        while g.limit() > before / 2 {
            let limit = g.limit();
            window(&mut g, &mut now, 20, 40_000, limit);
            windows += 1;
            assert!(windows < 20, "limit did not halve: {}", g.limit());
        }
        assert!(windows <= 8, "halved within 8 windows (4 s), took {windows}");
    }

    #[test]
    fn pressure_lowers_the_limit_whatever_the_latency() {
        let mut g = Gradient::new(GradientConfig { initial_limit: 100.0, min_samples: 1, ..GradientConfig::default() });
        g.sample(0, 10_000, true);
        assert!(g.sample(600_000, 10_000, true).is_some());
        assert_eq!(g.limit(), 90);
    }

    #[test]
    fn the_limit_stays_within_its_bounds() {
        let config = GradientConfig { initial_limit: 5.0, min_limit: 4.0, max_limit: 8.0, ..GradientConfig::default() };
        let mut g = Gradient::new(config);
        let mut now = 0;
        for _ in 0..100 {
            window(&mut g, &mut now, 20, 1_000, 100);
        }
        assert_eq!(g.limit(), 8);
        for _ in 0..100 {
            window(&mut g, &mut now, 20, 1_000_000, 100);
        }
        assert_eq!(g.limit(), 4);
    }
}
