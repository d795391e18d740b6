//! What a caller may say in a check request ([`crate::api::check::CheckRequest`], the wire
//! format both ends share): the namespace it may act in, and whether it may set the cost.

use super::auth::{Caller, Forbidden};
use crate::api::check::CheckRequest;

impl CheckRequest {
    /// The request as the policy matcher sees it, borrowed, with what `caller` may say applied:
    /// the namespace defaults to the caller's own and must be one it may use; only a trusted
    /// caller may set the cost. Any caller may state its client's IP (for its own namespaces).
    pub fn view<'a>(&'a self, caller: &'a Caller) -> Result<crate::policy::RequestView<'a>, Forbidden> {
        let namespace = caller.namespace_of(self.namespace.as_deref())?;
        if self.cost.is_some() && !caller.is_trusted() {
            return Err(Forbidden(format!(
                "cost: caller {} may not set a request's cost (gateways only)",
                caller.name()
            )));
        }
        Ok(crate::policy::RequestView {
            namespace,
            labels: &self.labels,
            method: &self.method,
            path: &self.path,
            host: self.host.as_deref(),
            client_ip: self.client_ip,
            headers: &self.headers,
            cost: self.cost.unwrap_or(1),
            fields: &self.request_fields,
            descriptor: None,
            egress: self.egress.as_deref(),
            max_wait: self.deadline_ms.map(|ms| ms.saturating_mul(crate::duration::MICROS_PER_MS)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        CheckRequest::from_json(body.as_bytes()).unwrap_err().0
    }
    use crate::api::check::CheckRequest;

    #[test]
    fn only_path_is_required() {
        let r = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
        let view = r.view(&Caller::Open).unwrap();
        assert_eq!((view.namespace, view.method, view.cost), ("default", "GET", 1));
        assert!(err(r#"{}"#).contains("missing field `path`"));
    }

    #[test]
    fn tenants_ask_about_their_own_namespace_and_never_set_the_cost() {
        let tenant = Caller::Tenant { name: "sa-a".into(), namespaces: vec!["tenant-a".to_string()].into() };
        let own = CheckRequest::from_json(br#"{"path": "/", "clientIp": "203.0.113.7"}"#).unwrap();
        let view = own.view(&tenant).unwrap();
        assert_eq!((view.namespace, view.cost), ("tenant-a", 1), "defaults to the caller's namespace");
        assert!(view.client_ip.is_some(), "a sidecar states its client's IP");
        let other = CheckRequest::from_json(br#"{"namespace": "tenant-b", "path": "/"}"#).unwrap();
        assert!(other.view(&tenant).unwrap_err().0.contains("\"tenant-b\""));
        let cost = CheckRequest::from_json(br#"{"namespace": "tenant-a", "path": "/", "cost": 0}"#).unwrap();
        assert!(cost.view(&tenant).unwrap_err().0.starts_with("cost: "));
        let gateway = Caller::Gateway { name: "edge".into() };
        assert_eq!(other.view(&gateway).unwrap().namespace, "tenant-b");
        assert_eq!(cost.view(&gateway).unwrap().cost, 0);
    }
}
