//! `sluice simulate`: see a policy before shipping it. Arrivals from a trace file or a pattern
//! ([`arrivals`]) are replayed through the real compiled policies and the real memory store on a
//! simulated clock ([`replay`]): every decision is made at the arrival's own `now`, nothing
//! sleeps, so a day of traffic replays in seconds. Per rule it reports what was offered,
//! admitted and refused, shaping delays, the most admitted in any window of `per` against the
//! algorithm's theoretical bound ([`stats`]), denial runs and recovery; `--compare` runs the same
//! traffic through all six algorithms ([`compare`]); `--svg` draws the timeline ([`plot`]).
//!
//! Time: trace time 0 falls on a window boundary of every rule (a common multiple of their
//! `per`, as windows are aligned to the Unix epoch), shifted by `--start`.

pub mod accuracy;
pub mod arrivals;
pub mod comparison;
pub mod every_algorithm;
pub mod plot;
pub mod replay;
pub mod stats;

use std::path::PathBuf;

pub use arrivals::{Arrival, parse_pattern, parse_trace};
pub use replay::{ReplayOptions, RuleReport, SimulationReport, Timeline, replay};

use crate::api::check::CheckRequest;
use crate::duration::parse_duration;

#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("invalid policies:\n{0}")]
    Policies(String),
    #[error("trace line {line}: {message}")]
    Trace { line: usize, message: String },
    #[error("pattern item {item:?}: {message}")]
    Pattern { item: String, message: String },
    #[error("--request: {0}")]
    Request(String),
    #[error("no policy in namespace {0:?} (the request template's namespace)")]
    NoRules(String),
    #[error(
        "rule {0} holds capacity while each request is in progress (a concurrency slot, or a responseCost reservation settled when the response ends): give --hold DURATION (every request), `hold DURATION` in a pattern item, or a trace's 4th column (seconds)"
    )]
    Concurrency(String),
    #[error("the rules' windows have no common boundary below 2^51 µs; use windows that divide each other")]
    NoCommonBoundary,
    #[error("cannot read {path}: {error}")]
    Read { path: PathBuf, error: std::io::Error },
    #[error("cannot draw the picture: {0}")]
    Plot(String),
    #[error("{0}")]
    Usage(String),
}

#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Policy files or directories (their *.yaml and *.yml files).
    #[arg(long = "policies", short = 'p', required = true, num_args = 1.., value_delimiter = ',')]
    pub policies: Vec<PathBuf>,
    /// Replicas sharing each `onStoreFailure: localFallback` limit, as the endpoint's
    /// `--fallback-replicas`: the layering report checks their shares against the limit.
    #[arg(long, default_value_t = 1)]
    pub fallback_replicas: u32,
    /// Arrivals, one per line: `seconds [key [cost]]` (docs/simulate.md).
    #[arg(long, group = "arrivals")]
    pub trace: Option<PathBuf>,
    /// Arrivals from shapes, e.g. `burst 20; burst 20 at 300ms` (docs/simulate.md).
    #[arg(long, group = "arrivals")]
    pub pattern: Option<String>,
    /// Everything else about each request, as the body of POST /v1/check.
    #[arg(long, default_value = r#"{"path": "/"}"#)]
    pub request: String,
    /// Trace time 0 falls this long after a window boundary of every rule.
    #[arg(long, default_value = "0", value_parser = parse_start)]
    pub start: u64,
    /// Width of a timeline bucket (default: about a hundredth of the trace).
    #[arg(long, value_parser = parse_bucket)]
    pub bucket: Option<u64>,
    /// How long each request is in progress (its service time), for `concurrency` rules: an
    /// arrival's own (`hold D` in a pattern item, a trace line's 4th field) takes precedence.
    #[arg(long, value_parser = parse_bucket)]
    pub hold: Option<u64>,
    /// Also run the traffic through all six algorithms with the same parameters.
    #[arg(long)]
    pub compare: bool,
    /// Spread the arrivals over this many enforcers (round robin), each holding quota leases of
    /// the `consistency: leased` rules as an endpoint replica does: the report says how many
    /// requests the slices decided, the store calls made, and each leased rule's most admitted
    /// in a window against its bound plus its maxOvershoot (docs/leasing.md).
    #[arg(long, default_value_t = 0)]
    pub holders: usize,
    /// Draw the timeline to this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Not offered: only SVG is drawn (see docs/simulate.md).
    #[arg(long, hide = true)]
    pub png: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn parse_start(text: &str) -> Result<u64, String> {
    arrivals::parse_seconds(text).or_else(|_| parse_duration(text).map_err(|e| e.to_string()))
}

fn parse_bucket(text: &str) -> Result<u64, String> {
    parse_duration(text)
        .map_err(|e| e.to_string())
        .and_then(|b| if b == 0 { Err("must be positive".into()) } else { Ok(b) })
}

/// Runs `sluice simulate`: returns what to print (the table, or the JSON object).
pub fn run(args: &SimulateArgs) -> Result<String, SimulateError> {
    if args.png.is_some() {
        return Err(SimulateError::Usage(
            "--png is not offered: a raster picture needs a font shipped with the binary; use --svg (text is SVG <text>, rendered by the viewer)".into(),
        ));
    }
    if args.trace.is_none() && args.pattern.is_none() {
        return Err(SimulateError::Usage(
            "no arrivals: give --trace FILE (one `seconds [key [cost]]` per line) or --pattern SPEC (e.g. 'burst 20; burst 20 at 300ms'); docs/simulate.md".into(),
        ));
    }
    let (snapshot, warnings) = crate::policy::load_snapshot_with_warnings(&args.policies, args.fallback_replicas)
        .map_err(SimulateError::Policies)?;
    // The command's own stderr: the report on stdout stays what a script reads.
    for warning in warnings {
        eprintln!("warning: {warning}");
    }
    let template = CheckRequest::from_json(args.request.as_bytes()).map_err(|e| SimulateError::Request(e.0))?;
    let arrivals = match (&args.trace, &args.pattern) {
        (Some(path), _) => {
            let text =
                std::fs::read_to_string(path).map_err(|error| SimulateError::Read { path: path.clone(), error })?;
            parse_trace(&text)?
        }
        (None, Some(pattern)) => parse_pattern(pattern)?,
        (None, None) => unreachable!("checked above"),
    };
    if args.holders > 1024 {
        return Err(SimulateError::Usage("--holders: at most 1024".into()));
    }
    let options =
        ReplayOptions { start_offset: args.start, bucket: args.bucket, hold: args.hold, holders: args.holders };
    let mut report = replay(&snapshot, &template, &arrivals, &options)?;
    if args.compare {
        report.compare = Some(every_algorithm::compare(snapshot.sources(), &template, &arrivals, &options)?);
    }
    if let Some(path) = &args.svg {
        plot::write_svg(&report, path)?;
    }
    if args.json {
        let mut json = serde_json::to_string_pretty(&report).map_err(|e| SimulateError::Plot(e.to_string()))?;
        json.push('\n');
        Ok(json)
    } else {
        Ok(report.to_text())
    }
}
