//! Native or classic: where the injected sidecar goes, as pure functions.
//!
//! - native: an entry of `spec.initContainers` with `restartPolicy: Always` (Kubernetes' sidecar
//!   containers, on by default since 1.29, stable in 1.33). The kubelet starts it before the
//!   pod's own init containers and its application, waits for its startup probe, stops it after
//!   the application, and does not wait for it when the application has finished: a Job's pod
//!   completes.
//! - classic: an entry of `spec.containers`, as before native sidecars existed; it starts with the
//!   application and is stopped with it, and a Job's pod never completes (the sidecar does not exit).
//!
//! Chosen per cluster (`--sidecar-kind auto|native|classic`, `auto`: native when the API server
//! is 1.29 or later, read from `/version` at start) and per pod ([`SIDECAR_KIND_ANNOTATION`]).

use k8s_openapi::apimachinery::pkg::version::Info;

/// `native` or `classic`: this pod's sidecar kind, whatever the cluster's default.
pub const SIDECAR_KIND_ANNOTATION: &str = "sluice.dev/sidecar-kind";
/// The first Kubernetes minor release with native sidecars on by default (beta; stable in 1.33).
pub const NATIVE_SINCE: (u32, u32) = (1, 29);

/// The operator flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KindFlag {
    /// Native when the API server is 1.29 or later, classic otherwise or when its version cannot be read.
    #[default]
    Auto,
    /// An init container with `restartPolicy: Always`.
    Native,
    /// A container next to the application's.
    Classic,
}

/// Where the sidecar of one pod goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SidecarKind {
    /// `spec.initContainers`, `restartPolicy: Always`.
    Native,
    /// `spec.containers`.
    #[default]
    Classic,
}

impl SidecarKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SidecarKind::Native => "native",
            SidecarKind::Classic => "classic",
        }
    }

    /// The annotation's value; None when it is neither.
    pub fn parse(text: &str) -> Option<SidecarKind> {
        match text.trim() {
            "native" => Some(SidecarKind::Native),
            "classic" => Some(SidecarKind::Classic),
            _ => None,
        }
    }
}

/// `major.minor` of a Kubernetes version as `/version` spells it (`v1.30.0-gke.1`, `1.36.3`,
/// `1.28`); None when it is not one.
pub fn parse_version(text: &str) -> Option<(u32, u32)> {
    let text = text.trim();
    let text = text.strip_prefix(['v', 'V']).unwrap_or(text);
    let mut parts = text.split('.');
    let major = leading_number(parts.next()?)?;
    let minor = leading_number(parts.next()?)?;
    Some((major, minor))
}

/// The digits a version part starts with (`29+` on some managed clusters, `0-gke` after the patch).
fn leading_number(part: &str) -> Option<u32> {
    let end = part.find(|c: char| !c.is_ascii_digit()).unwrap_or(part.len());
    part[..end].parse().ok()
}

/// What the operator injects, and why (for its log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub kind: SidecarKind,
    pub reason: String,
}

/// The cluster's default kind from the flag and, for `auto`, the API server's `/version` (its
/// `gitVersion`, or why it could not be read).
pub fn decide(flag: KindFlag, version: Result<&str, &str>) -> Decision {
    let decision = |kind, reason: String| Decision { kind, reason };
    match flag {
        KindFlag::Native => decision(SidecarKind::Native, "--sidecar-kind native".into()),
        KindFlag::Classic => decision(SidecarKind::Classic, "--sidecar-kind classic".into()),
        KindFlag::Auto => match version {
            Err(error) => decision(
                SidecarKind::Classic,
                format!(
                    "--sidecar-kind auto, and the API server's /version cannot be read ({error}): classic, which every version runs"
                ),
            ),
            Ok(text) => match parse_version(text) {
                None => decision(
                    SidecarKind::Classic,
                    format!(
                        "--sidecar-kind auto, and the API server's version {text:?} is not major.minor: classic, which every version runs"
                    ),
                ),
                Some(version) if version >= NATIVE_SINCE => decision(
                    SidecarKind::Native,
                    format!(
                        "--sidecar-kind auto, and the API server is {text}: native sidecars are on by default from {}.{}",
                        NATIVE_SINCE.0, NATIVE_SINCE.1
                    ),
                ),
                Some(_) => decision(
                    SidecarKind::Classic,
                    format!(
                        "--sidecar-kind auto, and the API server is {text}: native sidecars are on by default only from {}.{}",
                        NATIVE_SINCE.0, NATIVE_SINCE.1
                    ),
                ),
            },
        },
    }
}

/// The version text of `info` for [`decide`]: `gitVersion`, else `major.minor` (`1.29+`).
pub fn version_text(info: &Info) -> String {
    if parse_version(&info.git_version).is_some() {
        info.git_version.clone()
    } else {
        format!("{}.{}", info.major, info.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_as_api_servers_spell_them() {
        assert_eq!(parse_version("1.28"), Some((1, 28)));
        assert_eq!(parse_version("1.29"), Some((1, 29)));
        assert_eq!(parse_version("1.36.3"), Some((1, 36)));
        assert_eq!(parse_version("v1.30.0-gke.1"), Some((1, 30)));
        assert_eq!(parse_version("v1.31.2-eks-7f9249a"), Some((1, 31)));
        assert_eq!(parse_version("1.29+"), Some((1, 29)));
        assert_eq!(parse_version(" v2.0.0 "), Some((2, 0)));
        for bad in ["", "v", "1", "v1.", "x.y", "1.x", "latest"] {
            assert_eq!(parse_version(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_version_text_falls_back_to_major_and_minor() {
        let info = |git: &str, major: &str, minor: &str| Info {
            git_version: git.into(),
            major: major.into(),
            minor: minor.into(),
            ..Default::default()
        };
        assert_eq!(version_text(&info("v1.36.3", "1", "36")), "v1.36.3");
        assert_eq!(version_text(&info("", "1", "29+")), "1.29+");
        assert_eq!(decide(KindFlag::Auto, Ok(&version_text(&info("", "1", "29+")))).kind, SidecarKind::Native);
        assert_eq!(decide(KindFlag::Auto, Ok(&version_text(&info("", "", "")))).kind, SidecarKind::Classic);
    }

    #[test]
    fn auto_is_native_from_1_29() {
        let kind = |v: &str| decide(KindFlag::Auto, Ok(v)).kind;
        assert_eq!(kind("1.28"), SidecarKind::Classic);
        assert_eq!(kind("v1.28.15"), SidecarKind::Classic);
        assert_eq!(kind("1.29"), SidecarKind::Native);
        assert_eq!(kind("1.36.3"), SidecarKind::Native);
        assert_eq!(kind("v1.30.0-gke.1"), SidecarKind::Native);
        assert_eq!(kind("2.0"), SidecarKind::Native);
        assert_eq!(kind("garbage"), SidecarKind::Classic);
        let unread = decide(KindFlag::Auto, Err("connection refused"));
        assert_eq!(unread.kind, SidecarKind::Classic);
        assert!(unread.reason.contains("cannot be read (connection refused)"), "{}", unread.reason);
        assert!(decide(KindFlag::Auto, Ok("v1.28.3")).reason.contains("v1.28.3"));
    }

    #[test]
    fn an_explicit_flag_wins_whatever_the_version() {
        assert_eq!(decide(KindFlag::Native, Ok("1.28")).kind, SidecarKind::Native);
        assert_eq!(decide(KindFlag::Native, Err("down")).kind, SidecarKind::Native);
        assert_eq!(decide(KindFlag::Classic, Ok("1.36.3")).kind, SidecarKind::Classic);
    }

    #[test]
    fn annotation_values() {
        assert_eq!(SidecarKind::parse("native"), Some(SidecarKind::Native));
        assert_eq!(SidecarKind::parse(" classic "), Some(SidecarKind::Classic));
        for bad in ["", "Native", "auto", "sidecar"] {
            assert_eq!(SidecarKind::parse(bad), None, "{bad:?}");
        }
    }
}
