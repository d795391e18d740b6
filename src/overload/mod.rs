//! Protecting a service from overload: the pure core of the sidecar's adaptive shedding.
//!
//! - [`Class`]: how much a request matters (`critical` > `default` > `sheddable`), chosen by a
//!   policy's `priorities`.
//! - [`gradient`]: the concurrency limit, adapted from the application's own latency
//!   (Netflix's Gradient2: a long-term latency average against the recent one).
//! - [`shedder`]: in-flight requests against that limit, each class up to its share of it, a
//!   bounded wait for critical requests, pressure from the container's cgroup.
//! - [`cgroup`]: reading that pressure (cgroup v2 and v1 text formats).
//!
//! Nothing here reads a clock or a file: times and readings are arguments, so tests drive it
//! with a fake clock and fixture text.

pub mod cgroup;
pub mod gradient;
pub mod shedder;

use serde::{Deserialize, Serialize};

/// How much a request matters when the service is overloaded: the lowest class is refused
/// first. Ordered: `Sheddable < Default < Critical`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Class {
    /// Work that may wait or fail first: batch jobs, prefetches, analytics.
    Sheddable,
    /// Everything not classified otherwise.
    #[default]
    Default,
    /// The requests the service exists for (checkout, login): the last refused.
    Critical,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Critical, Class::Default, Class::Sheddable];

    pub fn name(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Default => "default",
            Class::Sheddable => "sheddable",
        }
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
