//! The enforcement endpoint: the engine (snapshot + store → decision) and its HTTP API.

pub mod engine;
pub mod headers;
pub mod request;
pub mod http;
pub mod serve;
pub mod backend;
