//! Requests in flight against the adaptive limit, by class.
//!
//! Each class may fill the limit up to its share: `critical` all of it, `default` and
//! `sheddable` a declared part (80% and 50% unless configured). So as load grows, sheddable
//! requests are refused first (past half the limit), then default ones, and the last part of the
//! limit stays for critical requests. A critical request over the limit may wait, in a bounded
//! queue and for a bounded time, for a slot to free up.

use super::Class;
use super::gradient::{Estimate, Gradient, GradientConfig};
use crate::duration::Micros;

#[derive(Clone, Debug, PartialEq)]
pub struct ShedderConfig {
    pub gradient: GradientConfig,
    /// The share of the limit `default` requests may fill (0..=1).
    pub default_share: f64,
    /// The share of the limit `sheddable` requests may fill (0..=1).
    pub sheddable_share: f64,
    /// How many critical requests may wait for a slot at once (0: none wait).
    pub critical_queue: u32,
    /// Decide and count, never refuse.
    pub shadow: bool,
}

impl Default for ShedderConfig {
    fn default() -> Self {
        ShedderConfig {
            gradient: GradientConfig::default(),
            default_share: 0.8,
            sheddable_share: 0.5,
            critical_queue: 0,
            shadow: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead: a slot is taken, give it back with [`Shedder::done`].
    Admit,
    /// Shadow mode: admitted (a slot is taken) though over its class's share; counted.
    WouldShed,
    /// Wait (critical, queue not full), then ask [`Shedder::retry`]; [`Shedder::give_up`] at the
    /// deadline.
    Wait,
    /// Refuse (503).
    Shed,
}

/// Counts by class, for metrics: index by [`class_index`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ByClass {
    pub critical: u64,
    pub default: u64,
    pub sheddable: u64,
}

impl ByClass {
    fn add(&mut self, class: Class) {
        match class {
            Class::Critical => self.critical += 1,
            Class::Default => self.default += 1,
            Class::Sheddable => self.sheddable += 1,
        }
    }

    pub fn get(&self, class: Class) -> u64 {
        match class {
            Class::Critical => self.critical,
            Class::Default => self.default,
            Class::Sheddable => self.sheddable,
        }
    }
}

/// What the admin endpoint shows.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShedderState {
    pub limit: u32,
    pub in_flight: u32,
    pub waiting: u32,
    pub shadow: bool,
    pub estimate: Estimate,
    /// The most each class may have in flight now.
    pub ceilings: ByClass,
    pub shed: ByClass,
    /// In shadow mode: what would have been shed.
    pub would_shed: ByClass,
}

#[derive(Clone, Debug)]
pub struct Shedder {
    config: ShedderConfig,
    gradient: Gradient,
    in_flight: u32,
    waiting: u32,
    shed: ByClass,
    would_shed: ByClass,
}

impl Shedder {
    pub fn new(config: ShedderConfig) -> Shedder {
        Shedder {
            gradient: Gradient::new(config.gradient.clone()),
            config,
            in_flight: 0,
            waiting: 0,
            shed: ByClass::default(),
            would_shed: ByClass::default(),
        }
    }

    pub fn config(&self) -> &ShedderConfig {
        &self.config
    }

    /// The most `class` may have in flight now (at least 1 for critical, so the application is
    /// never cut off entirely).
    pub fn ceiling(&self, class: Class) -> u32 {
        let limit = self.gradient.limit();
        let share = match class {
            Class::Critical => return limit,
            Class::Default => self.config.default_share,
            Class::Sheddable => self.config.sheddable_share,
        };
        (f64::from(limit) * share).floor() as u32
    }

    pub fn try_admit(&mut self, class: Class) -> Admission {
        if self.in_flight < self.ceiling(class) {
            return self.take();
        }
        if class == Class::Critical && self.waiting < self.config.critical_queue && !self.config.shadow {
            self.waiting += 1;
            return Admission::Wait;
        }
        if self.config.shadow {
            self.would_shed.add(class);
            self.take();
            return Admission::WouldShed;
        }
        self.shed.add(class);
        Admission::Shed
    }

    /// A waiting critical request asks again: admitted when a slot is free, else it keeps
    /// waiting.
    pub fn retry(&mut self) -> Admission {
        if self.in_flight < self.ceiling(Class::Critical) {
            self.waiting -= 1;
            return self.take();
        }
        Admission::Wait
    }

    /// A waiting critical request left before its turn (its client went away): its place in the
    /// queue is given back, and nothing was shed.
    pub fn leave(&mut self) {
        self.waiting = self.waiting.saturating_sub(1);
    }

    /// A waiting critical request's deadline passed: it is shed.
    pub fn give_up(&mut self) {
        self.waiting = self.waiting.saturating_sub(1);
        self.shed.add(Class::Critical);
    }

    fn take(&mut self) -> Admission {
        self.in_flight += 1;
        self.gradient.observe_in_flight(self.in_flight);
        Admission::Admit
    }

    /// An admitted request is done with the application at `now`: `latency` is its time to the
    /// response head (`None`: not a sample — the connection failed, or it is a stream whose
    /// length is the client's). `pressure`: the container is past a threshold.
    pub fn done(&mut self, now: Micros, latency: Option<Micros>, pressure: bool) -> Option<Estimate> {
        self.in_flight = self.in_flight.saturating_sub(1);
        latency.and_then(|latency| self.gradient.sample(now, latency, pressure))
    }

    pub fn limit(&self) -> u32 {
        self.gradient.limit()
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Critical requests waiting for a slot.
    pub fn waiting(&self) -> u32 {
        self.waiting
    }

    pub fn state(&self) -> ShedderState {
        ShedderState {
            limit: self.gradient.limit(),
            in_flight: self.in_flight,
            waiting: self.waiting,
            shadow: self.config.shadow,
            estimate: self.gradient.estimate(),
            ceilings: ByClass {
                critical: u64::from(self.ceiling(Class::Critical)),
                default: u64::from(self.ceiling(Class::Default)),
                sheddable: u64::from(self.ceiling(Class::Sheddable)),
            },
            shed: self.shed,
            would_shed: self.would_shed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shedder(limit: f64, queue: u32, shadow: bool) -> Shedder {
        Shedder::new(ShedderConfig {
            gradient: GradientConfig { initial_limit: limit, min_limit: 1.0, ..GradientConfig::default() },
            critical_queue: queue,
            shadow,
            ..ShedderConfig::default()
        })
    }

    #[test]
    fn the_lowest_class_is_shed_first() {
        let mut s = shedder(10.0, 0, false);
        // 5 sheddable fill its half.
        for _ in 0..5 {
            assert_eq!(s.try_admit(Class::Sheddable), Admission::Admit);
        }
        assert_eq!(s.try_admit(Class::Sheddable), Admission::Shed);
        // Default may go on to 8, critical to 10.
        for _ in 0..3 {
            assert_eq!(s.try_admit(Class::Default), Admission::Admit);
        }
        assert_eq!(s.try_admit(Class::Default), Admission::Shed);
        assert_eq!(s.try_admit(Class::Critical), Admission::Admit);
        assert_eq!(s.try_admit(Class::Critical), Admission::Admit);
        assert_eq!(s.try_admit(Class::Critical), Admission::Shed);
        assert_eq!(s.state().shed, ByClass { critical: 1, default: 1, sheddable: 1 });
    }

    #[test]
    fn a_critical_request_waits_in_a_bounded_queue() {
        let mut s = shedder(2.0, 1, false);
        assert_eq!(s.try_admit(Class::Critical), Admission::Admit);
        assert_eq!(s.try_admit(Class::Critical), Admission::Admit);
        assert_eq!(s.try_admit(Class::Critical), Admission::Wait);
        assert_eq!(s.try_admit(Class::Critical), Admission::Shed, "the queue holds one");
        assert_eq!(s.retry(), Admission::Wait);
        s.done(1, Some(1_000), false);
        assert_eq!(s.retry(), Admission::Admit);
        assert_eq!(s.state().waiting, 0);
        assert_eq!(s.try_admit(Class::Critical), Admission::Wait);
        s.give_up();
        assert_eq!(s.state().shed.critical, 2);
    }

    #[test]
    fn shadow_mode_counts_and_admits() {
        let mut s = shedder(2.0, 4, true);
        let admitted: Vec<Admission> = (0..4).map(|_| s.try_admit(Class::Sheddable)).collect();
        assert_eq!(admitted, [Admission::Admit, Admission::WouldShed, Admission::WouldShed, Admission::WouldShed]);
        let state = s.state();
        assert_eq!((state.in_flight, state.would_shed.sheddable, state.shed.sheddable), (4, 3, 0));
    }
}
