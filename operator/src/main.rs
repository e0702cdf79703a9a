//! `ferry-operator`: see the crate documentation and the README.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferry_core::generation::capacity::{Limits, Targets};
use ferry_core::generation::step::StepCost;
use ferry_operator::autoscale::generation_plan::{self, GenerationPlanInput};
use ferry_operator::autoscale::generation_simulate;
use ferry_operator::autoscale::plan::{self, PlanInput};
use ferry_operator::autoscale::simulate::{self, Scenario, World};
use ferry_operator::autoscale::zero_simulate;
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
    /// Write the Grafana dashboards and the alerting rules (the chart's monitoring/ files).
    Monitoring {
        /// The folder to write them to.
        #[arg(long, default_value = ferry_operator::monitoring::DIR)]
        out: std::path::PathBuf,
    },
    /// Replicas a load needs: the arithmetic lower bound and the simulated answer.
    Plan(PlanArgs),
    /// Pods a generation (LLM) load needs: one pod's capacity, the arithmetic, the simulated answer.
    PlanGeneration(PlanGenerationArgs),
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
    /// Compare scaling policies for a generation (LLM) service whose pods take minutes to start,
    /// in a deterministic simulation.
    SimulateGeneration {
        /// One scenario; all of them when left out.
        #[arg(long, value_enum)]
        scenario: Option<Scenario>,
        /// From asking for a pod to its serving; 60s, 180s and 300s when left out.
        #[arg(long, value_parser = ferry_core::duration::parse)]
        startup: Option<Duration>,
        /// Ferry's spec.scaling.warmReplicas (examples/generation.yaml's: 1).
        #[arg(long, default_value_t = 1)]
        warm_replicas: u32,
        /// Ferry's spec.scaling.scaleDownDelay (the default: 5m).
        #[arg(long, default_value = "5m", value_parser = ferry_core::duration::parse)]
        scale_down_delay: Duration,
        #[arg(long, conflicts_with = "markdown")]
        json: bool,
        /// The README's table rows.
        #[arg(long)]
        markdown: bool,
    },
    /// Scale to zero over two days of office hours, against minReplicas 1, in a deterministic
    /// simulation.
    SimulateZero {
        #[arg(long, conflicts_with = "markdown")]
        json: bool,
        /// The README's table rows.
        #[arg(long)]
        markdown: bool,
    },
}

#[derive(Debug, Parser)]
struct PlanGenerationArgs {
    /// Requests per second across the service.
    #[arg(long, required_unless_present = "users", conflicts_with = "users")]
    rate: Option<f64>,
    /// Users streaming at once, each reading --tokens-per-second: the rate that keeps them going.
    #[arg(long)]
    users: Option<f64>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 100)]
    prompt_tokens: u32,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 256)]
    output_tokens: u32,
    /// The first token's deadline.
    #[arg(long, default_value = "1s", value_parser = ferry_core::duration::parse)]
    ttft: Duration,
    /// Tokens a second each user reads: the inter-token target is its inverse.
    #[arg(long, default_value_t = 10.0)]
    tokens_per_second: f64,
    /// The whole answer's deadline [default: --ttft + --output-tokens / --tokens-per-second].
    #[arg(long, value_parser = ferry_core::duration::parse)]
    timeout: Option<Duration>,
    /// The step cost: fixed, per decoding sequence, per prompt token, per attended query-key pair
    /// (the sim-llm engine's defaults, or what `ferry_step_cost_seconds` says of a real engine).
    #[arg(long, default_value = "10ms", value_parser = ferry_core::duration::parse_fine)]
    step_time: Duration,
    #[arg(long, default_value = "200us", value_parser = ferry_core::duration::parse_fine)]
    decode_per_seq: Duration,
    #[arg(long, default_value = "50us", value_parser = ferry_core::duration::parse_fine)]
    prefill_per_token: Duration,
    #[arg(long, default_value = "0s", value_parser = ferry_core::duration::parse_fine)]
    attention_per_slot: Duration,
    /// A pod's limits (spec.generation: maxSequences, maxBatchTokens, kvBlocks, kvBlockSize).
    #[arg(long, default_value_t = 64)]
    max_sequences: u32,
    #[arg(long, default_value_t = 2048)]
    max_batch_tokens: u32,
    #[arg(long, default_value_t = 4096)]
    kv_blocks: u32,
    #[arg(long, default_value_t = 16)]
    kv_block_size: u32,
    #[command(flatten)]
    check: Check,
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
    #[command(flatten)]
    check: Check,
}

/// What both planners share: the simulated check's goal and length, and the output's form.
#[derive(Debug, clap::Args)]
struct Check {
    /// Share of requests that must keep their deadlines (all three, for generation).
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
    /// The label selector of the holder's pods (`ferry-holder`, installed by the chart), which
    /// hold the requests of services at zero; empty: no holder (no service goes to zero).
    #[arg(
        long,
        env = "FERRY_HOLDER_SELECTOR",
        default_value = "app.kubernetes.io/name=ferry,app.kubernetes.io/component=holder"
    )]
    holder_selector: String,
    /// The bearer token of the holder's directions (the chart's Secret).
    #[arg(long, env = "FERRY_HOLDER_TOKEN", hide_env_values = true)]
    holder_token: Option<String>,
    /// Watch the InferencePools of routed services, so that one changed or deleted by anyone
    /// else is put back at once rather than at the next periodic reconcile (5 minutes). Needs the
    /// Inference Extension's CRD installed and the RBAC the chart grants with
    /// `routing.inferencePools` (which sets this).
    #[arg(long, env = "FERRY_WATCH_INFERENCE_POOLS", default_value_t = false, action = clap::ArgAction::Set)]
    watch_inference_pools: bool,
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
        Some(Command::Monitoring { out }) => {
            for (name, text) in ferry_operator::monitoring::files() {
                let path = out.join(name);
                if let Err(e) = std::fs::create_dir_all(&out).and_then(|()| std::fs::write(&path, text)) {
                    eprintln!("ferry-operator monitoring: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            return ExitCode::SUCCESS;
        }
        Some(Command::Plan(p)) => {
            let checks = [
                (p.rate > 0.0, format!("--rate is {}; it must be more than 0", p.rate)),
                (p.max_batch_size > 0, "--max-batch-size is 0; it must be at least 1".to_owned()),
                (p.workers > 0, "--workers is 0; it must be at least 1".to_owned()),
                (!p.batch_time.is_zero(), "--batch-time is 0s; it must be more than 0".to_owned()),
                (
                    (0.0..=1.0).contains(&p.check.goal),
                    format!("--goal is {}; it must be between 0 and 1", p.check.goal),
                ),
            ];
            if let Some(refused) = refuse(&checks) {
                return refused;
            }
            let input = PlanInput {
                rate: p.rate,
                batch_time: p.batch_time,
                max_batch_size: p.max_batch_size,
                max_wait: p.max_wait,
                latency_budget: p.latency_budget,
                workers: p.workers,
                goal: p.check.goal,
                seconds: p.check.seconds,
                seed: 1,
            };
            let result = plan::plan(&input);
            return print_plan(p.check.json, &result, || plan::table(&input, &result));
        }
        Some(Command::PlanGeneration(p)) => return plan_generation(&p),
        Some(Command::Simulate { scenario, json, markdown }) => {
            let runs = scenario.map_or(Scenario::ALL.to_vec(), |s| vec![s]).into_iter().map(|scenario| {
                let outcomes = simulate::compare(&World::problem_statement(), scenario);
                Run {
                    json: serde_json::json!({ "scenario": scenario.name(), "policies": outcomes }),
                    markdown: simulate::markdown(scenario, &outcomes),
                    table: simulate::table(scenario, &outcomes),
                }
            });
            return print_runs(runs, json, markdown);
        }
        Some(Command::SimulateGeneration { scenario, startup, warm_replicas, scale_down_delay, json, markdown }) => {
            if startup.is_some_and(|s| s.is_zero()) {
                return refuse(&[(false, "--startup is 0s; it must be more than 0".to_owned())]).expect("refused");
            }
            let startups = startup.map_or(generation_simulate::STARTUPS.to_vec(), |s| vec![s]);
            let scenarios = scenario.map_or(Scenario::ALL.to_vec(), |s| vec![s]);
            let runs = scenarios.into_iter().flat_map(|scenario| {
                startups.clone().into_iter().map(move |startup| {
                    let mut world = generation_simulate::World::example(startup);
                    world.target.warm_replicas = warm_replicas;
                    world.target.scale_down_delay = scale_down_delay;
                    let outcomes = generation_simulate::compare(&world, scenario);
                    Run {
                        json: serde_json::json!({
                            "scenario": scenario.name(),
                            "startup_seconds": startup.as_secs(),
                            "policies": outcomes,
                        }),
                        markdown: generation_simulate::markdown(scenario, &outcomes),
                        table: generation_simulate::table(scenario, &outcomes),
                    }
                })
            });
            return print_runs(runs, json, markdown);
        }
        Some(Command::SimulateZero { json, markdown }) => {
            let outcomes = zero_simulate::compare(&zero_simulate::World::office());
            let run = Run {
                json: serde_json::json!({ "scenario": "office", "policies": outcomes }),
                markdown: zero_simulate::markdown(&outcomes),
                table: zero_simulate::table(&outcomes),
            };
            return print_runs(std::iter::once(run), json, markdown);
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
        holder_selector: Some(args.holder_selector.clone()).filter(|s| !s.is_empty()),
        holder_token: args.holder_token.clone().filter(|t| !t.is_empty()),
        watch_inference_pools: args.watch_inference_pools,
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

/// `ferry-operator plan-generation`: checks the arguments (each error names the flag, its value and
/// the limit), then prints the plan.
fn plan_generation(p: &PlanGenerationArgs) -> ExitCode {
    let rate = p.rate.unwrap_or_else(|| {
        generation_plan::rate_for_users(p.users.unwrap_or(0.0), p.output_tokens, p.tokens_per_second)
    });
    let checks = [
        (p.rate.is_none_or(|r| r > 0.0), format!("--rate is {}; it must be more than 0", p.rate.unwrap_or(0.0))),
        (p.users.is_none_or(|u| u > 0.0), format!("--users is {}; it must be more than 0", p.users.unwrap_or(0.0))),
        (p.tokens_per_second > 0.0, format!("--tokens-per-second is {}; it must be more than 0", p.tokens_per_second)),
        (p.output_tokens > 0, "--output-tokens is 0; it must be at least 1".to_owned()),
        (p.prompt_tokens > 0, "--prompt-tokens is 0; it must be at least 1".to_owned()),
        (!p.ttft.is_zero(), "--ttft is 0s; it must be more than 0".to_owned()),
        (p.max_sequences > 0, "--max-sequences is 0; it must be at least 1".to_owned()),
        (p.kv_block_size > 0, "--kv-block-size is 0; it must be at least 1".to_owned()),
        (
            p.kv_blocks >= 2,
            format!("--kv-blocks is {}; it must be at least 2 (one is kept free for the decodes)", p.kv_blocks),
        ),
        (
            p.max_batch_tokens > p.max_sequences,
            format!(
                "--max-batch-tokens is {}; it must be more than --max-sequences ({}), so that prompts have room beside the decodes",
                p.max_batch_tokens, p.max_sequences
            ),
        ),
        ((0.0..=1.0).contains(&p.check.goal), format!("--goal is {}; it must be between 0 and 1", p.check.goal)),
        (p.check.seconds >= 10, format!("--seconds is {}; it must be at least 10", p.check.seconds)),
    ];
    if let Some(refused) = refuse(&checks) {
        return refused;
    }
    let itl = Duration::from_secs_f64(1.0 / p.tokens_per_second);
    let input = GenerationPlanInput {
        rate,
        prompt: p.prompt_tokens,
        output: p.output_tokens,
        targets: Targets {
            ttft: p.ttft,
            itl,
            timeout: p.timeout.unwrap_or(p.ttft + itl * p.output_tokens),
            // The sidecar's deadline margin floor (--deadline-margin).
            margin: Duration::from_millis(2),
        },
        cost: StepCost {
            fixed: p.step_time,
            per_decode: p.decode_per_seq,
            per_prefill_token: p.prefill_per_token,
            per_context_token: Duration::ZERO,
            per_attended_slot: p.attention_per_slot,
        },
        limits: Limits {
            blocks: p.kv_blocks,
            block_size: p.kv_block_size,
            watermark: ferry_core::generation::kv::watermark(p.kv_blocks),
            max_sequences: p.max_sequences,
            max_batch_tokens: p.max_batch_tokens,
        },
        goal: p.check.goal,
        seconds: p.check.seconds,
        seed: 1,
    };
    let result = generation_plan::plan(&input);
    print_plan(p.check.json, &result, || generation_plan::table(&input, &result))
}

/// One simulated run, in each of the forms `simulate` prints.
struct Run {
    json: serde_json::Value,
    markdown: String,
    table: String,
}

/// Prints each run as it is done (tables and rows), or all of them as one JSON document (a
/// single run's object alone).
fn print_runs(runs: impl Iterator<Item = Run>, json: bool, markdown: bool) -> ExitCode {
    let mut all = Vec::new();
    for run in runs {
        if json {
            all.push(run.json);
        } else if markdown {
            print!("{}", run.markdown);
        } else {
            print!("{}", run.table);
        }
    }
    if json {
        let out = if all.len() == 1 { all.remove(0) } else { serde_json::Value::Array(all) };
        println!("{}", serde_json::to_string_pretty(&out).expect("serializable"));
    }
    ExitCode::SUCCESS
}

/// The first failed check's message (it names the flag, its value and the limit), on stderr, and
/// the exit code of a usage error.
fn refuse(checks: &[(bool, String)]) -> Option<ExitCode> {
    let (_, message) = checks.iter().find(|(ok, _)| !ok)?;
    eprintln!("ferry-operator: {message}");
    Some(ExitCode::from(2))
}

/// A plan as JSON, or as its table for people.
fn print_plan(json: bool, plan: &impl serde::Serialize, table: impl FnOnce() -> String) -> ExitCode {
    if json {
        println!("{}", serde_json::to_string_pretty(plan).expect("serializable"));
    } else {
        print!("{}", table());
    }
    ExitCode::SUCCESS
}
