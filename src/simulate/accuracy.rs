//! How often slidingWindowCounter decides differently from the exact slidingWindowLog with the
//! same limit (docs/accuracy.md).
//!
//! Both algorithms see the same arrivals; each key keeps one state per algorithm, and each state
//! evolves with its own algorithm's decisions, as two deployments of the same policy would. A
//! request the counter admits and the log refuses is *wrongly admitted*; the other way round,
//! *wrongly refused*. The traffic is generated on the fly ([`HeavyTailedTraffic`]): one Poisson
//! process of the total rate, each arrival given to a key drawn from a Zipf distribution, which
//! is the same as independent Poisson clients with heavy-tailed rates.

use rand::{Rng, SeedableRng};

use crate::algorithm::{self, Algorithm, Limit, LimitError, Micros, State};

/// Disagreements of an estimating algorithm with the exact one over some traffic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Accuracy {
    pub decisions: u64,
    /// Admitted by the estimate, refused by the exact algorithm.
    pub wrongly_admitted: u64,
    /// Refused by the estimate, admitted by the exact algorithm.
    pub wrongly_refused: u64,
    pub admitted_exact: u64,
    /// Per key rate class (see [`rate_class`]): decisions and disagreements.
    pub by_rate: Vec<RateClass>,
}

/// Keys whose offered rate is within one power of two of `2^class × the limit's rate`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateClass {
    pub class: i32,
    pub keys: u64,
    pub decisions: u64,
    pub wrong: u64,
}

impl Accuracy {
    pub fn wrong(&self) -> u64 {
        self.wrongly_admitted + self.wrongly_refused
    }

    /// Wrong decisions as a share of all decisions.
    pub fn wrong_share(&self) -> f64 {
        if self.decisions == 0 { 0.0 } else { self.wrong() as f64 / self.decisions as f64 }
    }
}

/// The two limits compared: the same `requests` per `per`, one a sliding counter, one the log.
pub fn limits(requests: u64, per: Micros) -> Result<(Limit, Limit), LimitError> {
    Ok((
        Limit::new(Algorithm::SlidingWindowCounter, requests, per, None, None)?,
        Limit::new(Algorithm::SlidingWindowLog, requests, per, None, None)?,
    ))
}

/// The class of a key offered `offered` requests over `duration`, against a limit of `requests`
/// per `per`: ⌊log2(key rate ÷ limit rate)⌋, so class 0 is up to twice the limit.
pub fn rate_class(offered: u64, duration: Micros, requests: u64, per: Micros) -> i32 {
    let key_rate = offered as f64 / duration.max(1) as f64;
    let limit_rate = requests as f64 / per.max(1) as f64;
    (key_rate / limit_rate).log2().floor() as i32
}

/// Replays `arrivals` (time-ordered `(at, key)`, keys below `keys`) through `estimate` and
/// `exact`, one state per key and algorithm, cost 1 each. `duration` is the traffic's length,
/// for the rate classes.
pub fn compare(
    estimate: &Limit,
    exact: &Limit,
    keys: usize,
    duration: Micros,
    arrivals: impl IntoIterator<Item = (Micros, u32)>,
) -> Accuracy {
    let mut estimated: Vec<Option<State>> = vec![None; keys];
    let mut exacts: Vec<Option<State>> = vec![None; keys];
    let mut offered = vec![0u64; keys];
    let mut wrong = vec![0u64; keys];
    let mut result = Accuracy::default();
    for (at, key) in arrivals {
        let k = key as usize;
        let a = algorithm::decide(estimate, &mut estimated[k], at, 1).allowed;
        let b = algorithm::decide(exact, &mut exacts[k], at, 1).allowed;
        result.decisions += 1;
        result.admitted_exact += u64::from(b);
        offered[k] += 1;
        match (a, b) {
            (true, false) => result.wrongly_admitted += 1,
            (false, true) => result.wrongly_refused += 1,
            _ => continue,
        }
        wrong[k] += 1;
    }
    let mut classes: std::collections::BTreeMap<i32, RateClass> = std::collections::BTreeMap::new();
    for (offered, wrong) in offered.into_iter().zip(wrong).filter(|(o, _)| *o > 0) {
        let class = rate_class(offered, duration, exact.requests(), exact.per());
        let entry = classes.entry(class).or_insert_with(|| RateClass { class, ..RateClass::default() });
        entry.keys += 1;
        entry.decisions += offered;
        entry.wrong += wrong;
    }
    result.by_rate = classes.into_values().collect();
    result
}

/// `total` arrivals over `duration` from `start`, spread over `keys` keys with Zipf weights
/// (key i gets a share ∝ (i+1)^−alpha), reproducible from `seed`.
pub struct HeavyTailedTraffic {
    rng: rand::rngs::StdRng,
    cumulative: Vec<f64>,
    /// Mean gap between arrivals, µs.
    mean_gap: f64,
    now: f64,
    left: u64,
}

impl HeavyTailedTraffic {
    pub fn new(total: u64, keys: usize, duration: Micros, start: Micros, alpha: f64, seed: u64) -> Self {
        let mut cumulative = Vec::with_capacity(keys);
        let mut sum = 0.0;
        for i in 0..keys {
            sum += ((i + 1) as f64).powf(-alpha);
            cumulative.push(sum);
        }
        for c in &mut cumulative {
            *c /= sum;
        }
        HeavyTailedTraffic {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            cumulative,
            mean_gap: duration as f64 / total.max(1) as f64,
            now: start as f64,
            left: total,
        }
    }
}

impl Iterator for HeavyTailedTraffic {
    type Item = (Micros, u32);

    fn next(&mut self) -> Option<(Micros, u32)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // Exponential gaps: a Poisson process of the total rate.
        let u: f64 = self.rng.random::<f64>().max(f64::MIN_POSITIVE);
        self.now += -u.ln() * self.mean_gap;
        let pick: f64 = self.rng.random();
        let key = self.cumulative.partition_point(|&c| c < pick).min(self.cumulative.len() - 1);
        Some((self.now as Micros, key as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;
    /// A multiple of 10 s since the epoch: a window boundary.
    const T0: Micros = 1_700_000_000 * S;

    #[test]
    fn a_trace_with_a_known_answer() {
        // Limit 2 per 10 s. Two requests late in window 0 fill it for both algorithms. At 12 s
        // (20% into window 1) the counter estimates 2 × 0.8 = 1.6 → 1 and admits; the log still
        // holds both in its trailing 10 s and refuses: one wrong admission. At 19.6 s both admit
        // (the counter's estimate is 2 × 0.04 + 1 → 1; the log's window is empty again).
        let (counter, log) = limits(2, 10 * S).unwrap();
        let trace = [(T0 + 9 * S, 0), (T0 + 9_500_000, 0), (T0 + 12 * S, 0), (T0 + 19_600_000, 0)];
        let result = compare(&counter, &log, 1, 20 * S, trace);
        assert_eq!((result.decisions, result.wrongly_admitted, result.wrongly_refused), (4, 1, 0));
        assert_eq!(result.admitted_exact, 3);
        assert_eq!(result.by_rate.iter().map(|c| c.wrong).sum::<u64>(), 1);
    }

    #[test]
    fn under_the_limit_nothing_differs() {
        let (counter, log) = limits(100, 60 * S).unwrap();
        let traffic = HeavyTailedTraffic::new(20_000, 1000, 3600 * S, T0, 1.1, 7);
        let result = compare(&counter, &log, 1000, 3600 * S, traffic);
        assert_eq!(result.decisions, 20_000);
        assert_eq!(result.wrong(), 0, "the hottest key offers ~1.6/s against a limit of 1.67/s: {result:?}");
    }

    #[test]
    fn traffic_is_ordered_heavy_tailed_and_reproducible() {
        let a: Vec<_> = HeavyTailedTraffic::new(10_000, 100, 100 * S, T0, 1.2, 3).collect();
        let b: Vec<_> = HeavyTailedTraffic::new(10_000, 100, 100 * S, T0, 1.2, 3).collect();
        assert_eq!(a, b);
        assert!(a.windows(2).all(|w| w[0].0 <= w[1].0), "time-ordered");
        let first = a.iter().filter(|(_, k)| *k == 0).count();
        let last = a.iter().filter(|(_, k)| *k == 99).count();
        assert!(first > 20 * last.max(1), "key 0 far hotter than key 99: {first} vs {last}");
        let span = a.last().unwrap().0 - T0;
        assert!((90 * S..110 * S).contains(&span), "about the duration: {span}");
    }
}
