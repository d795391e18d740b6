//! The house keeps its shape: every module of `src/` stands on a layer (the order `src/lib.rs`
//! lists them in, ARCHITECTURE.md) and uses only modules of its own layer or the layers under it.
//! A `crate::…` path in code that reaches up a layer fails this test, naming the file and line;
//! so does a module `src/lib.rs` declares that no layer below names. Comments are not code: a doc
//! link may point anywhere.

use std::path::{Path, PathBuf};

/// From the bottom up. Entry points are peers: they may use each other's wire items (the sidecar
/// the endpoint's header names) but nothing under them uses any of them.
const LAYERS: &[(&str, &[&str])] = &[
    ("the pure core", &["algorithm", "clock", "decimal", "duration", "overload", "rule"]),
    ("state", &["store"]),
    ("policies", &["policy", "request", "response"]),
    ("the decision core", &["telemetry", "engine"]),
    ("shared by entry points", &["api", "convert", "listen"]),
    ("entry points", &["admission", "operator", "role", "server", "sidecar", "simulate", "main"]),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, modules)| modules.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The modules a line of code names as `crate::NAME` (or `sluice::NAME`, in main.rs).
fn named_modules(line: &str) -> Vec<&str> {
    let mut names = Vec::new();
    for prefix in ["crate::", "sluice::"] {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            let after = &rest[at + prefix.len()..];
            let end = after.find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(after.len());
            names.push(&after[..end]);
            rest = &after[end..];
        }
    }
    names
}

#[test]
fn no_module_uses_one_of_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut violations = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let top = relative.components().next().expect("a component").as_os_str().to_string_lossy();
        let top = top.trim_end_matches(".rs");
        if top == "lib" {
            continue;
        }
        let Some(own) = layer_of(top) else {
            violations.push(format!("src/{}: module `{top}` is in no layer of tests/layers.rs", relative.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read");
        for (number, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for name in named_modules(code) {
                if let Some(used) = layer_of(name)
                    && used > own
                {
                    violations.push(format!(
                        "src/{}:{}: `{top}` ({}) uses `{name}` ({}), a layer above it",
                        relative.display(),
                        number + 1,
                        LAYERS[own].0,
                        LAYERS[used].0
                    ));
                }
            }
        }
    }
    assert!(violations.is_empty(), "arrows running up a layer:\n{}", violations.join("\n"));
}

#[test]
fn every_module_lib_rs_declares_stands_on_a_layer() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).expect("lib.rs");
    let declared: Vec<&str> = lib.lines().filter_map(|line| line.strip_prefix("pub mod ")?.strip_suffix(';')).collect();
    assert!(!declared.is_empty(), "src/lib.rs declares no module");
    let homeless: Vec<_> = declared.iter().filter(|m| layer_of(m).is_none()).collect();
    assert!(homeless.is_empty(), "modules in no layer of tests/layers.rs: {homeless:?}");
    // And in layer order, so that src/lib.rs reads bottom-up like the layers.
    let layers: Vec<usize> = declared.iter().filter_map(|m| layer_of(m)).collect();
    assert!(layers.windows(2).all(|w| w[0] <= w[1]), "src/lib.rs lists its modules out of layer order: {declared:?}");
}

/// Peers that must not lean on each other: policies and state meet only in `rule` ("neither
/// depends on the other"), and the sidecar and simulate stand on the engine and the wire contract
/// (`api`), not on the endpoint's implementation ("why does the sidecar import the server?" has no
/// answer to give).
const APART: &[(&str, &str)] =
    &[("policy", "store"), ("store", "policy"), ("sidecar", "server"), ("simulate", "server")];

#[test]
fn peers_that_stand_apart_do_not_use_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut violations = Vec::new();
    for (module, other) in APART {
        let mut files = Vec::new();
        rust_files(&src.join(module), &mut files);
        assert!(!files.is_empty(), "no src/{module}/");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read");
            for (number, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if !code.starts_with("//") && named_modules(code).contains(other) {
                    violations.push(format!("{}:{}: `{module}` uses `{other}`: {code}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(violations.is_empty(), "peers leaning on each other:\n{}", violations.join("\n"));
}

#[test]
fn an_arrow_up_is_caught() {
    // The checker itself: a line of a store file naming the server is a violation.
    assert_eq!(named_modules("use crate::server::http::X; let y = crate::engine::MAX_COST;"), ["server", "engine"]);
    assert!(layer_of("server") > layer_of("store"));
    assert!(layer_of("engine") > layer_of("policy"));
}
