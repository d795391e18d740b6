//! The application's probes, run by the sidecar on the kubelet's behalf.
//!
//! The injecting webhook moves the application's HTTP and TCP probes to the sidecar's admin port
//! (`GET /app-health/<container>/<livez|readyz|startupz>`) and hands the sidecar what each one
//! was (`SLUICE_APP_PROBES`). The sidecar then does what the kubelet would have done, against
//! the application on loopback: never rate limited, never redirected, never stopped by the
//! NetworkPolicy that closes the application's ports. As the kubelet does, an HTTPS probe does
//! not verify the certificate, and 200-399 is success.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde::{Deserialize, Serialize};

/// Where the probes are served on the admin port.
pub const APP_HEALTH_PREFIX: &str = "/app-health/";

/// A probe the sidecar runs for the application: what the kubelet would have done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AppProbe {
    pub port: u16,
    /// None: a TCP connect is the whole probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpProbe>,
    pub timeout_seconds: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpProbe {
    pub path: String,
    /// `HTTP` or `HTTPS`.
    pub scheme: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
}

/// Path on the admin port → probe, as `SLUICE_APP_PROBES` gives them.
pub fn parse(json: &str) -> Result<BTreeMap<String, AppProbe>, String> {
    let probes: BTreeMap<String, AppProbe> =
        serde_json::from_str(json).map_err(|e| format!("SLUICE_APP_PROBES: {e}"))?;
    for (path, probe) in &probes {
        if !path.starts_with(APP_HEALTH_PREFIX) {
            return Err(format!("SLUICE_APP_PROBES: {path:?} does not start with {APP_HEALTH_PREFIX}"));
        }
        if let Some(http) = &probe.http {
            if !matches!(http.scheme.as_str(), "HTTP" | "HTTPS") {
                return Err(format!("SLUICE_APP_PROBES: {path}: scheme {:?} is not HTTP or HTTPS", http.scheme));
            }
            if !http.path.starts_with('/') {
                return Err(format!("SLUICE_APP_PROBES: {path}: path {:?} does not start with /", http.path));
            }
        }
        if probe.port == 0 {
            return Err(format!("SLUICE_APP_PROBES: {path}: port 0"));
        }
    }
    Ok(probes)
}

/// The probes and the client that runs them.
pub struct AppHealth {
    probes: BTreeMap<String, AppProbe>,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl AppHealth {
    pub fn new(probes: BTreeMap<String, AppProbe>) -> AppHealth {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map(|builder| {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                    .with_no_client_auth()
            });
        let tls = tls.unwrap_or_else(|_| {
            // Only fails on an empty protocol list, which the safe defaults never are.
            rustls::ClientConfig::builder().with_root_certificates(rustls::RootCertStore::empty()).with_no_client_auth()
        });
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        // No pool: probes are seconds apart, and a kept connection would hide a listener that
        // stopped accepting.
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(connector);
        AppHealth { probes, client }
    }

    pub fn is_empty(&self) -> bool {
        self.probes.is_empty()
    }

    /// Runs the probe at `path`: 200 when the application passes it, its own status (>= 400) or
    /// 503 when it fails, 404 for a path that is no probe.
    pub async fn run(&self, path: &str) -> (StatusCode, String) {
        let Some(probe) = self.probes.get(path) else {
            return (StatusCode::NOT_FOUND, format!("no probe at {path}\n"));
        };
        let deadline = Duration::from_secs(u64::from(probe.timeout_seconds.max(1)));
        let Some(http) = &probe.http else {
            return match tokio::time::timeout(deadline, tokio::net::TcpStream::connect(("127.0.0.1", probe.port))).await
            {
                Ok(Ok(_)) => (StatusCode::OK, format!("tcp {}: connected\n", probe.port)),
                Ok(Err(error)) => (StatusCode::SERVICE_UNAVAILABLE, format!("tcp {}: {error}\n", probe.port)),
                Err(_) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("tcp {}: no connection within {deadline:?}\n", probe.port),
                ),
            };
        };
        let scheme = if http.scheme == "HTTPS" { "https" } else { "http" };
        let uri = format!("{scheme}://127.0.0.1:{}{}", probe.port, http.path);
        let mut request = Request::get(uri.as_str()).header(http::header::USER_AGENT, "kube-probe/sluice");
        for (name, value) in &http.headers {
            if let (Ok(name), Ok(value)) = (HeaderName::try_from(name.as_str()), HeaderValue::try_from(value.as_str()))
            {
                request = request.header(name, value);
            }
        }
        let request = match request.body(Empty::new()) {
            Ok(request) => request,
            Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{uri}: {error}\n")),
        };
        match tokio::time::timeout(deadline, self.client.request(request)).await {
            Ok(Ok(response)) => {
                let status = response.status();
                if (200..400).contains(&status.as_u16()) {
                    (StatusCode::OK, format!("{uri}: {status}\n"))
                } else if status.as_u16() >= 400 {
                    (status, format!("{uri}: {status}\n"))
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, format!("{uri}: {status}\n"))
                }
            }
            Ok(Err(error)) => {
                (StatusCode::SERVICE_UNAVAILABLE, format!("{uri}: {}\n", super::verdict::error_chain(&error)))
            }
            Err(_) => (StatusCode::SERVICE_UNAVAILABLE, format!("{uri}: no answer within {deadline:?}\n")),
        }
    }
}

/// `GET /app-health/{container}/{kind}`.
pub async fn handler(
    State(health): State<Arc<AppHealth>>,
    Path((container, kind)): Path<(String, String)>,
) -> Response {
    let (status, body) = health.run(&format!("{APP_HEALTH_PREFIX}{container}/{kind}")).await;
    (status, body).into_response()
}

/// The kubelet's own HTTPS probes do not verify the application's certificate (it is often
/// self-signed, and the kubelet has no name to check it against); the sidecar does the same.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A one-connection-at-a-time HTTP server answering `status`, recording request heads.
    async fn app(status: u16) -> (u16, Arc<parking_lot::Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buffer = vec![0; 4096];
                let n = stream.read(&mut buffer).await.unwrap_or(0);
                record.lock().push(String::from_utf8_lossy(&buffer[..n]).to_string());
                let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
        (port, seen)
    }

    fn http_probe(port: u16, path: &str) -> AppProbe {
        AppProbe {
            port,
            http: Some(HttpProbe {
                path: path.into(),
                scheme: "HTTP".into(),
                headers: vec![("X-Probe".into(), "yes".into())],
            }),
            timeout_seconds: 1,
        }
    }

    #[tokio::test]
    async fn http_probes_pass_and_fail_as_the_kubelet_judges_them() {
        let (ok, seen) = app(204).await;
        let (redirect, _) = app(302).await;
        let (failing, _) = app(500).await;
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind").local_addr().expect("addr").port();
        let probes = [
            ("/app-health/app/livez", http_probe(ok, "/live?x=1")),
            ("/app-health/app/readyz", http_probe(redirect, "/")),
            ("/app-health/app/startupz", http_probe(failing, "/")),
            ("/app-health/other/livez", http_probe(closed, "/")),
        ];
        let health = AppHealth::new(probes.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
        assert_eq!(health.run("/app-health/app/livez").await.0, StatusCode::OK);
        let head = seen.lock()[0].clone();
        assert!(head.starts_with("GET /live?x=1 HTTP/1.1\r\n"), "{head}");
        assert!(head.to_ascii_lowercase().contains("x-probe: yes"), "{head}");
        assert_eq!(health.run("/app-health/app/readyz").await.0, StatusCode::OK, "3xx passes");
        assert_eq!(health.run("/app-health/app/startupz").await.0, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(health.run("/app-health/other/livez").await.0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(health.run("/app-health/nope/livez").await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn tcp_probes_connect() {
        let open = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = open.local_addr().expect("addr").port();
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind").local_addr().expect("addr").port();
        let tcp = |port| AppProbe { port, http: None, timeout_seconds: 1 };
        let health = AppHealth::new(
            [("/app-health/a/livez".to_string(), tcp(port)), ("/app-health/a/readyz".to_string(), tcp(closed))].into(),
        );
        assert_eq!(health.run("/app-health/a/livez").await.0, StatusCode::OK);
        assert_eq!(health.run("/app-health/a/readyz").await.0, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn the_webhooks_json_is_checked() {
        let good = r#"{"/app-health/app/livez": {"port": 8080, "http": {"path": "/h", "scheme": "HTTPS", "headers": [["a", "b"]]}, "timeoutSeconds": 2}}"#;
        let probes = parse(good).expect("valid");
        assert_eq!(probes["/app-health/app/livez"].http.as_ref().map(|h| h.scheme.as_str()), Some("HTTPS"));
        for bad in [
            r#"{"/elsewhere": {"port": 1, "timeoutSeconds": 1}}"#,
            r#"{"/app-health/a/livez": {"port": 0, "timeoutSeconds": 1}}"#,
            r#"{"/app-health/a/livez": {"port": 1, "timeoutSeconds": 1, "http": {"path": "/", "scheme": "FTP"}}}"#,
            r#"{"/app-health/a/livez": {"port": 1, "timeoutSeconds": 1, "extra": true}}"#,
            "[]",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
