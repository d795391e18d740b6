//! `sluice redirect`: the inbound redirection of the sidecar's "iptables" mode, installed by an
//! init container in the pod's network namespace.
//!
//! Inbound TCP to the application's ports is REDIRECTed to the sidecar's listen port, so nothing
//! reaches the application past the sidecar. Only `nat PREROUTING` gets a rule: the sidecar's own
//! connection to the application over 127.0.0.1 goes through OUTPUT and stays untouched, and
//! egress is never touched.
//!
//! The rules go in with `iptables-restore --noflush`, so other tools' rules in the pod survive:
//!
//! ```text
//! *nat
//! :SLUICE_INBOUND - [0:0]
//! -A SLUICE_INBOUND -p tcp --dport 8080 -j REDIRECT --to-ports 15080
//! -A PREROUTING -p tcp -j SLUICE_INBOUND
//! COMMIT
//! ```
//!
//! The chain line resets SLUICE_INBOUND, and the PREROUTING jump is only added when
//! `iptables-save -t nat` does not show it yet: running again (a restarted init container) leaves
//! exactly the same rules.

use std::collections::BTreeSet;
use std::fmt;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Our chain in the `nat` table.
pub const CHAIN: &str = "SLUICE_INBOUND";

/// Where Kubernetes reads a container's termination message from.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// Which iptables the rules are installed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IptablesMode {
    /// nft, and legacy if nft fails (a kernel without nf_tables).
    Auto,
    /// iptables-nft-restore / iptables-nft-save (the nf_tables kernel API).
    Nft,
    /// iptables-legacy-restore / iptables-legacy-save (the ip_tables kernel API).
    Legacy,
}

/// One concrete backend: the infix of the binaries' names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Legacy,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// IPv4 (`iptables-*`) or IPv6 (`ip6tables-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn prefix(self) -> &'static str {
        match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// The binary of one backend, family and action, e.g. `ip6tables-legacy-restore`.
pub fn program(backend: Backend, family: Family, action: &str) -> String {
    format!("{}-{}-{action}", family.prefix(), backend.name())
}

#[derive(clap::Args, Debug, Clone)]
pub struct RedirectArgs {
    /// The sidecar's listen port: inbound TCP to --ports is redirected here.
    #[arg(long, env = "SLUICE_REDIRECT_TO_PORT")]
    pub to_port: u16,
    /// The application's ports, comma-separated (e.g. 8080,9090): inbound TCP to them goes to
    /// --to-port instead. Other ports (the sidecar's admin port, say) are not redirected.
    #[arg(long, env = "SLUICE_REDIRECT_PORTS", required = true, num_args = 1.., value_delimiter = ',')]
    pub ports: Vec<u16>,
    /// Which iptables installs the rules: nft (the nf_tables kernel API), legacy (ip_tables), or
    /// auto: nft, and legacy if nft fails.
    #[arg(long, env = "SLUICE_IPTABLES", value_enum, default_value = "auto")]
    pub iptables: IptablesMode,
}

#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("--ports: no ports given; name the application's ports, e.g. --ports 8080,9090")]
    NoPorts,
    #[error("--ports: 0 is not a port an application listens on")]
    PortZero,
    #[error("--to-port: 0 is not a port the sidecar listens on")]
    ToPortZero,
    #[error(
        "--to-port {0} is also in --ports: traffic to the sidecar's own port would be redirected to itself; \
         --ports lists the application's ports only"
    )]
    ToPortInPorts(u16),
    #[error("{program} is not on PATH ({path}): the image lacks Debian's iptables")]
    NotFound { program: String, path: String },
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {output}")]
    Failed { command: String, status: String, output: String },
    #[error("`{command}` succeeded, but `{save}` shows no PREROUTING jump to {CHAIN} afterwards")]
    NotInstalled { command: String, save: String },
    #[error("iptables nft failed: {nft}\niptables legacy failed too: {legacy}")]
    BothFailed { nft: Box<RedirectError>, legacy: Box<RedirectError> },
}

impl RedirectError {
    /// The likely causes, by what the iptables binaries printed, one sentence each.
    pub fn likely_causes(&self) -> Vec<String> {
        let text = self.to_string().to_lowercase();
        let mut causes = Vec::new();
        let denied =
            ["permission denied", "operation not permitted", "you must be root"].iter().any(|s| text.contains(s));
        if denied {
            let mut cause = String::from(
                "the container lacks the NET_ADMIN and NET_RAW capabilities: the pod must be allowed them \
                 (its namespace at Pod Security level `privileged`), or use redirect mode `service`",
            );
            if lacks_net_admin() == Some(true) {
                cause.push_str(" (this process's effective capabilities do not include NET_ADMIN)");
            }
            causes.push(cause);
        }
        if text.contains("lock file") || text.contains("xtables lock") {
            causes.push(
                "legacy iptables cannot take its lock: set XTABLES_LOCKFILE to a path on a writable volume \
                 (an emptyDir) when the root filesystem is read-only"
                    .into(),
            );
        }
        let unsupported =
            ["protocol not supported", "unable to initialize table", "table does not exist", "no chain/target/match"];
        if !denied && unsupported.iter().any(|s| text.contains(s)) {
            causes.push(
                "the node's kernel lacks the netfilter support of that backend (nf_tables for nft; ip_tables, \
                 iptable_nat for legacy; the REDIRECT target for both): try the other with --iptables"
                    .into(),
            );
        }
        causes
    }
}

/// The message for stderr and the termination log: what failed and the likely cause.
pub fn failure_message(error: &RedirectError) -> String {
    let mut message = format!("cannot install the inbound redirection: {error}");
    for cause in error.likely_causes() {
        message.push_str("\nlikely cause: ");
        message.push_str(&cause);
    }
    message
}

/// Writes `message` to /dev/termination-log, which Kubernetes shows as the container's
/// termination message, when that file exists and is writable; never creates it.
pub fn write_termination_log(message: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new().write(true).truncate(true).open(TERMINATION_LOG) {
        let _ = file.write_all(message.as_bytes());
        let _ = file.write_all(b"\n");
    }
}

/// Checked ports: at least one, none 0, not the sidecar's; duplicates removed, first one kept.
pub fn validate(to_port: u16, ports: &[u16]) -> Result<Vec<u16>, RedirectError> {
    if ports.is_empty() {
        return Err(RedirectError::NoPorts);
    }
    if to_port == 0 {
        return Err(RedirectError::ToPortZero);
    }
    if ports.contains(&0) {
        return Err(RedirectError::PortZero);
    }
    if ports.contains(&to_port) {
        return Err(RedirectError::ToPortInPorts(to_port));
    }
    let mut seen = BTreeSet::new();
    Ok(ports.iter().copied().filter(|port| seen.insert(*port)).collect())
}

/// The `iptables-restore --noflush` input: our chain (reset by its declaration) with one REDIRECT
/// per port, and the PREROUTING jump when `add_jump` (it is not there yet).
pub fn restore_input(to_port: u16, ports: &[u16], add_jump: bool) -> String {
    let mut text = format!("*nat\n:{CHAIN} - [0:0]\n");
    for port in ports {
        text.push_str(&format!("-A {CHAIN} -p tcp --dport {port} -j REDIRECT --to-ports {to_port}\n"));
    }
    if add_jump {
        text.push_str(&format!("-A PREROUTING -p tcp -j {CHAIN}\n"));
    }
    text.push_str("COMMIT\n");
    text
}

/// How many PREROUTING rules of an `iptables-save -t nat` output jump to our chain.
pub fn jump_count(save: &str) -> usize {
    save.lines()
        .filter(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            words.starts_with(&["-A", "PREROUTING"]) && words.windows(2).any(|pair| pair == ["-j", CHAIN])
        })
        .count()
}

/// The lines of an `iptables-save` output that mention our chain (not its comments).
pub fn sluice_lines(save: &str) -> Vec<String> {
    save.lines().filter(|line| !line.starts_with('#') && line.contains("SLUICE")).map(str::to_string).collect()
}

/// Whether the kernel has IPv6 addresses in this network namespace: /proc/net/if_inet6 lists
/// one per line, and is absent with IPv6 disabled.
pub fn ipv6_configured() -> bool {
    std::fs::read_to_string("/proc/net/if_inet6").is_ok_and(|text| !text.trim().is_empty())
}

/// Whether this process's effective capabilities lack CAP_NET_ADMIN (bit 12); None when
/// /proc/self/status cannot tell.
fn lacks_net_admin() -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|line| line.strip_prefix("CapEff:"))?.trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << 12) == 0)
}

/// Runs the iptables binaries; a trait so the unit tests can stand in for them.
pub trait Exec {
    /// Runs `program args`, `stdin` fed to it; its stdout on success.
    fn run(&mut self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, RedirectError>;
}

/// The binaries on PATH, with this process's environment (XTABLES_LOCKFILE among it).
pub struct System;

/// The first executable file called `program` in the directories of PATH.
fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(program))
        .find(|file| std::fs::metadata(file).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0))
}

impl Exec for System {
    fn run(&mut self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, RedirectError> {
        let command = std::iter::once(program).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
        let file = find_on_path(program).ok_or_else(|| RedirectError::NotFound {
            program: program.to_string(),
            path: std::env::var("PATH").unwrap_or_default(),
        })?;
        // The multi-call binaries dispatch on argv[0]'s file name, which `file` keeps. stdin is
        // a pipe even without input: no need for /dev/null.
        let mut child = Command::new(&file)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| RedirectError::Spawn { program: file.display().to_string(), source })?;
        if let Some(mut pipe) = child.stdin.take() {
            // A few hundred bytes: fits the pipe, so writing before reading cannot deadlock.
            // A failed write shows as the program's failure below. Dropping the pipe closes it.
            let _ = pipe.write_all(stdin.unwrap_or_default().as_bytes());
        }
        let output =
            child.wait_with_output().map_err(|source| RedirectError::Spawn { program: program.to_string(), source })?;
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
        }
        let mut text = String::from_utf8_lossy(&output.stderr).trim().to_string();
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !stdout.trim().is_empty() {
            text = format!("{text}\n{}", stdout.trim());
        }
        if text.is_empty() {
            text = "(no output)".into();
        }
        Err(RedirectError::Failed { command, status: output.status.to_string(), output: text })
    }
}

/// What one family ended up with.
#[derive(Debug, Clone)]
pub struct Installed {
    pub family: Family,
    /// The `iptables-save` used to show the rules.
    pub save: String,
    /// Its lines mentioning SLUICE.
    pub lines: Vec<String>,
}

/// What `sluice redirect` did.
#[derive(Debug)]
pub struct Report {
    pub backend: Backend,
    pub to_port: u16,
    pub ports: Vec<u16>,
    pub installed: Vec<Installed>,
    /// IPv6 was not configured, so ip6tables was not run.
    pub ipv6_skipped: bool,
    /// auto: why nft was not used.
    pub nft_failure: Option<RedirectError>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ports = self.ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        writeln!(
            f,
            "sluice redirect: inbound TCP to port(s) {ports} now goes to port {} (iptables {})",
            self.to_port, self.backend
        )?;
        if let Some(error) = &self.nft_failure {
            writeln!(f, "iptables nft failed, so legacy was used: {error}")?;
        }
        for installed in &self.installed {
            writeln!(f, "{} rules (`{} -t nat`, lines mentioning SLUICE):", installed.family.label(), installed.save)?;
            for line in &installed.lines {
                writeln!(f, "  {line}")?;
            }
        }
        if self.ipv6_skipped {
            writeln!(f, "IPv6: not configured in this pod (/proc/net/if_inet6 absent or empty), ip6tables skipped")?;
        }
        Ok(())
    }
}

/// Installs (or re-installs) one family's rules with one backend.
pub fn install_family(
    exec: &mut dyn Exec,
    backend: Backend,
    family: Family,
    to_port: u16,
    ports: &[u16],
) -> Result<Installed, RedirectError> {
    let save = program(backend, family, "save");
    let restore = program(backend, family, "restore");
    let before = exec.run(&save, &["-t", "nat"], None)?;
    let input = restore_input(to_port, ports, jump_count(&before) == 0);
    // Legacy iptables takes the xtables lock (XTABLES_LOCKFILE); wait for it rather than fail.
    let mut args = vec!["--noflush"];
    if backend == Backend::Legacy {
        args.push("--wait=10");
    }
    exec.run(&restore, &args, Some(&input))?;
    let after = exec.run(&save, &["-t", "nat"], None)?;
    if jump_count(&after) == 0 {
        return Err(RedirectError::NotInstalled {
            command: format!("{restore} {}", args.join(" ")),
            save: format!("{save} -t nat"),
        });
    }
    Ok(Installed { family, save, lines: sluice_lines(&after) })
}

fn install_backend(
    exec: &mut dyn Exec,
    backend: Backend,
    families: &[Family],
    to_port: u16,
    ports: &[u16],
) -> Result<Vec<Installed>, RedirectError> {
    families.iter().map(|family| install_family(exec, backend, *family, to_port, ports)).collect()
}

/// Validates, then installs the rules for IPv4 and, when `ipv6`, IPv6, with the chosen backend
/// (auto: nft, then legacy if nft fails; nft may have installed part of the rules then, which the
/// legacy ones duplicate harmlessly).
pub fn install(exec: &mut dyn Exec, args: &RedirectArgs, ipv6: bool) -> Result<Report, RedirectError> {
    let ports = validate(args.to_port, &args.ports)?;
    let families: &[Family] = if ipv6 { &[Family::V4, Family::V6] } else { &[Family::V4] };
    let to_port = args.to_port;
    let report = |backend, installed, nft_failure| Report {
        backend,
        to_port,
        ports: ports.clone(),
        installed,
        ipv6_skipped: !ipv6,
        nft_failure,
    };
    match args.iptables {
        IptablesMode::Nft => {
            Ok(report(Backend::Nft, install_backend(exec, Backend::Nft, families, to_port, &ports)?, None))
        }
        IptablesMode::Legacy => {
            Ok(report(Backend::Legacy, install_backend(exec, Backend::Legacy, families, to_port, &ports)?, None))
        }
        IptablesMode::Auto => match install_backend(exec, Backend::Nft, families, to_port, &ports) {
            Ok(installed) => Ok(report(Backend::Nft, installed, None)),
            Err(nft) => match install_backend(exec, Backend::Legacy, families, to_port, &ports) {
                Ok(installed) => Ok(report(Backend::Legacy, installed, Some(nft))),
                Err(legacy) => Err(RedirectError::BothFailed { nft: Box::new(nft), legacy: Box::new(legacy) }),
            },
        },
    }
}

/// `sluice redirect`: the binaries on PATH, IPv6 when this network namespace has it.
pub fn run(args: &RedirectArgs) -> Result<Report, RedirectError> {
    install(&mut System, args, ipv6_configured())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE_WITHOUT: &str = "# Generated by iptables-nft-save v1.8.9 (nf_tables)\n*nat\n:PREROUTING ACCEPT [0:0]\n\
        :INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
        -A PREROUTING -p tcp -m tcp --dport 53 -j DNAT --to-destination 10.0.0.1\nCOMMIT\n# Completed\n";
    const SAVE_WITH: &str = "# Generated by iptables-nft-save v1.8.9 (nf_tables)\n*nat\n:PREROUTING ACCEPT [0:0]\n\
        :INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:SLUICE_INBOUND - [0:0]\n\
        -A PREROUTING -p tcp -j SLUICE_INBOUND\n\
        -A SLUICE_INBOUND -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 15080\nCOMMIT\n# Completed\n";

    fn args(mode: IptablesMode) -> RedirectArgs {
        RedirectArgs { to_port: 15080, ports: vec![8080, 9090], iptables: mode }
    }

    #[test]
    fn the_rules_read_as_iptables_save_would_print_them() {
        assert_eq!(
            restore_input(15080, &[8080, 9090], true),
            "*nat\n:SLUICE_INBOUND - [0:0]\n\
             -A SLUICE_INBOUND -p tcp --dport 8080 -j REDIRECT --to-ports 15080\n\
             -A SLUICE_INBOUND -p tcp --dport 9090 -j REDIRECT --to-ports 15080\n\
             -A PREROUTING -p tcp -j SLUICE_INBOUND\nCOMMIT\n"
        );
        assert_eq!(
            restore_input(15080, &[8080], false),
            "*nat\n:SLUICE_INBOUND - [0:0]\n-A SLUICE_INBOUND -p tcp --dport 8080 -j REDIRECT --to-ports 15080\nCOMMIT\n"
        );
    }

    #[test]
    fn validation_names_what_is_wrong() {
        assert_eq!(validate(15080, &[8080, 9090, 8080]).unwrap(), vec![8080, 9090]);
        assert_eq!(validate(15080, &[9090, 8080, 9090, 9090]).unwrap(), vec![9090, 8080]);
        let error = validate(15080, &[]).unwrap_err();
        assert!(matches!(error, RedirectError::NoPorts) && error.to_string().contains("--ports"), "{error}");
        let error = validate(15080, &[8080, 0]).unwrap_err();
        assert!(matches!(error, RedirectError::PortZero) && error.to_string().contains("--ports: 0"), "{error}");
        let error = validate(0, &[8080]).unwrap_err();
        assert!(matches!(error, RedirectError::ToPortZero) && error.to_string().contains("--to-port"), "{error}");
        let error = validate(15080, &[8080, 15080]).unwrap_err();
        assert!(matches!(error, RedirectError::ToPortInPorts(15080)), "{error}");
        assert!(error.to_string().contains("--to-port 15080 is also in --ports"), "{error}");
    }

    #[test]
    fn the_jump_is_added_only_when_missing() {
        assert_eq!(jump_count(SAVE_WITHOUT), 0);
        assert_eq!(jump_count(SAVE_WITH), 1);
        assert_eq!(jump_count(""), 0);
        // Another chain's jump to ours, or ours mentioned in a comment, is not the PREROUTING jump.
        assert_eq!(jump_count("-A OUTPUT -p tcp -j SLUICE_INBOUND\n# -A PREROUTING -j SLUICE_INBOUND\n"), 0);
        assert_eq!(jump_count("-A PREROUTING -p tcp -j SLUICE_INBOUND_OTHER\n"), 0);
        assert_eq!(jump_count("-A PREROUTING -j SLUICE_INBOUND\n-A PREROUTING -p tcp -j SLUICE_INBOUND\n"), 2);
        assert_eq!(
            sluice_lines(SAVE_WITH),
            [
                ":SLUICE_INBOUND - [0:0]",
                "-A PREROUTING -p tcp -j SLUICE_INBOUND",
                "-A SLUICE_INBOUND -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 15080"
            ]
        );
        assert!(sluice_lines(SAVE_WITHOUT).is_empty());
    }

    /// A stand-in for the binaries: a `*nat` table per program family, and failures by name.
    #[derive(Default)]
    struct Fake {
        calls: Vec<(String, Vec<String>, Option<String>)>,
        jumps: std::collections::HashMap<String, bool>,
        failing: Vec<&'static str>,
    }

    impl Exec for Fake {
        fn run(&mut self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, RedirectError> {
            self.calls.push((program.into(), args.iter().map(|a| a.to_string()).collect(), stdin.map(Into::into)));
            if self.failing.iter().any(|f| program.contains(f)) {
                return Err(RedirectError::Failed {
                    command: program.into(),
                    status: "exit status: 4".into(),
                    output: format!(
                        "{program} v1.8.9: Could not fetch rule set generation id: Permission denied (you must be root)"
                    ),
                });
            }
            let table = program.trim_end_matches("-save").trim_end_matches("-restore").to_string();
            if program.ends_with("-restore") {
                if stdin.is_some_and(|input| jump_count(input) == 1) {
                    let already = self.jumps.insert(table, true);
                    assert_ne!(already, Some(true), "a second jump was added");
                }
                return Ok(String::new());
            }
            Ok(if self.jumps.get(&table).copied().unwrap_or(false) { SAVE_WITH } else { SAVE_WITHOUT }.into())
        }
    }

    #[test]
    fn running_twice_adds_the_jump_once_per_family() {
        let mut fake = Fake::default();
        let report = install(&mut fake, &args(IptablesMode::Nft), true).unwrap();
        assert_eq!(report.backend, Backend::Nft);
        assert_eq!(report.installed.len(), 2);
        assert!(report.to_string().contains("-A PREROUTING -p tcp -j SLUICE_INBOUND"), "{report}");
        let restores: Vec<_> = fake.calls.iter().filter(|c| c.0.ends_with("-restore")).collect();
        assert_eq!(
            restores.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(),
            ["iptables-nft-restore", "ip6tables-nft-restore"]
        );
        assert!(restores.iter().all(|c| c.1 == ["--noflush"] && jump_count(c.2.as_deref().unwrap()) == 1));

        fake.calls.clear();
        install(&mut fake, &args(IptablesMode::Nft), true).unwrap();
        let restores: Vec<_> = fake.calls.iter().filter(|c| c.0.ends_with("-restore")).collect();
        assert_eq!(restores.len(), 2);
        assert!(restores.iter().all(|c| jump_count(c.2.as_deref().unwrap()) == 0), "{restores:?}");
    }

    #[test]
    fn without_ipv6_only_iptables_runs() {
        let mut fake = Fake::default();
        let report = install(&mut fake, &args(IptablesMode::Legacy), false).unwrap();
        assert!(fake.calls.iter().all(|c| c.0.starts_with("iptables-legacy-")), "{:?}", fake.calls);
        assert!(fake.calls.iter().any(|c| c.0 == "iptables-legacy-restore" && c.1 == ["--noflush", "--wait=10"]));
        assert!(report.ipv6_skipped && report.to_string().contains("ip6tables skipped"), "{report}");
    }

    #[test]
    fn auto_falls_back_to_legacy_and_reports_both_failures() {
        let mut fake = Fake { failing: vec!["-nft-"], ..Fake::default() };
        let report = install(&mut fake, &args(IptablesMode::Auto), false).unwrap();
        assert_eq!(report.backend, Backend::Legacy);
        assert!(report.to_string().contains("iptables nft failed, so legacy was used"), "{report}");

        let mut fake = Fake { failing: vec!["-nft-", "-legacy-"], ..Fake::default() };
        let error = install(&mut fake, &args(IptablesMode::Auto), false).unwrap_err();
        let message = failure_message(&error);
        assert!(message.contains("iptables-nft-save") && message.contains("iptables-legacy-save"), "{message}");
        assert!(message.contains("lacks the NET_ADMIN and NET_RAW capabilities"), "{message}");
        assert!(message.contains("redirect mode `service`"), "{message}");

        // An explicit backend does not fall back.
        let mut fake = Fake { failing: vec!["-nft-"], ..Fake::default() };
        assert!(install(&mut fake, &args(IptablesMode::Nft), false).is_err());
        assert!(fake.calls.iter().all(|c| c.0.contains("-nft-")));
    }

    #[test]
    fn the_likely_cause_follows_the_output() {
        let failed = |output: &str| RedirectError::Failed {
            command: "iptables-legacy-restore --noflush".into(),
            status: "exit status: 4".into(),
            output: output.into(),
        };
        let causes = failed("Fatal: can't open lock file /run/xtables.lock: Read-only file system").likely_causes();
        assert!(causes.len() == 1 && causes[0].contains("XTABLES_LOCKFILE"), "{causes:?}");
        let causes = failed("iptables-restore: unable to initialize table 'nat'").likely_causes();
        assert!(causes.len() == 1 && causes[0].contains("--iptables"), "{causes:?}");
        let causes = failed("Operation not permitted").likely_causes();
        assert!(causes.len() == 1 && causes[0].contains("NET_ADMIN"), "{causes:?}");
        let missing = RedirectError::NotFound { program: "iptables-nft-save".into(), path: "/usr/bin".into() };
        assert!(missing.to_string().contains("lacks Debian's iptables"));
        assert!(validate(1, &[]).unwrap_err().likely_causes().is_empty());
    }
}
