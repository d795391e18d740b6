//! The fake LLM upstream (examples/fake_llm.rs) for tests: built once per test binary, started
//! on a free port, killed on drop.
//!
//! `cargo test` builds no examples, so the first use runs `cargo build --example fake_llm`
//! (`--release` when the test is a release build) and takes the binary's path from cargo's JSON
//! output; `FAKE_LLM_BIN=/path` skips that. The variables cargo sets for a running test are
//! removed first, or build scripts would see another CARGO_MANIFEST_DIR and rebuild.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use serde_json::{Value, json};

pub fn fake_llm_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("FAKE_LLM_BIN") {
                return PathBuf::from(path);
            }
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| option_env!("CARGO").unwrap_or("cargo").to_string());
            // target/<profile>/deps/fake_llm-<hash>
            let exe = std::env::current_exe().expect("current_exe");
            let release =
                exe.parent().and_then(|deps| deps.parent()).is_some_and(|profile| profile.ends_with("release"));
            let mut command = Command::new(cargo);
            command
                .args([
                    "build",
                    "--example",
                    "fake_llm",
                    "--message-format",
                    "json-render-diagnostics",
                    "--manifest-path",
                ])
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
                .stderr(Stdio::inherit());
            if release {
                command.arg("--release");
            }
            // Cargo runs a test with its package's variables set (CARGO_MANIFEST_DIR, CARGO_PKG_*,
            // …). Passed on, they would differ from a plain `cargo build` for dependencies whose
            // build scripts watch them (ring watches CARGO_MANIFEST_DIR), rebuilding those here
            // and again at the next ordinary build.
            for (name, _) in std::env::vars_os() {
                let name = name.to_string_lossy();
                let set_for_tests = name.starts_with("CARGO_PKG_")
                    || name.starts_with("CARGO_BIN_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_CRATE_NAME",
                        "CARGO_PRIMARY_PACKAGE",
                        "CARGO_TARGET_TMPDIR",
                        "CARGO_RUSTC_CURRENT_DIR",
                        "OUT_DIR",
                    ]
                    .contains(&name.as_ref());
                if set_for_tests {
                    command.env_remove(name.as_ref());
                }
            }
            let output = command.output().expect("runs cargo build --example fake_llm");
            assert!(output.status.success(), "cargo build --example fake_llm failed: {}", output.status);
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter_map(|line| serde_json::from_str::<Value>(line).ok())
                .filter(|message| message["reason"] == "compiler-artifact" && message["target"]["name"] == "fake_llm")
                .find(|message| message["target"]["kind"].as_array().is_some_and(|k| k.contains(&json!("example"))))
                .and_then(|message| message["executable"].as_str().map(PathBuf::from))
                .expect("cargo reported the fake_llm example's executable")
        })
        .clone()
}

/// The running fake upstream, killed on drop.
pub struct FakeLlm {
    child: Child,
    pub base: String,
}

impl FakeLlm {
    pub fn start(args: &[&str]) -> FakeLlm {
        let mut child = Command::new(fake_llm_binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("fake_llm starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("reads stdout");
        let address = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("first line: {line:?}"));
        FakeLlm { child, base: format!("http://{address}") }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
