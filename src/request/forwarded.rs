//! Who the client is, and what the application is told about it.
//!
//! X-Forwarded-For is a list anyone can start: only the entries appended by proxies we trust are
//! believable. With `trusted_hops = N` the last N addresses of the chain (the X-Forwarded-For
//! entries followed by the TCP peer) are our own proxies, and the one before them is the client.
//! With N = 0 the TCP peer is the client and incoming X-Forwarded-For entries are kept for the
//! application but never used to key limits, so a client cannot pick its own rate-limit key.

use std::net::{IpAddr, SocketAddr};

use http::header::{HeaderMap, HeaderName, HeaderValue};

pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// Envoy's record of the downstream address: written by Envoy from the connection, and removed
/// from what external clients send, so it is believable from a trusted gateway only.
pub static X_ENVOY_EXTERNAL_ADDRESS: HeaderName = HeaderName::from_static("x-envoy-external-address");

/// The client address a trusted gateway names in an ext_authz call: Envoy's
/// `x-envoy-external-address`, else [`client_ip`] over its X-Forwarded-For with `trusted_hops`
/// (1: the gateway appended the client it saw, as nginx's `$proxy_add_x_forwarded_for` or
/// `$remote_addr` and Envoy's `use_remote_address` do).
pub fn gateway_client_ip(headers: &HeaderMap, peer: IpAddr, trusted_hops: usize) -> IpAddr {
    headers
        .get(&X_ENVOY_EXTERNAL_ADDRESS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_hop(v.trim()))
        .unwrap_or_else(|| client_ip(headers, peer, trusted_hops))
}

/// The client address per the trusted hop count.
pub fn client_ip(headers: &HeaderMap, peer: IpAddr, trusted_hops: usize) -> IpAddr {
    let peer = peer.to_canonical();
    if trusted_hops == 0 {
        return peer;
    }
    let chain: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    // The full chain is `chain ++ [peer]`; its last N are ours, so the client sits at index
    // len(chain) − N, clamped at the leftmost entry when there are fewer hops than configured.
    let index = chain.len().saturating_sub(trusted_hops);
    chain.get(index).and_then(|entry| parse_hop(entry)).unwrap_or(peer)
}

/// An X-Forwarded-For entry: an address, perhaps with a port (`1.2.3.4:80`, `[::1]:80`).
fn parse_hop(entry: &str) -> Option<IpAddr> {
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sa) = entry.parse::<SocketAddr>() {
        return Some(sa.ip().to_canonical());
    }
    entry.strip_prefix('[').and_then(|e| e.strip_suffix(']')).and_then(|e| e.parse::<IpAddr>().ok())
}

/// Appends the peer to X-Forwarded-For and sets X-Forwarded-Proto: kept from a trusted proxy,
/// otherwise `http`, because the sidecar itself only speaks plaintext.
pub fn set_forwarded(headers: &mut HeaderMap, peer: IpAddr, trusted_hops: usize) {
    let peer = peer.to_canonical().to_string();
    let existing: Vec<&str> = headers.get_all(&X_FORWARDED_FOR).iter().filter_map(|v| v.to_str().ok()).collect();
    let joined = if existing.is_empty() { peer } else { format!("{}, {peer}", existing.join(", ")) };
    if let Ok(value) = HeaderValue::from_str(&joined) {
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    if trusted_hops == 0 || !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&X_FORWARDED_FOR, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9));

    #[test]
    fn untrusted_means_the_peer() {
        assert_eq!(client_ip(&xff(&["203.0.113.7"]), PEER, 0), PEER);
    }

    #[test]
    fn trusted_hops_count_from_the_right() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // One load balancer: the peer is it, the last entry is the client.
        assert_eq!(client_ip(&xff(&["198.51.100.1, 203.0.113.7"]), PEER, 1), ip("203.0.113.7"));
        // A spoofed first entry is ignored with one hop, believed only with more hops.
        assert_eq!(client_ip(&xff(&["6.6.6.6", "203.0.113.7"]), PEER, 1), ip("203.0.113.7"));
        assert_eq!(client_ip(&xff(&["6.6.6.6", "203.0.113.7"]), PEER, 2), ip("6.6.6.6"));
        // More hops than entries: the leftmost entry.
        assert_eq!(client_ip(&xff(&["203.0.113.7"]), PEER, 5), ip("203.0.113.7"));
        // Nothing forwarded: the peer.
        assert_eq!(client_ip(&HeaderMap::new(), PEER, 1), PEER);
        // Ports and brackets.
        assert_eq!(client_ip(&xff(&["203.0.113.7:5555"]), PEER, 1), ip("203.0.113.7"));
        assert_eq!(client_ip(&xff(&["[2001:db8::1]:80"]), PEER, 1), ip("2001:db8::1"));
        assert_eq!(client_ip(&xff(&["[2001:db8::1]"]), PEER, 1), ip("2001:db8::1"));
        // Garbage from a trusted hop: fall back to the peer rather than fail the request.
        assert_eq!(client_ip(&xff(&["unknown"]), PEER, 1), PEER);
        // IPv4-mapped peers (dual-stack listeners) read as IPv4.
        assert_eq!(client_ip(&HeaderMap::new(), ip("::ffff:10.0.0.9"), 0), PEER);
    }

    #[test]
    fn gateways_name_the_client() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut h = xff(&["6.6.6.6, 203.0.113.7"]);
        assert_eq!(gateway_client_ip(&h, PEER, 1), ip("203.0.113.7"), "the entry the gateway appended");
        h.insert(&X_ENVOY_EXTERNAL_ADDRESS, HeaderValue::from_static("198.51.100.2"));
        assert_eq!(gateway_client_ip(&h, PEER, 1), ip("198.51.100.2"));
        h.insert(&X_ENVOY_EXTERNAL_ADDRESS, HeaderValue::from_static("garbage"));
        assert_eq!(gateway_client_ip(&h, PEER, 1), ip("203.0.113.7"));
    }

    #[test]
    fn forwarded_headers_are_appended() {
        let mut h = xff(&["203.0.113.7"]);
        h.insert(&X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        set_forwarded(&mut h, PEER, 1);
        assert_eq!(h[&X_FORWARDED_FOR], "203.0.113.7, 10.0.0.9");
        assert_eq!(h[&X_FORWARDED_PROTO], "https", "kept from a trusted proxy");
        let mut h = xff(&["203.0.113.7"]);
        h.insert(&X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        set_forwarded(&mut h, PEER, 0);
        assert_eq!(h[&X_FORWARDED_PROTO], "http", "an untrusted client cannot claim https");
        let mut h = HeaderMap::new();
        set_forwarded(&mut h, PEER, 0);
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.9");
    }
}
