use std::collections::BTreeMap;

use super::*;
use crate::policy::{compile, load_str};

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders, namespace: shop}
spec:
  selector:
    matchLabels: {app: orders}
    matchExpressions: [{key: tier, operator: NotIn, values: [free]}]
  rules:
    - name: writes
      match: {methods: [POST, PUT], paths: [{prefix: /orders}, {regex: "/carts/[0-9]+"}]}
      key: [{header: X-API-Key}]
      algorithm: tokenBucket
      limit: {requests: 10, per: 1s, burst: 5}
      deferIfLimited: {maxAttempts: 3, maxQueued: 50}
    - name: by-host
      match: {hosts: ["*.example.com"], headers: [{name: X-Tier, exact: gold}]}
      key: [{clientIP: true, missing: skip}, {host: true}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1m}
    - name: exact-health
      match: {paths: [{exact: /healthz}], headers: [{name: X-Probe, present: false}]}
      algorithm: slidingWindowLog
      limit: {requests: 2, per: 1s}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: everything, namespace: shop}
spec:
  rules:
    - name: all
      key: [{path: true}, {method: true}]
      algorithm: gcra
      limit: {requests: 100, per: 1s}
"#;

fn snapshot() -> Snapshot {
    let loaded = load_str(POLICIES, std::path::Path::new("test.yaml")).unwrap();
    let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    compiled.snapshot
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Explain and resolve are the same decision: for every combination of a few methods, paths
/// (normal and not), hosts, headers, labels and client IPs, a rule is explained as matched
/// exactly when resolve returns it, with the same key and cost.
#[test]
fn explain_agrees_with_resolve_on_many_requests() {
    let snapshot = snapshot();
    let methods = ["GET", "post", "PUT", "DELETE"];
    let paths = ["/orders", "/orders/1?x=1", "//orders/./2", "/ordersX", "/carts/12", "/carts/x", "/healthz", "/"];
    let hosts = [None, Some("a.example.com:8443"), Some("example.com"), Some("A.EXAMPLE.COM.")];
    let header_sets = [map(&[]), map(&[("x-api-key", "k1")]), map(&[("x-tier", "gold"), ("x-probe", "1")])];
    let label_sets = [map(&[]), map(&[("app", "orders")]), map(&[("app", "orders"), ("tier", "free")])];
    let ips = [None, Some("203.0.113.7".parse().unwrap())];
    let mut cases = 0;
    let mut matched_total = 0;
    for method in methods {
        for path in paths {
            for host in hosts {
                for headers in &header_sets {
                    for labels in &label_sets {
                        for client_ip in ips {
                            let req = RequestView {
                                namespace: "shop",
                                labels,
                                method,
                                path,
                                host,
                                client_ip,
                                headers,
                                cost: 2,
                                fields: &crate::request::names::NoEntries,
                                descriptor: None,
                                egress: None,
                                max_wait: None,
                            };
                            let mut resolved = Vec::new();
                            snapshot.resolve(&req, &mut resolved);
                            let explanation = snapshot.explain(&req, 1);
                            let explained = explanation.matched();
                            assert_eq!(resolved.len(), explained.len(), "{req:?}");
                            for (r, e) in resolved.iter().zip(&explained) {
                                assert_eq!(r.rule.identity(), e.rule.identity(), "{req:?}");
                                assert_eq!((&r.key, r.cost), (&e.key, e.cost), "{req:?}");
                            }
                            for rule in explanation.policies.iter().flat_map(|p| &p.rules) {
                                if let Err(reason) = &rule.outcome {
                                    assert!(!reason.is_empty());
                                }
                            }
                            cases += 1;
                            matched_total += resolved.len();
                        }
                    }
                }
            }
        }
    }
    assert_eq!(cases, 4 * 8 * 4 * 3 * 3 * 2);
    assert!(matched_total > cases / 2, "the cases exercise matches too");
}

fn reasons(req: &RequestView<'_>) -> Vec<(String, Option<String>)> {
    let snapshot = snapshot();
    let report = snapshot.explain(req, 1).report(None);
    report.rules.into_iter().map(|r| (r.rule, r.reason)).collect()
}

fn reason_of(req: &RequestView<'_>, rule: &str) -> String {
    reasons(req).into_iter().find(|(name, _)| name == rule).and_then(|(_, reason)| reason).unwrap_or_default()
}

#[test]
fn reasons_name_the_failing_condition() {
    let orders = map(&[("app", "orders")]);
    let free = map(&[("app", "orders"), ("tier", "free")]);
    let gold = map(&[("x-tier", "gold")]);
    let mut req = RequestView::new("/orders/1");
    req.namespace = "shop";
    assert!(reason_of(&req, "writes").starts_with("selector: matchLabels needs app=orders"));
    req.labels = &free;
    assert!(reason_of(&req, "writes").starts_with("selector: matchExpressions[0] needs tier NotIn [free]"));
    req.labels = &orders;
    assert_eq!(reason_of(&req, "writes"), "methods: GET is not one of [POST, PUT]");
    req.method = "POST";
    req.path = "//ordersX/../ordersY";
    assert_eq!(
        reason_of(&req, "writes"),
        "paths: /ordersY (normalized) matches none of [prefix /orders, regex /carts/[0-9]+]"
    );
    assert_eq!(reason_of(&req, "by-host"), "hosts: the request has no host; the rule needs one of [*.example.com]");
    req.host = Some("example.com:80");
    assert_eq!(reason_of(&req, "by-host"), "hosts: example.com matches none of [*.example.com]");
    req.host = Some("a.example.com");
    assert_eq!(reason_of(&req, "by-host"), "headers[0]: x-tier is absent; the rule needs exact \"gold\"");
    req.headers = &gold;
    assert!(reason_of(&req, "by-host").starts_with("key[0]: clientIP has no value"));
    req.client_ip = Some("203.0.113.7".parse().unwrap());
    assert_eq!(reason_of(&req, "by-host"), "");
}

#[test]
fn a_deferring_rule_says_what_a_limited_write_gets() {
    let snapshot = snapshot();
    let labels = map(&[("app", "orders")]);
    let mut req = RequestView::new("/orders/1");
    req.namespace = "shop";
    req.method = "POST";
    req.labels = &labels;
    let report = snapshot.explain(&req, 1).report(None);
    let writes = report.rules.iter().find(|r| r.rule == "writes").unwrap();
    let said = writes.when_limited.as_deref().unwrap_or_default();
    assert!(said.contains("accepted (202, with a status URL)") && said.contains("at most 3 tries"), "{said}");
    assert!(said.contains("50 per key"), "{said}");
    assert!(report.to_text().contains("    limited: a limited POST, PUT, PATCH or DELETE is accepted"));
    let all = report.rules.iter().find(|r| r.rule == "all").unwrap();
    assert_eq!(all.when_limited, None);
}

#[test]
fn keys_are_shown_part_by_part() {
    let snapshot = snapshot();
    let headers = map(&[("x-api-key", "a|b:c")]);
    let labels = map(&[("app", "orders")]);
    let mut req = RequestView::new("/orders/%31");
    req.namespace = "shop";
    req.method = "POST";
    req.headers = &headers;
    req.labels = &labels;
    let report = snapshot.explain(&req, 1).report(None);
    assert_eq!(report.path, "/orders/1", "the normalized path");
    let writes = report.rules.iter().find(|r| r.rule == "writes").unwrap();
    assert_eq!(writes.key.as_deref(), Some("5:a|b:c"));
    assert_eq!(writes.key_parts[0].source, "header x-api-key");
    assert_eq!(writes.key_parts[0].value, "a|b:c");
    let all = report.rules.iter().find(|r| r.rule == "all").unwrap();
    assert_eq!(all.key_parts.iter().map(|p| p.value.as_str()).collect::<Vec<_>>(), ["/orders/1", "POST"]);
    assert_eq!(report.decision, None, "no store consulted: unknown");
}

#[test]
fn decode_key_inverts_encode_key() {
    for parts in [vec![], vec![""], vec!["a|b", "c"], vec!["1:2", "", "é"]] {
        let encoded = crate::policy::encode_key(parts.iter().copied());
        assert_eq!(decode_key(&encoded), Some(parts.clone()));
    }
    assert_eq!(decode_key("3:ab"), None);
    assert_eq!(decode_key("x:ab"), None);
}
