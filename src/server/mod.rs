//! The enforcement endpoint: the engine (snapshot + store → decision) and its HTTP API.

pub mod auth;
pub mod engine;
pub mod headers;
pub mod http;
pub mod request;
pub mod serve;
