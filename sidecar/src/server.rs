//! Puts the parts together: engine, scheduler and batcher per model version, the two listeners,
//! and the drain on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::batcher::Batcher;
use crate::config::{EngineSettings, Settings};
use crate::deadline::DeadlinePolicy;
use crate::engine::embedding::EmbeddingEngine;
use crate::engine::remote::RemoteEngine;
use crate::engine::sim::SimEngine;
use crate::engine::Engine;
use crate::front::{self, Backend, Front, Generating, Served, Steps};
use crate::generation::engine::{KvLayout, StepEngine};
use crate::generation::llm::LlmEngine;
use crate::generation::relay::Relay;
use crate::generation::sim::SimLlm;
use crate::generation::steps::{self, Generator};
use crate::metrics::{GenerationMetrics, Metrics};
use crate::tenants::Tenants;
use ferry_core::estimate::Estimator;
use ferry_core::generation::window::{UpstreamCost, Window, WindowPolicy};
use ferry_core::generation::{self, kv::BlockPool, step::StepEstimator};
use ferry_core::scheduler::{Policy, Scheduler};

/// How long, after the queue has drained, open connections get to finish before the process
/// exits anyway.
const CONNECTION_GRACE: Duration = Duration::from_secs(5);

/// The bound listeners, so that callers (and tests) learn the ports before serving starts.
pub struct Listeners {
    pub api: TcpListener,
    pub admin: TcpListener,
}

impl Listeners {
    pub async fn bind(settings: &Settings) -> std::io::Result<Listeners> {
        Ok(Listeners {
            api: TcpListener::bind(settings.listen).await?,
            admin: TcpListener::bind(settings.metrics_listen).await?,
        })
    }

    pub fn addresses(&self) -> std::io::Result<(SocketAddr, SocketAddr)> {
        Ok((self.api.local_addr()?, self.admin.local_addr()?))
    }
}

/// Starts a sidecar inside this process from command-line style `args` (as the binary takes
/// them, without the program name), on the current tokio runtime, until the process ends. Returns
/// the API and admin addresses (bind to `127.0.0.1:0` for free ports). For embedding and tests.
pub async fn spawn(args: &[&str]) -> Result<(SocketAddr, SocketAddr), Box<dyn std::error::Error>> {
    use clap::Parser;
    let cli = crate::config::Cli::try_parse_from(std::iter::once("ferry-sidecar").chain(args.iter().copied()))?;
    let settings = Settings::resolve(cli)?;
    let listeners = Listeners::bind(&settings).await?;
    let addresses = listeners.addresses()?;
    tokio::spawn(serve(settings, listeners, std::future::pending()));
    Ok(addresses)
}

/// Resolves on SIGTERM (Kubernetes stopping the pod) or SIGINT (Ctrl-C). Shared by both binaries.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Builds the model version's engine and batcher from the settings. Fails when the engine
/// cannot start (model files missing or malformed, the device asked for absent): the process
/// should exit and say why rather than serve nothing.
pub fn build(settings: &Settings, metrics: &Metrics) -> Result<(Front, Loading), String> {
    if settings.engine.generates() {
        return build_generation(settings, metrics);
    }
    let mut loading = None;
    let (engine, estimator): (Arc<dyn Engine>, Estimator) = match settings.engine {
        EngineSettings::Sim { batch_time, per_item, faults } => {
            (Arc::new(SimEngine::new(batch_time, per_item).with_faults(faults)), Estimator::new(batch_time, per_item))
        }
        EngineSettings::Remote { ref upstream, batch_time_estimate } => (
            RemoteEngine::start(upstream, &settings.model, &settings.version, Duration::from_secs(1)),
            Estimator::new(batch_time_estimate, Duration::ZERO),
        ),
        EngineSettings::Cuda { ref source, device, long_inputs } => {
            let (engine, loaded) = EmbeddingEngine::start(source, device, long_inputs)?;
            let engine = Arc::new(engine);
            // The first guess until the model has loaded and timed itself; nothing is admitted
            // before then (the engine is not ready).
            loading = Some((engine.clone(), loaded));
            (engine, Estimator::new(Duration::from_millis(100), Duration::ZERO))
        }
        EngineSettings::SimLlm { .. } | EngineSettings::Llm { .. } | EngineSettings::OpenAi { .. } => {
            unreachable!("generation engines are built by build_generation")
        }
    };
    let policy = Policy {
        max_batch_rows: settings.max_batch_size,
        max_wait: settings.max_wait,
        deadline_margin: settings.deadline_margin,
        max_queue: settings.max_queue,
        max_queue_bytes: settings.max_queue_bytes,
    };
    let scheduler = Scheduler::new(policy, settings.workers, estimator);
    let model_metrics = metrics.model(&settings.model, &settings.version);
    metrics.target(&settings.model, &settings.version, "request", settings.latency_budget);
    let served = Served {
        name: settings.model.clone(),
        version: settings.version.clone(),
        batcher: Batcher::spawn(scheduler, engine.clone(), model_metrics, settings.retry),
        engine,
        max_rows: settings.max_batch_size,
    };
    let deadlines = deadlines(settings);
    let batcher = served.batcher.clone();
    let front = Front::new(
        vec![Arc::new(served)],
        Vec::new(),
        deadlines,
        settings.max_request_bytes,
        metrics.clone(),
        settings.idempotency,
        tenants(settings)?,
    );
    let loading: Loading = match loading {
        None => Box::pin(std::future::pending()),
        Some((engine, loaded)) => {
            let source = settings.engine.clone();
            Box::pin(async move {
                let started = ferry_core::clock::now();
                match loaded.await {
                    Ok(Ok((model, cost))) => {
                        let (device, dim, max_tokens) = (model.device(), model.dim(), model.encoder.max_tokens());
                        // Calibrated before ready: the batcher sees the new estimate before any
                        // request (its commands are in order). Logged once ready, for whoever
                        // waits for the line.
                        batcher.calibrate(cost);
                        engine.install(model);
                        tracing::info!(
                            engine = ?source,
                            %device,
                            dim,
                            max_tokens,
                            load_time = ?ferry_core::clock::elapsed(started),
                            fixed = ?cost.fixed,
                            per_token = ?cost.per_token,
                            "model loaded; ready"
                        );
                        std::future::pending().await
                    }
                    Ok(Err(e)) => e,
                    Err(_) => "the model loader stopped without a word".to_owned(),
                }
            })
        }
    };
    Ok((front, loading))
}

/// The generation model version: its step engine, its ledger and the task around it; or the
/// relay to its upstream server. The llm engine loads in the background (its file read, its
/// first steps timed): the sidecar is live meanwhile and the model not ready, and a model that
/// cannot load ends the sidecar, saying why ([`Loading`]).
fn build_generation(settings: &Settings, metrics: &Metrics) -> Result<(Front, Loading), String> {
    let g = &settings.generation;
    let model_metrics = metrics.generation(&settings.model, &settings.version);
    metrics.target(&settings.model, &settings.version, "time_to_first_token", g.ttft_budget);
    metrics.target(&settings.model, &settings.version, "inter_token", g.max_inter_token_latency);
    let mut loading: Loading = Box::pin(std::future::pending());
    let backend = match &settings.engine {
        EngineSettings::SimLlm { times, slow } => {
            let engine: Arc<dyn StepEngine> = Arc::new(
                SimLlm::new(*times, KvLayout { blocks: g.kv_blocks.unwrap_or(4096), block_size: g.kv_block_size })
                    .with_slow_spell(*slow),
            );
            let (steps, installer) = Steps::new(model_metrics.clone(), "ferry_sim_llm");
            installer.install(engine.clone(), start_steps(engine, settings, model_metrics));
            Backend::Steps(steps)
        }
        EngineSettings::Llm { source, device, kv_cache_memory, float32, kv_dtype } => {
            let (steps, installer) = Steps::new(model_metrics.clone(), "ferry_llm");
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (source, device, kv_cache_memory) = (source.clone(), *device, *kv_cache_memory);
            let options = ferry_llm::Options { dequantize: *float32, kv_dtype: *kv_dtype };
            let (kv_blocks, block_size, specials) = (g.kv_blocks, g.kv_block_size, g.special_tokens_in_messages);
            std::thread::Builder::new()
                .name("model-loader".into())
                .spawn(move || {
                    let started = ferry_core::clock::now();
                    let loaded = LlmEngine::load(&source, device, kv_blocks, kv_cache_memory, block_size, options)
                        .map(|engine| engine.reading_message_specials(specials))
                        .map(|engine| (engine, source, ferry_core::clock::elapsed(started)));
                    let _ = tx.send(loaded);
                })
                .map_err(|e| format!("cannot start the model loader: {e}"))?;
            let settings = settings.clone();
            loading = Box::pin(async move {
                let (engine, source, load_time) = match rx.await {
                    Ok(Ok(loaded)) => loaded,
                    Ok(Err(e)) => return format!("the llm engine cannot start: {e}"),
                    Err(_) => return "the model loader stopped without a word".to_owned(),
                };
                let cost = engine.cost();
                let (device, kv, context) = (engine.device(), engine.kv(), engine.model().context_length());
                let engine: Arc<dyn StepEngine> = Arc::new(engine);
                installer.install(engine.clone(), start_steps(engine, &settings, model_metrics));
                // Logged once ready, for whoever waits for the line.
                tracing::info!(
                    source = %source.display(),
                    ?device,
                    kv_blocks = kv.blocks,
                    kv_block_size = kv.block_size,
                    context,
                    ?load_time,
                    decode = ?(cost.fixed + cost.per_decode),
                    prefill_per_token = ?cost.per_prefill_token,
                    attention_per_slot = ?cost.per_attended_slot,
                    "model loaded; ready"
                );
                std::future::pending().await
            });
            Backend::Steps(steps)
        }
        EngineSettings::OpenAi { upstream, model } => {
            let policy = WindowPolicy {
                max_in_flight: g.max_sequences,
                max_queue: settings.max_queue,
                max_queue_bytes: settings.max_queue_bytes,
                max_queue_tokens: g.max_queue_tokens,
                // The upstream enforces its own context (a 400, passed on).
                max_context: u32::MAX,
                max_attempts: settings.retry.max_attempts,
            };
            let window = Window::new(policy, UpstreamCost::default(), settings.deadline_margin);
            Backend::Relay(Relay::spawn(window, upstream, model, model_metrics, targets(settings)))
        }
        _ => unreachable!("only generation engines come here"),
    };
    let served = Generating {
        name: settings.model.clone(),
        version: settings.version.clone(),
        backend,
        ttft_budget: g.ttft_budget,
        itl: g.max_inter_token_latency,
        tool_parser: g.tool_call_parser,
    };
    let deadlines = deadlines(settings);
    let front = Front::new(
        Vec::new(),
        vec![Arc::new(served)],
        deadlines,
        settings.max_request_bytes,
        metrics.clone(),
        settings.idempotency,
        tenants(settings)?,
    );
    Ok((front, loading))
}

/// The deadlines a generation gets when it names none: what the exported capacity keeps.
fn targets(settings: &Settings) -> generation::capacity::Targets {
    generation::capacity::Targets {
        ttft: settings.generation.ttft_budget,
        itl: settings.generation.max_inter_token_latency,
        timeout: settings.max_timeout,
        margin: settings.deadline_margin,
    }
}

/// The step rule's task over a step engine: its scheduler over the engine's KV blocks, from the
/// step cost the engine was configured with or timed at load.
fn start_steps(engine: Arc<dyn StepEngine>, settings: &Settings, metrics: GenerationMetrics) -> Generator {
    let g = &settings.generation;
    let kv = engine.kv();
    let policy = generation::scheduler::Policy {
        max_batch_tokens: g.max_batch_tokens,
        max_sequences: g.max_sequences,
        max_queue: settings.max_queue,
        max_queue_bytes: settings.max_queue_bytes,
        max_queue_tokens: g.max_queue_tokens,
        max_context: engine.model().context_length(),
        watermark: generation::kv::watermark(kv.blocks),
        discipline: generation::scheduler::Discipline::Deadlines,
    };
    let scheduler = generation::scheduler::Scheduler::new(
        policy,
        BlockPool::new(kv.blocks, kv.block_size),
        StepEstimator::new(engine.cost()),
    );
    let ledger = generation::ledger::Ledger::new(scheduler, settings.deadline_margin, settings.retry.max_attempts);
    let prefix_cache = g.prefix_cache.then(|| generation::prefix::seed(&settings.model, &settings.version));
    steps::spawn(ledger, engine, metrics, targets(settings), prefix_cache)
}

fn deadlines(settings: &Settings) -> DeadlinePolicy {
    DeadlinePolicy {
        budget: settings.latency_budget,
        batch_budget: settings.batch_latency_budget,
        max_timeout: settings.max_timeout,
    }
}

/// The tenants file (`--tenants`), watched for changes; or every caller is `default`.
fn tenants(settings: &Settings) -> Result<Arc<Tenants>, String> {
    let tenants = Arc::new(
        match &settings.tenants {
            Some(path) => Tenants::load(path)?,
            None => Tenants::none(),
        }
        .with_batch_objectives(settings.batch_objectives.clone()),
    );
    tenants.watch(Duration::from_secs(1));
    Ok(tenants)
}

/// Resolves, with the reason, only if the engine fails to load; pends forever otherwise.
pub type Loading = std::pin::Pin<Box<dyn Future<Output = String> + Send>>;

/// Serves until `shutdown` resolves, then drains: readiness turns false and new requests get
/// 503 `draining`, everything queued or running is answered (or expires), and only then do the
/// listeners close.
pub async fn serve(
    settings: Settings,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let metrics = Metrics::new();
    let (front, loading) = build(&settings, &metrics).map_err(std::io::Error::other)?;
    let front = Arc::new(front);
    // Before the listeners serve: the first deadline-driven batch then already knows the timer.
    let lateness = crate::batcher::measure_timer_lateness().await;
    for served in &front.models {
        served.batcher.timer_lateness(lateness.clone());
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    // Without TCP_NODELAY, an answer written in two parts (HTTP/2 headers, then data) waits for
    // the client's delayed ACK of the first: 40 ms on Linux, enough to carry a 200 past its
    // deadline on the client's side.
    let api = listeners.api.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
        }
    });
    let api = axum::serve(api, front::api(front.clone())).with_graceful_shutdown(stopped(stop_rx.clone()));
    let admin = axum::serve(listeners.admin, front::admin(front.clone())).with_graceful_shutdown(stopped(stop_rx));
    let api = tokio::spawn(async move { api.await });
    let admin = tokio::spawn(async move { admin.await });

    let batchers = front.models.iter().map(|served| {
        let served = served.clone();
        Box::pin(async move {
            served.batcher.stopped().await;
            format!(
                "the batcher of model '{}' version '{}' stopped (a bug); exiting so that the pod restarts",
                served.name, served.version
            )
        }) as std::pin::Pin<Box<dyn Future<Output = String> + Send>>
    });
    let generators = front.generators.iter().map(|served| {
        let served = served.clone();
        Box::pin(async move {
            served.stopped().await;
            format!(
                "the generator of model '{}' version '{}' stopped (its engine broke, or a bug: see the log); exiting so that the pod restarts",
                served.name, served.version
            )
        }) as std::pin::Pin<Box<dyn Future<Output = String> + Send>>
    });
    let died = futures::future::select_all(batchers.chain(generators));
    tokio::select! {
        () = shutdown => {}
        failure = loading => {
            // Nothing was admitted (the engine was never ready): stop at once, saying why.
            let _ = stop_tx.send(true);
            return Err(std::io::Error::other(failure));
        }
        (failure, _, _) = died => {
            // Readiness is already false; what it held was answered `failed`: those answers
            // leave (the listeners close gracefully) before the process exits, for at most 2 s.
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                let _ = api.await;
                let _ = admin.await;
            })
            .await;
            return Err(std::io::Error::other(failure));
        }
    }
    tracing::info!("shutting down: draining the queue");
    front.start_draining();
    for served in &front.models {
        served.batcher.drain().await;
    }
    for served in &front.generators {
        served.drain().await;
    }
    tracing::info!("queue drained; closing the listeners");
    let _ = stop_tx.send(true);
    let closed = async {
        for server in [api, admin] {
            server.await.map_err(std::io::Error::other)??;
        }
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout(CONNECTION_GRACE, closed).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!("connections still open {CONNECTION_GRACE:?} after the drain; exiting anyway");
            Ok(())
        }
    }
}
