//! Sluice: a Kubernetes-native distributed rate limiter. ARCHITECTURE.md walks through it; the
//! modules, by layer, each using only those above it in this list (tests/layers.rs holds it):

// Request paths never unwrap: bad input gets a 4xx, a broken dependency a failure mode (tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The pure core: time is an argument, nothing is read from outside.
pub mod algorithm;
pub mod clock;
pub mod decimal;
pub mod duration;
pub mod overload;
pub mod rule;

// Keeping per-key state: memory, Redis (one server, Cluster, Sentinel), the backend that picks one.
pub mod store;

// Policies: the CRD, validation and compilation into the snapshot rules are matched against;
// request heads and response costs as policies read them.
pub mod policy;
pub mod request;
pub mod response;

// The decision core: snapshot + store → decision, rate-limit headers, hold tokens, quota leases.
pub mod engine;
pub mod telemetry;

// What the entry points share: the wire contract between the endpoint and its clients,
// listeners, conversions of other limiters' configurations.
pub mod api;
pub mod convert;
pub mod listen;

// The entry points, peers standing on the engine: the endpoint (HTTP API, Envoy's RLS), the
// sidecar proxy, simulate/explain, the operator and its admission webhooks, and the roles that
// wire them to a store.
pub mod admission;
pub mod operator;
pub mod role;
pub mod server;
pub mod sidecar;
pub mod simulate;
