//! `ferry-sidecar`: see the crate documentation and the README.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use ferry_sidecar::config::{Cli, Settings};
use ferry_sidecar::server::{self, Listeners};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let settings = match Settings::resolve(Cli::parse()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("ferry-sidecar: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Before the runtime starts any thread (see the function).
    if !ferry_sidecar::heap::keep_freed_memory() && cfg!(all(target_os = "linux", target_env = "gnu")) {
        tracing::warn!(
            mmap_threshold = ferry_sidecar::heap::MMAP_THRESHOLD,
            trim_threshold = ferry_sidecar::heap::TRIM_THRESHOLD,
            "glibc refused mallopt's thresholds: each step's buffers are faulted in afresh"
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ferry-sidecar: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-sidecar: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(settings: Settings) -> anyhow::Result<()> {
    let listeners = Listeners::bind(&settings).await?;
    let (api, admin) = listeners.addresses()?;
    // One line on stdout that scripts and tests read to learn the ports (useful with port 0).
    println!("ferry-sidecar listening on http://{api} (metrics on http://{admin})");
    std::io::stdout().flush()?;
    tracing::info!(
        model = %settings.model,
        version = %settings.version,
        max_batch_size = settings.max_batch_size,
        max_wait = ?settings.max_wait,
        latency_budget = ?settings.latency_budget,
        workers = settings.workers,
        "serving"
    );
    server::serve(settings, listeners, server::shutdown_signal()).await?;
    tracing::info!("drained; exiting");
    Ok(())
}
