//! Reading what a response cost, for the rules that charge by the response (`responseCost`):
//! from a header the application sets, or from the usage fields of its JSON body or event
//! stream, read as the bytes pass to the client, which gets them unchanged.
//!
//! The outcome settles the request's reservations: the actual cost per rule; the rule's
//! `onFailure` cost when the application failed (5xx, a broken-off response) or the client left
//! before any of it; the estimate when the cost could not be read. A cost read before a response
//! broke off (a header, or the usage event of a stream whose last chunk never came) is charged:
//! the work it counts was done, and a client must not be able to erase it by breaking the stream.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::HeaderMap;

use crate::engine::SettleCost;
use crate::policy::response_cost::ResponseCost;
use crate::response::usage::{UsageMeter, UsageSpec, cost_from_header};

/// One response's cost readers.
pub struct Metering {
    /// Rules whose header stated the cost, and the cost.
    stated: BTreeMap<String, u64>,
    /// Body readers, one per distinct set of fields, with the rules that read it.
    meters: Vec<(Arc<UsageSpec>, Vec<String>, UsageMeter)>,
    /// The application answered 5xx.
    failed: bool,
    /// Bytes passed to the client so far.
    sent: u64,
}

impl Metering {
    /// Readers for the rules of `costs` (name, responseCost), or `None` when there are none.
    /// Takes the cost headers out of `headers`: they are for Sluice, not for the client.
    pub fn start(
        costs: Vec<(String, Arc<ResponseCost>)>,
        status: http::StatusCode,
        headers: &mut HeaderMap,
    ) -> Option<Metering> {
        if costs.is_empty() {
            return None;
        }
        let content_type = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
        let mut metering =
            Metering { stated: BTreeMap::new(), meters: Vec::new(), failed: status.is_server_error(), sent: 0 };
        let stated_headers: Vec<(String, Option<u64>)> = costs
            .iter()
            .filter_map(|(_, cost)| cost.header.as_ref())
            .map(|name| (name.clone(), headers.get(name.as_str()).and_then(|v| cost_from_header(v.as_bytes()).ok())))
            .collect();
        for (name, _) in &stated_headers {
            headers.remove(name.as_str());
        }
        for (rule, cost) in costs {
            let stated = cost.header.as_ref().and_then(|h| stated_headers.iter().find(|(n, _)| n == h)?.1);
            if let Some(value) = stated {
                metering.stated.insert(rule, value);
                continue;
            }
            let Some(usage) = &cost.usage else { continue };
            match metering.meters.iter_mut().find(|(spec, _, _)| spec == usage) {
                Some((_, rules, _)) => rules.push(rule),
                None => {
                    let meter = UsageMeter::new(usage.clone(), content_type.as_deref());
                    metering.meters.push((usage.clone(), vec![rule], meter));
                }
            }
        }
        Some(metering)
    }

    /// A chunk of the body, as it passes to the client.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.sent += chunk.len() as u64;
        if self.failed {
            return;
        }
        for (_, _, meter) in &mut self.meters {
            meter.feed(chunk);
        }
    }

    /// The body ended: each rule's cost (a rule whose cost could not be read keeps its estimate).
    pub fn finish(self) -> SettleCost {
        if self.failed {
            return SettleCost::Failed;
        }
        let mut by_rule = self.stated;
        for (_, rules, meter) in self.meters {
            match meter.finish() {
                Ok(cost) => by_rule.extend(rules.into_iter().map(|rule| (rule, cost))),
                Err(problem) => tracing::debug!(%problem, "response cost not readable; the estimate stays charged"),
            }
        }
        SettleCost::Actual { all: None, by_rule }
    }

    /// The body broke off (`upstream_failed`: the application's side), or the client left: the
    /// costs read so far (a stated header; usage already streamed), each other rule keeping its
    /// estimate; with none read, a failure when nothing reached the client or the application
    /// broke it, otherwise an unknown cost (the estimate stays charged).
    pub fn broken(self, upstream_failed: bool) -> SettleCost {
        if self.failed {
            return SettleCost::Failed;
        }
        let sent = self.sent;
        let mut by_rule = self.stated;
        for (_, rules, meter) in self.meters {
            if let Ok(cost) = meter.finish() {
                by_rule.extend(rules.into_iter().map(|rule| (rule, cost)));
            }
        }
        if !by_rule.is_empty() {
            return SettleCost::Actual { all: None, by_rule };
        }
        if upstream_failed || sent == 0 { SettleCost::Failed } else { SettleCost::AsReserved }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::crd::ResponseCostMode;
    use crate::policy::response_cost::Estimate;
    use crate::response::usage::JsonPath;

    fn cost(fields: &[&str], header: Option<&str>) -> Arc<ResponseCost> {
        let usage = (!fields.is_empty())
            .then(|| Arc::new(UsageSpec::new(fields.iter().map(|f| JsonPath::parse(f).unwrap()).collect()).unwrap()));
        Arc::new(ResponseCost {
            usage,
            header: header.map(str::to_string),
            estimate: Estimate::Constant(100),
            on_failure: 0,
            mode: ResponseCostMode::Reserve,
        })
    }

    fn json_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, "application/json".parse().unwrap());
        headers
    }

    #[test]
    fn each_rule_gets_its_fields_and_a_stated_header_wins() {
        let costs = vec![
            ("input".to_string(), cost(&["usage.prompt_tokens"], None)),
            ("output".to_string(), cost(&["usage.completion_tokens"], None)),
            ("total".to_string(), cost(&["usage.prompt_tokens", "usage.completion_tokens"], Some("x-sluice-cost"))),
        ];
        let mut headers = json_headers();
        headers.insert("x-sluice-cost", "7".parse().unwrap());
        let mut metering = Metering::start(costs, http::StatusCode::OK, &mut headers).unwrap();
        assert!(!headers.contains_key("x-sluice-cost"), "the cost header is Sluice's, not the client's");
        metering.feed(br#"{"usage": {"prompt_tokens": 10, "#);
        metering.feed(br#""completion_tokens": 32}}"#);
        let SettleCost::Actual { by_rule, .. } = metering.finish() else { panic!() };
        assert_eq!(by_rule, BTreeMap::from([("input".into(), 10), ("output".into(), 32), ("total".into(), 7)]));
    }

    #[test]
    fn failures_and_unreadable_costs_are_told_apart() {
        let costs = || vec![("total".to_string(), cost(&["usage.total_tokens"], None))];
        let failed = Metering::start(costs(), http::StatusCode::BAD_GATEWAY, &mut json_headers()).unwrap();
        assert_eq!(failed.finish(), SettleCost::Failed);
        let mut unreadable = Metering::start(costs(), http::StatusCode::OK, &mut json_headers()).unwrap();
        unreadable.feed(b"{}");
        assert_eq!(unreadable.finish(), SettleCost::Actual { all: None, by_rule: BTreeMap::new() });
        let nothing_sent = Metering::start(costs(), http::StatusCode::OK, &mut json_headers()).unwrap();
        assert_eq!(nothing_sent.broken(false), SettleCost::Failed, "the client left before any of it");
        let mut some_sent = Metering::start(costs(), http::StatusCode::OK, &mut json_headers()).unwrap();
        some_sent.feed(b"{\"usa");
        assert_eq!(some_sent.broken(false), SettleCost::AsReserved, "the client left mid-response");
        let mut reset = Metering::start(costs(), http::StatusCode::OK, &mut json_headers()).unwrap();
        reset.feed(b"{\"usa");
        assert_eq!(reset.broken(true), SettleCost::Failed, "the application broke it off");
    }

    /// Issue #37: a stream whose usage event was sent, then broken off before its end, cost 0
    /// (the rule's onFailure): the usage read counts when it was read.
    #[test]
    fn usage_read_before_a_stream_broke_off_is_charged() {
        let costs = || vec![("total".to_string(), cost(&["usage.total_tokens"], None))];
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, "text/event-stream".parse().unwrap());
        let mut stream = Metering::start(costs(), http::StatusCode::OK, &mut headers.clone()).unwrap();
        stream.feed(b"data: {\"choices\": []}\n\ndata: {\"usage\": {\"total_tokens\": 812}}\n\n");
        let expected = SettleCost::Actual { all: None, by_rule: BTreeMap::from([("total".into(), 812)]) };
        assert_eq!(stream.broken(true), expected, "the application broke it off after the usage");
        let mut left = Metering::start(costs(), http::StatusCode::OK, &mut headers).unwrap();
        left.feed(b"data: {\"usage\": {\"total_tokens\": 812}}\n\n");
        assert_eq!(left.broken(false), expected, "the client left after the usage");
        let mut stated = json_headers();
        stated.insert("x-sluice-cost", "9".parse().unwrap());
        let header = vec![("total".to_string(), cost(&[], Some("x-sluice-cost")))];
        let broken = Metering::start(header, http::StatusCode::OK, &mut stated).unwrap();
        assert_eq!(
            broken.broken(true),
            SettleCost::Actual { all: None, by_rule: BTreeMap::from([("total".into(), 9)]) }
        );
    }
}
