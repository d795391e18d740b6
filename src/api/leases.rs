//! `POST /v1/leases`: a holder elsewhere (a sidecar) settles the quota leases it held and asks for
//! new ones, for `consistency: leased` rules of a namespace it may act in.

use serde::{Deserialize, Serialize};

/// `{"namespace": "…", "leases": [{"rule": "<rule id>", "key": "…", "settle": {"hold": "<id>",
/// "spent": N}, "ask": {"hold": "<id>", "want": N}}, …]}`; hold and rule ids are decimal strings
/// (64 bits do not survive a JSON number).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeasesBody {
    pub namespace: String,
    pub leases: Vec<LeaseEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseEntry {
    pub rule: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settle: Option<LeaseSettle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask: Option<LeaseWant>,
}

/// The slice held under `hold`, of which `spent` units were used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseSettle {
    pub hold: String,
    pub spent: u64,
}

/// A new slice of up to `want` units, to be held under `hold`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseWant {
    pub hold: String,
    pub want: u64,
}

/// The answer: one grant per entry, in order (amount 0: none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Granted {
    pub grants: Vec<Grant>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Grant {
    pub amount: u64,
    pub lasts_us: u64,
    pub remaining: u64,
    pub reset_after_us: u64,
    #[serde(default)]
    pub holders: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_holder_sends_the_endpoint_reads_and_the_grants_come_back() {
        let body = LeasesBody {
            namespace: "tenant-a".into(),
            leases: vec![
                LeaseEntry {
                    rule: u64::MAX.to_string(),
                    key: "k".into(),
                    settle: Some(LeaseSettle { hold: "17".into(), spent: 3 }),
                    ask: Some(LeaseWant { hold: "18".into(), want: 10 }),
                },
                LeaseEntry { rule: "5".into(), key: "j".into(), settle: None, ask: None },
            ],
        };
        let sent = serde_json::to_string(&body).unwrap();
        assert!(sent.contains(r#""rule":"18446744073709551615""#), "ids as decimal strings: {sent}");
        assert_eq!(serde_json::from_str::<LeasesBody>(&sent).unwrap(), body);
        let granted = Granted {
            grants: vec![Grant { amount: 10, lasts_us: 2_000_000, remaining: 90, reset_after_us: 1, holders: 2 }],
        };
        let answer = serde_json::to_string(&granted).unwrap();
        assert!(answer.contains(r#""lastsUs":2000000"#) && answer.contains(r#""resetAfterUs":1"#), "{answer}");
        assert_eq!(serde_json::from_str::<Granted>(&answer).unwrap(), granted);
        assert!(serde_json::from_str::<LeasesBody>(r#"{"namespace": "a", "leases": [], "x": 1}"#).is_err());
    }
}
