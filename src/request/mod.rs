//! The one interpretation of an incoming HTTP request that every entry point shares (the check
//! API, the ext_authz mode, the sidecar), so the limiter sees what the application sees:
//!
//! - [`forwarded`]: who the client is (the TCP peer, or trusted X-Forwarded-For hops);
//! - [`headers`]: header values as rules see them (duplicates of used headers refused, `_` read
//!   as `-`);
//! - [`host`]: the host rules see (several or invalid Host headers refused);
//! - [`labels`]: workload labels written as `k=v,k2=v2`;
//! - [`names`]: header-name tokens, canonical names, hop-by-hop headers, the maps rules read.
//!
//! Pure functions over `http` types; no I/O.

pub mod forwarded;
pub mod headers;
pub mod host;
pub mod labels;
pub mod names;
