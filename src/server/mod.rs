//! The enforcement endpoint: the engine (snapshot + store → decision), its HTTP API and Envoy's
//! rate limit service (gRPC).

pub mod auth;
pub mod engine;
pub mod headers;
pub mod http;
pub mod lease;
pub mod leasing;
pub mod listen;
pub mod reload;
pub mod request;
pub mod rls;
pub mod serve;
