//! The policies and request the check API tests share (tests/serve.rs in a process,
//! tests/http_contract.rs in-process), so both test the same contract.

#![allow(dead_code)]

use serde_json::{Value, json};

pub const POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders-api, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: orders}}
  rules:
    - name: per-api-key
      match: {methods: [POST], paths: [{prefix: /orders}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
    - name: trial
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
      mode: shadow
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shaping, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: batch}}
  rules:
    - name: smooth
      algorithm: leakyBucket
      limit: {requests: 10, per: 1s, burst: 5, maxDelay: 1s}
"#;

pub fn order(key: &str) -> Value {
    json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "POST", "path": "/orders/1",
           "host": "api.example.com", "clientIp": "203.0.113.7", "headers": {"x-api-key": key}})
}
