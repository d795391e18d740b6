use super::library::ARGS_PER_RULE;
use super::*;
use crate::algorithm::Decision;
use crate::algorithm::Limit;
use ::redis::{ErrorKind, ServerErrorKind};

fn ints(v: &[i64]) -> Value {
    Value::Array(v.iter().map(|&i| Value::Int(i)).collect())
}

#[test]
fn parses_a_two_rule_reply() {
    let verdict = parse_reply(&ints(&[0, 1, 4, 100, -1, 0, 0, 0, 900, 250, 0, 5_000]), 2).unwrap();
    assert!(!verdict.allowed);
    assert_eq!(verdict.at, Some(5_000));
    assert_eq!(
        verdict.decisions,
        vec![
            Decision { allowed: true, remaining: 4, reset_after: 100, retry_after: None, delay: 0 },
            Decision { allowed: false, remaining: 0, reset_after: 900, retry_after: Some(250), delay: 0 },
        ]
    );
    let shaped = parse_reply(&ints(&[1, 1, 0, 10, -1, 7, 0]), 1).unwrap();
    assert_eq!(shaped.decisions[0].delay, 7);
    assert!(shaped.allowed);
}

#[test]
fn rejects_malformed_replies() {
    let err = |v: Value, n| parse_reply(&v, n).unwrap_err();
    assert!(matches!(err(ints(&[1, 1, 0, 0, -1, 0]), 1), StoreError::Protocol(m) if m.contains("expected 7")));
    assert!(matches!(err(Value::Okay, 1), StoreError::Protocol(m) if m.contains("OK")));
    assert!(matches!(err(ints(&[2, 1, 0, 0, -1, 0, 0]), 1), StoreError::Protocol(m) if m.contains("0 or 1")));
    assert!(matches!(err(ints(&[1, 1, -5, 0, -1, 0, 0]), 1), StoreError::Protocol(m) if m.contains("count")));
    assert!(matches!(err(ints(&[1, 1, 0, 0, -2, 0, 0]), 1), StoreError::Protocol(_)));
    let mixed = Value::Array(vec![Value::Int(1), Value::BulkString(b"x".to_vec())]);
    assert!(matches!(err(mixed, 0), StoreError::Protocol(_)));
    assert_eq!(
        parse_reply(&ints(&[1, 9]), 0).unwrap(),
        Verdict { allowed: true, decisions: vec![], cached_denial: None, at: Some(9) }
    );
}

#[test]
fn args_follow_the_script_contract() {
    let shaper = Limit::new(Algorithm::LeakyBucket, 3, 1_000_000, Some(2), Some(400_000)).unwrap();
    let window = Limit::new(Algorithm::FixedWindow, 10, 60_000_000, None, None).unwrap();
    let checks = [
        RuleCheck { rule: 1, limit: &shaper, key: b"a", cost: 1, enforce: true, hold: 0 },
        RuleCheck { rule: 2, limit: &window, key: b"b", cost: 2, enforce: false, hold: 0 },
    ];
    assert_eq!(
        script_args(Some(42), &checks),
        ["42", "", "3:3:1000000:2:333334:400000:1", "1", "4:10:60000000:10:6000000:-1:0", "2"]
    );
    assert_eq!(script_args(None, &checks[..1])[0], "");
    assert_eq!(script_args(None, &checks).len(), 2 + ARGS_PER_RULE * 2);
    let slots = Limit::new(Algorithm::Concurrency, 20, 300_000_000, None, None).unwrap();
    let held = [RuleCheck { rule: 3, limit: &slots, key: b"t", cost: 1, enforce: true, hold: 77 }];
    assert_eq!(script_args(None, &held), ["", "77", "7:20:300000000:20:15000000:-1:1", "1"], "the hold id second");
}

#[test]
fn script_is_one_piece_with_every_algorithm() {
    for name in [
        "sluice.token_bucket",
        "sluice.gcra",
        "sluice.fixed_window",
        "sluice.sliding_window_log",
        "sluice.sliding_window_counter",
        "sluice.concurrency",
    ] {
        assert!(SCRIPT_SOURCE.contains(&format!("{name} = {{}}")), "{name}");
    }
    assert!(SCRIPT_SOURCE.starts_with("-- Shared prelude"));
    assert!(SCRIPT_SOURCE.trim_end().ends_with("return decide(KEYS, ARGV)"));
    assert!(LIBRARY_SOURCE.starts_with(&format!("#!lua name={}\n", &*FUNCTION_NAME)));
    assert!(LIBRARY_SOURCE.contains(&format!("\nredis.register_function('{}', decide)\n", &*FUNCTION_NAME)));
    assert!(LIBRARY_SOURCE.contains(&format!("redis.register_function('{}_cancel', cancel)", &*FUNCTION_NAME)));
    assert!(
        LIBRARY_SOURCE
            .trim_end()
            .ends_with(&format!("redis.register_function('{}_deferred', deferred)", &*FUNCTION_NAME))
    );
    assert_eq!(FUNCTION_NAME.len(), "sluice_".len() + 16);
}

#[test]
fn memory_settings_that_hurt_other_tenants_are_named() {
    assert!(memory_concerns("67108864", "volatile-ttl", 0).is_empty());
    assert!(memory_concerns("67108864", "noeviction", 1000).is_empty());
    for policy in ["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random"] {
        let concerns = memory_concerns("67108864", policy, 1000);
        assert!(concerns.len() == 1 && concerns[0].contains(policy), "{policy}: {concerns:?}");
    }
    assert!(memory_concerns("67108864", "noeviction", 0)[0].contains("--redis-namespace-max-keys"));
    assert!(memory_concerns("0", "noeviction", 0)[0].contains("no maxmemory"));
    assert!(memory_concerns("0", "noeviction", 10).is_empty(), "namespaces bounded");
}

#[test]
fn passwords_never_survive_redaction() {
    assert_eq!(redact_url("redis://:hunter2@10.0.0.1:6379/0"), "redis://:***@10.0.0.1:6379/0");
    assert_eq!(redact_url("rediss://app:hunter2@redis.svc:6380"), "rediss://app:***@redis.svc:6380");
    assert_eq!(redact_url("redis://hunter2@h"), "redis://***@h");
    assert_eq!(redact_url("redis://localhost:6379"), "redis://localhost:6379");
    assert_eq!(redact_url("redis://h:1/0?user=a@b"), "redis://h:1/0?user=a@b");
    let endpoint = RedisEndpoint::Cluster(vec!["redis://:pw@a:1".into(), "redis://:pw@b:2".into()]);
    assert!(!format!("{endpoint:?}").contains("pw"));
}

#[tokio::test]
async fn unusable_configuration_is_refused_without_echoing_secrets() {
    let err = RedisStore::connect(RedisConfig::single("http://:hunter2@host")).await.unwrap_err();
    assert!(matches!(&err, RedisConfigError::Invalid { .. }), "{err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = RedisStore::connect(RedisConfig::single(":hunter2@10.0.0.1:6379")).await.unwrap_err();
    assert!(err.to_string().contains("the URL has no scheme"), "{err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = RedisStore::connect(RedisConfig::cluster(["redis://a:1", "b:2"])).await.unwrap_err();
    assert!(err.to_string().starts_with("invalid Redis endpoint b:2: the URL has no scheme"), "{err}");
    let none: [&str; 0] = [];
    assert_eq!(RedisStore::connect(RedisConfig::cluster(none)).await.unwrap_err(), RedisConfigError::NoClusterNodes);
    assert!(RedisStore::connect(RedisConfig::single("redis://127.0.0.1:1")).await.is_ok(), "lazy: no connection yet");
}

#[test]
fn classifies_outages_apart_from_bad_answers() {
    let refused: RedisError = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
    assert!(matches!(classify(&refused), (StoreError::Unavailable(_), true)));
    let script_bug: RedisError =
        (ErrorKind::Server(ServerErrorKind::ResponseError), "ERR", "user_script:1: bad".to_string()).into();
    assert!(matches!(classify(&script_bug), (StoreError::Protocol(_), false)));
    let loading: RedisError = (ErrorKind::Server(ServerErrorKind::BusyLoading), "loading").into();
    assert!(classify(&loading).1);
}
