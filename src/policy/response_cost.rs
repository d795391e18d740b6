//! A rule's `responseCost`, compiled: where the actual cost is read from the response, what
//! admission reserves meanwhile, and what a failed request costs. One compilation, shared by
//! validation (which reports its errors) and the snapshot (which keeps its result).

use std::sync::Arc;

use super::crd::{ResponseCostMode, ResponseCostSpec};
use super::errors::ValidationErrors;
use crate::algorithm::{Limit, MAX_REQUESTS, Micros};
use crate::duration::parse_duration;
use crate::request::names::StrMap;
use crate::response::usage::{JsonPath, UsageSpec};

/// How long a reservation lasts when `reservationTtl` is not given.
pub const DEFAULT_RESERVATION_TTL: Micros = 10 * 60 * 1_000_000;

/// What admission reserves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Estimate {
    Constant(u64),
    /// A top-level integer field of the request's JSON body, plus `plus`, at most `cap` (also
    /// the estimate when the field is missing or unreadable).
    RequestField {
        name: String,
        plus: u64,
        cap: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseCost {
    /// The fields summed from a JSON or event-stream body; `None` when only a header says.
    pub usage: Option<Arc<UsageSpec>>,
    /// A response header stating the cost, lowercase.
    pub header: Option<String>,
    pub estimate: Estimate,
    pub on_failure: u64,
    pub mode: ResponseCostMode,
}

impl ResponseCost {
    /// What a request reserves, given the values of request body fields its sender extracted
    /// (`fields`, by name). `reportAfter` reserves nothing.
    pub fn estimate(&self, fields: &dyn StrMap) -> u64 {
        if self.mode == ResponseCostMode::ReportAfter {
            return 0;
        }
        match &self.estimate {
            Estimate::Constant(n) => *n,
            Estimate::RequestField { name, plus, cap } => fields
                .get_str(name)
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(*cap, |v| v.saturating_add(*plus).min(*cap)),
        }
    }

    /// The request body field the estimate reads, if any.
    pub fn request_field(&self) -> Option<&str> {
        match &self.estimate {
            Estimate::RequestField { name, .. } => Some(name),
            Estimate::Constant(_) => None,
        }
    }

    /// The most a request can reserve.
    pub fn largest_estimate(&self) -> u64 {
        match &self.estimate {
            Estimate::Constant(n) => *n,
            Estimate::RequestField { cap, .. } => *cap,
        }
    }
}

/// A field name of a request body the estimate may read: like a JSON path segment.
fn valid_field_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Compiles `spec` (at `path`) for a rule of `limit`; returns the limit made reserving and the
/// compiled cost, or records what is wrong in `errs`.
pub fn compile(
    spec: &ResponseCostSpec,
    limit: Option<&Limit>,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<(Limit, ResponseCost)> {
    let before = errs.errors.len();
    let mut usage = None;
    if !spec.fields.is_empty() {
        let mut paths = Vec::with_capacity(spec.fields.len());
        for (i, field) in spec.fields.iter().enumerate() {
            match JsonPath::parse(field) {
                Ok(p) => paths.push(p),
                Err(e) => errs.push(format!("{path}.fields[{i}]"), e.to_string()),
            }
        }
        if paths.len() == spec.fields.len() {
            match UsageSpec::new(paths) {
                Ok(u) => usage = Some(Arc::new(u)),
                Err(e) => errs.push(format!("{path}.fields"), e.to_string()),
            }
        }
    }
    let header = spec.header.as_ref().map(|h| h.to_ascii_lowercase());
    if let Some(h) = &header
        && (!crate::request::names::is_token(h) || crate::request::names::HOP_BY_HOP.contains(&h.as_str()))
    {
        errs.push(format!("{path}.header"), format!("{h:?} is not a header name an application can send"));
    }
    if usage.is_none() && header.is_none() && errs.errors.len() == before {
        errs.push(path.to_string(), "needs fields or a header to read the cost from".to_string());
    }
    let estimate = match (&spec.estimate.constant, &spec.estimate.request_field, spec.estimate.cap) {
        (Some(n), None, _) => Some(Estimate::Constant(*n)),
        (None, Some(name), Some(cap)) => {
            if !valid_field_name(name) {
                errs.push(format!("{path}.estimate.requestField"), format!("{name:?} is not a top-level field name"));
            }
            Some(Estimate::RequestField { name: name.clone(), plus: spec.estimate.plus, cap })
        }
        (None, Some(_), None) => {
            errs.push(format!("{path}.estimate.cap"), "requestField needs a cap".to_string());
            None
        }
        _ => {
            errs.push(format!("{path}.estimate"), "takes exactly one of constant or requestField".to_string());
            None
        }
    };
    if spec.on_failure > MAX_REQUESTS {
        errs.push(format!("{path}.onFailure"), format!("must be at most {MAX_REQUESTS}"));
    }
    let ttl = match spec.reservation_ttl.as_deref().map(parse_duration) {
        None => Some(DEFAULT_RESERVATION_TTL),
        Some(Ok(ttl)) => Some(ttl),
        Some(Err(e)) => {
            errs.push(format!("{path}.reservationTtl"), e.to_string());
            None
        }
    };
    let cost = ResponseCost { usage, header, estimate: estimate?, on_failure: spec.on_failure, mode: spec.mode };
    let limit = limit?;
    if cost.largest_estimate() > limit.capacity() {
        errs.push(
            format!("{path}.estimate"),
            format!(
                "an estimate of {} exceeds the limit's {}: such a request could never be admitted",
                cost.largest_estimate(),
                limit.capacity()
            ),
        );
    }
    let reserving = match limit.clone().reserving(ttl?) {
        Ok(l) => Some(l),
        Err(e) => {
            let field = match e {
                crate::algorithm::LimitError::ReservationTtlOutOfRange => "reservationTtl",
                _ => "",
            };
            let at = if field.is_empty() { path.to_string() } else { format!("{path}.{field}") };
            errs.push(at, e.to_string());
            None
        }
    };
    (errs.errors.len() == before).then_some(())?;
    Some((reserving?, cost))
}
