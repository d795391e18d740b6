//! The operator's serving certificate (webhooks and, with `--check-api-tls`, the check API):
//! shared by every replica through one Secret, renewed before it expires, and trusted by the API
//! server through the webhook configurations' caBundle.
//!
//! - The Secret holds `ca.crt`, `tls.crt`, `tls.key` and, when the operator generated it,
//!   `ca.key`: renewing the serving certificate then keeps the CA, so neither caBundle nor the CA
//!   injected sidecars were given changes. Validity: CA 10 years, serving certificate 1 year,
//!   renewed (by the Lease holder) once less than a third of its lifetime is left.
//! - caBundle is a list of CAs. When the Secret's CA changes (rotation), the bundle becomes the
//!   new CA followed by the old ones for [`BUNDLE_OVERLAP`], so replicas still serving the old
//!   certificate keep working until they re-read the Secret, then the new CA alone. A replica
//!   always reads the Secret before it writes caBundle, and writes with the configuration's
//!   resourceVersion, so a lagging replica can never put its old CA back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PublicKeyData,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::sync::watch;

use super::Error;
use crate::telemetry::{Metrics, ReasonLabels};

pub const CA_KEY: &str = "ca.crt";
/// The CA's private key: present when the operator generated the pair, so it can renew the
/// serving certificate without changing the CA.
pub const CA_PRIVATE_KEY: &str = "ca.key";
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";

const DAY: u64 = 24 * 60 * 60;
/// Lifetime of a generated CA.
pub const CA_VALIDITY: Duration = Duration::from_secs(3650 * DAY);
/// Lifetime of a generated serving certificate (never past its CA's).
pub const SERVING_VALIDITY: Duration = Duration::from_secs(365 * DAY);
/// notBefore lies this far back, so a node whose clock is a little behind accepts a certificate
/// issued a moment ago (Kubernetes' own self-signed certificates do the same).
pub const BACKDATE: Duration = Duration::from_secs(60 * 60);
/// How often every replica re-reads the Secret (and the leader checks for renewal).
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(15);
/// How long caBundle keeps the previous CAs next to a new one: far longer than replicas take to
/// re-read the Secret ([`RELOAD_INTERVAL`]).
pub const BUNDLE_OVERLAP: Duration = Duration::from_secs(5 * 60);
/// At most this many CAs in a caBundle (a rotation storm cannot grow it without bound).
pub const MAX_BUNDLE: usize = 4;
/// On each webhook configuration: when its caBundle last gained a CA (RFC 3339); the old CAs
/// are dropped [`BUNDLE_OVERLAP`] later.
pub const ROTATED_AT_ANNOTATION: &str = "sluice.dev/ca-bundle-rotated-at";

#[derive(Clone, PartialEq, Eq)]
pub struct Keypair {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    /// The CA's key (PEM), when known.
    pub ca_key_pem: Option<String>,
}

impl std::fmt::Debug for Keypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keypair")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field("ca_key_pem", &self.ca_key_pem.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

fn unix(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// rcgen's time type; times here are within decades of now, far inside its range.
fn offset(t: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(t).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// A fresh CA and a serving certificate for `hosts` (DNS names or IP addresses) signed by it.
pub fn generate(hosts: &[String]) -> Result<Keypair, rcgen::Error> {
    generate_at(hosts, SystemTime::now())
}

/// [`generate`] as of `now`.
pub fn generate_at(hosts: &[String], now: SystemTime) -> Result<Keypair, rcgen::Error> {
    let start = unix(now) - BACKDATE.as_secs() as i64;
    let ca_end = unix(now) + CA_VALIDITY.as_secs() as i64;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    // Signs serving certificates only.
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    // A distinct name per CA: during a rotation caBundle holds two, and logs and openssl say which.
    ca.distinguished_name.push(DnType::CommonName, format!("sluice-webhook-ca-{}", unix(now)));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = offset(start);
    ca.not_after = offset(ca_end);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca, ca_key);
    let (cert_pem, key_pem) = sign_serving(hosts, &issuer, now, ca_end)?;
    Ok(Keypair { ca_pem: ca_cert.pem(), cert_pem, key_pem, ca_key_pem: Some(ca_key_pem) })
}

fn sign_serving(
    hosts: &[String],
    issuer: &Issuer<'_, KeyPair>,
    now: SystemTime,
    ca_end: i64,
) -> Result<(String, String), rcgen::Error> {
    // rcgen turns names that parse as IP addresses into IP SANs.
    let mut leaf = CertificateParams::new(hosts.to_vec())?;
    leaf.distinguished_name.push(DnType::CommonName, hosts.first().map(String::as_str).unwrap_or("sluice-webhook"));
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = offset(unix(now) - BACKDATE.as_secs() as i64);
    leaf.not_after = offset((unix(now) + SERVING_VALIDITY.as_secs() as i64).min(ca_end));
    let key = KeyPair::generate()?;
    let cert = leaf.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A new serving certificate for `hosts` from `pair`'s CA (which must carry its key).
pub fn renew_serving(pair: &Keypair, hosts: &[String], now: SystemTime) -> Result<Keypair, rcgen::Error> {
    let key = KeyPair::from_pem(pair.ca_key_pem.as_deref().ok_or(rcgen::Error::CouldNotParseKeyPair)?)?;
    let ca_end = inspect(&pair.ca_pem).map_err(|_| rcgen::Error::CouldNotParseCertificate)?.not_after;
    let issuer = Issuer::from_ca_cert_pem(&pair.ca_pem, key)?;
    let (cert_pem, key_pem) = sign_serving(hosts, &issuer, now, ca_end)?;
    Ok(Keypair { cert_pem, key_pem, ..pair.clone() })
}

/// A name a certificate is valid for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Name {
    Dns(String),
    Ip(IpAddr),
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Dns(name) => f.write_str(name),
            Name::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// What [`plan`] needs to know about one certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// Unix seconds.
    pub not_before: i64,
    pub not_after: i64,
    /// The subjectAltName entries (DNS names and IP addresses).
    pub names: Vec<Name>,
    /// SubjectPublicKeyInfo, DER.
    pub public_key: Vec<u8>,
}

/// The first certificate of `pem`.
pub fn inspect(pem: &str) -> Result<CertInfo, String> {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or("no certificate")?
        .map_err(|e| format!("PEM: {e:?}"))?;
    inspect_der(&der)
}

fn inspect_der(der: &[u8]) -> Result<CertInfo, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("X.509: {e}"))?;
    let mut names = Vec::new();
    if let Some(san) = cert.subject_alternative_name().map_err(|e| format!("subjectAltName: {e}"))? {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => names.push(Name::Dns(dns.to_ascii_lowercase())),
                x509_parser::extensions::GeneralName::IPAddress(bytes) => match bytes.len() {
                    4 => names.push(Name::Ip(IpAddr::from(<[u8; 4]>::try_from(*bytes).unwrap_or_default()))),
                    16 => names.push(Name::Ip(IpAddr::from(<[u8; 16]>::try_from(*bytes).unwrap_or_default()))),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    Ok(CertInfo {
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        names,
        public_key: cert.public_key().raw.to_vec(),
    })
}

/// Whether `names` cover `host` (an IP address, a DNS name, or a DNS name under a `*.` wildcard
/// of one label).
pub fn covers(names: &[Name], host: &str) -> bool {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return names.contains(&Name::Ip(ip));
    }
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    names.iter().any(|name| match name {
        Name::Dns(dns) if *dns == host => true,
        Name::Dns(dns) => dns.strip_prefix("*.").is_some_and(|parent| {
            host.split_once('.').is_some_and(|(label, rest)| !label.is_empty() && rest == parent)
        }),
        Name::Ip(_) => false,
    })
}

/// Why a keypair is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A field is missing or does not parse.
    Unreadable,
    /// The serving certificate or the CA has expired.
    Expired,
    /// The serving certificate does not name every `--webhook-host`.
    HostsNotCovered,
    /// Less than a third of the CA's lifetime is left.
    CaExpiring,
    /// Less than a third of the serving certificate's lifetime is left.
    Expiring,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Unreadable => "unreadable",
            Reason::Expired => "expired",
            Reason::HostsNotCovered => "hosts",
            Reason::CaExpiring => "ca_expiring",
            Reason::Expiring => "expiring",
        }
    }

    /// The pair cannot serve as it is: any replica replaces it at startup. Otherwise renewal
    /// waits for the leader.
    pub fn urgent(self) -> bool {
        matches!(self, Reason::Unreadable | Reason::Expired | Reason::HostsNotCovered)
    }
}

/// What to do with the Secret's keypair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    Keep,
    /// A new serving certificate from the same CA (caBundle unchanged).
    Serving(Reason),
    /// A new CA and serving certificate: a rotation.
    NewCa(Reason),
}

impl Renewal {
    pub fn reason(self) -> Option<Reason> {
        match self {
            Renewal::Keep => None,
            Renewal::Serving(r) | Renewal::NewCa(r) => Some(r),
        }
    }
}

/// Whether `pair` (None: the Secret lacks a field) serves `hosts` well at `now`, and if not, how
/// to replace it. A pair without the CA's key (written by an earlier version or by hand) can
/// only be replaced with a new CA.
pub fn plan(pair: Option<&Keypair>, hosts: &[String], now: SystemTime) -> Renewal {
    let Some(pair) = pair else { return Renewal::NewCa(Reason::Unreadable) };
    let now = unix(now);
    // Renew once less than a third of the lifetime is left (cert-manager's default).
    let due = |c: &CertInfo| now >= c.not_after - (c.not_after - c.not_before) / 3;
    let ca = inspect(&pair.ca_pem).ok();
    let ca_key = pair.ca_key_pem.as_deref().and_then(|k| KeyPair::from_pem(k).ok());
    let ca_usable = match (&ca, &ca_key) {
        (Some(ca), Some(key)) => now < ca.not_after && !due(ca) && key.subject_public_key_info() == ca.public_key,
        _ => false,
    };
    let replace = |reason| if ca_usable { Renewal::Serving(reason) } else { Renewal::NewCa(reason) };
    let Some(ca) = ca else { return Renewal::NewCa(Reason::Unreadable) };
    let leaf = inspect(&pair.cert_pem).ok().filter(|_| KeyPair::from_pem(&pair.key_pem).is_ok());
    let Some(leaf) = leaf else { return replace(Reason::Unreadable) };
    if now >= ca.not_after {
        Renewal::NewCa(Reason::Expired)
    } else if now >= leaf.not_after {
        replace(Reason::Expired)
    } else if !hosts.iter().all(|h| covers(&leaf.names, h)) {
        replace(Reason::HostsNotCovered)
    } else if due(&ca) {
        Renewal::NewCa(Reason::CaExpiring)
    } else if due(&leaf) {
        replace(Reason::Expiring)
    } else {
        Renewal::Keep
    }
}

/// `hosts`, then the names `pair`'s serving certificate has beyond them: a replacement never
/// drops a name, so replicas of two versions with different `--webhook-host` (a rolling update)
/// cannot take turns replacing each other's certificate.
fn names_for(hosts: &[String], pair: Option<&Keypair>) -> Vec<String> {
    let mut names = hosts.to_vec();
    if let Some(info) = pair.and_then(|p| inspect(&p.cert_pem).ok()) {
        for name in info.names.iter().map(Name::to_string) {
            if !names.iter().any(|n| n.eq_ignore_ascii_case(&name)) {
                names.push(name);
            }
        }
    }
    names
}

/// The replacement `renewal` calls for.
pub fn renewed(pair: Option<&Keypair>, renewal: Renewal, hosts: &[String], now: SystemTime) -> Result<Keypair, Error> {
    let names = names_for(hosts, pair);
    match (renewal, pair) {
        (Renewal::Serving(_), Some(pair)) => Ok(renew_serving(pair, &names, now)?),
        _ => Ok(generate_at(&names, now)?),
    }
}

fn from_secret(secret: &Secret) -> Result<Keypair, Error> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let data = secret.data.clone().unwrap_or_default();
    let text = |key: &str| data.get(key).and_then(|b| String::from_utf8(b.0.clone()).ok());
    let field = |key: &'static str| text(key).ok_or_else(|| Error::IncompleteSecret(name.clone(), key));
    Ok(Keypair {
        ca_pem: field(CA_KEY)?,
        cert_pem: field(CERT_KEY)?,
        key_pem: field(KEY_KEY)?,
        ca_key_pem: text(CA_PRIVATE_KEY),
    })
}

fn secret_data(pair: &Keypair) -> BTreeMap<String, ByteString> {
    let mut data = BTreeMap::new();
    data.insert(CA_KEY.to_string(), ByteString(pair.ca_pem.clone().into_bytes()));
    data.insert(CERT_KEY.to_string(), ByteString(pair.cert_pem.clone().into_bytes()));
    data.insert(KEY_KEY.to_string(), ByteString(pair.key_pem.clone().into_bytes()));
    if let Some(key) = &pair.ca_key_pem {
        data.insert(CA_PRIVATE_KEY.to_string(), ByteString(key.clone().into_bytes()));
    }
    data
}

/// cert-manager (or anything announcing itself the same way) writes this Secret: never replace it.
fn externally_managed(secret: &Secret) -> bool {
    secret.metadata.annotations.as_ref().is_some_and(|a| a.keys().any(|k| k.starts_with("cert-manager.io/")))
}

/// How the operator treats the Secret.
#[derive(Clone, Debug)]
pub struct SecretPolicy {
    pub namespace: String,
    pub name: String,
    pub hosts: Vec<String>,
    /// Create, renew and replace it (`--generate-certificates`); false: only read it.
    pub generate: bool,
}

/// Creates the Secret with a fresh pair; None when another replica created it first.
async fn create(api: &Api<Secret>, policy: &SecretPolicy, now: SystemTime) -> Result<Option<Keypair>, Error> {
    let pair = generate_at(&policy.hosts, now)?;
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(policy.name.clone()), ..Default::default() },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(secret_data(&pair)),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = %policy.name, "generated the webhook CA and serving certificate");
            Ok(Some(pair))
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Replaces the Secret's pair as `renewal` says, conditional on the Secret being unchanged since
/// it was read (its resourceVersion); None when someone else wrote it first.
async fn replace(
    api: &Api<Secret>,
    secret: &Secret,
    pair: Option<&Keypair>,
    renewal: Renewal,
    policy: &SecretPolicy,
    now: SystemTime,
) -> Result<Option<Keypair>, Error> {
    let new = renewed(pair, renewal, &policy.hosts, now)?;
    let mut body = secret.clone();
    body.metadata.managed_fields = None;
    body.data = Some(secret_data(&new));
    body.string_data = None;
    match api.replace(&policy.name, &PostParams::default(), &body).await {
        Ok(_) => {
            let reason = renewal.reason().map(Reason::as_str).unwrap_or_default();
            match renewal {
                Renewal::NewCa(_) => {
                    tracing::warn!(secret = %policy.name, reason, "replaced the webhook CA and serving certificate (caBundle rotation)")
                }
                _ => tracing::info!(secret = %policy.name, reason, "renewed the webhook serving certificate"),
            }
            Ok(Some(new))
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The keypair in the Secret, creating it if absent and replacing it when it cannot serve (see
/// [`Reason::urgent`]). Replicas starting together race; every write is conditional, and the
/// losers read the winner's pair.
pub async fn shared_keypair(client: &Client, policy: &SecretPolicy, metrics: &Metrics) -> Result<Keypair, Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &policy.namespace);
    for _ in 0..5 {
        let now = SystemTime::now();
        let Some(secret) = api.get_opt(&policy.name).await? else {
            if !policy.generate {
                return Err(Error::MissingSecret(policy.name.clone()));
            }
            match create(&api, policy, now).await? {
                Some(pair) => return Ok(pair),
                None => continue,
            }
        };
        let pair = from_secret(&secret);
        if !policy.generate || externally_managed(&secret) {
            return pair;
        }
        let renewal = plan(pair.as_ref().ok(), &policy.hosts, now);
        match renewal.reason() {
            Some(reason) if reason.urgent() => {
                match replace(&api, &secret, pair.as_ref().ok(), renewal, policy, now).await {
                    Ok(Some(new)) => {
                        metrics.certificate_renewals.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
                        return Ok(new);
                    }
                    // Someone else wrote it first: read theirs.
                    Ok(None) => {}
                    // Not allowed (an older Role without update), or refused (an immutable Secret):
                    // serve what is there rather than not at all, if it is a pair.
                    Err(error) => {
                        tracing::error!(%error, reason = reason.as_str(), secret = %policy.name, "cannot replace the certificate Secret");
                        return pair.map_err(|_| error);
                    }
                }
            }
            _ => return pair,
        }
    }
    Err(Error::SecretContention(policy.name.clone()))
}

// ------------------------------------------------------------------------------------------
// caBundle

fn certificates(pem: &[u8]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for der in CertificateDer::pem_slice_iter(pem).flatten() {
        if !out.iter().any(|d| d[..] == der[..]) {
            out.push(der.to_vec());
        }
    }
    out
}

fn to_pem(ders: &[Vec<u8>]) -> Vec<u8> {
    use base64::Engine;
    let mut out = String::new();
    for der in ders {
        let text = base64::engine::general_purpose::STANDARD.encode(der);
        out.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in text.as_bytes().chunks(64) {
            out.push_str(std::str::from_utf8(line).unwrap_or_default());
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
    }
    out.into_bytes()
}

/// The Secret's CA as it is written there (so a bundle of it alone is exactly `ca.crt`), then
/// `others`.
fn assemble(ca_pem: &str, others: &[Vec<u8>]) -> Vec<u8> {
    let mut out = ca_pem.as_bytes().to_vec();
    if !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out.extend(to_pem(others));
    out
}

/// A caBundle and when it last gained a CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub pem: Vec<u8>,
    pub rotated_at: Option<SystemTime>,
}

/// The caBundle to write, given the current one (and its [`ROTATED_AT_ANNOTATION`]) and the
/// Secret's CA just read; None to leave it as it is.
///
/// - The Secret's CA missing: it goes first, the CAs there stay behind it (expired ones dropped,
///   [`MAX_BUNDLE`] at most), and the rotation time is now.
/// - The Secret's CA present with others: they are dropped [`BUNDLE_OVERLAP`] after the rotation.
///
/// So a bundle never loses the Secret's CA, and never loses another CA sooner than
/// [`BUNDLE_OVERLAP`] after the Secret's CA joined it.
pub fn next_bundle(current: &[u8], rotated_at: Option<SystemTime>, ca_pem: &str, now: SystemTime) -> Option<Bundle> {
    let ca = certificates(ca_pem.as_bytes());
    if ca.is_empty() {
        return None;
    }
    let present = certificates(current);
    let others: Vec<Vec<u8>> = present.iter().filter(|d| !ca.contains(d)).cloned().collect();
    if ca.iter().any(|d| !present.contains(d)) {
        let alive = |der: &Vec<u8>| inspect_der(der).is_ok_and(|c| c.not_after > unix(now));
        let kept: Vec<Vec<u8>> = others.into_iter().filter(alive).take(MAX_BUNDLE.saturating_sub(ca.len())).collect();
        let rotated_at = (!kept.is_empty()).then_some(now);
        return Some(Bundle { pem: assemble(ca_pem, &kept), rotated_at });
    }
    if others.is_empty() {
        return None;
    }
    match rotated_at {
        // Several CAs and no record of when: start the overlap now rather than cut one off.
        None => Some(Bundle { pem: assemble(ca_pem, &others), rotated_at: Some(now) }),
        Some(at) if now.duration_since(at).is_ok_and(|d| d >= BUNDLE_OVERLAP) => {
            Some(Bundle { pem: assemble(ca_pem, &[]), rotated_at: None })
        }
        Some(_) => None,
    }
}

/// The two webhook configuration kinds, for their client configurations.
trait WebhookConfiguration:
    Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::Serialize
    + serde::de::DeserializeOwned
{
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig>;
}

impl WebhookConfiguration for ValidatingWebhookConfiguration {
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig> {
        self.webhooks.iter_mut().flatten().map(|h| &mut h.client_config).collect()
    }
}

impl WebhookConfiguration for MutatingWebhookConfiguration {
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig> {
        self.webhooks.iter_mut().flatten().map(|h| &mut h.client_config).collect()
    }
}

fn parse_time(text: &str) -> Option<SystemTime> {
    text.parse::<k8s_openapi::jiff::Timestamp>().ok().map(SystemTime::from)
}

fn format_time(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map(|t| t.to_string()).unwrap_or_default()
}

/// Brings the caBundle of every webhook in the named configurations in line with `ca_pem` (the
/// Secret's CA, read just before) by [`next_bundle`]. An empty name skips one (cert-manager
/// injects it); a missing configuration is only logged (the chart may create it after the
/// operator starts; the next round patches it). True when a bundle gained `ca_pem` just now (or
/// may have): the API server trusts it a moment later, not yet.
pub async fn sync_ca_bundles(
    client: &Client,
    validating: &str,
    mutating: &str,
    ca_pem: &str,
    now: SystemTime,
) -> Result<bool, Error> {
    let mut added = false;
    if !validating.is_empty() {
        added |= sync_one::<ValidatingWebhookConfiguration>(client, validating, ca_pem, now).await?;
    }
    if !mutating.is_empty() {
        added |= sync_one::<MutatingWebhookConfiguration>(client, mutating, ca_pem, now).await?;
    }
    Ok(added)
}

async fn sync_one<K: WebhookConfiguration>(
    client: &Client,
    name: &str,
    ca_pem: &str,
    now: SystemTime,
) -> Result<bool, Error> {
    let api: Api<K> = Api::all(client.clone());
    let kind = K::kind(&());
    for _ in 0..3 {
        let Some(mut config) = api.get_opt(name).await? else {
            tracing::warn!(%kind, name, "webhook configuration not found; caBundle not set yet");
            return Ok(false);
        };
        let rotated_at =
            config.meta().annotations.as_ref().and_then(|a| a.get(ROTATED_AT_ANNOTATION)).and_then(|t| parse_time(t));
        let resource_version = config.meta().resource_version.clone();
        let mut hooks = config.client_configs();
        if hooks.is_empty() {
            return Ok(false);
        }
        // Every hook gets the same bundle; should they differ, start from all of their CAs.
        let mut current = Vec::new();
        for hook in &hooks {
            current.extend_from_slice(hook.ca_bundle.as_ref().map(|b| b.0.as_slice()).unwrap_or_default());
            current.push(b'\n');
        }
        let first = hooks[0].ca_bundle.clone();
        let uniform = hooks.iter().all(|h| h.ca_bundle == first && h.ca_bundle.is_some());
        let bundle = match next_bundle(&current, rotated_at, ca_pem, now) {
            Some(bundle) => bundle,
            None if uniform => return Ok(false),
            None => Bundle { pem: to_pem(&certificates(&current)), rotated_at },
        };
        let present = certificates(&current);
        let added = certificates(ca_pem.as_bytes()).iter().any(|d| !present.contains(d));
        for hook in hooks.iter_mut() {
            hook.ca_bundle = Some(ByteString(bundle.pem.clone()));
        }
        drop(hooks);
        let webhooks = serde_json::to_value(&config).map(|v| v["webhooks"].clone()).unwrap_or_default();
        // The resourceVersion makes the write conditional: whoever changed the configuration since
        // we read it wins, and we recompute from what they wrote.
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": resource_version,
                "annotations": {ROTATED_AT_ANNOTATION: bundle.rotated_at.map(format_time)},
            },
            "webhooks": webhooks,
        });
        match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                let cas = certificates(&bundle.pem).len();
                tracing::info!(%kind, name, cas, added, "caBundle updated");
                return Ok(added);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    // Contended three times: the next round tries again; not known to trust the CA yet.
    Ok(true)
}

// ------------------------------------------------------------------------------------------
// Following the Secret

/// What [`follow_secret`] keeps in step with the Secret.
pub struct Follower {
    pub client: Client,
    pub policy: SecretPolicy,
    /// The validating and mutating configurations whose caBundle is kept (empty to skip).
    pub ca_bundles: (String, String),
    /// Reloaded in place: the webhooks and the check API serve through it.
    pub tls: RustlsConfig,
    /// The pair served now (the injecting webhook gives sidecars its CA).
    pub current: watch::Sender<Keypair>,
    /// Whether this replica holds the Lease: only the leader renews.
    pub leading: watch::Receiver<bool>,
    pub metrics: Arc<Metrics>,
}

/// Sets the served certificate's expiry gauge.
pub fn record_expiry(metrics: &Metrics, pair: &Keypair) {
    if let Ok(info) = inspect(&pair.cert_pem) {
        metrics.certificate_expiry_seconds.set(info.not_after);
    }
}

/// Every [`RELOAD_INTERVAL`], in this order: reads the Secret; as the leader, renews or replaces
/// it when [`plan`] says so (and recreates it when deleted); brings caBundle in line with the CA
/// just read; then hot-swaps the served certificate when it changed, a certificate from a new CA
/// only once caBundle held that CA before this round (the API server must trust a certificate
/// before it is served; meanwhile the old one stays valid, the bundle keeping its CA). Ends when
/// `stop` flips.
pub async fn follow_secret(mut follower: Follower, mut stop: watch::Receiver<bool>) {
    let api: Api<Secret> = Api::namespaced(follower.client.clone(), &follower.policy.namespace);
    let mut ticker = tokio::time::interval(RELOAD_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let leading = *follower.leading.borrow_and_update();
        let Some(pair) = read_and_renew(&api, &follower.policy, leading, &follower.metrics).await else { continue };
        let (validating, mutating) = &follower.ca_bundles;
        let trusted =
            match sync_ca_bundles(&follower.client, validating, mutating, &pair.ca_pem, SystemTime::now()).await {
                Ok(added) => !added,
                Err(error) => {
                    tracing::warn!(%error, "cannot keep the webhook configurations' caBundle current");
                    false
                }
            };
        let current = follower.current.borrow().clone();
        if pair == current {
            continue;
        }
        let new_ca = pair.ca_pem != current.ca_pem;
        if new_ca && !trusted {
            tracing::info!("new CA in the Secret: its certificate is served once caBundle trusts it (next round)");
            continue;
        }
        match follower.tls.reload_from_pem(pair.cert_pem.clone().into_bytes(), pair.key_pem.clone().into_bytes()).await
        {
            Ok(()) => {
                tracing::info!(new_ca, "serving certificate reloaded from the Secret");
                record_expiry(&follower.metrics, &pair);
                follower.current.send_replace(pair);
            }
            Err(error) => tracing::warn!(%error, "cannot load the certificate from the Secret"),
        }
    }
}

/// The Secret's pair, after the leader's renewal if one was due; None when it cannot be read
/// now (nothing is written from a stale view).
async fn read_and_renew(api: &Api<Secret>, policy: &SecretPolicy, leading: bool, metrics: &Metrics) -> Option<Keypair> {
    let now = SystemTime::now();
    let secret = match api.get_opt(&policy.name).await {
        Ok(secret) => secret,
        Err(error) => {
            tracing::warn!(%error, secret = %policy.name, "cannot read the certificate Secret");
            return None;
        }
    };
    let renew = leading && policy.generate;
    let Some(secret) = secret else {
        if !renew {
            return None;
        }
        // Deleted (a rotation): the leader makes the new pair; the others pick it up.
        return match create(api, policy, now).await {
            Ok(pair) => {
                metrics.certificate_renewals.get_or_create(&ReasonLabels { reason: "absent" }).inc();
                pair
            }
            Err(error) => {
                tracing::warn!(%error, "cannot create the certificate Secret");
                None
            }
        };
    };
    let pair = from_secret(&secret);
    if !renew || externally_managed(&secret) {
        return pair.map_err(|error| tracing::warn!(%error, "the certificate Secret is unusable")).ok();
    }
    let renewal = plan(pair.as_ref().ok(), &policy.hosts, now);
    let Some(reason) = renewal.reason() else { return pair.ok() };
    match replace(api, &secret, pair.as_ref().ok(), renewal, policy, now).await {
        Ok(Some(new)) => {
            metrics.certificate_renewals.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
            Some(new)
        }
        // Written by someone else since: read it next round.
        Ok(None) => None,
        Err(error) => {
            tracing::warn!(%error, reason = reason.as_str(), "cannot renew the certificate Secret");
            pair.ok()
        }
    }
}

#[cfg(test)]
mod tests;
