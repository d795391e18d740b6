//! e2e/rls-client (Go, Envoy's published protos, grpc-go) as a test client of the rate limit
//! service: one process per connection, one JSON command and answer per line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use serde_json::{Value, json};

/// The token of the gateway the tests' token files name.
pub const GATEWAY_TOKEN: &str = "gateway-token-0123456789";

/// e2e/rls-client, built (once per machine, cached outside the checkout) by its script.
pub fn client_binary() -> &'static str {
    static BINARY: OnceLock<String> = OnceLock::new();
    BINARY.get_or_init(|| {
        let out = Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/e2e/rls-client.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/rls-client.sh");
        assert!(out.status.success(), "e2e/rls-client.sh failed: the Go client is needed for this test");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    })
}

/// One `rls-client stdio` process: a gRPC connection kept for its life.
pub struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    pub fn connect(addr: &str) -> Client {
        Client::connect_with(addr, &[])
    }

    pub fn connect_with(addr: &str, flags: &[&str]) -> Client {
        let mut child = Command::new(client_binary())
            .args(["stdio", "-addr", addr])
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn rls-client");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Client { child, stdin, stdout }
    }

    pub fn send(&mut self, command: Value) -> Value {
        writeln!(self.stdin, "{command}").expect("write to rls-client");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read from rls-client");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("rls-client answered {line:?}: {e}"))
    }

    /// `ShouldRateLimit` in domain gateway-limits with the gateway's token.
    pub fn rls(&mut self, descriptors: &[&[(&str, &str)]], extra: Value) -> Value {
        self.rls_in("gateway-limits", Some(GATEWAY_TOKEN), descriptors, extra)
    }

    /// `ShouldRateLimit` in `domain`, with `token` if any; `extra` fields are added to the command.
    pub fn rls_in(
        &mut self,
        domain: &str,
        token: Option<&str>,
        descriptors: &[&[(&str, &str)]],
        extra: Value,
    ) -> Value {
        let mut command = json!({
            "op": "rls",
            "domain": domain,
            "descriptors": descriptors.iter().map(|entries| json!({
                "entries": entries.iter().map(|(k, v)| json!({"key": k, "value": v})).collect::<Vec<_>>()
            })).collect::<Vec<_>>(),
        });
        if let (Some(command), Some(token)) = (command.as_object_mut(), token) {
            command.insert("token".into(), json!(token));
        }
        if let (Some(command), Some(extra)) = (command.as_object_mut(), extra.as_object()) {
            command.extend(extra.clone());
        }
        self.send(command)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn overall(answer: &Value) -> &str {
    assert_eq!(answer["ok"], true, "not a decision: {answer}");
    answer["overall_code"].as_str().unwrap()
}

pub fn header<'a>(answer: &'a Value, name: &str) -> Option<&'a str> {
    answer["response_headers_to_add"]
        .as_array()?
        .iter()
        .find(|h| h["key"].as_str().is_some_and(|k| k.eq_ignore_ascii_case(name)))
        .and_then(|h| h["value"].as_str())
}
