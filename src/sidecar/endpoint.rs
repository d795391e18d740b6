//! The enforcement endpoint as the sidecar talks to it: the client (TLS against the operator's CA
//! only), the credential it presents, and the check answers it reads.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::config::Config;
use super::verdict::{Decision, EndpointError, Held, decision_of, error_chain};
use crate::api::check::CheckAnswer;
use crate::api::leases::{Granted, LeaseEntry, LeaseSettle, LeaseWant, LeasesBody};

/// The endpoint's answers are small; this only guards against a misdirected URL.
pub(super) const MAX_ENDPOINT_BODY: usize = 4 << 20;
pub(super) type EndpointClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// The enforcement endpoint: its client, its URLs and the credential presented to it.
pub(super) struct Endpoint {
    pub client: EndpointClient,
    pub check_uri: Uri,
    pub checks_uri: Uri,
    pub settle_uri: Uri,
    pub leases_uri: Uri,
    pub snapshot_uri: Uri,
    /// `snapshot_uri` with `?wait=`: held by the endpoint while the snapshot is unchanged.
    pub snapshot_wait_uri: Uri,
    pub credential: Option<Credential>,
}

impl Endpoint {
    /// The endpoint `config` names; `snapshot_wait` is how long it may hold a snapshot request
    /// while nothing changes.
    pub fn new(config: &Config, snapshot_wait: Duration) -> Result<Endpoint, super::SidecarError> {
        Ok(Endpoint {
            client: endpoint_client(config)?,
            check_uri: config.check_uri.clone(),
            checks_uri: config.checks_uri.clone(),
            settle_uri: config.settle_uri.clone(),
            leases_uri: config.leases_uri.clone(),
            snapshot_uri: config.snapshot_uri.clone(),
            snapshot_wait_uri: format!("{}?wait={}s", config.snapshot_uri, snapshot_wait.as_secs())
                .parse()
                .map_err(|_| super::SidecarError::Config(format!("cannot append ?wait= to {}", config.snapshot_uri)))?,
            credential: config.token_file.clone().map(Credential::new),
        })
    }

    pub fn authorize(&self, request: http::request::Builder) -> http::request::Builder {
        match self.credential.as_ref().and_then(|c| c.value.load_full()) {
            Some(value) => request.header(crate::request::headers::CREDENTIAL_HEADER, (*value).clone()),
            None => request,
        }
    }

    /// POSTs a JSON body; the status and the whole answer.
    pub async fn post(&self, uri: &Uri, body: Bytes) -> Result<(StatusCode, Bytes), EndpointError> {
        let request = self
            .authorize(Request::post(uri.clone()))
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(Full::new(body))
            .map_err(|e| EndpointError::Rejected(StatusCode::BAD_REQUEST, e.to_string()))?;
        let response = self.client.request(request).await.map_err(|e| EndpointError::Unreachable(error_chain(&e)))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ENDPOINT_BODY)
            .collect()
            .await
            .map_err(|e| EndpointError::Unreachable(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    }

    /// One check on its own: `POST /v1/check` with `body` (a check request as JSON).
    pub async fn check_one(&self, body: Vec<u8>) -> Result<Decision, EndpointError> {
        let (status, body) = self.post(&self.check_uri, Bytes::from(body)).await?;
        if status == StatusCode::BAD_REQUEST || status == StatusCode::PAYLOAD_TOO_LARGE {
            return Err(EndpointError::Rejected(status, String::from_utf8_lossy(&body).into_owned()));
        }
        if !status.is_success() {
            return Err(EndpointError::Status(status));
        }
        let answer: CheckAnswer = serde_json::from_slice(&body).map_err(|e| EndpointError::Decode(e.to_string()))?;
        answer.decision()
    }
}

/// A failed exchange with the endpoint, by what it means. An endpoint that is away, slow or
/// failing is what the failure modes are for; one that answers in a way that shows this sidecar
/// is set up wrong for it (plain HTTP to an HTTPS endpoint or the reverse, a certificate its CA
/// did not sign, a credential refused) fails every request alike and never heals by itself, so
/// it is named and the sidecar is not ready ([`super::snapshot::Readiness`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeFailure {
    #[error("{0}")]
    Misconfigured(String),
    #[error("{0}")]
    Unavailable(String),
}

impl ExchangeFailure {
    /// A request to `uri` failed before any answer: `chain` is the client's error chain
    /// ([`error_chain`]), whose words say whether the two ends disagree on the protocol or the
    /// certificate (the client has no typed error for either).
    pub fn of_transport(uri: &Uri, chain: String) -> ExchangeFailure {
        let authority = uri.authority().map_or("", |a| a.as_str());
        let endpoint = format!("the endpoint {}://{authority}", uri.scheme_str().unwrap_or("http"));
        let https = uri.scheme_str() == Some("https");
        let cause = if !https && chain.contains("invalid HTTP version parsed") {
            // A TLS server's answer (an alert) to a plain HTTP request.
            format!(
                "{endpoint} does not answer plain HTTP ({chain}): it serves HTTPS, so --endpoint must be https://{authority} with --endpoint-ca the CA that signed its certificate (in a cluster, the operator's: docs/sidecar.md)"
            )
        } else if https && (chain.contains("InvalidContentType") || chain.contains("corrupt message")) {
            // A plain HTTP server's answer to a TLS handshake.
            format!(
                "{endpoint} does not answer TLS ({chain}): it serves plain HTTP, so --endpoint must be http://{authority}, or the endpoint must serve HTTPS (--tls-cert)"
            )
        } else if https && chain.contains("invalid peer certificate") {
            format!(
                "{endpoint} presents a certificate --endpoint-ca does not vouch for ({chain}): give the CA that signed it (in a cluster, the operator's: docs/sidecar.md)"
            )
        } else {
            return ExchangeFailure::Unavailable(chain);
        };
        ExchangeFailure::Misconfigured(cause)
    }

    /// The endpoint answered `status` where it answers 2xx (or 304) to a sidecar it accepts:
    /// 401 and 403 say the credential was refused.
    pub fn of_status(status: StatusCode, what: &str) -> ExchangeFailure {
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return ExchangeFailure::Misconfigured(format!(
                "the endpoint refused this sidecar's credential ({status} to {what}): check --token-file (in a cluster, the pod's projected token and the operator's --token-audience) and --namespace"
            ));
        }
        ExchangeFailure::Unavailable(format!("{what} answered {status}"))
    }

    #[cfg(test)]
    fn is_misconfigured(&self) -> bool {
        matches!(self, ExchangeFailure::Misconfigured(_))
    }
}

/// The endpoint grants this pod's slices of hot keys' quota (`POST /v1/leases`): the sidecar
/// holds them for its own pod's requests ([`crate::engine::leases`]).
impl crate::store::LeaseStore for Endpoint {
    async fn lease(
        &self,
        namespace: &str,
        ops: &[crate::store::LeaseOp<'_>],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, crate::store::StoreError> {
        use crate::store::StoreError;
        let body = LeasesBody {
            namespace: namespace.to_string(),
            leases: ops
                .iter()
                .map(|op| LeaseEntry {
                    rule: op.rule.to_string(),
                    key: String::from_utf8_lossy(op.key).into_owned(),
                    settle: op.settle.map(|(hold, spent)| LeaseSettle { hold: hold.to_string(), spent }),
                    ask: op.ask.map(|ask| LeaseWant { hold: ask.hold.to_string(), want: ask.want }),
                })
                .collect(),
        };
        let body = serde_json::to_vec(&body).map_err(|e| StoreError::Protocol(e.to_string()))?;
        let (status, answer) =
            self.post(&self.leases_uri, Bytes::from(body)).await.map_err(|e| StoreError::Unavailable(e.to_string()))?;
        if !status.is_success() {
            return Err(StoreError::Unavailable(format!(
                "POST /v1/leases answered {status}: {}",
                String::from_utf8_lossy(&answer).chars().take(200).collect::<String>()
            )));
        }
        let granted: Granted = serde_json::from_slice(&answer).map_err(|e| StoreError::Protocol(e.to_string()))?;
        if granted.grants.len() != ops.len() {
            return Err(StoreError::Protocol(format!("{} grants for {} leases", granted.grants.len(), ops.len())));
        }
        Ok(granted
            .grants
            .into_iter()
            .map(|g| crate::algorithm::lease::LeaseGrant {
                amount: g.amount,
                lasts: g.lasts_us,
                holders: g.holders,
                after: crate::algorithm::Decision {
                    allowed: true,
                    remaining: g.remaining,
                    reset_after: g.reset_after_us,
                    retry_after: None,
                    delay: 0,
                },
            })
            .collect())
    }
}

impl CheckAnswer {
    pub fn decision(self) -> Result<Decision, EndpointError> {
        if let Some(error) = self.error {
            let status = self.status.and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::BAD_REQUEST);
            if status == StatusCode::BAD_REQUEST || status == StatusCode::PAYLOAD_TOO_LARGE {
                return Err(EndpointError::Rejected(status, error));
            }
            return Err(EndpointError::Status(status));
        }
        let allowed = self.allowed.ok_or_else(|| EndpointError::Decode("an answer without `allowed`".into()))?;
        let headers = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let status = self.status.unwrap_or(if allowed { 200 } else { 429 });
        Ok(decision_of(
            allowed,
            self.retry_after_ms,
            self.delay_ms,
            headers,
            self.lease.map(Held::Endpoint),
            status,
            self.body.as_deref(),
        ))
    }
}

/// The bearer token the sidecar presents, re-read from its file as the kubelet rotates it.
pub(super) struct Credential {
    path: std::path::PathBuf,
    pub(super) value: arc_swap::ArcSwapOption<HeaderValue>,
}

impl Credential {
    pub fn new(path: std::path::PathBuf) -> Credential {
        let credential = Credential { path, value: arc_swap::ArcSwapOption::empty() };
        credential.refresh();
        credential
    }

    /// Re-reads the file; a read error keeps the last token (a rotation replaces the file
    /// atomically, so a failed read is transient).
    pub fn refresh(&self) {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => match HeaderValue::from_str(&format!("Bearer {}", text.trim())) {
                Ok(mut value) => {
                    value.set_sensitive(true);
                    if self.value.load().as_deref() != Some(&value) {
                        self.value.store(Some(Arc::new(value)));
                    }
                }
                Err(_) => tracing::warn!(path = %self.path.display(), "token file does not hold a usable token"),
            },
            Err(error) => tracing::warn!(path = %self.path.display(), %error, "cannot read the token file"),
        }
    }
}

/// The client to the endpoint: plain HTTP, or HTTPS verified against the given CA only (never
/// the system roots: in a cluster the endpoint's certificate comes from the operator's CA, and
/// anything else answering at that name is an impostor).
fn endpoint_client(config: &Config) -> Result<EndpointClient, super::SidecarError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut http = HttpConnector::new();
    // Checks are one small write and one small read: Nagle would add a delayed-ACK wait.
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.endpoint_timeout));
    http.enforce_http(false);
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pem) = &config.endpoint_ca {
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| super::SidecarError::Config(format!("endpoint CA: {e}")))?;
            roots.add(cert).map_err(|e| super::SidecarError::Config(format!("endpoint CA: {e}")))?;
        }
        if roots.is_empty() {
            return Err(super::SidecarError::Config("endpoint CA: no certificate in the PEM".into()));
        }
    }
    pooled_client(roots, http).map_err(super::SidecarError::Config)
}

/// A pooled HTTP/1 client that speaks plain HTTP, or TLS verified against `roots` only: the
/// endpoint's and the egress destinations' ([`super::egress`]).
pub(super) fn pooled_client(roots: rustls::RootCertStore, http: HttpConnector) -> Result<EndpointClient, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(connector))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheme_tls_or_credential_mismatch_is_told_from_an_outage() {
        let http: Uri = "http://sluice.sluice-system.svc:8080/v1/snapshot".parse().unwrap();
        let https: Uri = "https://sluice.sluice-system.svc:8080/v1/snapshot".parse().unwrap();
        let failure =
            ExchangeFailure::of_transport(&http, "client error (SendRequest): invalid HTTP version parsed".into());
        assert!(failure.is_misconfigured(), "{failure}");
        assert!(failure.to_string().contains("--endpoint must be https://sluice.sluice-system.svc:8080"), "{failure}");
        let failure = ExchangeFailure::of_transport(
            &https,
            "client error (Connect): received corrupt message of type InvalidContentType".into(),
        );
        assert!(failure.to_string().contains("does not answer TLS"), "{failure}");
        let failure = ExchangeFailure::of_transport(
            &https,
            "client error (Connect): invalid peer certificate: UnknownIssuer".into(),
        );
        assert!(failure.to_string().contains("--endpoint-ca does not vouch for"), "{failure}");
        assert!(ExchangeFailure::of_status(StatusCode::UNAUTHORIZED, "GET /v1/snapshot").is_misconfigured());
        assert!(ExchangeFailure::of_status(StatusCode::FORBIDDEN, "GET /v1/snapshot").is_misconfigured());

        for outage in ["client error (Connect): tcp connect error: Connection refused (os error 111)", "timed out"] {
            assert!(!ExchangeFailure::of_transport(&https, outage.into()).is_misconfigured(), "{outage}");
            assert!(!ExchangeFailure::of_transport(&http, outage.into()).is_misconfigured(), "{outage}");
        }
        assert!(!ExchangeFailure::of_status(StatusCode::SERVICE_UNAVAILABLE, "GET /v1/snapshot").is_misconfigured());
    }
}
