//! Shared helpers of the integration tests.

pub mod redis_server;
