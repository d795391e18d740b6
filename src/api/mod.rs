//! The wire contract between a client of the enforcement endpoint (the sidecar first) and the
//! endpoint itself: the request and answer bodies of `/v1/check`, `/v1/checks`, `/v1/settle`,
//! `/v1/leases` and `/v1/snapshot`, their limits and header names. Both ends take them from here,
//! so a field renamed on one side is renamed on the other, and each module's round-trip test
//! sends what one end writes through what the other end reads. The handlers are in
//! `server/http/`; the sidecar's client in `sidecar/endpoint.rs`, `sidecar/settling.rs` and
//! `sidecar/snapshot.rs`.

pub mod check;
pub mod checks;
pub mod deferred;
pub mod leases;
pub mod settle;
pub mod snapshot;

/// Check bodies are small; anything larger is refused with 413 before parsing.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// The most checks one `POST /v1/checks` may carry.
pub const MAX_BATCH_CHECKS: usize = 256;
/// A batch body's limit: room for [`MAX_BATCH_CHECKS`] typical checks, not for that many of the
/// largest single ones (a sender with large checks sends smaller batches).
pub const MAX_BATCH_BODY_BYTES: usize = 1024 * 1024;

/// The longest `GET /v1/snapshot?wait=` honoured.
pub const MAX_SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// Answered when `wait` was honoured: a client can tell an endpoint that holds an unchanged
/// snapshot's request (and so tells it of a change at once) from one that answers at once.
pub const SNAPSHOT_WAIT_HEADER: &str = "x-sluice-snapshot-wait";
