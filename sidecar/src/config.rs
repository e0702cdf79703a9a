//! The sidecar's settings: an InferenceService manifest (`--config`, the same YAML that
//! `kubectl apply` takes), overridden by flags, each of which also reads `FERRY_<FLAG>`.
//! Precedence: flag, then environment, then manifest, then the defaults of DESIGN.md.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use ferry_core::spec::{InferenceServiceSpec, ModelSpec};
use serde::Deserialize;

use crate::embed::{Device, Overflow};
use crate::engine::sim::Faults;
use crate::engine::spell::SlowSpell;
use crate::generation::sim::SimLlmTimes;
use crate::idempotency;
use ferry_core::duration;
use ferry_core::ledger::RetryPolicy;

#[derive(Debug, Parser, Default)]
#[command(
    name = "ferry-sidecar",
    version,
    about = "Ferry's sidecar: deadline-aware batching in front of an inference engine"
)]
pub struct Cli {
    /// An InferenceService manifest (YAML); flags override its fields.
    #[arg(long, env = "FERRY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address of the inference API. [default: 0.0.0.0:8080]
    #[arg(long, env = "FERRY_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Address of the admin listener (/metrics, health). [default: 0.0.0.0:9090]
    #[arg(long, env = "FERRY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Model name (spec.model.name). [default: sim]
    #[arg(long, env = "FERRY_MODEL")]
    pub model: Option<String>,
    /// Model version (spec.model.version). [default: 1]
    #[arg(long, env = "FERRY_MODEL_VERSION")]
    pub model_version: Option<String>,
    /// Rows per batch (spec.batching.maxBatchSize). [default: 32]
    #[arg(long, env = "FERRY_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<u32>,
    /// Longest voluntary wait of the oldest request (spec.batching.maxWait). [default: 10ms]
    #[arg(long, env = "FERRY_MAX_WAIT", value_parser = duration::parse)]
    pub max_wait: Option<Duration>,
    /// Default deadline of a request (spec.batching.latencyBudget). [default: 200ms]
    #[arg(long, env = "FERRY_LATENCY_BUDGET", value_parser = duration::parse)]
    pub latency_budget: Option<Duration>,
    /// Default deadline of a batch-tier request. [default: 10 × the latency budget]
    #[arg(long, env = "FERRY_BATCH_LATENCY_BUDGET", value_parser = duration::parse)]
    pub batch_latency_budget: Option<Duration>,
    /// Tenants: a YAML file mapping bearer tokens to tenants, their weights and quotas; re-read
    /// when it changes. Without it every caller is tenant `default`.
    #[arg(long, env = "FERRY_TENANTS")]
    pub tenants: Option<std::path::PathBuf>,
    /// Gateway objectives whose requests ride the batch tier: a request whose
    /// `x-llm-d-inference-objective` (or `x-gateway-inference-objective`) names one of these — the
    /// InferenceObjectives given a negative priority — is batch-tier unless `x-ferry-priority`
    /// says otherwise. Comma-separated. [default: `spec.routing.batchObjectives`]
    #[arg(long, env = "FERRY_BATCH_OBJECTIVES", value_delimiter = ',')]
    pub batch_objectives: Vec<String>,
    /// Longest deadline a request may ask for. [default: the latency budget]
    #[arg(long, env = "FERRY_MAX_TIMEOUT", value_parser = duration::parse)]
    pub max_timeout: Option<Duration>,
    /// Batches that run at once on the engine. [default: 1]
    #[arg(long, env = "FERRY_WORKERS")]
    pub workers: Option<usize>,
    /// Queue bound by count (spec.batching.maxQueue). [default: 1024]
    #[arg(long, env = "FERRY_MAX_QUEUE")]
    pub max_queue: Option<usize>,
    /// Queue bound by payload bytes (spec.batching.maxQueueBytes). [default: 268435456]
    #[arg(long, env = "FERRY_MAX_QUEUE_BYTES")]
    pub max_queue_bytes: Option<u64>,
    /// Largest request body accepted (spec.batching.maxRequestBytes). [default: 16777216]
    #[arg(long, env = "FERRY_MAX_REQUEST_BYTES")]
    pub max_request_bytes: Option<u64>,
    /// A deadline-driven batch leaves this long before the last possible moment, and admission keeps
    /// this much of every deadline for the answer's trip back. [default: 2ms]
    #[arg(long, env = "FERRY_DEADLINE_MARGIN", value_parser = duration::parse)]
    pub deadline_margin: Option<Duration>,
    /// Engine kind (spec.engine.kind): sim, cuda, remote, sim-llm or openai. [default: sim]
    #[arg(long, env = "FERRY_ENGINE")]
    pub engine: Option<String>,
    /// Fixed time per batch of the sim engine (spec.engine.sim.batchTime). [default: 100ms]
    #[arg(long, env = "FERRY_SIM_BATCH_TIME", value_parser = duration::parse)]
    pub sim_batch_time: Option<Duration>,
    /// Time per row of the sim engine (spec.engine.sim.perItem). [default: 0ms]
    #[arg(long, env = "FERRY_SIM_PER_ITEM", value_parser = duration::parse)]
    pub sim_per_item: Option<Duration>,
    /// Probability that a sim batch fails (fault injection). [default: 0]
    #[arg(long, env = "FERRY_SIM_FAIL_RATE")]
    pub sim_fail_rate: Option<f64>,
    /// Probability that a sim batch never returns (fault injection). [default: 0]
    #[arg(long, env = "FERRY_SIM_HANG_RATE")]
    pub sim_hang_rate: Option<f64>,
    /// A slow spell of the sim engines (fault injection): FACTORx@AFTER+LASTING, e.g. 3x@5s+4s —
    /// batches or steps that start from AFTER since start-up, for LASTING, take FACTOR times as long.
    #[arg(long, env = "FERRY_SIM_SLOW_SPELL")]
    pub sim_slow_spell: Option<String>,
    /// Seed of the sim engine's fault draws. [default: 0]
    #[arg(long, env = "FERRY_SIM_SEED")]
    pub sim_seed: Option<u64>,
    /// Runs a request may ride in when batches fail, the first included. [default: 3]
    #[arg(long, env = "FERRY_MAX_ATTEMPTS")]
    pub max_attempts: Option<u32>,
    /// The watchdog gives up on a batch after this many times its expected time. [default: 3]
    #[arg(long, env = "FERRY_WATCHDOG_FACTOR")]
    pub watchdog_factor: Option<f64>,
    /// How long a response is kept for replay under its idempotency-key. [default: 10m]
    #[arg(long, env = "FERRY_IDEMPOTENCY_TTL", value_parser = duration::parse)]
    pub idempotency_ttl: Option<Duration>,
    /// Most idempotency records kept. [default: 10000]
    #[arg(long, env = "FERRY_IDEMPOTENCY_MAX_ENTRIES")]
    pub idempotency_max_entries: Option<usize>,
    /// Most bytes of saved responses kept for idempotent replay. [default: 67108864]
    #[arg(long, env = "FERRY_IDEMPOTENCY_MAX_BYTES")]
    pub idempotency_max_bytes: Option<usize>,
    /// Fails any sim batch holding a row whose first element equals this (fault injection).
    #[arg(long, env = "FERRY_SIM_POISON", allow_negative_numbers = true)]
    pub sim_poison: Option<f64>,
    /// First guess of the engine's time per batch, before it is measured (remote engine). [default: 100ms]
    #[arg(long, env = "FERRY_BATCH_TIME_ESTIMATE", value_parser = duration::parse)]
    pub batch_time_estimate: Option<Duration>,
    /// URL of the inference server beside the sidecar (remote and openai engines).
    #[arg(long, env = "FERRY_UPSTREAM")]
    pub upstream: Option<String>,
    /// The model's name on the upstream LLM server (openai engine). [default: --model]
    #[arg(long, env = "FERRY_UPSTREAM_MODEL")]
    pub upstream_model: Option<String>,
    /// Model files for the cuda and llm engines (spec.model.source): the embedding model's
    /// folder; a GGUF file or a Hugging Face folder for llm.
    #[arg(long, env = "FERRY_MODEL_SOURCE")]
    pub model_source: Option<PathBuf>,
    /// `auto`, `cpu` or `cuda[:N]` (cuda and llm engines). [default: auto]
    #[arg(long, env = "FERRY_DEVICE")]
    pub device: Option<String>,
    /// The llm engine's weights: `auto` computes a GGUF file's quantized matrices as stored
    /// (F16/BF16 in f32); `float32` dequantizes every matrix to f32 at load (exact, slower and
    /// up to eight times larger). [default: auto]
    #[arg(long, env = "FERRY_DTYPE")]
    pub dtype: Option<String>,
    /// What the llm engine's KV cache holds: `auto` (f16 on the CPU, f32 with `--dtype float32`
    /// and on the GPU), `f16` (twice the tokens in the same memory) or `f32`. [default: auto]
    #[arg(long, env = "FERRY_KV_CACHE_DTYPE")]
    pub kv_cache_dtype: Option<String>,
    /// Inputs longer than the model takes: `truncate` (keep the first tokens) or `refuse` (400)
    /// (cuda engine). [default: truncate]
    #[arg(long, env = "FERRY_LONG_INPUTS")]
    pub long_inputs: Option<String>,
    /// Tokens one engine step may feed the model (spec.generation.maxBatchTokens). [default: 2048]
    #[arg(long, env = "FERRY_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<u32>,
    /// Sequences running at once (spec.generation.maxSequences). [default: 64]
    #[arg(long, env = "FERRY_MAX_SEQUENCES")]
    pub max_sequences: Option<u32>,
    /// Default deadline of a generation's first token (spec.generation.ttftBudget). [default: 1s]
    #[arg(long, env = "FERRY_TTFT_BUDGET", value_parser = duration::parse)]
    pub ttft_budget: Option<Duration>,
    /// Default inter-token target: the longest step while a sequence decodes
    /// (spec.generation.maxInterTokenLatency). [default: 200ms]
    #[arg(long, env = "FERRY_MAX_INTER_TOKEN_LATENCY", value_parser = duration::parse)]
    pub max_inter_token_latency: Option<Duration>,
    /// KV-cache blocks (spec.generation.kvBlocks). [default: sim-llm 4096; llm as many as
    /// --kv-cache-memory holds]
    #[arg(long, env = "FERRY_KV_BLOCKS")]
    pub kv_blocks: Option<u32>,
    /// Memory for the llm engine's KV cache, in bytes or with a Ki, Mi or Gi suffix, when
    /// --kv-blocks is not given. [default: 1Gi on the CPU, 90 % of the GPU's free memory]
    #[arg(long, env = "FERRY_KV_CACHE_MEMORY", value_parser = parse_bytes)]
    pub kv_cache_memory: Option<u64>,
    /// Tokens per KV-cache block (spec.generation.kvBlockSize). [default: 16]
    #[arg(long, env = "FERRY_KV_BLOCK_SIZE")]
    pub kv_block_size: Option<u32>,
    /// Prompt tokens waiting to be prefilled (spec.generation.maxQueueTokens). [default: 262144]
    #[arg(long, env = "FERRY_MAX_QUEUE_TOKENS")]
    pub max_queue_tokens: Option<u64>,
    /// Keep the KV of computed prompt blocks and reuse it for prompts that start with the same
    /// tokens, as vLLM's automatic prefix caching (spec.generation.prefixCache; engines llm and
    /// sim-llm). --prefix-cache=false turns it off. [default: true]
    #[arg(long, env = "FERRY_PREFIX_CACHE", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub prefix_cache: Option<bool>,
    /// Read special tokens typed in chat messages as the tokens they name (engine llm): for
    /// callers trusted to write turns of their own. Off, a user who types `<|im_start|>system`
    /// sends those characters as text, not a system turn. [default: false]
    #[arg(long, env = "FERRY_SPECIAL_TOKENS_IN_MESSAGES", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub special_tokens_in_messages: Option<bool>,
    /// Reads tool calls out of the model's free text, so that chats with tools may leave
    /// `tool_choice` at `auto` (vLLM's `--enable-auto-tool-choice --tool-call-parser`): `hermes`
    /// (`<tool_call>{...}</tool_call>`: Hermes, Qwen 2.5 and 3). Engines llm and sim-llm.
    #[arg(long, env = "FERRY_TOOL_CALL_PARSER")]
    pub tool_call_parser: Option<String>,
    /// Fixed time per step of the sim-llm engine (spec.engine.sim.stepTime). [default: 10ms]
    #[arg(long, env = "FERRY_SIM_STEP_TIME", value_parser = duration::parse_fine)]
    pub sim_step_time: Option<Duration>,
    /// Time per prefill token of the sim-llm engine, e.g. 50us (spec.engine.sim.prefillPerToken). [default: 50us]
    #[arg(long, env = "FERRY_SIM_PREFILL_PER_TOKEN", value_parser = duration::parse_fine)]
    pub sim_prefill_per_token: Option<Duration>,
    /// Time per decoding sequence of the sim-llm engine (spec.engine.sim.decodePerSeq). [default: 200us]
    #[arg(long, env = "FERRY_SIM_DECODE_PER_SEQ", value_parser = duration::parse_fine)]
    pub sim_decode_per_seq: Option<Duration>,
    /// Time per attended slot of the sim-llm engine, e.g. 20ns: a prefill chunk of n tokens after
    /// c computed ones attends n·c + n(n+1)/2 slots, a decode its context
    /// (spec.engine.sim.attentionPerSlot). [default: 0s, off]
    #[arg(long, env = "FERRY_SIM_ATTENTION_PER_SLOT", value_parser = duration::parse_fine)]
    pub sim_attention_per_slot: Option<Duration>,
}

/// How generation is scheduled (engines `sim-llm`, `llm`, `openai`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationSettings {
    pub max_batch_tokens: u32,
    pub max_sequences: u32,
    pub ttft_budget: Duration,
    pub max_inter_token_latency: Duration,
    /// As configured; each engine has its default.
    pub kv_blocks: Option<u32>,
    pub kv_block_size: u32,
    pub max_queue_tokens: u64,
    /// Prompts share the KV blocks they start with ([`ferry_core::generation::prefix`]).
    pub prefix_cache: bool,
    /// Special tokens typed in messages are read as tokens (`--special-tokens-in-messages`).
    pub special_tokens_in_messages: bool,
    /// Reads tool calls out of the model's free text (`--tool-call-parser`).
    pub tool_call_parser: Option<crate::front::tools::Parser>,
}

/// The engine to run, with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineSettings {
    Sim {
        batch_time: Duration,
        per_item: Duration,
        faults: Faults,
    },
    /// An Open Inference Protocol server at `upstream`.
    Remote {
        upstream: String,
        batch_time_estimate: Duration,
    },
    /// The local sentence-embedding model in `source`, on `device`.
    Cuda {
        source: PathBuf,
        device: Device,
        long_inputs: Overflow,
    },
    /// The built-in decoder serving the model at `source` (a GGUF file or a Hugging Face folder).
    Llm {
        source: PathBuf,
        device: Device,
        /// The KV cache's memory when `--kv-blocks` is not given (default: the device's).
        kv_cache_memory: Option<u64>,
        /// Every matrix dequantized to f32 at load (`--dtype float32`).
        float32: bool,
        /// What the KV cache holds (`None`: the engine's default for the device).
        kv_dtype: Option<ferry_llm::KvDtype>,
    },
    /// Simulated generation: the prompt cycled, steps of a configured time.
    SimLlm {
        times: SimLlmTimes,
        /// A slow spell (fault injection).
        slow: Option<SlowSpell>,
    },
    /// An OpenAI-compatible LLM server at `upstream` that batches by itself, serving the model
    /// as `model`.
    OpenAi {
        upstream: String,
        model: String,
    },
}

impl EngineSettings {
    /// Whether the engine generates text, scheduled per step.
    pub fn generates(&self) -> bool {
        matches!(self, EngineSettings::SimLlm { .. } | EngineSettings::Llm { .. } | EngineSettings::OpenAi { .. })
    }
}

/// Everything resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    pub model: String,
    pub version: String,
    pub max_batch_size: u32,
    pub max_wait: Duration,
    pub latency_budget: Duration,
    pub batch_latency_budget: Duration,
    pub tenants: Option<std::path::PathBuf>,
    pub batch_objectives: Vec<String>,
    pub max_timeout: Duration,
    pub workers: usize,
    pub max_queue: usize,
    pub max_queue_bytes: u64,
    pub max_request_bytes: u64,
    pub deadline_margin: Duration,
    pub retry: RetryPolicy,
    pub idempotency: idempotency::Limits,
    pub engine: EngineSettings,
    pub generation: GenerationSettings,
}

/// A setting that cannot be used; the message names the field, the value and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// An InferenceService manifest as the sidecar reads it: the spec types the operator's CRD is
/// generated from (`ferry_core::spec`), so a field the cluster would prune is not honoured here
/// either. Other parts of the object (metadata, status) are ignored.
#[derive(Debug, Default, Deserialize)]
struct Manifest {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    spec: Option<InferenceServiceSpec>,
}

const MS: Duration = Duration::from_millis(1);

impl Settings {
    /// Resolves the command line (with its environment) over the manifest it names, if any.
    pub fn resolve(cli: Cli) -> Result<Settings, ConfigError> {
        let manifest = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("--config {}: cannot read it: {e}", path.display())))?;
                parse_manifest(&text).map_err(|e| ConfigError(format!("--config {}: {e}", path.display())))?
            }
            None => Manifest::default(),
        };
        Settings::merge(cli, manifest)
    }

    fn merge(cli: Cli, m: Manifest) -> Result<Settings, ConfigError> {
        let spec = m.spec.unwrap_or_else(|| InferenceServiceSpec {
            model: ModelSpec { name: "sim".into(), version: "1".into(), source: None },
            engine: Default::default(),
            batching: Default::default(),
            scaling: Default::default(),
            generation: None,
            tenants: None,
            routing: None,
        });
        let generation = spec.generation.unwrap_or_default();
        let routing = spec.routing.unwrap_or_default();
        let (model, engine, batching) = (spec.model, spec.engine, spec.batching);
        let sim = engine.sim.unwrap_or_default();
        let latency_budget = cli.latency_budget.unwrap_or(batching.latency_budget.duration());
        let served_name = cli.model.clone().unwrap_or_else(|| model.name.clone());
        // The built-in decoder's number formats mean nothing to the other engines: said, not ignored.
        let kind = cli.engine.clone().unwrap_or_else(|| engine.kind.as_str().to_owned());
        for (flag, given) in [("--dtype", &cli.dtype), ("--kv-cache-dtype", &cli.kv_cache_dtype)] {
            if given.is_some() && kind != "llm" {
                return Err(ConfigError(format!(
                    "{flag} applies to --engine llm (the built-in decoder) only; this sidecar's engine is {kind}"
                )));
            }
        }
        let s = Settings {
            listen: cli.listen.unwrap_or_else(|| "0.0.0.0:8080".parse().expect("valid address")),
            metrics_listen: cli.metrics_listen.unwrap_or_else(|| "0.0.0.0:9090".parse().expect("valid address")),
            model: served_name.clone(),
            version: cli.model_version.unwrap_or(model.version),
            max_batch_size: cli.max_batch_size.unwrap_or(batching.max_batch_size),
            max_wait: cli.max_wait.unwrap_or(batching.max_wait.duration()),
            latency_budget,
            batch_latency_budget: cli.batch_latency_budget.unwrap_or(latency_budget * 10),
            tenants: cli.tenants.clone(),
            batch_objectives: if cli.batch_objectives.is_empty() { routing.batch_objectives } else { cli.batch_objectives.clone() },
            max_timeout: cli.max_timeout.unwrap_or(latency_budget),
            workers: cli.workers.unwrap_or(1),
            max_queue: cli.max_queue.unwrap_or(batching.max_queue as usize),
            max_queue_bytes: cli.max_queue_bytes.or(batching.max_queue_bytes).unwrap_or(256 << 20),
            max_request_bytes: cli.max_request_bytes.or(batching.max_request_bytes).unwrap_or(16 << 20),
            deadline_margin: cli.deadline_margin.unwrap_or(2 * MS),
            retry: RetryPolicy {
                max_attempts: cli.max_attempts.unwrap_or(RetryPolicy::default().max_attempts),
                watchdog_factor: cli.watchdog_factor.unwrap_or(RetryPolicy::default().watchdog_factor),
                ..RetryPolicy::default()
            },
            idempotency: idempotency::Limits {
                ttl: cli.idempotency_ttl.unwrap_or(Duration::from_secs(600)),
                max_entries: cli.idempotency_max_entries.unwrap_or(10_000),
                max_bytes: cli.idempotency_max_bytes.unwrap_or(64 << 20),
            },
            engine: match cli.engine.as_deref().unwrap_or(engine.kind.as_str()) {
                "sim" => EngineSettings::Sim {
                    batch_time: cli.sim_batch_time.unwrap_or(sim.batch_time.duration()),
                    per_item: cli.sim_per_item.unwrap_or(sim.per_item.duration()),
                    faults: Faults {
                        fail_rate: probability("--sim-fail-rate", cli.sim_fail_rate)?,
                        hang_rate: probability("--sim-hang-rate", cli.sim_hang_rate)?,
                        seed: cli.sim_seed.unwrap_or(0),
                        poison: cli.sim_poison,
                        slow: slow_spell(cli.sim_slow_spell.as_deref())?,
                    },
                },
                "remote" => EngineSettings::Remote {
                    upstream: cli.upstream.clone().ok_or_else(|| {
                        ConfigError(
                            "--upstream is required when --engine is remote (the inference server's URL)".into(),
                        )
                    })?,
                    batch_time_estimate: cli.batch_time_estimate.unwrap_or(100 * MS),
                },
                "llm" => EngineSettings::Llm {
                    source: cli.model_source.clone().or(model.source.clone().map(PathBuf::from)).ok_or_else(|| {
                        ConfigError(
                            "--model-source (spec.model.source) is required when --engine is llm: a GGUF file, or a \
                             Hugging Face folder with config.json, *.safetensors and tokenizer.json"
                                .into(),
                        )
                    })?,
                    device: device(cli.device.as_deref())?,
                    kv_cache_memory: cli.kv_cache_memory,
                    float32: match cli.dtype.as_deref() {
                        None | Some("auto") => false,
                        Some("float32") => true,
                        Some(other) => {
                            return Err(ConfigError(format!("--dtype is '{other}'; it must be auto or float32")))
                        }
                    },
                    kv_dtype: match cli.kv_cache_dtype.as_deref() {
                        None | Some("auto") => None,
                        Some("f16") => Some(ferry_llm::KvDtype::F16),
                        Some("f32") => Some(ferry_llm::KvDtype::F32),
                        Some(other) => {
                            return Err(ConfigError(format!(
                                "--kv-cache-dtype is '{other}'; it must be auto, f16 or f32"
                            )))
                        }
                    },
                },
                "cuda" => EngineSettings::Cuda {
                    source: cli.model_source.clone().or(model.source.map(PathBuf::from)).ok_or_else(|| {
                        ConfigError(
                            "--model-source (spec.model.source) is required when --engine is cuda: the directory \
                             with config.json, model.safetensors and tokenizer.json"
                                .into(),
                        )
                    })?,
                    device: device(cli.device.as_deref())?,
                    long_inputs: match cli.long_inputs.as_deref() {
                        None => Overflow::Truncate,
                        Some(text) => Overflow::parse(text).ok_or_else(|| {
                            ConfigError(format!("--long-inputs is '{text}'; it must be truncate or refuse"))
                        })?,
                    },
                },
                "sim-llm" => EngineSettings::SimLlm {
                    slow: slow_spell(cli.sim_slow_spell.as_deref())?,
                    times: SimLlmTimes {
                        step_time: cli
                            .sim_step_time
                            .or(sim.step_time.as_ref().map(|d| d.duration()))
                            .unwrap_or(10 * MS),
                        prefill_per_token: cli
                            .sim_prefill_per_token
                            .or(sim.prefill_per_token.as_ref().map(|d| d.duration()))
                            .unwrap_or(Duration::from_micros(50)),
                        decode_per_seq: cli
                            .sim_decode_per_seq
                            .or(sim.decode_per_seq.as_ref().map(|d| d.duration()))
                            .unwrap_or(Duration::from_micros(200)),
                        attention_per_slot: cli
                            .sim_attention_per_slot
                            .or(sim.attention_per_slot.as_ref().map(|d| d.duration()))
                            .unwrap_or(Duration::ZERO),
                    },
                },
                "openai" => EngineSettings::OpenAi {
                    upstream: cli.upstream.clone().ok_or_else(|| {
                        ConfigError(
                            "--upstream is required when --engine is openai (the LLM server's URL, e.g. http://127.0.0.1:8000)"
                                .into(),
                        )
                    })?,
                    model: cli.upstream_model.clone().unwrap_or(served_name),
                },
                other => {
                    return Err(ConfigError(format!(
                        "spec.engine.kind (--engine) is '{other}'; it must be one of sim, cuda, remote, sim-llm, llm, openai"
                    )))
                }
            },
            generation: GenerationSettings {
                max_batch_tokens: cli.max_batch_tokens.or(generation.max_batch_tokens).unwrap_or(2048),
                max_sequences: cli.max_sequences.or(generation.max_sequences).unwrap_or(64),
                ttft_budget: cli
                    .ttft_budget
                    .or(generation.ttft_budget.as_ref().map(|d| d.duration()))
                    .unwrap_or(Duration::from_secs(1)),
                max_inter_token_latency: cli
                    .max_inter_token_latency
                    .or(generation.max_inter_token_latency.as_ref().map(|d| d.duration()))
                    .unwrap_or(200 * MS),
                kv_blocks: cli.kv_blocks.or(generation.kv_blocks),
                kv_block_size: cli.kv_block_size.or(generation.kv_block_size).unwrap_or(16),
                max_queue_tokens: cli.max_queue_tokens.or(generation.max_queue_tokens).unwrap_or(1 << 18),
                prefix_cache: cli.prefix_cache.or(generation.prefix_cache).unwrap_or(true),
                special_tokens_in_messages: cli.special_tokens_in_messages.unwrap_or(false),
                tool_call_parser: match cli.tool_call_parser.as_deref() {
                    None => None,
                    Some(name) => Some(name.parse().map_err(ConfigError)?),
                },
            },
        };
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let fail = |msg: String| Err(ConfigError(msg));
        if self.model.is_empty() || self.model.contains('/') {
            return fail(format!(
                "spec.model.name (--model) is '{}'; it must be non-empty and have no '/'",
                self.model
            ));
        }
        if self.version.is_empty() || self.version.contains('/') {
            return fail(format!(
                "spec.model.version (--model-version) is '{}'; it must be non-empty and have no '/'",
                self.version
            ));
        }
        if self.max_batch_size == 0 {
            return fail("spec.batching.maxBatchSize (--max-batch-size) is 0; it must be at least 1".into());
        }
        if self.workers == 0 {
            return fail("--workers is 0; it must be at least 1".into());
        }
        if self.max_queue == 0 {
            return fail("spec.batching.maxQueue (--max-queue) is 0; it must be at least 1".into());
        }
        if self.latency_budget.is_zero() {
            return fail("spec.batching.latencyBudget (--latency-budget) is 0s; it must be more than 0".into());
        }
        if self.max_timeout < self.latency_budget {
            return fail(format!(
                "--max-timeout is {}; it must be at least the latency budget, {}",
                duration::format(self.max_timeout),
                duration::format(self.latency_budget)
            ));
        }
        if self.batch_latency_budget < self.latency_budget {
            return fail(format!(
                "--batch-latency-budget is {}; it must be at least the latency budget, {}",
                duration::format(self.batch_latency_budget),
                duration::format(self.latency_budget)
            ));
        }
        if self.retry.max_attempts == 0 {
            return fail("--max-attempts is 0; it must be at least 1".into());
        }
        if self.retry.watchdog_factor.is_nan() || self.retry.watchdog_factor < 1.0 {
            return fail(format!("--watchdog-factor is {}; it must be at least 1", self.retry.watchdog_factor));
        }
        let g = &self.generation;
        for (field, value) in [
            ("spec.generation.maxBatchTokens (--max-batch-tokens)", g.max_batch_tokens),
            ("spec.generation.maxSequences (--max-sequences)", g.max_sequences),
            ("spec.generation.kvBlocks (--kv-blocks)", g.kv_blocks.unwrap_or(1)),
            ("spec.generation.kvBlockSize (--kv-block-size)", g.kv_block_size),
        ] {
            if value == 0 {
                return fail(format!("{field} is 0; it must be at least 1"));
            }
        }
        if g.ttft_budget.is_zero() || g.max_inter_token_latency.is_zero() {
            return fail(format!(
                "spec.generation.ttftBudget (--ttft-budget) is {} and maxInterTokenLatency (--max-inter-token-latency) is {}; both must be more than 0",
                duration::format(g.ttft_budget),
                duration::format(g.max_inter_token_latency)
            ));
        }
        if self.max_request_bytes == 0 || self.max_queue_bytes < self.max_request_bytes {
            return fail(format!(
                "--max-queue-bytes is {} and --max-request-bytes is {}; the queue must hold at least one request of the largest size (and that size must be more than 0)",
                self.max_queue_bytes, self.max_request_bytes
            ));
        }
        Ok(())
    }
}

fn device(text: Option<&str>) -> Result<Device, ConfigError> {
    match text {
        None => Ok(Device::Auto),
        Some(text) => Device::parse(text)
            .ok_or_else(|| ConfigError(format!("--device is '{text}'; it must be auto, cpu, cuda or cuda:N"))),
    }
}

/// A byte count: digits, optionally with a binary suffix (`512Mi`, `2Gi`).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, ""),
    };
    let scale: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return Err(format!("'{text}' is not a byte count: digits, optionally followed by Ki, Mi, Gi or Ti")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("'{text}' is not a byte count: digits, optionally followed by Ki, Mi, Gi or Ti"))
}

fn slow_spell(text: Option<&str>) -> Result<Option<SlowSpell>, ConfigError> {
    text.map(SlowSpell::parse).transpose().map_err(ConfigError)
}

fn probability(flag: &str, value: Option<f64>) -> Result<f64, ConfigError> {
    match value {
        None => Ok(0.0),
        Some(p) if (0.0..=1.0).contains(&p) => Ok(p),
        Some(p) => Err(ConfigError(format!("{flag} is {p}; it must be a probability between 0 and 1"))),
    }
}

fn parse_manifest(text: &str) -> Result<Manifest, ConfigError> {
    let m: Manifest = serde_saphyr::from_str(text).map_err(|e| ConfigError(one_line(&e.to_string())))?;
    match m.kind.as_deref() {
        None | Some("InferenceService") => Ok(m),
        Some(other) => Err(ConfigError(format!("kind is '{other}'; the sidecar reads an InferenceService manifest"))),
    }
}

/// YAML errors come with an annotated snippet over several lines; the contract is one line.
fn one_line(text: &str) -> String {
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("ferry-sidecar").chain(args.iter().copied())).unwrap()
    }

    const MANIFEST: &str = r#"
apiVersion: ferry.dev/v1alpha1
kind: InferenceService
metadata: {name: quickstart}
spec:
  model: {name: echo, version: "3"}
  engine: {kind: sim, sim: {batchTime: 100ms, perItem: 1ms}}
  batching: {maxBatchSize: 16, maxWait: 5ms, latencyBudget: 300ms, maxQueue: 50}
  scaling: {minReplicas: 1, maxReplicas: 4}
"#;

    #[test]
    fn defaults_are_those_of_the_design() {
        let s = Settings::merge(Cli::default(), Manifest::default()).unwrap();
        assert_eq!((s.max_batch_size, s.max_wait, s.latency_budget), (32, 10 * MS, 200 * MS));
        assert_eq!((s.max_timeout, s.workers, s.max_queue), (200 * MS, 1, 1024));
        assert_eq!(
            s.engine,
            EngineSettings::Sim { batch_time: 100 * MS, per_item: Duration::ZERO, faults: Faults::default() }
        );
        assert_eq!(s.listen.to_string(), "0.0.0.0:8080");
    }

    #[test]
    fn the_manifest_sets_and_flags_override() {
        let m = parse_manifest(MANIFEST).unwrap();
        let s = Settings::merge(cli(&["--max-wait", "7ms", "--workers", "3"]), m).unwrap();
        assert_eq!((s.model.as_str(), s.version.as_str()), ("echo", "3"));
        assert_eq!((s.max_batch_size, s.max_wait, s.latency_budget, s.max_queue), (16, 7 * MS, 300 * MS, 50));
        assert_eq!(s.workers, 3);
        assert_eq!(s.engine, EngineSettings::Sim { batch_time: 100 * MS, per_item: MS, faults: Faults::default() });
    }

    #[test]
    fn bad_values_name_the_field_and_the_rule() {
        let err = Settings::merge(cli(&["--max-batch-size", "0"]), Manifest::default()).unwrap_err();
        assert_eq!(err.0, "spec.batching.maxBatchSize (--max-batch-size) is 0; it must be at least 1");
        let err = Settings::merge(cli(&["--max-timeout", "100ms"]), Manifest::default()).unwrap_err();
        assert!(err.0.contains("--max-timeout is 100ms; it must be at least the latency budget, 200ms"), "{err}");
        let err = Settings::merge(cli(&["--engine", "tpu"]), Manifest::default()).unwrap_err();
        assert!(err.0.contains("'tpu'; it must be one of sim, cuda, remote"), "{err}");
        let err = Settings::merge(cli(&["--engine", "remote"]), Manifest::default()).unwrap_err();
        assert!(err.0.starts_with("--upstream is required when --engine is remote"), "{err}");
        let err = Settings::merge(cli(&["--sim-fail-rate", "1.5"]), Manifest::default()).unwrap_err();
        assert_eq!(err.0, "--sim-fail-rate is 1.5; it must be a probability between 0 and 1");
        let llm = ["--engine", "llm", "--model-source", "m.gguf"];
        let err = Settings::merge(cli(&[&llm[..], &["--tool-call-parser", "mistral"]].concat()), Manifest::default())
            .unwrap_err();
        assert_eq!(err.0, "--tool-call-parser is 'mistral'; this server reads hermes");
        let hermes = Settings::merge(cli(&[&llm[..], &["--tool-call-parser", "hermes"]].concat()), Manifest::default());
        assert_eq!(hermes.unwrap().generation.tool_call_parser, Some(crate::front::tools::Parser::Hermes));
        let err = Settings::merge(cli(&[&llm[..], &["--dtype", "q4"]].concat()), Manifest::default()).unwrap_err();
        assert_eq!(err.0, "--dtype is 'q4'; it must be auto or float32");
        let err =
            Settings::merge(cli(&[&llm[..], &["--kv-cache-dtype", "fp8"]].concat()), Manifest::default()).unwrap_err();
        assert_eq!(err.0, "--kv-cache-dtype is 'fp8'; it must be auto, f16 or f32");
        let err =
            Settings::merge(cli(&["--engine", "sim-llm", "--dtype", "float32"]), Manifest::default()).unwrap_err();
        assert_eq!(
            err.0,
            "--dtype applies to --engine llm (the built-in decoder) only; this sidecar's engine is sim-llm"
        );
    }

    #[test]
    fn bad_manifests_are_one_line_errors() {
        let err = parse_manifest("spec:\n  batching: {maxWait: soon}\n").unwrap_err();
        assert!(err.0.contains("'soon' is not a duration"), "{err}");
        assert!(!err.0.contains('\n'));
        let err = parse_manifest("kind: Deployment\n").unwrap_err();
        assert!(err.0.contains("kind is 'Deployment'"), "{err}");
    }

    #[test]
    fn a_bad_flag_value_is_refused_by_the_parser() {
        let err = Cli::try_parse_from(["ferry-sidecar", "--max-wait", "10"]).unwrap_err();
        assert!(err.to_string().contains("'10' is not a duration"), "{err}");
    }

    #[test]
    fn the_prefix_cache_is_on_unless_turned_off_by_flag_or_manifest() {
        let on = |args: &[&str], manifest: &str| {
            let m = if manifest.is_empty() { Manifest::default() } else { parse_manifest(manifest).unwrap() };
            Settings::merge(cli(args), m).unwrap().generation.prefix_cache
        };
        assert!(on(&[], ""));
        assert!(!on(&["--prefix-cache=false"], ""));
        let off = format!("{MANIFEST}  generation: {{prefixCache: false}}\n");
        assert!(!on(&[], &off));
        assert!(on(&["--prefix-cache"], &off), "the flag overrides");
        let err = Cli::try_parse_from(["ferry-sidecar", "--prefix-cache=maybe"]).unwrap_err();
        assert!(err.to_string().contains("maybe"), "{err}");
    }
}
