//! Integers written in decimal on the request path (JSON answers, rate-limit headers, state
//! keys) by `itoa`, without `fmt`'s machinery: `write!` and `to_string` were about a tenth of a
//! three-rule check's instructions (docs/benchmarks.md, "The answer and the keys without `fmt`").

use std::net::Ipv4Addr;

/// Appends `n` in decimal to `out`: what `n.to_string()` gives.
pub fn push_decimal(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// Appends `n` in decimal to `out`.
pub fn push_decimal_bytes(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `n` in decimal, as a new string.
pub fn decimal_string(n: u64) -> String {
    let mut text = String::with_capacity(20);
    push_decimal(&mut text, n);
    text
}

/// Appends `ip` in its canonical text (what `Display` writes: `10.0.0.1`).
pub fn push_ipv4(out: &mut String, ip: Ipv4Addr) {
    for (i, octet) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        push_decimal(out, u64::from(octet));
    }
}

/// The length of `ip`'s canonical text: what [`push_ipv4`] appends.
pub fn ipv4_text_len(ip: Ipv4Addr) -> usize {
    let digits = |octet: u8| match octet {
        100.. => 3,
        10.. => 2,
        _ => 1,
    };
    3 + ip.octets().into_iter().map(digits).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn writes_what_display_writes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let edges = [0, 1, 9, 10, 99, 100, u64::from(u32::MAX), u64::MAX - 1, u64::MAX];
        for n in edges.into_iter().chain((0..5_000).map(|_| rng.random::<u64>() >> rng.random_range(0..64))) {
            assert_eq!(decimal_string(n), n.to_string());
        }
        for _ in 0..5_000 {
            let ip = Ipv4Addr::from(rng.random::<u32>());
            let mut text = String::new();
            push_ipv4(&mut text, ip);
            assert_eq!(text, ip.to_string());
            assert_eq!(ipv4_text_len(ip), text.len());
        }
    }
}
