use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use sluice::clock::SystemClock;
use sluice::server::serve;

#[derive(Parser)]
#[command(name = "sluice", version, about = "Kubernetes-native distributed rate limiter")]
struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "SLUICE_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Threads that run the long-running roles (serve, operator, sidecar); default: the CPUs
    /// this process may use (its CPU affinity and cgroup CPU quota). With 1, one thread runs
    /// everything (tokio's current-thread scheduler): on one CPU a proxied request through the
    /// sidecar costs about a tenth less CPU than with a pool of one worker (docs/benchmarks.md).
    #[arg(long, global = true, env = "SLUICE_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Standalone enforcement endpoint on RateLimitPolicy YAML files, hot-reloaded.
    Serve(serve::ServeArgs),
    /// In-cluster: controller, embedded enforcement endpoint, status writer (leader), webhooks.
    Operator(sluice::operator::OperatorArgs),
    /// Print the RateLimitPolicy CustomResourceDefinition (what crds/ holds).
    Crd,
    /// Per-pod reverse proxy in front of the application: asks the endpoint, answers 429 or forwards.
    Sidecar(sluice::sidecar::SidecarArgs),
    /// Which rules a request matches, why the others do not, its keys and what a check would
    /// decide on a fresh store; consumes nothing.
    Explain(ExplainArgs),
    /// Replays a trace or a traffic pattern through the policies with a simulated clock.
    Simulate(sluice::simulate::SimulateArgs),
    /// Converts another rate limiter's configuration into RateLimitPolicy documents (stdout).
    #[command(subcommand)]
    Convert(ConvertCommand),
    /// Init container of the sidecar's iptables mode: redirects inbound TCP to the application's
    /// ports to the sidecar (nat PREROUTING only; loopback and egress untouched). Needs NET_ADMIN.
    Redirect(sluice::sidecar::redirect::RedirectArgs),
}

#[derive(Subcommand)]
enum ConvertCommand {
    /// An envoyproxy/ratelimit configuration file (domain and descriptor tree), for Sluice as
    /// Envoy's rate limit service (docs/envoy.md).
    EnvoyRatelimit {
        /// The YAML file (one document per domain).
        file: PathBuf,
        /// Namespace of the policies, which Envoy must then send as its domain; default: each
        /// document's domain.
        #[arg(long)]
        namespace: Option<String>,
        /// The algorithm of every rule: tokenBucket, gcra, leakyBucket, fixedWindow,
        /// slidingWindowLog or slidingWindowCounter. fixedWindow (default) decides exactly as
        /// envoyproxy/ratelimit does; slidingWindowCounter avoids the double burst at window
        /// boundaries.
        #[arg(long, default_value = "fixedWindow")]
        algorithm: String,
    },
}

#[derive(clap::Args)]
struct ExplainArgs {
    /// Policy files or directories (their *.yaml and *.yml files).
    #[arg(long = "policies", short = 'p', required = true, num_args = 1.., value_delimiter = ',')]
    policies: Vec<PathBuf>,
    /// The request, as the body of POST /v1/check, e.g. '{"namespace": "shop", "path": "/orders/1"}'.
    #[arg(long)]
    request: String,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Replicas sharing each `onStoreFailure: localFallback` limit, as the endpoint's
    /// `--fallback-replicas`: the layering report checks their shares against the limit.
    #[arg(long, default_value_t = 1)]
    fallback_replicas: u32,
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Every long-running role: logging, then a runtime of `worker_threads` (default: the CPUs this
/// process may use) driving the role to its end; one thread runs everything itself, without a
/// pool to hand work to.
fn run_async(
    log_format: &str,
    worker_threads: Option<u16>,
    role: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    init_logging(log_format);
    let threads = worker_threads
        .map(usize::from)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut pool = tokio::runtime::Builder::new_multi_thread();
        pool.worker_threads(threads);
        pool
    };
    let runtime = builder.enable_all().build()?;
    tracing::debug!(threads, "runtime started");
    runtime.block_on(role)
}

/// A failed command prints what went wrong and its causes, one per line, and exits 1: the
/// messages name what to fix, so no stack trace (which `RUST_BACKTRACE=1`, common among Rust
/// users, would otherwise print for every mistyped file name).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error}");
            // Many errors (kube's, io's wrapped in ours) already say their cause in their own
            // message; printing it again as a cause repeated one sentence up to four times.
            let mut shown = error.to_string();
            for cause in error.chain().skip(1) {
                let text = cause.to_string();
                if !shown.contains(&text) {
                    eprintln!("  caused by: {text}");
                    shown = text;
                }
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", sluice::policy::crd_yaml());
            Ok(())
        }
        Command::Serve(args) => run_async(&cli.log_format, cli.worker_threads, async { Ok(serve::run(args).await?) }),
        Command::Sidecar(args) => {
            run_async(&cli.log_format, cli.worker_threads, async { Ok(sluice::sidecar::run(args).await?) })
        }
        Command::Operator(args) => {
            run_async(&cli.log_format, cli.worker_threads, async { Ok(sluice::operator::run(args).await?) })
        }
        Command::Explain(args) => run_explain(args),
        Command::Convert(ConvertCommand::EnvoyRatelimit { file, namespace, algorithm }) => {
            let algorithm: sluice::algorithm::Algorithm = serde_json::from_value(serde_json::Value::String(algorithm))
                .context("--algorithm: expected tokenBucket, gcra, leakyBucket, fixedWindow, slidingWindowLog or slidingWindowCounter")?;
            let yaml = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let converted = sluice::convert::envoy_ratelimit(&yaml, namespace.as_deref(), algorithm)
                .with_context(|| format!("cannot convert {}", file.display()))?;
            print!("{}", sluice::convert::to_yaml(&converted)?);
            Ok(())
        }
        Command::Simulate(args) => {
            print!("{}", sluice::simulate::run(&args)?);
            Ok(())
        }
        Command::Redirect(args) => run_redirect(&args),
    }
}

/// One shot, no runtime: the rules on stdout for `kubectl logs`; on failure what failed and why
/// on stderr and in the termination message, exit code 1 (no `Error:` and no backtrace: the
/// message is the whole story).
fn run_redirect(args: &sluice::sidecar::redirect::RedirectArgs) -> anyhow::Result<()> {
    match sluice::sidecar::redirect::run(args) {
        Ok(report) => {
            print!("{report}");
            Ok(())
        }
        Err(error) => {
            let message = format!("sluice redirect: {}", sluice::sidecar::redirect::failure_message(&error));
            sluice::sidecar::redirect::write_termination_log(&message);
            eprintln!("{message}");
            std::process::exit(1)
        }
    }
}

fn run_explain(args: ExplainArgs) -> anyhow::Result<()> {
    let snapshot = match sluice::policy::load_snapshot_with_warnings(&args.policies, args.fallback_replicas) {
        Ok((snapshot, warnings)) => {
            for warning in warnings {
                eprintln!("warning: {warning}");
            }
            snapshot
        }
        Err(message) => bail!("invalid policies:\n{message}"),
    };
    let request = sluice::api::check::CheckRequest::from_json(args.request.as_bytes())
        .map_err(|e| anyhow::anyhow!("--request: {e}"))?;
    let caller = sluice::server::auth::Caller::Open;
    let view = request.view(&caller).map_err(|e| anyhow::anyhow!("--request: {e}"))?;
    let explanation = snapshot.explain(&view, args.fallback_replicas);
    // Offline there are no counters yet: a fresh store shows what a first check would decide.
    let store = sluice::store::memory::MemoryStore::new(1024);
    let verdict = store.peek_at(sluice::clock::Clock::now(&SystemClock), &explanation.checks());
    let report = explanation.report(Some(&verdict));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}
