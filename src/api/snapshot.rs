//! `GET /v1/snapshot`: the live snapshot as far as the caller may see it. The endpoint writes a
//! [`SnapshotBody`]; a sidecar reads the part it needs as a [`SnapshotDocument`] (the version, the
//! header names its checks carry, the policies it compiles into the same snapshot).

use serde::{Deserialize, Serialize};

use crate::policy::RateLimitPolicy;

/// What `GET /v1/snapshot` shows of the policies in force.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotView {
    pub version: String,
    /// `namespace/name` of each policy in force.
    pub policies: Vec<String>,
    pub rules: Vec<RuleView>,
    pub header_names: Vec<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RuleView {
    pub policy: String,
    pub rule: String,
    /// The rule's `RuleId` in hex.
    pub id: String,
    pub algorithm: crate::algorithm::Algorithm,
    pub requests: u64,
    /// As written in the policy.
    pub per: String,
    /// Effective capacity of the bucket algorithms; absent for window algorithms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_delay: Option<String>,
    pub cost: u64,
    pub mode: crate::policy::Mode,
    pub on_store_failure: crate::policy::FailureMode,
    pub key: String,
}

impl SnapshotView {
    pub fn of(part: &crate::policy::SnapshotPart<'_>) -> SnapshotView {
        SnapshotView {
            version: part.version(),
            policies: part.policies().map(|p| p.qualified_name().to_string()).collect(),
            rules: part
                .policies()
                .flat_map(|p| p.rules())
                .map(|r| RuleView {
                    policy: r.policy().to_string(),
                    rule: r.name().to_string(),
                    id: format!("{:016x}", r.id()),
                    algorithm: r.algorithm(),
                    requests: r.limit().requests(),
                    per: r.per_text().to_string(),
                    burst: r.algorithm().uses_burst().then(|| r.limit().burst()),
                    max_delay: r.max_delay_text().map(str::to_string),
                    cost: r.cost(),
                    mode: r.mode(),
                    on_store_failure: r.on_store_failure(),
                    key: r.key_description(),
                })
                .collect(),
            header_names: part.header_names(),
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotBody<'a> {
    // No `version` here: the flattened view carries it, and a second copy made the JSON object
    // repeat the key, which strict parsers (serde structs among them) refuse.
    pub loaded: bool,
    pub loaded_at_ms: u64,
    #[serde(flatten)]
    pub view: SnapshotView,
    /// The policies in force, as documents a sidecar can compile into the same snapshot.
    pub sources: Vec<&'a RateLimitPolicy>,
    pub last_reload_error: Option<crate::engine::ReloadError>,
    pub store: crate::store::StoreStatus,
}

/// What a sidecar reads of a [`SnapshotBody`].
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotDocument {
    pub version: String,
    #[serde(default = "yes")]
    pub loaded: bool,
    #[serde(default)]
    pub header_names: Vec<String>,
    #[serde(default)]
    pub sources: Vec<RateLimitPolicy>,
}

fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_endpoint_writes_a_sidecar_reads_back_into_the_same_snapshot() {
        let policy: RateLimitPolicy = serde_yaml::from_str(
            r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  rules:
    - name: r
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 10, per: 1s}
"#,
        )
        .unwrap();
        let snapshot = crate::policy::compile(vec![policy]).snapshot;
        let part = snapshot.part(None);
        let body = SnapshotBody {
            loaded: true,
            loaded_at_ms: 1,
            view: SnapshotView::of(&part),
            sources: part.sources(),
            last_reload_error: None,
            store: crate::store::StoreStatus::default(),
        };
        let sent = serde_json::to_vec(&body).unwrap();
        let read: SnapshotDocument = serde_json::from_slice(&sent).unwrap();
        assert_eq!(read.version, body.view.version, "one `version` key, which a strict reader accepts");
        assert!(read.loaded);
        assert_eq!(read.header_names, ["x-api-key"]);
        let again = crate::policy::compile(read.sources).snapshot;
        assert_eq!(SnapshotView::of(&again.part(None)), body.view, "the sources compile into the same snapshot");
    }

    #[test]
    fn snapshot_view_shows_each_rule_as_written() {
        let policy: crate::policy::RateLimitPolicy = serde_yaml::from_str(
            r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  rules:
    - name: r
      match: {headers: [{name: X-Tenant, present: true}]}
      key: [{header: X-API-Key}, {clientIP: true}]
      algorithm: tokenBucket
      limit: {requests: 10, per: 1s, burst: 5}
      mode: shadow
      onStoreFailure: deny
"#,
        )
        .unwrap();
        let snapshot = crate::policy::compile(vec![policy]).snapshot;
        let v = serde_json::to_value(SnapshotView::of(&snapshot.part(None))).unwrap();
        assert_eq!(v["policies"][0], "ns/p");
        assert_eq!(v["headerNames"], serde_json::json!(["x-api-key", "x-tenant"]));
        let r = &v["rules"][0];
        assert_eq!(r["policy"], "ns/p");
        assert_eq!(r["rule"], "r");
        assert_eq!(r["algorithm"], "tokenBucket");
        assert_eq!(r["requests"], 10);
        assert_eq!(r["per"], "1s");
        assert_eq!(r["burst"], 5);
        assert_eq!(r["mode"], "shadow");
        assert_eq!(r["onStoreFailure"], "deny");
        assert_eq!(r["key"], "header x-api-key, clientIP");
    }
}
