//! Sluice: a Kubernetes-native distributed rate limiter.
//!
//! The pure core (`duration`, `algorithm`) takes time as an argument; `store` keeps per-key
//! state; `clock` is the one place time is read.

// Request paths never unwrap: bad input gets a 4xx, a broken dependency a failure mode (tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod admission;
pub mod algorithm;
pub mod batching;
pub mod clock;
pub mod convert;
pub mod duration;
pub mod operator;
pub mod overload;
pub mod policy;
pub mod quota_leases;
pub mod redirect;
pub mod request;
pub mod role;
pub mod rule;
pub mod server;
pub mod sidecar;
pub mod simulate;
pub mod store;
pub mod telemetry;
pub mod usage;
