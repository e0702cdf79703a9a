//! `ferry-operator`: see the crate documentation and the README.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferry_operator::autoscale::plan::{self, PlanInput};
use ferry_operator::autoscale::simulate::{self, Scenario, World};
use ferry_operator::desired::Images;
use ferry_operator::lease::LeaseConfig;
use ferry_operator::run::{self, Options};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "ferry-operator", version, about = "Ferry's Kubernetes operator for InferenceServices")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the controller (the default).
    Run(RunArgs),
    /// Print the InferenceService CRD as YAML.
    Crdgen,
    /// Print the RBAC rules the operator needs, as JSON (the Helm chart grants exactly these).
    Rbac,
    /// Replicas a load needs: the arithmetic lower bound and the simulated answer.
    Plan(PlanArgs),
    /// Compare scaling policies on an arrival trace, in a deterministic simulation.
    Simulate {
        /// One scenario; all of them when left out.
        #[arg(long, value_enum)]
        scenario: Option<Scenario>,
        #[arg(long, conflicts_with = "markdown")]
        json: bool,
        /// The README's table rows.
        #[arg(long)]
        markdown: bool,
    },
}

#[derive(Debug, Parser)]
struct PlanArgs {
    /// Requests per second.
    #[arg(long)]
    rate: f64,
    /// Engine time per batch.
    #[arg(long, value_parser = ferry_core::duration::parse)]
    batch_time: Duration,
    #[arg(long)]
    max_batch_size: u32,
    #[arg(long, value_parser = ferry_core::duration::parse)]
    max_wait: Duration,
    #[arg(long, value_parser = ferry_core::duration::parse)]
    latency_budget: Duration,
    /// Workers (concurrent batches) per replica.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Share of requests that must be answered within their deadline.
    #[arg(long, default_value_t = 0.99)]
    goal: f64,
    /// Virtual seconds simulated per replica count.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Parser)]
struct RunArgs {
    /// Address of /metrics and /healthz.
    #[arg(long, env = "FERRY_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Image of the sidecar container in worker pods.
    #[arg(long, env = "FERRY_SIDECAR_IMAGE", default_value = concat!("ghcr.io/ferry-dev/ferry-sidecar:", env!("CARGO_PKG_VERSION")))]
    sidecar_image: String,
    /// Elect a leader among operator replicas through a Lease.
    #[arg(long, env = "FERRY_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the Lease.
    #[arg(long, env = "FERRY_LEASE_NAME", default_value = "ferry-operator")]
    lease_name: String,
    /// Namespace of the Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long the Lease stays held without renewal.
    #[arg(long, env = "FERRY_LEASE_DURATION", default_value = "15s", value_parser = ferry_core::duration::parse)]
    lease_duration: Duration,
    /// How long the leader keeps acting without a successful renewal (below the duration).
    #[arg(long, env = "FERRY_LEASE_RENEW_DEADLINE", default_value = "10s", value_parser = ferry_core::duration::parse)]
    lease_renew_deadline: Duration,
    /// How often the leader renews and a candidate looks.
    #[arg(long, env = "FERRY_LEASE_RETRY_PERIOD", default_value = "2s", value_parser = ferry_core::duration::parse)]
    lease_retry_period: Duration,
    /// How often the autoscaler scrapes the sidecars and decides.
    #[arg(long, env = "FERRY_SCALE_INTERVAL", default_value = "2s", value_parser = ferry_core::duration::parse)]
    scale_interval: Duration,
    /// The span over which counters become rates.
    #[arg(long, env = "FERRY_METRICS_WINDOW", default_value = "10s", value_parser = ferry_core::duration::parse)]
    metrics_window: Duration,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::Crdgen) => {
            print!("{}", ferry_operator::crdgen::crd_yaml());
            return ExitCode::SUCCESS;
        }
        Some(Command::Rbac) => {
            println!("{:#}", ferry_operator::rbac::to_json());
            return ExitCode::SUCCESS;
        }
        Some(Command::Plan(p)) => {
            let checks = [
                (p.rate > 0.0, format!("--rate is {}; it must be more than 0", p.rate)),
                (p.max_batch_size > 0, "--max-batch-size is 0; it must be at least 1".to_owned()),
                (p.workers > 0, "--workers is 0; it must be at least 1".to_owned()),
                (!p.batch_time.is_zero(), "--batch-time is 0s; it must be more than 0".to_owned()),
                ((0.0..=1.0).contains(&p.goal), format!("--goal is {}; it must be between 0 and 1", p.goal)),
            ];
            if let Some((_, message)) = checks.iter().find(|(ok, _)| !ok) {
                eprintln!("ferry-operator: {message}");
                return ExitCode::from(2);
            }
            let input = PlanInput {
                rate: p.rate,
                batch_time: p.batch_time,
                max_batch_size: p.max_batch_size,
                max_wait: p.max_wait,
                latency_budget: p.latency_budget,
                workers: p.workers,
                goal: p.goal,
                seconds: p.seconds,
                seed: 1,
            };
            let result = plan::plan(&input);
            if p.json {
                println!("{}", serde_json::to_string_pretty(&result).expect("serializable"));
            } else {
                print!("{}", plan::table(&input, &result));
            }
            return ExitCode::SUCCESS;
        }
        Some(Command::Simulate { scenario, json, markdown }) => {
            let scenarios = scenario.map_or(Scenario::ALL.to_vec(), |s| vec![s]);
            let single = scenarios.len() == 1;
            let mut all = Vec::new();
            for scenario in scenarios {
                let outcomes = simulate::compare(&World::problem_statement(), scenario);
                if json {
                    all.push(serde_json::json!({ "scenario": scenario.name(), "policies": outcomes }));
                } else if markdown {
                    print!("{}", simulate::markdown(scenario, &outcomes));
                } else {
                    print!("{}", simulate::table(scenario, &outcomes));
                }
            }
            if json {
                let out = if single { all.remove(0) } else { serde_json::Value::Array(all) };
                println!("{}", serde_json::to_string_pretty(&out).expect("serializable"));
            }
            return ExitCode::SUCCESS;
        }
        Some(Command::Run(args)) => args,
        None => RunArgs::parse_from(["ferry-operator"]),
    };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let identity = args.identity.clone().unwrap_or_else(|| {
        std::env::var("HOSTNAME").unwrap_or_else(|_| format!("ferry-operator-{}", std::process::id()))
    });
    let options = Options {
        listen: args.listen,
        images: Images { sidecar: args.sidecar_image },
        scale_interval: args.scale_interval,
        metrics_window: args.metrics_window,
        lease: args.leader_elect.then(|| {
            (
                args.lease_namespace.clone(),
                LeaseConfig {
                    name: args.lease_name.clone(),
                    identity,
                    duration: args.lease_duration,
                    renew_deadline: args.lease_renew_deadline,
                    retry: args.lease_retry_period,
                },
            )
        }),
    };
    if let Some(Err(e)) = options.lease.as_ref().map(|(_, config)| config.check()) {
        tracing::error!("{e}");
        return ExitCode::FAILURE;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(run::run(options, run::shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
