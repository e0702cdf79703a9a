//! `ferry-load`: see the crate documentation and the README.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferry_core::duration;
use ferry_load::bench::{self, BenchOptions};
use ferry_load::record::Summary;
use ferry_load::run::{self, LoadSpec};
use ferry_load::schedule::Arrivals;
use ferry_load::{dashboard, echo, plot, report};

#[derive(Debug, Parser)]
#[command(name = "ferry-load", version, about = "Open-loop load generator and benchmarks for Ferry")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Send an open-loop load to an infer endpoint and summarise it.
    Run(RunArgs),
    /// Send an open-loop load of streamed completions to an OpenAI-compatible server.
    Generate(GenerateArgs),
    /// Serve a bare hyper echo server (the floor of the overhead benchmark).
    Echo {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// Draw a Grafana dashboard as an SVG from a Prometheus server's answers to its queries.
    Dashboard {
        /// The Prometheus server, e.g. http://127.0.0.1:9090
        #[arg(long)]
        prometheus: String,
        /// The dashboard's JSON (charts/ferry/monitoring/*.json).
        #[arg(long)]
        dashboard: PathBuf,
        /// The time range drawn, up to now.
        #[arg(long, default_value = "10m", value_parser = duration::parse)]
        range: Duration,
        /// What `$__rate_interval` stands for.
        #[arg(long, default_value = "1m")]
        rate_interval: String,
        /// A variable's value, `name=regex` (repeatable); the others are "All".
        #[arg(long = "var")]
        vars: Vec<String>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run the benchmark suite against real sidecar processes and write BENCHMARKS.md.
    Bench {
        #[arg(long, default_value = "BENCHMARKS.md")]
        out: PathBuf,
        /// Seconds of each open-loop run.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Run only the generation section and print it (BENCHMARKS.md is left as it is).
        #[arg(long)]
        generation_only: bool,
        /// Run only the built-in decoder's section (7) and print it.
        #[arg(long)]
        decoder_only: bool,
        /// Run only section 7's prefix-cache rows and print them.
        #[arg(long)]
        prefix_cache_only: bool,
        /// Run only section 7's structured output rows and print them.
        #[arg(long)]
        structured_only: bool,
    },
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    /// The completions endpoint, e.g. http://127.0.0.1:8080/v1/completions
    #[arg(long)]
    url: String,
    #[arg(long)]
    model: String,
    /// Requests per second (Poisson).
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    #[arg(long, default_value = "30s", value_parser = duration::parse)]
    duration: Duration,
    /// Prompt words, uniformly between the two.
    #[arg(long, num_args = 2, default_values_t = [32, 512])]
    prompt: Vec<u32>,
    /// max_tokens, uniformly between the two.
    #[arg(long, num_args = 2, default_values_t = [16, 256])]
    output: Vec<u32>,
    /// Time to first token each request is judged against.
    #[arg(long, default_value = "1s", value_parser = duration::parse)]
    ttft: Duration,
    /// Time per output token: the inter-token target, and the completion deadline's slope
    /// (deadline = ttft + max_tokens × tpot).
    #[arg(long, default_value = "100ms", value_parser = duration::parse)]
    tpot: Duration,
    /// Do not send the deadlines as x-ferry-* headers.
    #[arg(long)]
    no_deadline_headers: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The infer endpoint, e.g. http://127.0.0.1:8080/v2/models/quickstart/infer
    #[arg(long)]
    url: String,
    /// Requests per second.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    #[arg(long, default_value = "10s", value_parser = duration::parse)]
    duration: Duration,
    #[arg(long, value_enum, default_value_t = Arrivals::Poisson)]
    arrivals: Arrivals,
    /// The deadline each request is judged against.
    #[arg(long, default_value = "200ms", value_parser = duration::parse)]
    deadline: Duration,
    /// Send the deadline as x-ferry-timeout-ms (otherwise the service's budget applies).
    #[arg(long)]
    send_deadline: bool,
    /// Rows per request, and FP32 elements per row.
    #[arg(long, default_value_t = 1)]
    rows: u32,
    #[arg(long, default_value_t = 4)]
    width: u32,
    /// Share of requests sent with x-ferry-priority: batch.
    #[arg(long, default_value_t = 0.0)]
    batch_share: f64,
    /// A tenants file (the sidecar's format; `name` and `token` are read): each request is sent
    /// by one of its tenants, with its bearer token, and the report gives each tenant's figures.
    #[arg(long)]
    tenants: Option<PathBuf>,
    /// Shares of the requests by tenant, `heavy=10,light=1` (a tenant not named: 1).
    #[arg(long, requires = "tenants")]
    tenant_shares: Option<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// The service's maxBatchSize, to report batch fill.
    #[arg(long)]
    max_batch_size: Option<u32>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Write an SVG of latency and rate over time.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => load(args).await,
            Command::Generate(args) => generate(args).await,
            Command::Echo { listen } => {
                let listener = tokio::net::TcpListener::bind(listen).await?;
                println!("ferry-load echo listening on http://{}", listener.local_addr()?);
                echo::serve(listener).await?;
                Ok(())
            }
            Command::Dashboard { prometheus, dashboard, range, rate_interval, vars, out } => {
                let board: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&dashboard)?)?;
                let vars = vars
                    .iter()
                    .map(|v| {
                        v.split_once('=')
                            .map(|(k, v)| (k.to_owned(), v.to_owned()))
                            .ok_or_else(|| anyhow::anyhow!("--var {v}: expected name=regex"))
                    })
                    .collect::<anyhow::Result<_>>()?;
                let panels = dashboard::panels(&board)?;
                let panels = dashboard::fetch(&prometheus, panels, range, &rate_interval, &vars).await?;
                dashboard::draw(board["title"].as_str().unwrap_or("dashboard"), &panels, range, &out)?;
                eprintln!("wrote {}", out.display());
                Ok(())
            }
            Command::Bench { out, seconds, generation_only, decoder_only, prefix_cache_only, structured_only } => {
                let options = BenchOptions {
                    out: out.clone(),
                    seconds,
                    generation_only,
                    decoder_only,
                    prefix_cache_only,
                    structured_only,
                };
                let md = bench::run(&options).await?;
                println!("{md}");
                if !generation_only && !decoder_only && !prefix_cache_only && !structured_only {
                    eprintln!("wrote {}", out.display());
                }
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-load: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn load(args: RunArgs) -> anyhow::Result<()> {
    let spec = LoadSpec {
        url: args.url,
        rate: args.rate,
        duration: args.duration,
        arrivals: args.arrivals,
        deadline: args.deadline,
        send_deadline: args.send_deadline,
        rows: args.rows,
        width: args.width,
        batch_share: args.batch_share,
        tenants: match &args.tenants {
            Some(path) => ferry_load::tenants::load(path, args.tenant_shares.as_deref())?,
            None => Vec::new(),
        },
        seed: args.seed,
        connections: args.connections,
        drain: Duration::from_secs(30),
    };
    anyhow::ensure!(spec.rate > 0.0, "--rate is {}; it must be more than 0", spec.rate);
    let samples = run::run(&spec, !args.json).await?;
    let summary = Summary::of(&samples, spec.duration, args.max_batch_size);
    let by_tenant: Vec<(String, Summary)> = spec
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mine: Vec<_> = samples.iter().filter(|s| s.tenant == Some(i)).cloned().collect();
            (t.name.clone(), Summary::of(&mine, spec.duration, args.max_batch_size))
        })
        .collect();
    if args.json && by_tenant.is_empty() {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else if args.json {
        let tenants: serde_json::Map<String, serde_json::Value> = by_tenant
            .iter()
            .map(|(n, s)| Ok((n.clone(), serde_json::to_value(s)?)))
            .collect::<serde_json::Result<_>>()?;
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"all": summary, "tenants": tenants}))?);
    } else {
        print!("{}", report::table(&summary));
        if !by_tenant.is_empty() {
            print!("{}", report::tenants(&by_tenant));
        }
    }
    if let Some(path) = args.plot {
        plot::svg(&summary, spec.rate, "ferry-load", &path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    use ferry_load::generation::{stream, summary, trace};
    anyhow::ensure!(args.rate > 0.0, "--rate is {}; it must be more than 0", args.rate);
    let range = |v: &[u32], flag: &str| -> anyhow::Result<(u32, u32)> {
        anyhow::ensure!(
            v[0] >= 1 && v[0] <= v[1],
            "--{flag} is {} {}; it must be two numbers, 1 <= low <= high",
            v[0],
            v[1]
        );
        Ok((v[0], v[1]))
    };
    let shape = trace::Shape {
        rate: args.rate,
        duration: args.duration,
        prompt: range(&args.prompt, "prompt")?,
        output: range(&args.output, "output")?,
        ttft: args.ttft,
        tpot: args.tpot,
        seed: args.seed,
    };
    let target =
        stream::Target { url: args.url, model: args.model, send_deadlines: !args.no_deadline_headers, salt: None };
    let samples = stream::run(&target, &trace::trace(&shape), Duration::from_secs(60)).await?;
    let s = summary::Summary::of(&samples, shape.duration);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!("| requests | {} |\n|---|---|", s.sent);
        for (name, value) in summary::HEADER.split(" | ").zip(summary::cells(&s).split(" | ")) {
            println!("| {name} | {value} |");
        }
    }
    Ok(())
}
