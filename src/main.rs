use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use sluice::clock::SystemClock;
use sluice::role::{self, store::StoreArgs};
use sluice::server::auth::{Auth, AuthArgs, Authenticator};
use sluice::server::{http, rls, serve};
use sluice::telemetry::Metrics;
use tokio::sync::watch;

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
    Serve(ServeArgs),
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
    Redirect(sluice::redirect::RedirectArgs),
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
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Policy files or directories (their *.yaml and *.yml files); multi-document YAML.
    #[arg(long = "policies", short = 'p', required = true, num_args = 1.., env = "SLUICE_POLICIES", value_delimiter = ',')]
    policies: Vec<PathBuf>,
    /// Start, and reload, even when the policies hold no RateLimitPolicy document (every
    /// request is then allowed). Without it an empty set refuses to start, and a reload that
    /// leaves none keeps the last good snapshot: a mistyped path must not look like a limiter.
    #[arg(long, env = "SLUICE_ALLOW_EMPTY")]
    allow_empty: bool,
    /// Address of the check API.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080", value_parser = sluice::listen::parse_listen_address)]
    listen: SocketAddr,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    auth: AuthArgs,
    #[command(flatten)]
    grpc: sluice::server::rls::GrpcArgs,
    /// PEM certificate chain to serve the check API over HTTPS (with --tls-key); plain HTTP
    /// without it.
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// How often policy and token files are checked for changes.
    #[arg(long, env = "SLUICE_RELOAD_INTERVAL", default_value = "250ms", value_parser = sluice::duration::parse_positive_std_duration)]
    reload_interval: Duration,
    #[command(flatten)]
    listen_limits: sluice::listen::ListenArgs,
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
        Command::Serve(args) => run_async(&cli.log_format, cli.worker_threads, run_serve(args)),
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
fn run_redirect(args: &sluice::redirect::RedirectArgs) -> anyhow::Result<()> {
    match sluice::redirect::run(args) {
        Ok(report) => {
            print!("{report}");
            Ok(())
        }
        Err(error) => {
            let message = format!("sluice redirect: {}", sluice::redirect::failure_message(&error));
            sluice::redirect::write_termination_log(&message);
            eprintln!("{message}");
            std::process::exit(1)
        }
    }
}

fn run_explain(args: ExplainArgs) -> anyhow::Result<()> {
    let snapshot = match sluice::policy::load_snapshot_with_warnings(&args.policies) {
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
    let explanation = snapshot.explain(&view);
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

async fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let paths = args.policies.clone();
    // The fingerprint read before the load is the watcher's baseline: an edit made while the
    // process starts is then seen as a change, not taken for what was loaded.
    let (baseline, loaded) =
        tokio::task::spawn_blocking(move || (serve::fingerprint(&paths), sluice::policy::load_snapshot(&paths)))
            .await?;
    let snapshot = match loaded {
        Ok(snapshot) => snapshot,
        Err(message) => bail!("cannot start: invalid policies:\n{message}"),
    };
    if snapshot.policies().is_empty() && !args.allow_empty {
        bail!("cannot start: {}", serve::empty_policy_set(&args.policies));
    }
    let tokens = args.auth.static_tokens().context("cannot start")?;
    if args.grpc.grpc_tls && args.tls_cert.is_none() {
        bail!("cannot start: --grpc-tls serves the certificate of --tls-cert and --tls-key, which are not given");
    }
    // One process-wide rustls provider before the first TLS configuration (ring, as elsewhere).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
                .await
                .with_context(|| format!("cannot load --tls-cert {} / --tls-key {}", cert.display(), key.display()))?,
        ),
        _ => None,
    };
    let metrics = Arc::new(Metrics::new());
    let clock = Arc::new(SystemClock);
    let (engine, memory) = role::engine(&args.store, clock, metrics).await.context("cannot set up the store")?;
    let store = sluice::store::Store::status(engine.store());
    tracing::info!(
        kind = store.kind,
        endpoint = store.endpoint.as_deref().unwrap_or("this process"),
        breaker = store.breaker.unwrap_or("none"),
        timeout_ms = store.timeout_ms,
        "store set up"
    );
    tracing::info!(version = snapshot.version(), rules = snapshot.rule_count(), "policies loaded");
    engine.install(Arc::new(snapshot));

    // Register for SIGTERM before announcing the address: a signal future only installs its
    // handler when first polled, and a supervisor may signal as soon as it sees the address.
    let mut terminated = std::pin::pin!(role::termination_signal());
    let _ = futures::poll!(&mut terminated);
    // The gRPC listener first: whoever waits for the check API's address finds both open.
    let grpc_listener = match args.grpc.grpc_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --grpc-listen {addr}"))?;
            tracing::info!(grpc = %listener.local_addr()?, tls = args.grpc.grpc_tls, "rate limit service (gRPC) listening");
            Some(listener)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let address = listener.local_addr()?;
    tracing::info!(%address, tls = tls.is_some(), "check API listening");
    match &tokens {
        Some(tokens) => {
            tracing::info!(path = %tokens.path().display(), tokens = tokens.table().len(), "authentication on")
        }
        None if !address.ip().is_loopback() => tracing::warn!(
            %address,
            "authentication is off on a non-loopback address: anyone who can connect may spend or block any \
             namespace's limits; start with --tokens FILE (docs/security.md)"
        ),
        None => {}
    }

    let (stop, stopped) = watch::channel(false);
    let watcher = tokio::spawn(serve::watch_policies(
        engine.clone(),
        args.policies,
        baseline,
        args.reload_interval,
        args.allow_empty,
        stopped.clone(),
    ));
    let token_watcher = tokens.clone().map(|t| tokio::spawn(t.watch(args.reload_interval, stopped.clone())));
    let sweeper = tokio::spawn(role::sweep_memory(memory, stopped.clone()));
    tokio::spawn(role::follow_lease_keys(args.store.clone(), engine.clone(), stopped.clone()));
    let lease_keeper = tokio::spawn(engine.clone().keep_leases(stopped.clone()));
    let verifiers: Vec<Arc<dyn Authenticator>> = tokens.into_iter().map(|t| t as Arc<dyn Authenticator>).collect();
    let auth = Auth::new(verifiers);
    let grpc_server = grpc_listener.map(|listener| {
        let limiter = rls::RateLimiter::from_args(engine.clone(), auth.clone(), &args.grpc);
        let tls = if args.grpc.grpc_tls { tls.clone() } else { None };
        let (grpc, stopped) = (args.grpc.clone(), stopped.clone());
        tokio::spawn(async move { rls::serve_grpc(listener, limiter, &grpc, tls, stopped).await })
    });
    let state = http::ApiState { engine: engine.clone(), auth, gateway_trusted_hops: args.auth.gateway_trusted_hops };
    let router = http::router_with(state);
    let server = match tls {
        Some(tls) => tokio::spawn(serve::serve_https(listener, router, tls, args.listen_limits.limits(), stopped)),
        None => tokio::spawn(serve::serve_http(listener, router, args.listen_limits.limits(), stopped)),
    };

    terminated.await;
    tracing::info!("shutting down: draining in-flight requests");
    let _ = stop.send(true);
    engine.stop_snapshot_waits();
    server.await?.context("HTTP server failed")?;
    if let Some(grpc_server) = grpc_server {
        grpc_server.await?.context("gRPC server failed")?;
    }
    let _ = tokio::join!(watcher, sweeper, lease_keeper);
    if let Some(token_watcher) = token_watcher {
        let _ = token_watcher.await;
    }
    Ok(())
}
