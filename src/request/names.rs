//! The names and maps every reader of a request head shares: what makes a header name a token,
//! which names are one header (canonical names), which headers belong to the connection, and the
//! read-only maps policies look headers and labels up in. One home, so the endpoint, the sidecar
//! and the policies read a header the same way.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;

/// An RFC 9110 token (header names, methods): one home for every parser that needs it.
pub fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

/// Read-only string map: request headers (looked up by [canonical name](canonical_header_name))
/// and workload labels.
pub trait StrMap: Sync {
    fn get_str(&self, key: &str) -> Option<&str>;
}

/// Connection-level headers, whatever `Connection` says.
pub const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "proxy-authenticate",
];

/// How rules name a header: lowercase, `_` written `-`. CGI and WSGI servers (and what runs
/// behind them: PHP, Django, Flask, Rack) read `X-API-Key`, `x_api_key` and `X_API-KEY` all as
/// `HTTP_X_API_KEY`, so in front of them these are one header; reading them as one is the
/// reading that limits.
pub fn canonical_header_name(name: &str) -> String {
    name.bytes().map(|b| char::from(canonical_header_byte(b))).collect()
}

/// Whether `a` and `b` name one header in the sense of [`canonical_header_name`], without
/// allocating.
pub fn same_header_name(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).all(|(x, y)| canonical_header_byte(x) == canonical_header_byte(y))
}

fn canonical_header_byte(b: u8) -> u8 {
    if b == b'_' { b'-' } else { b.to_ascii_lowercase() }
}

impl StrMap for BTreeMap<String, String> {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl<S: BuildHasher + Sync> StrMap for HashMap<String, String, S> {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// A borrowed list of (name, value) pairs, searched linearly (fine for the few headers a
/// request carries); names must be canonical ([`canonical_header_name`]) for header lookups.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pairs<'a>(pub &'a [(&'a str, &'a str)]);

impl StrMap for Pairs<'_> {
    fn get_str(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }
}

/// The empty map.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEntries;

impl StrMap for NoEntries {
    fn get_str(&self, _: &str) -> Option<&str> {
        None
    }
}
