//! `POST /v1/settle` (and `/v1/release`): a request's holds given back when it ends, with the
//! cost known after the response for rules that reserved an estimate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::engine::SettleCost;

/// `{"lease": "<the hold token of a /v1/check answer>"}`, with, for rules whose cost is known
/// after the response, the actual cost: `cost` (every such rule), `costs` (by rule name), or
/// `failed: true` (each rule's `onFailure`). Without any, each reservation settles to its
/// estimate. (`lease` is the field's name on the wire; in the code it is a hold,
/// `crate::engine::hold`.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleBody {
    pub lease: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub costs: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

impl SettleBody {
    /// What a client sends to settle `token` at `cost`.
    pub fn new(token: String, cost: &SettleCost) -> SettleBody {
        let mut body = SettleBody { lease: token, cost: None, costs: BTreeMap::new(), failed: false };
        match cost {
            SettleCost::AsReserved => {}
            SettleCost::Failed => body.failed = true,
            SettleCost::Actual { all, by_rule } => {
                body.cost = *all;
                body.costs = by_rule.clone();
            }
        }
        body
    }

    /// The cost the body states, once its parts agree (the endpoint's reading of it).
    pub fn settle_cost(&self) -> Result<SettleCost, String> {
        if self.failed && (self.cost.is_some() || !self.costs.is_empty()) {
            return Err("failed: a failed request's cost is the policy's onFailure; remove cost and costs".to_string());
        }
        Ok(if self.failed {
            SettleCost::Failed
        } else if self.cost.is_none() && self.costs.is_empty() {
            SettleCost::AsReserved
        } else {
            SettleCost::Actual { all: self.cost, by_rule: self.costs.clone() }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_client_sends_the_endpoint_reads_as_the_same_cost() {
        let costs = [
            SettleCost::AsReserved,
            SettleCost::Failed,
            SettleCost::Actual { all: Some(7), by_rule: BTreeMap::new() },
            SettleCost::Actual { all: None, by_rule: BTreeMap::from([("tokens".to_string(), 1200)]) },
            SettleCost::Actual { all: Some(3), by_rule: BTreeMap::from([("a".to_string(), 1)]) },
        ];
        for cost in costs {
            let sent = serde_json::to_vec(&SettleBody::new("t.sig".into(), &cost)).unwrap();
            let read: SettleBody = serde_json::from_slice(&sent).unwrap();
            assert_eq!(read.lease, "t.sig");
            assert_eq!(read.settle_cost().unwrap(), cost, "{}", String::from_utf8_lossy(&sent));
        }
        assert_eq!(
            serde_json::to_string(&SettleBody::new("t".into(), &SettleCost::AsReserved)).unwrap(),
            r#"{"lease":"t"}"#
        );
        let both: SettleBody = serde_json::from_str(r#"{"lease": "t", "failed": true, "cost": 1}"#).unwrap();
        assert!(both.settle_cost().is_err());
        assert!(serde_json::from_str::<SettleBody>(r#"{"lease": "t", "spent": 1}"#).is_err(), "unknown fields refused");
    }
}
