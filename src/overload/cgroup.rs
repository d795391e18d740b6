//! The container's own CPU and memory pressure, from its cgroup: never the host's load average,
//! which in a container measures the neighbours (the known failure of load-based limiters such
//! as Sentinel's system rule inside Kubernetes).
//!
//! cgroup v2: `cpu.pressure` (PSI: the share of time some task waited for CPU, `avg10`), and
//! `cpu.stat` for throttling by the CPU limit; `memory.current` against `memory.max`.
//! cgroup v1: `cpu.stat` (`nr_periods`, `nr_throttled`) and `memory.usage_in_bytes` against
//! `memory.limit_in_bytes`. These functions read the files' text; the sidecar reads the files.

/// One reading of the cgroup's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    /// PSI `some avg10` of `cpu.pressure`, as a share (0..=1); v2 only.
    pub cpu_pressure: Option<f64>,
    /// `cpu.stat` periods and throttled periods so far (both versions).
    pub periods: Option<(u64, u64)>,
    /// Memory in use as a share of the limit (`None` without a limit).
    pub memory: Option<f64>,
}

/// The thresholds past which the container counts as under pressure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    /// CPU: PSI some avg10, or the share of CFS periods throttled since the last reading.
    pub cpu: f64,
    /// Memory in use over the limit.
    pub memory: f64,
}

/// `some avg10=…` of a PSI file, as a share.
pub fn parse_psi_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let value = line.split_whitespace().find_map(|field| field.strip_prefix("avg10="))?;
    value.parse::<f64>().ok().map(|percent| percent / 100.0)
}

/// `nr_periods` and `nr_throttled` of a `cpu.stat` (v1 and v2 name them alike).
pub fn parse_cpu_stat(text: &str) -> Option<(u64, u64)> {
    let field =
        |name: &str| text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<u64>().ok());
    Some((field("nr_periods")?, field("nr_throttled")?))
}

/// Memory in use over its limit; `None` when there is no limit (`max`, or v1's huge number).
pub fn memory_share(current: &str, max: &str) -> Option<f64> {
    let current: f64 = current.trim().parse().ok()?;
    let max = max.trim();
    if max == "max" {
        return None;
    }
    let max: f64 = max.parse().ok()?;
    // cgroup v1 writes "no limit" as a number near 2^63.
    if max <= 0.0 || max >= 9.0e18 {
        return None;
    }
    Some(current / max)
}

/// Whether `now` (compared with the `previous` reading, for throttling) is past `thresholds`.
pub fn under_pressure(previous: &Reading, now: &Reading, thresholds: &Thresholds) -> bool {
    let psi = now.cpu_pressure.is_some_and(|p| p >= thresholds.cpu);
    let throttled = match (previous.periods, now.periods) {
        (Some((p0, t0)), Some((p1, t1))) if p1 > p0 => {
            (t1.saturating_sub(t0)) as f64 / (p1 - p0) as f64 >= thresholds.cpu
        }
        _ => false,
    };
    let memory = now.memory.is_some_and(|m| m >= thresholds.memory);
    psi || throttled || memory
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_v2_and_v1_formats() {
        let psi =
            "some avg10=62.50 avg60=10.00 avg300=2.00 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=5\n";
        assert_eq!(parse_psi_some_avg10(psi), Some(0.625));
        let v2 = "usage_usec 100\nuser_usec 60\nsystem_usec 40\nnr_periods 200\nnr_throttled 50\nthrottled_usec 9000\n";
        assert_eq!(parse_cpu_stat(v2), Some((200, 50)));
        let v1 = "nr_periods 10\nnr_throttled 1\nthrottled_time 5000000\n";
        assert_eq!(parse_cpu_stat(v1), Some((10, 1)));
        assert_eq!(memory_share("512\n", "1024\n"), Some(0.5));
        assert_eq!(memory_share("512\n", "max\n"), None);
        assert_eq!(memory_share("512", "9223372036854771712"), None, "v1's no limit");
        assert_eq!(parse_psi_some_avg10("garbage"), None);
    }

    #[test]
    fn pressure_is_psi_throttling_or_memory() {
        let t = Thresholds { cpu: 0.5, memory: 0.9 };
        let calm = Reading { cpu_pressure: Some(0.1), periods: Some((100, 0)), memory: Some(0.5) };
        assert!(!under_pressure(&calm, &calm, &t));
        let psi = Reading { cpu_pressure: Some(0.7), ..calm };
        assert!(under_pressure(&calm, &psi, &t));
        let throttled = Reading { periods: Some((200, 60)), ..calm };
        assert!(under_pressure(&calm, &throttled, &t), "60 of the last 100 periods throttled");
        let memory = Reading { memory: Some(0.95), ..calm };
        assert!(under_pressure(&calm, &memory, &t));
    }
}
