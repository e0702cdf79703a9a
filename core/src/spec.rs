//! The `InferenceService` resource (`ferry.dev/v1alpha1`): what a platform team declares. One
//! set of types for both readers: the sidecar's `--config` deserializes a manifest into them, and
//! the operator's CRD schema is generated from them (`ferry-operator crdgen`, feature `kube`),
//! with bounds, defaults and CEL rules, so the API server refuses a bad spec before the operator
//! sees it, and a field the cluster would prune cannot be honoured locally.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

#[cfg(feature = "kube")]
use kube::{CustomResource, KubeSchema};
#[cfg(feature = "kube")]
use schemars::JsonSchema;
#[cfg(feature = "kube")]
pub use status::InferenceServiceStatus;

pub use crate::duration::PATTERN as DURATION_PATTERN;

// Each printer column repeats `type_ = ...`, which clippy takes for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[cfg_attr(feature = "kube", derive(CustomResource, KubeSchema))]
#[cfg_attr(
    feature = "kube",
    kube(
        group = "ferry.dev",
        version = "v1alpha1",
        kind = "InferenceService",
        plural = "inferenceservices",
        shortname = "fisvc",
        category = "ferry",
        namespaced,
        cel,
        status = "InferenceServiceStatus",
        doc = "A model version served by GPU worker pods that batch requests under deadlines",
        printcolumn(name = "Model", type_ = "string", json_path = ".spec.model.name"),
        printcolumn(name = "Version", type_ = "string", json_path = ".spec.model.version"),
        printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
        printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredReplicas"),
        printcolumn(
            name = "Queue Age",
            type_ = "number",
            json_path = ".status.oldestQueueAge",
            description = "seconds the oldest queued request has waited"
        ),
        printcolumn(
            name = "Rate",
            type_ = "number",
            json_path = ".status.arrivalRate",
            description = "requests per second"
        ),
        printcolumn(
            name = "Tokens/s",
            type_ = "number",
            json_path = ".status.tokensPerSecond",
            description = "generated tokens per second (generation services)"
        ),
        printcolumn(
            name = "KV",
            type_ = "number",
            json_path = ".status.kvUsage",
            description = "the fullest pod's KV-cache usage (generation services)"
        ),
        printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceSpec {
    pub model: ModelSpec,
    #[serde(default)]
    pub engine: EngineSpec,
    #[serde(default)]
    pub batching: BatchingSpec,
    #[serde(default)]
    pub scaling: ScalingSpec,
    /// The knobs of generation engines (`sim-llm`, `llm`, `openai`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationSpec>,
    /// Who may call, and their weights and quotas: a Secret holding the tenants file (README,
    /// "Tenants"), mounted into every worker pod and re-read when the Secret changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<TenantsSpec>,
    /// How a gateway reaches the worker pods: an `InferencePool` for the Gateway API Inference
    /// Extension (README, "Behind the Gateway API Inference Extension").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingSpec>,
}

/// Routing behind the Gateway API Inference Extension.
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RoutingSpec {
    /// The operator owns an `InferencePool` (`inference.networking.k8s.io/v1`) of the same name
    /// selecting the worker pods on their API port, and labels them `llm-d.ai/engine-type: ferry`.
    #[serde(default)]
    pub inference_pool: bool,
    /// The endpoint picker the pool hands each request to (default: the Service
    /// `<name>-epp` on port 9002, failing closed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker: Option<EndpointPickerSpec>,
    /// The gateway objectives (`x-llm-d-inference-objective`) whose requests ride the batch tier:
    /// list here the InferenceObjectives you give a negative priority. Works with or without
    /// the pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(
        feature = "kube",
        schemars(
            length(max = 32),
            inner(length(min = 1, max = 253), regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"))
        )
    )]
    pub batch_objectives: Vec<String>,
}

impl RoutingSpec {
    /// The endpoint picker of the service `name`, defaults filled in.
    pub fn picker(&self, name: &str) -> EndpointPickerSpec {
        let given = self.endpoint_picker.clone().unwrap_or_default();
        EndpointPickerSpec { name: given.name.or_else(|| Some(format!("{name}-epp"))), ..given }
    }
}

/// The endpoint picker's Service (the pool's `endpointPickerRef`).
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerSpec {
    /// The picker's Service in the service's namespace (default `<name>-epp`, as the chart names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(length(min = 1, max = 63), regex(pattern = "^[a-z]([-a-z0-9]*[a-z0-9])?$")))]
    pub name: Option<String>,
    /// Its gRPC (ext_proc) port.
    #[serde(default = "default_picker_port")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 65535)))]
    pub port: u16,
    /// What the gateway does when the picker does not answer: `FailClose` (refuse the request,
    /// the default) or `FailOpen` (send it to any pod of the pool).
    #[serde(default)]
    pub failure_mode: FailureMode,
}

impl Default for EndpointPickerSpec {
    fn default() -> Self {
        EndpointPickerSpec { name: None, port: default_picker_port(), failure_mode: FailureMode::default() }
    }
}

fn default_picker_port() -> u16 {
    9002
}

/// The InferencePool's `endpointPickerRef.failureMode`, spelled as that API spells it.
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FailureMode {
    #[default]
    FailClose,
    FailOpen,
}

/// Where the tenants file is: a key of a Secret in the service's namespace.
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenantsSpec {
    /// The Secret's name.
    #[cfg_attr(
        feature = "kube",
        schemars(length(min = 1, max = 253), regex(pattern = "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"))
    )]
    pub secret_name: String,
    /// The key holding the file (default `tenants.yaml`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(length(min = 1, max = 253), regex(pattern = "^[-._a-zA-Z0-9]+$")))]
    pub key: Option<String>,
}

/// Which model version is served, and where its files are.
#[cfg_attr(feature = "kube", derive(KubeSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// The model's name in the API (`/v2/models/{name}`).
    #[cfg_attr(
        feature = "kube",
        schemars(length(min = 1, max = 63), regex(pattern = "^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"))
    )]
    pub name: String,
    /// The model version (`/v2/models/{name}/versions/{version}`).
    #[cfg_attr(
        feature = "kube",
        schemars(length(min = 1, max = 63), regex(pattern = "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"))
    )]
    pub version: String,
    /// Model files: a path in the image, or `pvc://CLAIM[/PATH]` to mount a PersistentVolumeClaim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// The engines a worker can run.
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Simulated batches of fixed duration (tests, demos, capacity planning).
    #[default]
    Sim,
    /// The built-in CUDA engine, in the sidecar.
    Cuda,
    /// An inference server (Triton, vLLM, ...) beside the sidecar in the pod.
    Remote,
    /// Simulated text generation, scheduled per engine step (tests, demos, capacity planning).
    #[serde(rename = "sim-llm")]
    SimLlm,
    /// The built-in Llama-family decoder, in the sidecar: `model.source` a GGUF file or a
    /// Hugging Face folder.
    #[serde(rename = "llm")]
    Llm,
    /// An OpenAI-compatible LLM server (vLLM, SGLang, TGI, llama.cpp) beside the sidecar, which
    /// batches by itself; the sidecar admits, orders and limits what it has in flight.
    #[serde(rename = "openai")]
    OpenAi,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Sim => "sim",
            EngineKind::Cuda => "cuda",
            EngineKind::Remote => "remote",
            EngineKind::SimLlm => "sim-llm",
            EngineKind::Llm => "llm",
            EngineKind::OpenAi => "openai",
        }
    }

    /// Whether the engine generates text (scheduled per step) rather than running batches.
    pub fn generates(self) -> bool {
        matches!(self, EngineKind::SimLlm | EngineKind::Llm | EngineKind::OpenAi)
    }

    /// Whether a server container runs beside the sidecar (`image`, `port`).
    pub fn beside(self) -> bool {
        matches!(self, EngineKind::Remote | EngineKind::OpenAi)
    }
}

#[cfg_attr(feature = "kube", derive(KubeSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "kube", x_kube(validation = kube::core::Rule::new("(self.kind != 'remote' && self.kind != 'openai') || has(self.image)")
    .message("engine.image is required when engine.kind is remote or openai")))]
pub struct EngineSpec {
    #[serde(default)]
    pub kind: EngineKind,
    /// GPUs per worker pod (`nvidia.com/gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 0, max = 16)))]
    pub gpus: Option<u32>,
    /// The inference server's image (`remote` and `openai` engines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The inference server's arguments (`remote` and `openai` engines), e.g. vLLM's
    /// `["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "8000"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// The inference server's HTTP port inside the pod (`remote` and `openai` engines).
    #[serde(default = "default_engine_port")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 65535)))]
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim: Option<SimSpec>,
}

fn default_engine_port() -> u16 {
    8000
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            kind: EngineKind::Sim,
            gpus: None,
            image: None,
            args: None,
            port: default_engine_port(),
            sim: None,
        }
    }
}

#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SimSpec {
    /// Fixed time per batch.
    #[serde(default = "default_batch_time")]
    pub batch_time: GatewayDuration,
    /// Extra time per row.
    #[serde(default = "zero")]
    pub per_item: GatewayDuration,
    /// `sim-llm`: fixed time per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time: Option<FineDuration>,
    /// `sim-llm`: extra time per prefill token (`50us`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_per_token: Option<FineDuration>,
    /// `sim-llm`: extra time per decoding sequence (`200us`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_per_seq: Option<FineDuration>,
    /// `sim-llm`: extra time per attended slot (`20ns`): a prefill chunk of n tokens after c
    /// computed ones attends n·c + n(n+1)/2 slots, a decode its context. Off unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_per_slot: Option<FineDuration>,
}

#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BatchingSpec {
    /// Rows per batch.
    #[serde(default = "default_max_batch_size")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 4096)))]
    pub max_batch_size: u32,
    /// Longest voluntary wait of the oldest request before its batch leaves.
    #[serde(default = "default_max_wait")]
    pub max_wait: GatewayDuration,
    /// Deadline of a request that asks for none.
    #[serde(default = "default_latency_budget")]
    pub latency_budget: GatewayDuration,
    /// Queue bound per worker pod, in requests.
    #[serde(default = "default_max_queue")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 1000000)))]
    pub max_queue: u32,
    /// Queue bound per worker pod, in payload bytes (the sidecar's default: 256 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1)))]
    pub max_queue_bytes: Option<u64>,
    /// Largest request body accepted (the sidecar's default: 16 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1)))]
    pub max_request_bytes: Option<u64>,
}

impl Default for BatchingSpec {
    fn default() -> Self {
        BatchingSpec {
            max_batch_size: default_max_batch_size(),
            max_wait: default_max_wait(),
            latency_budget: default_latency_budget(),
            max_queue: default_max_queue(),
            max_queue_bytes: None,
            max_request_bytes: None,
        }
    }
}

#[cfg_attr(feature = "kube", derive(KubeSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "kube", x_kube(
    validation = kube::core::Rule::new("self.minReplicas <= self.maxReplicas")
        .message("scaling.minReplicas must not exceed scaling.maxReplicas"),
    validation = kube::core::Rule::new("self.warmReplicas <= self.maxReplicas")
        .message("scaling.warmReplicas must not exceed scaling.maxReplicas"),
    validation = kube::core::Rule::new("!has(self.scaleToZeroAfter) || self.minReplicas == 0")
        .message("scaling.scaleToZeroAfter needs scaling.minReplicas: 0")
))]
pub struct ScalingSpec {
    #[serde(default = "one")]
    #[cfg_attr(feature = "kube", schemars(range(min = 0, max = 1000)))]
    pub min_replicas: u32,
    #[serde(default = "default_max_replicas")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 1000)))]
    pub max_replicas: u32,
    /// Spare replicas kept beyond what the load needs. For a generation service, pods' worth of
    /// capacity beyond the load, the headroom targetUtilization leaves counted towards it.
    #[serde(default = "one")]
    #[cfg_attr(feature = "kube", schemars(range(min = 0, max = 1000)))]
    pub warm_replicas: u32,
    /// Share of a replica's full-batch capacity to plan for.
    #[serde(default = "default_target_utilization")]
    #[cfg_attr(feature = "kube", schemars(range(min = 0.05, max = 1.0)))]
    pub target_utilization: f64,
    /// Scale-down follows the highest need over this window (a HorizontalPodAutoscaler's scale-down
    /// stabilization window); a load that falls steadily is followed a minute behind.
    #[serde(default = "default_scale_down_delay")]
    pub scale_down_delay: GatewayDuration,
    /// First guess of a new pod's time to ready.
    #[serde(default = "default_startup_time")]
    pub startup_time: GatewayDuration,
    /// With `minReplicas: 0`: after this long with no offered load the service goes to zero
    /// pods, and the holder holds its requests (by their deadlines) while it scales back up.
    /// Absent, a service keeps one pod at least, whatever `minReplicas` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_to_zero_after: Option<GatewayDuration>,
}

impl Default for ScalingSpec {
    fn default() -> Self {
        ScalingSpec {
            min_replicas: 1,
            max_replicas: default_max_replicas(),
            warm_replicas: 1,
            target_utilization: default_target_utilization(),
            scale_down_delay: default_scale_down_delay(),
            startup_time: default_startup_time(),
            scale_to_zero_after: None,
        }
    }
}

/// How a generation engine schedules its steps (DESIGN.md, "Generation knobs"). Absent fields
/// take the sidecar's defaults.
#[cfg_attr(feature = "kube", derive(JsonSchema))]
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GenerationSpec {
    /// Tokens one engine step may feed the model (default 2048).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 1048576)))]
    pub max_batch_tokens: Option<u32>,
    /// Sequences running at once (default 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 65536)))]
    pub max_sequences: Option<u32>,
    /// Default deadline of the first token (default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_budget: Option<GatewayDuration>,
    /// Default inter-token target: the longest step while a sequence decodes (default 200ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_inter_token_latency: Option<GatewayDuration>,
    /// Tokens per KV-cache block (default 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1, max = 1024)))]
    pub kv_block_size: Option<u32>,
    /// KV-cache blocks (`sim-llm`; default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1)))]
    pub kv_blocks: Option<u32>,
    /// Prompt tokens waiting to be prefilled, per worker pod (default 262144).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "kube", schemars(range(min = 1)))]
    pub max_queue_tokens: Option<u64>,
    /// Reuse the KV of prompt prefixes computed before, as vLLM's automatic prefix caching
    /// (engines `llm` and `sim-llm`; default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<bool>,
}

/// A duration in the Gateway API format (`10ms`, `1s`, `5m`, `1h`, `1m30s`), kept as written.
/// Deserializing checks the format, so a manifest read locally is refused for the same text the
/// CRD's pattern refuses in the cluster.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct GatewayDuration(String);

impl<'de> Deserialize<'de> for GatewayDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        crate::duration::parse(&text).map_err(serde::de::Error::custom)?;
        Ok(GatewayDuration(text))
    }
}

impl GatewayDuration {
    /// A duration from a text known to be one (a default, a literal).
    ///
    /// # Panics
    /// When `text` is not a Gateway API duration.
    pub fn new(text: &str) -> Self {
        if let Err(e) = crate::duration::parse(text) {
            panic!("GatewayDuration::new: {e}");
        }
        GatewayDuration(text.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The duration. `new` and deserializing check the text, so only a `GatewayDuration` built
    /// from a literal in this crate could fail here.
    pub fn duration(&self) -> Duration {
        crate::duration::parse(&self.0).expect("a GatewayDuration holds a checked duration")
    }

    /// The duration, or why it is not one.
    pub fn parse(&self) -> Result<Duration, crate::duration::DurationError> {
        crate::duration::parse(&self.0)
    }
}

#[cfg(feature = "kube")]
impl JsonSchema for GatewayDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "GatewayDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "description": "A duration in the Gateway API format: 10ms, 1s, 5m, 1h, 1m30s",
        })
    }
}

/// A Gateway API duration, or whole microseconds (`50us`) or nanoseconds (`20ns`), kept as
/// written: the `sim-llm` engine's per-token costs are fractions of a millisecond.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct FineDuration(String);

impl<'de> Deserialize<'de> for FineDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        crate::duration::parse_fine(&text).map_err(serde::de::Error::custom)?;
        Ok(FineDuration(text))
    }
}

impl FineDuration {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The duration (deserializing checked the text).
    pub fn duration(&self) -> Duration {
        crate::duration::parse_fine(&self.0).expect("a FineDuration holds a checked duration")
    }
}

#[cfg(feature = "kube")]
impl JsonSchema for FineDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "FineDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": crate::duration::FINE_PATTERN,
            "description": "A duration in the Gateway API format (10ms, 1s) or whole microseconds (50us) or nanoseconds (20ns)",
        })
    }
}

impl Default for SimSpec {
    fn default() -> Self {
        SimSpec {
            batch_time: default_batch_time(),
            per_item: zero(),
            step_time: None,
            prefill_per_token: None,
            decode_per_seq: None,
            attention_per_slot: None,
        }
    }
}

fn one() -> u32 {
    1
}
fn zero() -> GatewayDuration {
    GatewayDuration::new("0s")
}
fn default_batch_time() -> GatewayDuration {
    GatewayDuration::new("100ms")
}
fn default_max_batch_size() -> u32 {
    32
}
fn default_max_wait() -> GatewayDuration {
    GatewayDuration::new("10ms")
}
fn default_latency_budget() -> GatewayDuration {
    GatewayDuration::new("200ms")
}
fn default_max_queue() -> u32 {
    1024
}
fn default_max_replicas() -> u32 {
    8
}
fn default_target_utilization() -> f64 {
    0.8
}
fn default_scale_down_delay() -> GatewayDuration {
    GatewayDuration::new("5m")
}
fn default_startup_time() -> GatewayDuration {
    GatewayDuration::new("60s")
}

#[cfg(feature = "kube")]
mod status {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    /// What the operator observed and decided. Two writers patch it (the reconciler: generation,
    /// replicas and conditions; the autoscaler: its figures and decision), each as a merge patch of
    /// this type with only its own fields set, which is why every field is optional and skipped
    /// when unset.
    #[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
    #[serde(rename_all = "camelCase")]
    pub struct InferenceServiceStatus {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub observed_generation: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub replicas: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub ready_replicas: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub desired_replicas: Option<i32>,
        /// Offered requests per second over the metrics window.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub arrival_rate: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub queue_depth: Option<f64>,
        /// Seconds the oldest queued request has waited.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub oldest_queue_age: Option<f64>,
        /// Mean rows per batch over `maxBatchSize`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub batch_fill: Option<f64>,
        /// Requests per second one replica serves with its deadlines kept, as decisions use it:
        /// the pods' own figure for a generation service, the batch arithmetic otherwise.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub capacity_per_replica: Option<f64>,
        /// Generated tokens per second over the metrics window (generation services).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tokens_per_second: Option<f64>,
        /// The fullest worker pod's KV-cache usage, 0 to 1 (generation services).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub kv_usage: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_scale_time: Option<Time>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_scale_reason: Option<String>,
        /// Seconds from asking for a pod to its serving that decisions use: the measured
        /// time-to-ready once there is one, else `spec.scaling.startupTime`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub startup_time: Option<f64>,
        /// Seconds from a worker pod's creation to its Ready condition, measured on the service's
        /// own pods (the median of the latest).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub measured_startup_time: Option<f64>,
        /// The `InferencePool` the operator keeps for the service (`spec.routing.inferencePool`),
        /// once applied; its `Routed` condition says why not where it could not be.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub inference_pool: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub conditions: Vec<Condition>,
    }
}
