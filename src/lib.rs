//! Sluice: a Kubernetes-native distributed rate limiter.
//!
//! The pure core (`duration`, `algorithm`) takes time as an argument; `store` keeps per-key
//! state; `clock` is the one place time is read.

pub mod admission;
pub mod algorithm;
pub mod clock;
pub mod duration;
pub mod operator;
pub mod policy;
pub mod request;
pub mod server;
pub mod sidecar;
pub mod simulate;
pub mod store;
pub mod telemetry;
