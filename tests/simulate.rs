//! `sluice simulate`: the design notes' worked examples, replayed through the real compiled
//! policies and the real memory store on a simulated clock; bounds; the CLI's JSON, table and
//! picture agree.

use serde_json::Value;
use sluice::api::check::CheckRequest;
use sluice::policy::{Snapshot, compile, load_str};
use sluice::simulate::{ReplayOptions, RuleReport, SimulationReport, parse_pattern, parse_trace, replay};

fn policy(algorithm: &str, limit: &str) -> String {
    format!(
        r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: sim, namespace: default}}
spec:
  rules:
    - name: per-key
      key: [{{header: X-API-Key}}]
      algorithm: {algorithm}
      limit: {limit}
"#
    )
}

fn snapshot(yaml: &str) -> Snapshot {
    let loaded = load_str(yaml, std::path::Path::new("sim.yaml")).expect("policy parses");
    let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    compiled.snapshot
}

fn simulate(yaml: &str, pattern: &str, bucket: Option<u64>) -> SimulationReport {
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let arrivals = parse_pattern(pattern).expect("pattern parses");
    replay(&snapshot(yaml), &template, &arrivals, &ReplayOptions { start_offset: 0, bucket, hold: None, holders: 0 })
        .expect("replays")
}

fn only(report: &SimulationReport) -> &RuleReport {
    assert_eq!(report.rules.len(), 1);
    &report.rules[0]
}

/// The seed note's measurement: capacity 5 refilled at 10/s admits 5 of 20 immediate requests
/// and 3 of 20 after 300 ms — for each bucket algorithm.
#[test]
fn capacity_5_at_10_per_second_admits_5_then_3() {
    for algorithm in ["tokenBucket", "gcra", "leakyBucket"] {
        let report = simulate(
            &policy(algorithm, "{requests: 10, per: 1s, burst: 5}"),
            "burst 20; burst 20 at 300ms",
            Some(100_000),
        );
        let rule = only(&report);
        assert_eq!((rule.offered, rule.admitted, rule.denied), (40, 8, 32), "{algorithm}");
        assert_eq!(rule.timeline.admitted[..4], [5, 0, 0, 3], "{algorithm}");
        assert_eq!(rule.timeline.denied[..4], [15, 0, 0, 17], "{algorithm}");
        assert_eq!(rule.timeline.remaining[0], Some(0));
        assert_eq!(rule.longest_denial_run, 17, "the run of refusals after the 3 admitted at 300 ms");
        assert_eq!(rule.recovery_ms, Some(300.0), "refused at 0, admitted again at 300 ms");
    }
}

/// Fixed windows admit 2N within one window length across a boundary (here within 1 ms).
#[test]
fn fixed_window_admits_two_n_across_a_boundary() {
    let report = simulate(&policy("fixedWindow", "{requests: 100, per: 1m}"), "boundary 150 at 1m", None);
    let rule = only(&report);
    assert_eq!((rule.offered, rule.admitted), (300, 200));
    assert_eq!(rule.max_admitted_in_any_window, 200);
    assert_eq!(rule.bound, Some(200));
    // Shifted by --start so the attack misses the boundary, it gets N.
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let shifted = replay(
        &snapshot(&policy("fixedWindow", "{requests: 100, per: 1m}")),
        &template,
        &parse_pattern("boundary 150 at 1m").unwrap(),
        &ReplayOptions { start_offset: 30_000_000, bucket: None, hold: None, holders: 0 },
    )
    .unwrap();
    assert_eq!(only(&shifted).admitted, 100);
}

/// The sliding log never exceeds N in any window, whatever the traffic, and reaches it.
#[test]
fn sliding_log_never_exceeds_n_in_any_window() {
    let traffic = "boundary 30 at 1s; steady 45/s for 5s from 1s; onoff 200/s on 150ms off 350ms for 4s from 6s; \
                   burst 40 at 10999ms";
    let report = simulate(&policy("slidingWindowLog", "{requests: 20, per: 1s}"), traffic, None);
    let rule = only(&report);
    assert_eq!(rule.max_admitted_in_any_window, 20);
    assert_eq!(rule.bound, Some(20));
    assert!(rule.admitted > 100 && rule.denied > 100, "{rule:?}");
}

/// The book's example: limit 7 per minute, previous window 5, current 3, 30% into the window:
/// 3 + 5 × 0.7 = 6.5, floored to 6, so one more is admitted; the next is not.
#[test]
fn sliding_counter_book_example_is_admitted() {
    let trace = "0\n1\n2\n3\n4\n60\n61\n62\n78\n78\n";
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let report = replay(
        &snapshot(&policy("slidingWindowCounter", "{requests: 7, per: 1m}")),
        &template,
        &parse_trace(trace).unwrap(),
        &ReplayOptions { start_offset: 0, bucket: Some(1_000_000), hold: None, holders: 0 },
    )
    .unwrap();
    let rule = only(&report);
    assert_eq!((rule.admitted, rule.denied), (9, 1));
    assert_eq!((rule.timeline.admitted[78], rule.timeline.denied[78]), (1, 1), "18 s = 30% into the second window");
    assert_eq!(rule.timeline.remaining[78], Some(0));
}

/// Every algorithm stays within its bound on bursty many-client traffic, and the buckets reach
/// theirs exactly under steady overload.
#[test]
fn measured_maxima_stay_within_the_bounds() {
    let traffic =
        "clients 30 600/s for 20s alpha 1.1 seed 3; burst 50 at 5s key client-1; boundary 20 at 10s key client-2";
    for (algorithm, limit) in [
        ("tokenBucket", "{requests: 10, per: 1s, burst: 5}"),
        ("gcra", "{requests: 10, per: 1s}"),
        ("leakyBucket", "{requests: 10, per: 1s, burst: 4}"),
        ("leakyBucket", "{requests: 10, per: 1s, burst: 8, maxDelay: 300ms}"),
        ("fixedWindow", "{requests: 10, per: 1s}"),
        ("slidingWindowLog", "{requests: 10, per: 1s}"),
        ("slidingWindowCounter", "{requests: 10, per: 1s}"),
    ] {
        let report = simulate(&policy(algorithm, limit), traffic, None);
        let rule = only(&report);
        let bound = rule.bound.expect("every algorithm has a bound");
        assert!(rule.max_admitted_in_any_window <= bound, "{algorithm} {limit}: {rule:?}");
        assert!(rule.keys >= 25, "many clients: {}", rule.keys);
    }
    for (algorithm, limit, bound) in [
        ("tokenBucket", "{requests: 10, per: 1s, burst: 5}", 14),
        ("gcra", "{requests: 10, per: 1s, burst: 5}", 14),
        ("leakyBucket", "{requests: 10, per: 1s, burst: 8, maxDelay: 300ms}", 13),
    ] {
        let report = simulate(&policy(algorithm, limit), "steady 50/s for 5s", None);
        let rule = only(&report);
        assert_eq!((rule.max_admitted_in_any_window, rule.bound), (bound, Some(bound)), "{algorithm} {limit}");
    }
}

#[test]
fn leaky_bucket_shaping_reports_its_delays() {
    let report =
        simulate(&policy("leakyBucket", "{requests: 10, per: 1s, burst: 5, maxDelay: 300ms}"), "burst 10", None);
    let rule = only(&report);
    // Slots every 100 ms: waits of 0, 100, 200 and 300 ms pass, 400 ms is over maxDelay.
    assert_eq!((rule.admitted, rule.shaped), (4, 3));
    assert_eq!(rule.max_shaping_delay_ms, 300.0);
    assert_eq!(rule.mean_shaping_delay_ms, 200.0);
    // The picture's delay strip: the burst's bucket holds the longest wait.
    assert_eq!(rule.timeline.max_delay_ms.first(), Some(&300));
    assert!(rule.timeline.max_delay_ms[1..].iter().all(|&d| d == 0));
}

/// A trace at one instant is bucketed on the rule's window (a hundredth of `per`), not on its own
/// zero length; a longer trace on its own.
#[test]
fn an_instant_trace_is_bucketed_on_the_window() {
    let burst = simulate(&policy("tokenBucket", "{requests: 10, per: 2s, burst: 5}"), "burst 20", None);
    assert_eq!(burst.bucket_ms, 20.0);
    let long = simulate(&policy("tokenBucket", "{requests: 10, per: 2s, burst: 5}"), "steady 1/s for 50s", None);
    assert_eq!(long.bucket_ms, 500.0);
}

/// A shaping leaky bucket's panel has the delay strip and names maxDelay; others have neither.
#[test]
fn the_picture_draws_shaping_delays_for_a_shaping_bucket_only() {
    let dir = tempfile::tempdir().unwrap();
    let picture = |limit: &str| {
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, policy("leakyBucket", limit)).unwrap();
        let svg = dir.path().join("timeline.svg");
        let file = file.to_str().unwrap();
        sluice(&["simulate", "--policies", file, "--pattern", "steady 20/s for 2s", "--svg", svg.to_str().unwrap()]);
        std::fs::read_to_string(&svg).unwrap()
    };
    let shaping = picture("{requests: 10, per: 1s, burst: 5, maxDelay: 300ms}");
    assert!(shaping.contains("shaping delay (ms)") && shaping.contains("maxDelay 300 ms"));
    let policing = picture("{requests: 10, per: 1s, burst: 5}");
    assert!(!policing.contains("shaping delay") && policing.contains("remaining quota"));
}

#[test]
fn trace_keys_replace_the_keyed_header_and_the_client_ip() {
    let yaml = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: sim, namespace: shop}
spec:
  rules:
    - name: per-key
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1s}
    - name: per-ip
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1s}
"#;
    let template =
        CheckRequest::from_json(br#"{"namespace": "shop", "path": "/", "headers": {"x-api-key": "template"}}"#)
            .unwrap();
    let trace = "0 a\n0 a\n0 a\n0 b\n0 b\n0.5\n0.5\n0.5 203.0.113.7 2\n";
    let report = replay(&snapshot(yaml), &template, &parse_trace(trace).unwrap(), &ReplayOptions::default()).unwrap();
    let per_key = &report.rules[0];
    assert_eq!(per_key.keys, 4, "a, b, the template's value, 203.0.113.7");
    // a: 2 of 3; b: 2 of 2; template: 2 of 2, but per-ip (all template requests share no IP)
    // admits them; the last costs 2.
    assert_eq!(per_key.offered, 8);
    let per_ip = &report.rules[1];
    assert_eq!(per_ip.keys, 4, "a, b, none, and the address itself");
    assert_eq!(per_key.admitted, 7);
    assert_eq!(per_key.admitted_cost, 8);
}

fn sluice(args: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// The picture is drawn and non-empty, and its data (the --json output) is the printed table.
#[test]
fn the_picture_and_the_json_match_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    std::fs::write(
        &file,
        format!(
            "{}---{}",
            policy("tokenBucket", "{requests: 10, per: 1s, burst: 5}"),
            policy("fixedWindow", "{requests: 20, per: 2s}").replace("name: sim", "name: windows")
        ),
    )
    .unwrap();
    let svg = dir.path().join("timeline.svg");
    let pattern = "burst 20; steady 25/s for 3s from 1s; boundary 15 at 4s; clients 20 100/s for 2s from 5s";
    let file = file.to_str().unwrap();
    let table = sluice(&["simulate", "--policies", file, "--pattern", pattern, "--svg", svg.to_str().unwrap()]);
    let json: Value =
        serde_json::from_str(&sluice(&["simulate", "--policies", file, "--pattern", pattern, "--json"])).unwrap();

    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.len() > 5_000 && picture.starts_with("<svg"), "{} bytes", picture.len());
    assert!(picture.contains("<text") && picture.contains("simulated time (s)") && picture.contains("admitted"));
    // Both panels, each with its own quota strip and the legend above it.
    let axis_titles = picture.lines().filter(|l| l.trim() == "remaining quota").count();
    assert_eq!(axis_titles, 2, "one quota strip per rule");
    assert_eq!(picture.matches("denied (bar height = offered)").count(), 2);

    let rules = json["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    for rule in rules {
        for field in ["policy", "rule", "algorithm", "offered", "admitted", "denied", "maxAdmittedInAnyWindow", "bound"]
        {
            assert!(rule.get(field).is_some(), "{field}");
        }
        let name = format!("{}/{}", rule["policy"].as_str().unwrap(), rule["rule"].as_str().unwrap());
        let row: Vec<&str> =
            table.lines().find(|l| l.starts_with(&name)).expect("a table row").split_whitespace().collect();
        let number = |field: &str| rule[field].as_u64().unwrap().to_string();
        assert_eq!(row[1], rule["algorithm"].as_str().unwrap());
        assert_eq!(
            row[2..7],
            [
                number("offered"),
                number("admitted"),
                number("denied"),
                number("maxAdmittedInAnyWindow"),
                number("bound")
            ]
        );
        assert!(picture.contains(&name), "the picture has a panel for {name}");
        let sum = |series: &str| {
            rule["timeline"][series].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum::<u64>()
        };
        assert_eq!(
            (sum("offered"), sum("admitted"), sum("denied")),
            (rule["offered"].as_u64().unwrap(), rule["admitted"].as_u64().unwrap(), rule["denied"].as_u64().unwrap())
        );
    }
}

#[test]
fn compare_runs_all_six_algorithms() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    std::fs::write(&file, policy("tokenBucket", "{requests: 10, per: 1s, burst: 5}")).unwrap();
    let out =
        sluice(&["simulate", "-p", file.to_str().unwrap(), "--pattern", "boundary 20 at 1s", "--compare", "--json"]);
    let json: Value = serde_json::from_str(&out).unwrap();
    let rows = json["compare"][0]["rows"].as_array().unwrap();
    let algorithms: Vec<&str> = rows.iter().map(|r| r["algorithm"].as_str().unwrap()).collect();
    assert_eq!(
        algorithms,
        ["tokenBucket", "gcra", "leakyBucket", "fixedWindow", "slidingWindowLog", "slidingWindowCounter"]
    );
    let max = |a: &str| rows.iter().find(|r| r["algorithm"] == a).unwrap()["maxAdmittedInAnyWindow"].as_u64().unwrap();
    assert_eq!(max("fixedWindow"), 20, "2N across the boundary");
    assert_eq!(max("slidingWindowLog"), 10);
    assert_eq!(max("tokenBucket"), 5, "1 ms refills no token");
    for row in rows {
        assert!(row["maxAdmittedInAnyWindow"].as_u64() <= row["bound"].as_u64(), "{row}");
    }
}

#[test]
fn errors_are_named() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["simulate", "-p", "examples/policies", "--pattern", "steady 10/s"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("missing `for DURATION`"));
}

/// Issue 28, item 7: with no arrivals the command names both ways to give them; `--start` is
/// stated in the header; the policies' warnings go to stderr (the report on stdout stays clean);
/// a namespace with a concurrency rule is refused with the reason.
#[test]
fn the_cli_says_what_it_needs_and_warns_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.yaml");
    // Keyed on a header whose values nothing restricts: valid, and warned about.
    std::fs::write(&path, policy("fixedWindow", "{requests: 3, per: 1s}")).unwrap();
    let run = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap();

    let none = run(&["simulate", "--policies", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success());
    assert!(stderr.contains("--trace") && stderr.contains("--pattern"), "{stderr}");

    let started = run(&["simulate", "--policies", path.to_str().unwrap(), "--pattern", "burst 4", "--start", "300ms"]);
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    let stdout = String::from_utf8_lossy(&started.stdout);
    assert!(stdout.lines().next().unwrap().contains("300ms after a window boundary of every rule"), "{stdout}");
    let stderr = String::from_utf8_lossy(&started.stderr);
    assert!(
        stderr.contains("warning: ") && stderr.contains("spec.rules[0].key[0]") && stderr.contains("p.yaml"),
        "{stderr}"
    );
    assert!(!stdout.contains("warning"), "warnings stay off stdout: {stdout}");

    std::fs::write(&path, policy("concurrency", "{requests: 3, per: 1m}")).unwrap();
    let refused = run(&["simulate", "--policies", path.to_str().unwrap(), "--pattern", "burst 4"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("a concurrency slot") && stderr.contains("--hold"),
        "{stderr}"
    );
}

/// A concurrency rule replays with each request's time in progress: slots come back when the
/// requests end, and the report's maximum is the most in progress at once.
#[test]
fn concurrency_rules_replay_with_service_times() {
    let yaml = policy("concurrency", "{requests: 2, per: 1m}");
    let report = simulate(&yaml, "burst 10 hold 1s; burst 10 at 1s hold 500ms; burst 3 at 1200ms hold 1s", None);
    let rule = only(&report);
    // 0 s: two of ten; 1 s: the first two ended at that instant, two more; 1.2 s: those still run.
    assert_eq!((rule.offered, rule.admitted), (23, 4));
    assert_eq!(rule.max_admitted_in_any_window, 2, "never more than 2 in progress for the key");
    assert_eq!(rule.bound, Some(2));
    // A trace says it per line (4th field, seconds); --hold for the rest.
    let trace = parse_trace("0 k 1 0.5\n0 k\n0 k\n0.6 k\n").unwrap();
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let options = ReplayOptions { start_offset: 0, bucket: None, hold: Some(2_000_000), holders: 0 };
    let report = replay(&snapshot(&yaml), &template, &trace, &options).unwrap();
    // 0 s: the first (0.5 s) and the second (2 s) start, the third is refused; 0.6 s: one slot free.
    assert_eq!(only(&report).admitted, 3);
}

#[test]
fn a_concurrency_rule_without_service_times_says_how_to_give_them() {
    let yaml = policy("concurrency", "{requests: 2, per: 1m}");
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let arrivals = parse_pattern("burst 10").unwrap();
    let error = replay(&snapshot(&yaml), &template, &arrivals, &ReplayOptions::default()).unwrap_err().to_string();
    assert!(error.contains("--hold") && error.contains("hold DURATION"), "{error}");
}

/// A rule whose cost is known after the response: the trace's cost column is each request's
/// actual cost, the estimate comes from the policy. Estimates that bound the actual costs keep
/// every window within the limit; estimates below them let debt through, and the report says
/// by how much.
#[test]
fn response_costs_are_replayed_as_reservations_settled_to_the_actual_cost() {
    let yaml = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: sim, namespace: default}
spec:
  rules:
    - name: tokens
      algorithm: fixedWindow
      limit: {requests: 10000, per: 1m}
      responseCost: {fields: [usage.total_tokens], estimate: {requestField: max_tokens, cap: 4000}}
"#;
    let replay_with = |max_tokens: u64, actual: u64| {
        // Every 0.5 s for a minute, each response lasting 2 s.
        let trace: String = (0..120).map(|i| format!("{}.{} - {actual} 2\n", i / 2, (i % 2) * 5)).collect();
        let template = CheckRequest::from_json(
            format!(r#"{{"path": "/", "requestFields": {{"max_tokens": {max_tokens}}}}}"#).as_bytes(),
        )
        .unwrap();
        let report = replay(&snapshot(yaml), &template, &parse_trace(&trace).unwrap(), &ReplayOptions::default())
            .expect("replays");
        report.rules[0].clone()
    };
    let bounded = replay_with(1000, 900);
    assert_eq!(bounded.reserved_cost, Some(bounded.admitted * 1000));
    assert_eq!(bounded.admitted_cost, bounded.admitted * 900, "charged the actual costs");
    assert!(bounded.max_admitted_in_any_window <= 10_000, "{}", bounded.max_admitted_in_any_window);
    assert!(bounded.admitted >= 10, "the last settles give back what the estimates held");
    let under = replay_with(500, 900);
    assert!(
        under.max_admitted_in_any_window > 10_000,
        "underestimates overspend: {}",
        under.max_admitted_in_any_window
    );
    // Without a time in progress the reservations would never settle: refused, saying how.
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let error =
        replay(&snapshot(yaml), &template, &parse_trace("0\n").unwrap(), &ReplayOptions::default()).unwrap_err();
    assert!(error.to_string().contains("--hold"), "{error}");
}

/// `--holders`: the arrivals spread over enforcers holding quota leases of a leased rule; every
/// fixed window stays within the limit, most requests are decided from slices, and the store is
/// asked about a hundredth as often as there are requests.
#[test]
fn holders_decide_from_slices_and_keep_every_window_within_the_limit() {
    let yaml = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: api, namespace: default}
spec:
  rules:
    - name: window
      algorithm: fixedWindow
      limit: {requests: 6000, per: 1s}
      consistency: {mode: leased, maxOvershoot: "2%"}
"#;
    let template = CheckRequest::from_json(br#"{"path": "/"}"#).unwrap();
    let arrivals = parse_pattern("steady 60000/s for 5s").unwrap();
    let options = ReplayOptions { start_offset: 0, bucket: Some(1_000_000), hold: None, holders: 8 };
    let report = replay(&snapshot(yaml), &template, &arrivals, &options).unwrap();
    let rule = only(&report);
    assert_eq!(rule.lease_bound, Some(120));
    for (second, &admitted) in rule.timeline.admitted.iter().enumerate().take(5) {
        assert!((6000 - 120..=6000).contains(&admitted), "second {second}: {admitted} admitted of 6000");
    }
    let leases = report.leases.as_ref().expect("a lease report");
    assert_eq!(leases.holders, 8);
    assert!(leases.admitted_locally > 20_000, "{leases:?}");
    assert!(leases.store_calls * 100 < 300_000, "{} store calls for 300000 requests", leases.store_calls);
    let text = report.to_text();
    assert!(text.contains("across 8 holders: "), "{text}");
    assert!(text.contains("default/api/window: leased, maxOvershoot 120: most in a window "), "{text}");
    // The same traffic decided exactly admits the same, with a store call per request.
    let exact = replay(&snapshot(yaml), &template, &arrivals, &ReplayOptions { holders: 0, ..options }).unwrap();
    assert_eq!(only(&exact).admitted, 30_000);
    assert!(exact.leases.is_none());
}

/// Egress shaping replayed: 6 callers' bursts into one `spec.egress` budget of 50/s with 2 s
/// of waiting. The departures (what the bank sees) never exceed one per interval in any
/// second, the queue is reported, the waits stay within maxDelay, what does not fit is refused,
/// and the timeline counts every admitted request once where it departs.
#[test]
fn egress_shaping_spaces_the_departures_of_every_caller() {
    let yaml = "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: pay, namespace: pay}\nspec:\n  egress:\n  - {name: bank, destination: \"https://bank.example.com\", listenPort: 15100, limit: {requests: 50, per: 1s, maxDelay: 2s}}\n";
    let template = CheckRequest::from_json(br#"{"namespace": "pay", "path": "/", "egress": "bank"}"#).unwrap();
    // Six callers (the trace's key column names the caller), bursts of 30 at once, 1 s apart.
    let mut lines = String::new();
    for caller in 0..6 {
        for i in 0..30 {
            lines += &format!("{:.3} caller-{caller}\n", f64::from(caller) * 0.25 + f64::from(i) * 0.001);
        }
    }
    let mut arrivals = parse_trace(&lines).expect("trace parses");
    arrivals.sort_by_key(|a| a.at);
    let report = replay(&snapshot(yaml), &template, &arrivals, &ReplayOptions::default()).expect("replays");
    let rule = only(&report);
    assert_eq!(rule.rule, "egress-bank");
    let departures = rule.departures.expect("a shaping rule reports its departures");
    assert_eq!(departures.bound, 50);
    assert!(departures.most_in_any_window <= 50, "{departures:?}");
    assert!(departures.longest_queue >= 90, "{departures:?}");
    assert!(rule.max_shaping_delay_ms <= 2_000.0, "{}", rule.max_shaping_delay_ms);
    assert!(rule.denied > 0 && rule.admitted >= 100, "{} admitted, {} denied", rule.admitted, rule.denied);
    assert_eq!(rule.timeline.departed.iter().sum::<u64>(), rule.admitted);
    assert!(report.to_text().contains("departures (what the downstream sees)"));
}

/// Deferred writes replayed: a burst of 200 writes at once against 10/s with a queue of 150
/// per key. What the queue takes instead of refusing is replayed at the rule's rate (the key's
/// windows, replays included, never pass the limit), what it cannot take is refused, the
/// delays grow as the queue drains, and the timeline draws the queue and the replays.
#[test]
fn deferred_writes_drain_at_the_rules_rate() {
    let yaml = "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: orders, namespace: shop}\nspec:\n  rules:\n  - name: writes\n    match: {methods: [POST]}\n    key: [{header: x-api-key}]\n    algorithm: fixedWindow\n    limit: {requests: 10, per: 1s}\n    deferIfLimited: {maxQueued: 150}\n";
    let template = CheckRequest::from_json(
        br#"{"namespace": "shop", "method": "POST", "path": "/orders", "headers": {"x-api-key": "k"}}"#,
    )
    .unwrap();
    let lines: String = (0..200).map(|i| format!("{:.4} tenant\n", f64::from(i) * 0.0001)).collect();
    let arrivals = parse_trace(&lines).expect("trace parses");
    let report = replay(&snapshot(yaml), &template, &arrivals, &ReplayOptions::default()).expect("replays");
    let rule = only(&report);
    let deferral = rule.deferral.clone().expect("a deferring rule reports its queue");
    assert_eq!((rule.admitted, deferral.accepted, deferral.refused_full), (10, 150, 40), "{deferral:?}");
    assert_eq!((deferral.delivered, deferral.left, deferral.longest_queue), (150, 0, 150));
    // A fixed window admits up to twice its limit across a boundary (its bound), replays or not.
    let bound = rule.bound.expect("a fixed window has a bound");
    assert!(
        rule.max_admitted_in_any_window <= bound,
        "replays passed the bound {bound}: {}",
        rule.max_admitted_in_any_window
    );
    // 150 at 10 a second: the last one after 15 windows.
    let drained = deferral.drained_ms.expect("drained");
    assert!((14_000.0..=16_000.0).contains(&drained), "{drained}");
    assert!(deferral.delay_p50_ms < deferral.delay_max_ms && deferral.delay_max_ms <= drained, "{deferral:?}");
    assert_eq!(rule.timeline.replayed.iter().sum::<u64>(), 150);
    assert_eq!(rule.timeline.deferred.iter().copied().max(), Some(150));
    assert!(report.to_text().contains("deferred writes: 150 accepted instead of refused, 40 refused (queue full)"));
    // A read the rule does not defer: no queue.
    let read =
        CheckRequest::from_json(br#"{"namespace": "shop", "path": "/orders", "headers": {"x-api-key": "k"}}"#).unwrap();
    let report = replay(&snapshot(yaml), &read, &arrivals, &ReplayOptions::default()).expect("replays");
    assert!(only(&report).deferral.is_none() || only(&report).offered == 0);
}
