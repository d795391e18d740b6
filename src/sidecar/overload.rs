//! The sidecar's protection of its application from overload ([`crate::overload`] decides; this
//! is its edge: the clock, the lock, waiting critical requests, the cgroup files, metrics).
//!
//! Configured by the snapshot: the first policy selecting this workload with `spec.overload`
//! (none: every request passes untouched). A new snapshot with the same `overload` keeps the
//! limit learned so far; a changed one starts afresh.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::metrics::{ClassLabels, SidecarMetrics};
use crate::duration::{Micros, parse_duration};
use crate::overload::Class;
use crate::overload::cgroup::{self, Reading, Thresholds};
use crate::overload::gradient::GradientConfig;
use crate::overload::shedder::{Admission, Shedder, ShedderConfig, ShedderState};
use crate::policy::{DeclaredRefusal, Mode, OverloadSpec};

/// What protects the application now: the policy that asked for it and its shedder.
struct Active {
    policy: String,
    spec: OverloadSpec,
    shedder: Mutex<Shedder>,
    critical_wait: Duration,
    retry_after: Duration,
    jitter: Duration,
    thresholds: Option<Thresholds>,
    /// `overload.refusal`: what a shed request gets instead of the default 503.
    refusal: Option<Arc<DeclaredRefusal>>,
}

pub struct Protection {
    active: arc_swap::ArcSwapOption<Active>,
    /// A slot came free: waiting critical requests ask again.
    freed: Notify,
    /// The container is past a pressure threshold (read every second from its cgroup).
    pressure: AtomicBool,
    started: Instant,
    metrics: Arc<SidecarMetrics>,
    cgroup_root: PathBuf,
}

/// A request under way in the application: give it back with [`Slot::finish`] (or by dropping
/// it, which records no latency).
pub struct Slot {
    protection: Arc<Protection>,
    active: Arc<Active>,
    done: bool,
}

/// A request refused because the application is overloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shed {
    pub class: Class,
    pub retry_after_secs: u64,
    pub refusal: Option<Arc<DeclaredRefusal>>,
}

impl Protection {
    pub fn new(metrics: Arc<SidecarMetrics>, cgroup_root: PathBuf) -> Arc<Protection> {
        Arc::new(Protection {
            active: arc_swap::ArcSwapOption::empty(),
            freed: Notify::new(),
            pressure: AtomicBool::new(false),
            started: Instant::now(),
            metrics,
            cgroup_root,
        })
    }

    fn now(&self) -> Micros {
        self.started.elapsed().as_micros() as Micros
    }

    /// Applies the snapshot's `overload` for this workload (`None`: no protection).
    pub fn configure(&self, wanted: Option<(&str, &OverloadSpec)>) {
        let current = self.active.load();
        match (wanted, current.as_deref()) {
            (None, None) => {}
            (None, Some(_)) => {
                tracing::info!("overload protection off: no policy asks for it any more");
                self.active.store(None);
                self.freed.notify_waiters();
            }
            (Some((policy, spec)), Some(active)) if active.spec == *spec && active.policy == policy => {}
            (Some((policy, spec)), _) => {
                let active = active_of(policy, spec);
                tracing::info!(
                    policy,
                    mode = if active.shedder.lock().config().shadow { "shadow" } else { "enforce" },
                    initial_limit = spec.initial_limit,
                    "overload protection on"
                );
                self.active.store(Some(Arc::new(active)));
                self.freed.notify_waiters();
            }
        }
    }

    /// What the snapshot cache calls as it installs each snapshot: applies its `overload` for
    /// the workload `namespace` and `labels` name, so protection changes with the policies, at the
    /// moment they go in and before any request is decided on them.
    pub fn follow_snapshots(
        self: &Arc<Self>,
        namespace: String,
        labels: std::collections::BTreeMap<String, String>,
    ) -> super::snapshot::OnInstall {
        let protection = self.clone();
        Box::new(move |snapshot| protection.configure(snapshot.overload_for(&namespace, &labels)))
    }

    /// Whether a policy protects the application now.
    pub fn is_on(&self) -> bool {
        self.active.load().is_some()
    }

    /// Takes a slot for a request of `class`, waiting (critical, within `criticalWait`) when the
    /// limit is reached; `Ok(None)` when nothing protects the application.
    pub async fn admit(self: &Arc<Self>, class: Class) -> Result<Option<Slot>, Shed> {
        let Some(active) = self.active.load_full() else { return Ok(None) };
        let first = {
            let mut shedder = active.shedder.lock();
            let admission = shedder.try_admit(class);
            self.gauges(&shedder);
            admission
        };
        let admission = match first {
            Admission::Wait => self.wait(&active).await,
            other => other,
        };
        match admission {
            Admission::Admit => Ok(Some(Slot { protection: self.clone(), active, done: false })),
            Admission::WouldShed => {
                self.metrics.overload_would_shed.get_or_create(&ClassLabels { class: class.name() }).inc();
                Ok(Some(Slot { protection: self.clone(), active, done: false }))
            }
            Admission::Wait | Admission::Shed => {
                self.metrics.overload_shed.get_or_create(&ClassLabels { class: class.name() }).inc();
                Err(Shed { class, retry_after_secs: retry_after_secs(&active), refusal: active.refusal.clone() })
            }
        }
    }

    async fn wait(&self, active: &Active) -> Admission {
        /// The place of a request in the critical queue: given back when the request stops
        /// waiting without an answer (its client closed and the request's future was dropped),
        /// or the queue would stay full of requests nobody waits for.
        struct Place<'a> {
            active: &'a Active,
            protection: &'a Protection,
            answered: bool,
        }
        impl Drop for Place<'_> {
            fn drop(&mut self) {
                if !self.answered {
                    let mut shedder = self.active.shedder.lock();
                    shedder.leave();
                    self.protection.gauges(&shedder);
                }
            }
        }
        let mut place = Place { active, protection: self, answered: false };
        let deadline = tokio::time::Instant::now() + active.critical_wait;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before asking, so a slot freed in between is not missed.
            freed.as_mut().enable();
            if active.shedder.lock().retry() == Admission::Admit {
                place.answered = true;
                return Admission::Admit;
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                let mut shedder = active.shedder.lock();
                place.answered = true;
                // A last look: the slot may have come free as the deadline passed.
                if shedder.retry() == Admission::Admit {
                    return Admission::Admit;
                }
                shedder.give_up();
                return Admission::Shed;
            }
        }
    }

    /// The limit and the requests in flight, set while the shedder is locked anyway.
    fn gauges(&self, shedder: &Shedder) {
        self.metrics.overload_limit.set(i64::from(shedder.limit()));
        self.metrics.overload_in_flight.set(i64::from(shedder.in_flight()));
    }

    /// What `/overload` on the admin port shows.
    pub fn state(&self) -> serde_json::Value {
        match self.active.load_full() {
            None => serde_json::json!({"protection": null}),
            Some(active) => {
                let state: ShedderState = active.shedder.lock().state();
                serde_json::json!({
                    "protection": {
                        "policy": active.policy,
                        "pressure": self.pressure.load(Ordering::Relaxed),
                        "state": state,
                    }
                })
            }
        }
    }

    /// Reads the container's cgroup every second while a policy watches CPU or memory, and
    /// records whether it is past the thresholds.
    pub async fn watch_pressure(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut previous = Reading::default();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.changed() => return,
            }
            let thresholds = self.active.load().as_ref().and_then(|a| a.thresholds);
            let Some(thresholds) = thresholds else {
                self.pressure.store(false, Ordering::Relaxed);
                continue;
            };
            let reading = read_cgroup(&self.cgroup_root);
            let pressed = cgroup::under_pressure(&previous, &reading, &thresholds);
            if pressed != self.pressure.swap(pressed, Ordering::Relaxed) {
                tracing::info!(pressure = pressed, ?reading, "the container's CPU or memory pressure changed");
            }
            previous = reading;
        }
    }
}

impl Slot {
    /// The application answered after `latency` (its response head), or did not give a latency
    /// sample worth having (`None`: a stream, a failed connection, a 5xx).
    pub fn finish(mut self, latency: Option<Duration>) {
        self.give_back(latency);
    }

    fn give_back(&mut self, latency: Option<Duration>) {
        if self.done {
            return;
        }
        self.done = true;
        let pressure = self.protection.pressure.load(Ordering::Relaxed);
        let now = self.protection.now();
        let (estimate, waiting) = {
            let mut shedder = self.active.shedder.lock();
            let estimate = shedder.done(now, latency.map(|l| l.as_micros().max(1) as Micros), pressure);
            self.protection.gauges(&shedder);
            (estimate, shedder.waiting())
        };
        if let Some(estimate) = estimate {
            self.protection.metrics.overload_latency_ms.set((estimate.long_latency_ms * 1000.0) as i64);
            tracing::debug!(?estimate, "overload limit updated");
        }
        if waiting > 0 {
            self.protection.freed.notify_waiters();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.give_back(None);
    }
}

fn active_of(policy: &str, spec: &OverloadSpec) -> Active {
    let duration = |text: &Option<String>, otherwise: Duration| {
        text.as_deref().and_then(|t| parse_duration(t).ok()).map(Duration::from_micros).unwrap_or(otherwise)
    };
    let critical_wait = duration(&spec.critical_wait, Duration::ZERO);
    let config = ShedderConfig {
        gradient: GradientConfig {
            initial_limit: f64::from(spec.initial_limit),
            min_limit: f64::from(spec.min_limit),
            max_limit: f64::from(spec.max_limit),
            tolerance: f64::from(spec.tolerance_percent) / 100.0,
            ..GradientConfig::default()
        },
        default_share: f64::from(spec.default_share.min(100)) / 100.0,
        sheddable_share: f64::from(spec.sheddable_share.min(100)) / 100.0,
        critical_queue: if critical_wait.is_zero() { 0 } else { spec.critical_queue },
        shadow: spec.mode == Mode::Shadow,
    };
    let thresholds = (spec.cpu_pressure_percent.is_some() || spec.memory_percent.is_some()).then(|| Thresholds {
        cpu: spec.cpu_pressure_percent.map_or(f64::INFINITY, |p| f64::from(p) / 100.0),
        memory: spec.memory_percent.map_or(f64::INFINITY, |p| f64::from(p) / 100.0),
    });
    Active {
        policy: policy.to_string(),
        spec: spec.clone(),
        shedder: Mutex::new(Shedder::new(config)),
        critical_wait,
        retry_after: duration(&spec.retry_after, Duration::from_secs(1)),
        jitter: duration(&spec.retry_after_jitter, Duration::ZERO),
        thresholds,
        refusal: spec.refusal.as_ref().map(|r| Arc::new(DeclaredRefusal::from(r))),
    }
}

/// `Retry-After` seconds: the declared wait plus up to the declared jitter, rounded up.
fn retry_after_secs(active: &Active) -> u64 {
    let jitter = if active.jitter.is_zero() { Duration::ZERO } else { active.jitter.mul_f64(rand::random::<f64>()) };
    (active.retry_after + jitter).as_secs_f64().ceil().max(1.0) as u64
}

/// The cgroup's counters (v2 when `cgroup.controllers` exists at the root, else v1's layout).
fn read_cgroup(root: &Path) -> Reading {
    let read = |path: PathBuf| std::fs::read_to_string(path).ok();
    if root.join("cgroup.controllers").exists() {
        Reading {
            cpu_pressure: read(root.join("cpu.pressure")).and_then(|t| cgroup::parse_psi_some_avg10(&t)),
            periods: read(root.join("cpu.stat")).and_then(|t| cgroup::parse_cpu_stat(&t)),
            memory: read(root.join("memory.current"))
                .zip(read(root.join("memory.max")))
                .and_then(|(current, max)| cgroup::memory_share(&current, &max)),
        }
    } else {
        Reading {
            cpu_pressure: None,
            periods: read(root.join("cpu/cpu.stat")).and_then(|t| cgroup::parse_cpu_stat(&t)),
            memory: read(root.join("memory/memory.usage_in_bytes"))
                .zip(read(root.join("memory/memory.limit_in_bytes")))
                .and_then(|(current, max)| cgroup::memory_share(&current, &max)),
        }
    }
}
