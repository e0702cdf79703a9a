//! `ferry-embed`: the embedding engine's model outside the server, for checks and benchmarks.
//!
//! - `ferry-embed embed --model DIR [--device D] TEXT...`: prints `{"device", "embeddings"}` as JSON.
//! - `ferry-embed bench --model DIR [--device D] --batch 1,8,32`: embeddings per second per batch
//!   size (median of rounds), as JSON lines.
//! - `ferry-embed compare --model DIR --device cuda --batch 1,2,4,...,256`: the GPU's embeddings
//!   against the CPU's (least cosine), and the time of each batch size on both.
//! - `ferry-embed kernels` (`cuda` builds): compiles the GPU kernels with NVRTC and lists their
//!   entry points, a check that needs NVRTC but no GPU.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferry_sidecar::embed::{Device, Model, Overflow};
use serde_json::json;

#[derive(Parser)]
#[command(name = "ferry-embed", about = "Runs the embedding engine's model outside the server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// The model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long, env = "FERRY_MODEL_SOURCE")]
    model: PathBuf,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: Device,
}

#[derive(Subcommand)]
enum Command {
    /// Embeds the given texts.
    Embed {
        #[command(flatten)]
        model: ModelArgs,
        texts: Vec<String>,
    },
    /// Embeddings per second at each batch size.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Batch sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
        batch: Vec<usize>,
        /// Timed rounds per batch size; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Least time per round.
        #[arg(long, default_value = "1s", value_parser = ferry_core::duration::parse)]
        round_time: Duration,
        /// Texts to embed, one per line, cycled to fill each batch [default: eight built-in
        /// sentences of 4 to 60 tokens].
        #[arg(long)]
        texts: Option<PathBuf>,
    },
    /// Compares a device's embeddings and times with the CPU's.
    Compare {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256")]
        batch: Vec<usize>,
        /// The least cosine similarity accepted between the device's and the CPU's embeddings.
        #[arg(long, default_value_t = 0.999)]
        min_cosine: f64,
    },
    /// Compiles the GPU kernels with NVRTC (no GPU needed) and lists their entry points.
    Kernels,
}

fn parse_device(text: &str) -> Result<Device, String> {
    Device::parse(text).ok_or_else(|| format!("'{text}' is not auto, cpu, cuda or cuda:N"))
}

/// Sentences of mixed lengths (4 to ~60 tokens), cycled to fill a batch.
const SENTENCES: [&str; 8] = [
    "A man is eating food.",
    "The new movie is awesome and everybody in the theatre clapped when the credits rolled.",
    "Deadlines shape batching: a batch leaves when it is full, when its oldest request has waited long enough, or when waiting longer would break a promise.",
    "Kubernetes schedules GPU pods.",
    "The cat sits outside.",
    "Sentence embeddings map text to vectors whose cosine similarity tracks meaning, which makes them useful for search, clustering and deduplication of documents at scale.",
    "Il pleut à Paris aujourd'hui.",
    "Two dogs play in the snow near a frozen lake while their owners drink hot chocolate.",
];

fn texts(n: usize) -> Vec<&'static str> {
    cycle(&SENTENCES, n)
}

fn cycle<'a>(pool: &[&'a str], n: usize) -> Vec<&'a str> {
    pool.iter().copied().cycle().take(n).collect()
}

fn main() -> ExitCode {
    // The heap as the sidecar keeps it (before any thread), so that `bench` times what it serves.
    let kept = ferry_sidecar::heap::keep_freed_memory();
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    if !kept && cfg!(all(target_os = "linux", target_env = "gnu")) {
        tracing::warn!("glibc refused mallopt's thresholds: timings are not the sidecar's");
    }
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry-embed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load(args: &ModelArgs, device: Device) -> Result<Model, String> {
    Model::load(&args.model, device, Overflow::Truncate).map_err(|e| e.to_string())
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Embed { model, texts } => {
            let m = load(&model, model.device)?;
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let flat = m.embed_texts(&refs)?;
            let rows: Vec<&[f32]> = flat.chunks(m.dim()).collect();
            println!("{}", json!({ "device": m.device().to_string(), "embeddings": rows }));
        }
        Command::Bench { model, batch, rounds, round_time, texts } => {
            let m = load(&model, model.device)?;
            let owned = match texts {
                Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?,
                None => SENTENCES.join("\n"),
            };
            let pool: Vec<&str> = owned.lines().filter(|l| !l.is_empty()).collect();
            if pool.is_empty() {
                return Err("--texts has no lines".into());
            }
            for &b in &batch {
                let per_second = bench(&m, &cycle(&pool, b), rounds, round_time)?;
                println!(
                    "{}",
                    json!({ "engine": "ferry", "device": m.device().to_string(), "batch": b, "embeddings_per_second": per_second })
                );
            }
        }
        Command::Compare { model, batch, min_cosine } => {
            let device = load(&model, model.device)?;
            let cpu = load(&model, Device::Cpu)?;
            let mut worst = f64::INFINITY;
            for &b in &batch {
                let t = texts(b);
                let (a, c) = (device.embed_texts(&t)?, cpu.embed_texts(&t)?);
                let least = a
                    .chunks(device.dim())
                    .zip(c.chunks(cpu.dim()))
                    .map(|(x, y)| cosine(x, y))
                    .fold(f64::INFINITY, f64::min);
                worst = worst.min(least);
                let time =
                    |m: &Model| -> Result<f64, String> { Ok(b as f64 / bench(m, &t, 3, Duration::from_millis(300))?) };
                let (td, tc) = (time(&device)?, time(&cpu)?);
                println!(
                    "{}",
                    json!({ "batch": b, "device": device.device().to_string(), "least_cosine": least,
                            "device_ms": td * 1e3, "cpu_ms": tc * 1e3, "speedup": tc / td })
                );
            }
            if worst < min_cosine {
                return Err(format!("least cosine {worst:.6} is below {min_cosine}"));
            }
            println!("{}", json!({ "ok": true, "least_cosine": worst, "device": device.device().to_string() }));
        }
        Command::Kernels => kernels()?,
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn kernels() -> Result<(), String> {
    use ferry_sidecar::embed::gpu;
    if !gpu::nvrtc_present() {
        return Err("NVRTC (libnvrtc.so) cannot be loaded; put its directory on LD_LIBRARY_PATH".into());
    }
    let ptx = gpu::compile()?.to_src();
    let entries: Vec<&str> = ptx
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l))
        .collect();
    println!("{}", json!({ "ptx_bytes": ptx.len(), "entries": entries }));
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn kernels() -> Result<(), String> {
    Err("this build has no CUDA code; build with `--features cuda`".into())
}

/// Median embeddings per second over `rounds` rounds of at least `round_time` each (one warm-up).
fn bench(m: &Model, t: &[&str], rounds: usize, round_time: Duration) -> Result<f64, String> {
    let batch = t.len();
    m.embed_texts(t)?;
    let mut rates = Vec::with_capacity(rounds);
    for _ in 0..rounds.max(1) {
        let start = ferry_core::clock::now();
        let mut n = 0;
        while n == 0 || ferry_core::clock::elapsed(start) < round_time {
            m.embed_texts(t)?;
            n += batch;
        }
        rates.push(n as f64 / ferry_core::clock::elapsed(start).as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}
