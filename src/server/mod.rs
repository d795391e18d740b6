//! The enforcement endpoint: the engine (snapshot + store → decision), its HTTP API and Envoy's
//! rate limit service (gRPC).

pub mod auth;
pub mod http;
pub mod reload;
pub mod request;
pub mod rls;
pub mod serve;
