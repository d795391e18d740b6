//! Mistakes in how Sluice is told to reach Redis, told apart from Redis being away: a URL
//! without a scheme, credentials Redis refuses, a database it does not have. Each fails every
//! call alike and never heals by itself, so start-up stops naming it; an outage (nothing
//! listening, no such host, a timeout) lets the process start unready and retry.
//!
//! The client reports a refused `AUTH` during its connection handshake only as "authentication
//! failed", without Redis's words (`WRONGPASS …`, or that the server has no password at all), so
//! [`replay_handshake`] repeats the handshake one command at a time to say which.

use std::time::Duration;

use ::redis::{ErrorKind, IntoConnectionInfo, RedisConnectionInfo, RedisError, TlsCertificates};

use super::url::redact_url;

/// What `--redis`, `--redis-cluster` and `--redis-sentinel` URLs may start with (the client's
/// own list: valkey is Redis's fork, unix a local socket).
const SCHEMES: [&str; 7] = ["redis", "rediss", "valkey", "valkeys", "unix", "redis+unix", "valkey+unix"];

/// The accepted forms, as the error names them.
const ACCEPTED: &str = "redis://[USER@]HOST[:PORT][/DB], rediss://… (TLS), or unix:///PATH (a socket)";

/// Why `url` cannot name a Redis by its scheme, or `None` when its scheme is one the client
/// speaks. The answer never holds a password the URL has.
pub fn scheme_problem(url: &str) -> Option<String> {
    match url.find("://") {
        None => {
            let meant = redact_url(&format!("redis://{url}"));
            Some(format!("the URL has no scheme: write {meant} (rediss:// for TLS); accepted: {ACCEPTED}"))
        }
        Some(end) if SCHEMES.contains(&url[..end].to_ascii_lowercase().as_str()) => None,
        Some(end) => Some(format!("{}:// is not a Redis scheme; accepted: {ACCEPTED}", &url[..end])),
    }
}

/// A configuration Redis refuses during the connection's handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeRefusal {
    /// `AUTH` failed: Redis's own words when [`replay_handshake`] could get them.
    Credentials(String),
    /// `SELECT` of the URL's database failed (Redis's words).
    Database { db: i64, reason: String },
}

impl HandshakeRefusal {
    /// The refusal `error` stands for, if the handshake failed on the credentials or the database
    /// (the database number read from `url`, when there is one).
    pub fn of(error: &RedisError, url: Option<&str>) -> Option<HandshakeRefusal> {
        let text = error.to_string();
        // A cluster client wraps the node's failure into an I/O error, keeping only its words.
        if error.kind() == ErrorKind::AuthenticationFailed || text.contains("Password authentication failed") {
            return Some(HandshakeRefusal::Credentials(text));
        }
        // The client's words for a failed SELECT at connection set-up.
        if text.contains("refused to switch database") {
            let db = url.and_then(|u| u.into_connection_info().ok()).map_or(0, |info| info.redis_settings().db());
            let reason = error.detail().unwrap_or("refused").to_string();
            return Some(HandshakeRefusal::Database { db, reason });
        }
        None
    }

    /// The sentence for the start-up error.
    pub fn describe(&self) -> String {
        match self {
            HandshakeRefusal::Credentials(words) => format!(
                "Redis refused the credentials: {words}; give the password with --redis-password-file, SLUICE_REDIS_PASSWORD or the URL, and the user with the URL or --redis-username (docs/redis.md)"
            ),
            HandshakeRefusal::Database { db, reason } if reason.contains("out of range") => format!(
                "Redis has no database {db} ({reason}): a Redis has databases 0 to `databases` - 1 (16 by default), a Redis Cluster only 0; fix the /DB of the URL"
            ),
            HandshakeRefusal::Database { db, reason } => format!("Redis refused to switch to database {db}: {reason}"),
        }
    }
}

/// Connects to `url` without credentials or database and sends its `AUTH` as a command of its
/// own, to learn what Redis says of the credentials (the handshake hides it): `Some(words)` of a
/// refusal, `None` when it passed or the question could not be asked within `within`.
pub async fn replay_handshake(url: &str, certificates: Option<TlsCertificates>, within: Duration) -> Option<String> {
    let info = url.into_connection_info().ok()?;
    let settings = info.redis_settings();
    let password = settings.password()?.to_string();
    let username = settings.username().map(str::to_string);
    let bare = info.clone().set_redis_settings(RedisConnectionInfo::default().set_protocol(settings.protocol()));
    let client = match certificates {
        Some(certificates) => ::redis::Client::build_with_tls(bare, certificates),
        None => ::redis::Client::open(bare),
    }
    .ok()?;
    let ask = async {
        let mut connection = client.get_multiplexed_async_connection().await.ok()?;
        let mut auth = ::redis::cmd("AUTH");
        auth.arg(username.as_deref().into_iter().collect::<Vec<_>>()).arg(&password);
        match auth.query_async::<::redis::Value>(&mut connection).await {
            Ok(_) => None,
            Err(error) => {
                let words = match (error.code(), error.detail()) {
                    (Some(code), Some(detail)) => format!("{code} {detail}"),
                    _ => error.to_string(),
                };
                Some(match &username {
                    Some(user) => format!("{words} (ACL user {user})"),
                    None => format!("{words} (the default user)"),
                })
            }
        }
    };
    tokio::time::timeout(within, ask).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_scheme_is_named_with_the_accepted_ones() {
        let problem = scheme_problem("127.0.0.1:6379").unwrap();
        assert!(problem.starts_with("the URL has no scheme: write redis://127.0.0.1:6379"), "{problem}");
        assert!(problem.contains("rediss://"), "{problem}");
        let problem = scheme_problem(":hunter2@10.0.0.1:6379").unwrap();
        assert!(!problem.contains("hunter2"), "{problem}");
        assert!(scheme_problem("http://h:6379").unwrap().starts_with("http:// is not a Redis scheme"));
        for ok in ["redis://h", "rediss://u@h:1/2", "unix:///run/redis.sock", "REDIS://h"] {
            assert_eq!(scheme_problem(ok), None, "{ok}");
        }
    }

    #[test]
    fn handshake_refusals_are_told_from_outages() {
        let auth: RedisError = (ErrorKind::AuthenticationFailed, "Password authentication failed").into();
        assert!(matches!(HandshakeRefusal::of(&auth, None), Some(HandshakeRefusal::Credentials(_))));
        let select: RedisError = (
            ::redis::ServerErrorKind::ResponseError.into(),
            "Redis server refused to switch database",
            "DB index is out of range".to_string(),
        )
            .into();
        let refusal = HandshakeRefusal::of(&select, Some("redis://h:1/99")).unwrap();
        assert_eq!(refusal, HandshakeRefusal::Database { db: 99, reason: "DB index is out of range".into() });
        assert!(refusal.describe().starts_with("Redis has no database 99"), "{}", refusal.describe());
        let cluster: RedisError = (
            ErrorKind::Io,
            "Failed to create initial connections",
            "Password authentication failed - AuthenticationFailed".to_string(),
        )
            .into();
        assert!(matches!(HandshakeRefusal::of(&cluster, None), Some(HandshakeRefusal::Credentials(_))));
        let down: RedisError = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert_eq!(HandshakeRefusal::of(&down, None), None);
    }
}
