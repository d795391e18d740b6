use super::*;

fn at(unix: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix)
}

const T0: u64 = 1_800_000_000;

fn hosts(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Whether some CA of `bundle` signed `cert_pem`.
fn verifies(bundle: &[u8], cert_pem: &str) -> bool {
    let leaf_der = CertificateDer::pem_slice_iter(cert_pem.as_bytes()).next().unwrap().unwrap();
    let (_, leaf) = x509_parser::parse_x509_certificate(&leaf_der).unwrap();
    certificates(bundle).iter().any(|der| {
        let (_, ca) = x509_parser::parse_x509_certificate(der).unwrap();
        leaf.verify_signature(Some(ca.public_key())).is_ok()
    })
}

#[test]
fn generated_certificates_have_finite_validity_and_cover_the_hosts() {
    let pair = generate_at(&hosts(&["sluice-webhook.sluice-system.svc", "127.0.0.1"]), at(T0)).unwrap();
    let ca = inspect(&pair.ca_pem).unwrap();
    let leaf = inspect(&pair.cert_pem).unwrap();
    assert_eq!(ca.not_before, (T0 - BACKDATE.as_secs()) as i64);
    assert_eq!(ca.not_after, (T0 + CA_VALIDITY.as_secs()) as i64);
    assert_eq!(leaf.not_after, (T0 + SERVING_VALIDITY.as_secs()) as i64);
    assert!(covers(&leaf.names, "sluice-webhook.sluice-system.svc"));
    assert!(covers(&leaf.names, "127.0.0.1"));
    assert!(!covers(&leaf.names, "sluice.sluice-system.svc"));
    assert!(!covers(&leaf.names, "127.0.0.2"));
    assert!(verifies(pair.ca_pem.as_bytes(), &pair.cert_pem));
    assert_eq!(plan(Some(&pair), &hosts(&["127.0.0.1"]), at(T0)), Renewal::Keep);
}

#[test]
fn wildcards_cover_one_label() {
    let names = [Name::Dns("*.sluice-system.svc".into())];
    assert!(covers(&names, "sluice.sluice-system.svc"));
    assert!(covers(&names, "Sluice.Sluice-System.svc."));
    assert!(!covers(&names, "a.b.sluice-system.svc"));
    assert!(!covers(&names, "sluice-system.svc"));
}

#[test]
fn serving_certificate_is_renewed_from_the_same_ca_before_it_expires() {
    let h = hosts(&["127.0.0.1"]);
    let pair = generate_at(&h, at(T0)).unwrap();
    let year = SERVING_VALIDITY.as_secs();
    assert_eq!(plan(Some(&pair), &h, at(T0 + year / 2)), Renewal::Keep);
    let due = at(T0 + year * 2 / 3 + 1);
    assert_eq!(plan(Some(&pair), &h, due), Renewal::Serving(Reason::Expiring));
    assert_eq!(plan(Some(&pair), &h, at(T0 + year + 1)), Renewal::Serving(Reason::Expired));
    let renewed = renewed(Some(&pair), Renewal::Serving(Reason::Expiring), &h, due).unwrap();
    assert_eq!(renewed.ca_pem, pair.ca_pem, "same CA: caBundle and sidecars' CA unchanged");
    assert_ne!(renewed.cert_pem, pair.cert_pem);
    assert!(verifies(pair.ca_pem.as_bytes(), &renewed.cert_pem));
    assert_eq!(plan(Some(&renewed), &h, due), Renewal::Keep);
}

#[test]
fn a_certificate_not_covering_the_hosts_is_replaced_keeping_its_names() {
    let pair = generate_at(&hosts(&["old.example"]), at(T0)).unwrap();
    let h = hosts(&["127.0.0.1"]);
    let renewal = plan(Some(&pair), &h, at(T0));
    assert_eq!(renewal, Renewal::Serving(Reason::HostsNotCovered));
    assert!(renewal.reason().unwrap().urgent());
    let new = renewed(Some(&pair), renewal, &h, at(T0)).unwrap();
    let names = inspect(&new.cert_pem).unwrap().names;
    assert!(covers(&names, "127.0.0.1") && covers(&names, "old.example"), "{names:?}");
    assert_eq!(plan(Some(&new), &h, at(T0)), Renewal::Keep);
}

#[test]
fn without_the_ca_key_or_near_the_ca_expiry_a_new_ca_is_made() {
    let h = hosts(&["127.0.0.1"]);
    let mut pair = generate_at(&h, at(T0)).unwrap();
    let ten_years = CA_VALIDITY.as_secs();
    // The leader renewed the serving certificate on time; now the CA itself is due.
    let late = at(T0 + ten_years * 2 / 3 + 1);
    let fresh_leaf = renew_serving(&pair, &h, late - Duration::from_secs(DAY)).unwrap();
    assert_eq!(plan(Some(&fresh_leaf), &h, late), Renewal::NewCa(Reason::CaExpiring));
    assert_eq!(plan(Some(&pair), &h, at(T0 + ten_years + 1)), Renewal::NewCa(Reason::Expired));
    // A CA key that is not the CA's.
    pair.ca_key_pem = generate_at(&h, at(T0)).unwrap().ca_key_pem;
    assert_eq!(plan(Some(&pair), &hosts(&["other"]), at(T0)), Renewal::NewCa(Reason::HostsNotCovered));
    // An earlier version's Secret (no ca.key, valid until 4096) that still serves is kept.
    pair.ca_key_pem = None;
    assert_eq!(plan(Some(&pair), &h, at(T0)), Renewal::Keep);
    pair.key_pem = "garbage".into();
    assert_eq!(plan(Some(&pair), &h, at(T0)), Renewal::NewCa(Reason::Unreadable));
    assert_eq!(plan(None, &h, at(T0)), Renewal::NewCa(Reason::Unreadable));
    let fresh = renewed(Some(&pair), Renewal::NewCa(Reason::Unreadable), &h, at(T0)).unwrap();
    assert_ne!(fresh.ca_pem, pair.ca_pem);
    assert!(verifies(fresh.ca_pem.as_bytes(), &fresh.cert_pem));
}

#[test]
fn a_rotation_puts_the_new_ca_first_keeps_the_old_then_drops_it() {
    let h = hosts(&["127.0.0.1"]);
    let old = generate_at(&h, at(T0)).unwrap();
    let new = generate_at(&h, at(T0 + 10)).unwrap();
    // An empty configuration gets the CA alone.
    let first = next_bundle(b"", None, &old.ca_pem, at(T0)).unwrap();
    assert_eq!((first.pem.as_slice(), first.rotated_at), (old.ca_pem.as_bytes(), None), "exactly ca.crt");
    assert!(next_bundle(&first.pem, None, &old.ca_pem, at(T0 + 5)).is_none(), "steady state: no write");

    // The Secret's CA changes: new + old, and both certificates verify.
    let t = at(T0 + 20);
    let rotated = next_bundle(&first.pem, None, &new.ca_pem, t).unwrap();
    assert_eq!(certificates(&rotated.pem), [certificates(new.ca_pem.as_bytes()), certificates(&first.pem)].concat());
    assert_eq!(rotated.rotated_at, Some(t));
    assert!(verifies(&rotated.pem, &new.cert_pem) && verifies(&rotated.pem, &old.cert_pem));

    // A lagging replica that still believes the old CA changes nothing: its CA is there.
    assert!(next_bundle(&rotated.pem, rotated.rotated_at, &old.ca_pem, at(T0 + 30)).is_none());
    // Nor does anyone before the overlap is over.
    let almost = t + BUNDLE_OVERLAP - Duration::from_secs(1);
    assert!(next_bundle(&rotated.pem, rotated.rotated_at, &new.ca_pem, almost).is_none());
    // Then the new CA alone; never the old one alone.
    let done = next_bundle(&rotated.pem, rotated.rotated_at, &new.ca_pem, t + BUNDLE_OVERLAP).unwrap();
    assert_eq!(certificates(&done.pem), certificates(new.ca_pem.as_bytes()));
    assert_eq!(done.rotated_at, None);
    assert!(verifies(&done.pem, &new.cert_pem));
    // Even a replica acting on a stale read of the old CA cannot leave the old CA alone.
    let stale = next_bundle(&done.pem, None, &old.ca_pem, t + BUNDLE_OVERLAP).unwrap();
    assert!(verifies(&stale.pem, &new.cert_pem) && verifies(&stale.pem, &old.cert_pem));
}

#[test]
fn bundles_stay_small_and_drop_expired_cas() {
    let h = hosts(&["127.0.0.1"]);
    let mut bundle = Vec::new();
    let mut at_time = None;
    for i in 0..10 {
        let pair = generate_at(&h, at(T0 + i)).unwrap();
        if let Some(b) = next_bundle(&bundle, at_time, &pair.ca_pem, at(T0 + i)) {
            bundle = b.pem;
            at_time = b.rotated_at;
        }
    }
    assert_eq!(certificates(&bundle).len(), MAX_BUNDLE);
    // Long after, a new CA is not followed by expired ones.
    let later = at(T0 + CA_VALIDITY.as_secs() + 100);
    let pair = generate_at(&h, later).unwrap();
    let next = next_bundle(&bundle, at_time, &pair.ca_pem, later).unwrap();
    assert_eq!(certificates(&next.pem), certificates(pair.ca_pem.as_bytes()));
    // Several CAs with no recorded rotation: the overlap starts now, nothing is cut off.
    let two = next_bundle(&bundle, None, &certificates_pem(&bundle, 0), at(T0 + 20)).unwrap();
    assert_eq!(certificates(&two.pem), certificates(&bundle));
    assert_eq!(two.rotated_at, Some(at(T0 + 20)));
    // A CA that does not parse is never written.
    assert!(next_bundle(&bundle, None, "not a certificate", at(T0)).is_none());
}

fn certificates_pem(bundle: &[u8], index: usize) -> String {
    String::from_utf8(to_pem(&[certificates(bundle)[index].clone()])).unwrap()
}
