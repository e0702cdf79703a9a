//! `ferry-holder`: holds the requests of Ferry services scaled to zero until their pods are
//! ready, refusing at once what their start-up would make late (README, "Scale to zero").

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ferry_core::hold::Bounds;
use ferry_sidecar::holder::{self, Holder, Options};

#[derive(Parser)]
#[command(name = "ferry-holder", about = "Holds the requests of Ferry services at zero until a pod is ready")]
struct Cli {
    /// The API: where services at zero send their traffic.
    #[arg(long, env = "FERRY_HOLDER_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// The operator's directions (`PUT /services/NAMESPACE/NAME`), `/metrics` and `/healthz`.
    #[arg(long, env = "FERRY_HOLDER_ADMIN_LISTEN", default_value = "0.0.0.0:9090")]
    admin_listen: SocketAddr,
    /// Requests held for one service at most.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_held: u64,
    /// Bytes of request bodies held for one service at most (also one body's limit).
    #[arg(long, default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_held_bytes: u64,
    /// Bytes of request bodies held for all services together at most (the pod's memory).
    #[arg(long, default_value_t = 256 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_held_bytes_total: u64,
    /// How often a held stream gets an SSE comment (a Gateway API duration).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    keep_alive: Duration,
    /// The bearer token the operator's directions carry (the chart's Secret); without one, any
    /// caller may direct the holder (development only).
    #[arg(long, env = "FERRY_HOLDER_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    ferry_core::duration::parse(text).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let cli = Cli::parse();
    let holder = Holder::new(Options {
        bounds: Bounds { requests: cli.max_held as usize, bytes: cli.max_held_bytes as usize },
        total_bytes: cli.max_held_bytes_total as usize,
        keep_alive: cli.keep_alive,
        token: cli.token.filter(|t| !t.is_empty()),
    });
    let (api, admin) = match (
        tokio::net::TcpListener::bind(cli.listen).await,
        tokio::net::TcpListener::bind(cli.admin_listen).await,
    ) {
        (Ok(api), Ok(admin)) => (api, admin),
        (Err(e), _) => {
            eprintln!("ferry-holder: cannot listen on {}: {e}", cli.listen);
            return ExitCode::FAILURE;
        }
        (_, Err(e)) => {
            eprintln!("ferry-holder: cannot listen on {}: {e}", cli.admin_listen);
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(api = %cli.listen, admin = %cli.admin_listen, "holding");
    let admin_server = axum::serve(admin, holder::admin(holder.clone()));
    tokio::spawn(async move { admin_server.await });
    let served = axum::serve(api, holder::api(holder)).with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    });
    match served.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-holder: {e}");
            ExitCode::FAILURE
        }
    }
}
