//! The docs' one-machine examples, run as written and compared with what the page shows.
//!
//! A page's ```` ```console ```` blocks are its checked examples:
//! - `$ ` starts a command; it goes on over the following lines until it is complete shell (an
//!   open quote, a trailing `\`, `|` or `do` carries it on);
//! - the lines after it, up to the next `$ ` or the block's end, are what it prints (stdout and
//!   stderr together, in the order written); `…` in a line stands for any text, and a line that
//!   is only `…` for any number of lines;
//! - it must exit 0, unless the last expected line is `[exit N]`;
//! - a command ending in `&` runs in the background; its output is not compared;
//! - `cargo run --release --` is the `sluice` binary under test, `cargo run --release --example
//!   fake_llm --` the fake LLM upstream (examples/fake_llm.rs, built by tests/support/fake_llm.rs).
//!
//! An HTML comment `<!-- check: $ COMMAND -->` is a step the reader does not need to see (the
//! quickstart's server, started in the reader's other terminal; `cmp` of a file a command wrote
//! with the committed one, under `$SLUICE_REPO`): it must succeed, and its output is not
//! compared.
//!
//! Each page runs in one bash session, top to bottom, in a scratch copy of `examples/` with the
//! binary under test first on `PATH`. As root each page gets a network namespace of its own, so
//! its ports (8080, 3000, …, as the page says) never meet another test's; otherwise pages run one
//! at a time on this host's loopback.

#[path = "support/fake_llm.rs"]
mod fake_llm;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Pages with checked examples, and how many each has at least: turning an example back into
/// prose is a visible edit here, not a silent loss of coverage.
const PAGES: &[(&str, usize)] = &[
    ("README.md", 7),
    ("docs/simulate.md", 5),
    ("docs/sidecar.md", 4),
    ("docs/policy.md", 2),
    ("docs/overload.md", 2),
    ("docs/llm.md", 4),
    ("docs/redis.md", 8),
    ("docs/leasing.md", 6),
];

/// The longest any one documented command may take (the debug binary, a loaded machine).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// A command the page shows, with the output it shows.
    Shown { line: usize, command: String, expected: Vec<String>, exit: i32 },
    /// A command in a `<!-- check: $ … -->` comment.
    Hidden { line: usize, command: String },
}

const HIDDEN: &str = "<!-- check: $ ";
const ELLIPSIS: &str = "…";

/// Whether `text` is complete shell (bash parses it without running it).
fn complete(text: &str) -> bool {
    if text.trim_end().ends_with('\\') {
        return false;
    }
    Command::new("bash").args(["-n", "-c", text]).stderr(Stdio::null()).status().map(|s| s.success()).unwrap_or(true)
}

fn steps(page: &str) -> Vec<Step> {
    let lines: Vec<&str> = page.lines().collect();
    let mut steps = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some(rest) = line.trim_start().strip_prefix(HIDDEN) {
            let command = rest.trim_end().strip_suffix("-->").unwrap_or(rest).trim().to_string();
            steps.push(Step::Hidden { line: i + 1, command });
            i += 1;
            continue;
        }
        if line.trim_start().starts_with("```") {
            let console = line.trim() == "```console";
            // A block inside a list item is indented; its lines are read without that indent.
            let indent = &line[..line.len() - line.trim_start().len()];
            let at = |i: usize| lines[i].strip_prefix(indent).unwrap_or(lines[i]);
            i += 1;
            while i < lines.len() && !at(i).starts_with("```") {
                let Some(first) = at(i).strip_prefix("$ ").filter(|_| console) else {
                    i += 1;
                    continue;
                };
                let start = i + 1;
                let mut command = first.to_string();
                i += 1;
                while !complete(&command) && i < lines.len() && !at(i).starts_with("```") {
                    command.push('\n');
                    command.push_str(at(i));
                    i += 1;
                }
                let mut expected = Vec::new();
                while i < lines.len() && !at(i).starts_with("$ ") && !at(i).starts_with("```") {
                    expected.push(at(i).to_string());
                    i += 1;
                }
                while expected.last().is_some_and(|l| l.trim().is_empty()) {
                    expected.pop();
                }
                let mut exit = 0;
                if let Some(code) =
                    expected.last().and_then(|l| l.strip_prefix("[exit ")?.strip_suffix(']')?.parse().ok())
                {
                    exit = code;
                    expected.pop();
                }
                let command = command
                    .replace("cargo run --release --example fake_llm -- ", "fake_llm ")
                    .replace("cargo run --release -- ", "sluice ");
                steps.push(Step::Shown { line: start, command, expected, exit });
            }
        }
        i += 1;
    }
    steps
}

/// One line against its expected form, where `…` stands for any text.
fn line_matches(expected: &str, actual: &str) -> bool {
    let (expected, actual) = (expected.trim_end(), actual.trim_end());
    let pieces: Vec<&str> = expected.split(ELLIPSIS).collect();
    if pieces.len() == 1 {
        return expected == actual;
    }
    let (first, last) = (pieces[0], pieces[pieces.len() - 1]);
    if !actual.starts_with(first) || actual.len() < first.len() + last.len() || !actual.ends_with(last) {
        return false;
    }
    let mut rest = &actual[first.len()..actual.len() - last.len()];
    for piece in &pieces[1..pieces.len() - 1] {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    true
}

/// The whole output against the expected lines; a line that is only `…` takes any number.
fn output_matches(expected: &[String], actual: &[&str]) -> bool {
    match expected.split_first() {
        None => actual.iter().all(|l| l.trim().is_empty()),
        Some((first, rest)) if first.trim() == ELLIPSIS => {
            (0..=actual.len()).any(|skip| output_matches(rest, &actual[skip..]))
        }
        Some((first, rest)) => {
            actual.split_first().is_some_and(|(line, more)| line_matches(first, line) && output_matches(rest, more))
        }
    }
}

/// A bash session the page's commands run in, one after another.
struct Session {
    child: Child,
    stdin: ChildStdin,
    done: mpsc::Receiver<i32>,
    scratch: tempfile::TempDir,
    count: usize,
}

fn own_network_namespace() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        Command::new("unshare").args(["--net", "--", "true"]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("scratch dir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

impl Session {
    fn start() -> Session {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        let scratch = tempfile::tempdir().expect("scratch");
        copy_dir(&repo.join("examples"), &scratch.path().join("examples"));
        // A repository of its own, so a page can say `git checkout` to undo an edit it made.
        let git = |args: &[&str]| {
            let status = Command::new("git")
                .args(["-c", "user.name=docs", "-c", "user.email=docs@localhost", "-c", "init.defaultBranch=main"])
                .args(args)
                .current_dir(scratch.path())
                .stdout(Stdio::null())
                .status();
            assert!(status.is_ok_and(|s| s.success()), "git {args:?} in the scratch copy failed");
        };
        git(&["init", "-q"]);
        git(&["add", "-A"]);
        git(&["commit", "-qm", "the examples as the repository has them"]);
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_sluice"));
        let mut command = if own_network_namespace() {
            let mut c = Command::new("unshare");
            c.args(["--net", "--", "bash", "--norc", "--noprofile"]);
            c
        } else {
            let mut c = Command::new("bash");
            c.args(["--norc", "--noprofile"]);
            c
        };
        let mut child = command
            .current_dir(scratch.path())
            .env(
                "PATH",
                format!(
                    "{}:{}:{}",
                    binary.parent().expect("bin dir").display(),
                    fake_llm::fake_llm_binary().parent().expect("examples dir").display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .env_remove("RUST_LOG")
            // For hidden steps that compare what a page's command wrote with a committed file.
            .env("SLUICE_REPO", repo)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            // Its own process group: the page's background servers end with the session.
            .process_group(0)
            .spawn()
            .expect("bash");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(code) = line.strip_prefix("__docs_check_done__ ").and_then(|c| c.trim().parse().ok())
                    && tx.send(code).is_err()
                {
                    return;
                }
            }
        });
        let mut session = Session { child, stdin, done, scratch, count: 0 };
        if own_network_namespace() {
            let (code, out) = session.run("ip link set lo up");
            assert_eq!(code, 0, "cannot bring up loopback in the page's network namespace: {out}");
        }
        session
    }

    /// Runs `command` in the session; its exit status and what it printed.
    fn run(&mut self, command: &str) -> (i32, String) {
        self.count += 1;
        let out = self.scratch.path().join(format!(".out.{}", self.count));
        let script =
            format!("{{\n{command}\n}} >'{}' 2>&1 </dev/null\necho \"__docs_check_done__ $?\"\n", out.display());
        self.stdin.write_all(script.as_bytes()).and_then(|_| self.stdin.flush()).expect("write to bash");
        let code = match self.done.recv_timeout(COMMAND_TIMEOUT) {
            Ok(code) => code,
            Err(_) => {
                let printed = std::fs::read_to_string(&out).unwrap_or_default();
                panic!("still running after {COMMAND_TIMEOUT:?}: {command}\nprinted so far:\n{printed}");
            }
        };
        (code, std::fs::read_to_string(&out).unwrap_or_default())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).status();
        let _ = self.child.wait();
    }
}

/// Runs a page's examples; the number it ran.
fn check_page(page: &str) -> usize {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _serial = (!own_network_namespace()).then(|| ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(page);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{page}: {e}"));
    let steps = steps(&text);
    let mut session = Session::start();
    let mut shown = 0;
    for step in &steps {
        match step {
            Step::Hidden { line, command } => {
                let (code, out) = session.run(command);
                assert_eq!(code, 0, "{page}:{line}: the hidden step `{command}` exited {code}:\n{out}");
            }
            Step::Shown { line, command, expected, exit } => {
                shown += 1;
                let (code, out) = session.run(command);
                let actual: Vec<&str> = out.lines().map(|l| l.trim_end_matches('\r')).collect();
                let background = command.trim_end().ends_with('&');
                let same = background || output_matches(expected, &actual);
                assert!(
                    code == *exit && same,
                    "{page}:{line}: the page's example does not do what the page says.\n\
                     command:\n{command}\n\
                     exit: {code} (the page says {exit})\n\
                     the page shows:\n{}\n\
                     it printed:\n{}",
                    expected.join("\n"),
                    actual.join("\n")
                );
            }
        }
    }
    shown
}

fn check(page: &str) {
    let minimum = PAGES.iter().find(|(p, _)| *p == page).map(|(_, n)| *n).expect("page listed in PAGES");
    let ran = check_page(page);
    assert!(ran >= minimum, "{page}: {ran} checked examples, fewer than the {minimum} PAGES expects");
}

#[test]
fn readme() {
    check("README.md");
}

#[test]
fn simulate_page() {
    check("docs/simulate.md");
}

#[test]
fn sidecar_page() {
    check("docs/sidecar.md");
}

#[test]
fn policy_page() {
    check("docs/policy.md");
}

#[test]
fn overload_page() {
    check("docs/overload.md");
}

#[test]
fn llm_page() {
    check("docs/llm.md");
}

#[test]
fn redis_page() {
    check("docs/redis.md");
}

#[test]
fn leasing_page() {
    check("docs/leasing.md");
}

#[test]
fn every_page_with_examples_is_checked() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![repo.join("README.md"), repo.join("examples/README.md")];
    for entry in std::fs::read_dir(repo.join("docs")).expect("docs") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    for path in pages {
        let text = std::fs::read_to_string(&path).expect("page");
        let name = path.strip_prefix(repo).expect("in repo").display().to_string();
        let has = steps(&text).iter().any(|s| matches!(s, Step::Shown { .. }));
        assert!(!has || PAGES.iter().any(|(p, _)| *p == name), "{name} has console examples but no test runs them");
    }
}

#[test]
fn the_harness_reads_commands_and_matches_output() {
    let page = "text\n<!-- check: $ sluice serve & -->\n```console\n$ echo 'a\nb' \\\n  | cat\na\nb\n$ false\n[exit 1]\n```\n```sh\n$ not checked\n```\n";
    assert_eq!(
        steps(page),
        vec![
            Step::Hidden { line: 2, command: "sluice serve &".into() },
            Step::Shown {
                line: 4,
                command: "echo 'a\nb' \\\n  | cat".into(),
                expected: vec!["a".into(), "b".into()],
                exit: 0
            },
            Step::Shown { line: 9, command: "false".into(), expected: vec![], exit: 1 },
        ]
    );
    assert!(line_matches("200 … 429", "200 200 429"));
    assert!(!line_matches("200 … 429", "200 200 200"));
    assert!(line_matches("a…b…c", "a-b-c"));
    assert!(!line_matches("ab…ba", "aba"));
    let lines = ["HTTP/1.1 429", "date: x", "retry-after: 1"];
    assert!(output_matches(&["HTTP/1.1 429".into(), "…".into(), "retry-after: 1".into()], &lines));
    assert!(!output_matches(&["HTTP/1.1 429".into(), "retry-after: 1".into()], &lines));
    assert!(!output_matches(&["HTTP/1.1 429".into()], &lines));
}
