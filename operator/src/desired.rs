//! What the cluster should hold for an InferenceService: its worker Deployment and its Service.
//! Pure functions of the resource, so that every field can be tested without an API server.
//!
//! The Deployment is applied without `spec.replicas`: replicas belong to the autoscaler (field
//! manager [`REPLICAS_MANAGER`]), which the reconciler stands in for once, on create.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, HTTPGetAction, KeyToPath, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec,
    Probe, ResourceRequirements, SecretVolumeSource, Service, ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::probe;
use ferry_core::spec::{EngineKind, InferenceService, InferenceServiceSpec};

/// The name of the sidecar's container in every worker pod.
pub const SIDECAR: &str = "sidecar";

/// The field manager of everything the reconciler applies.
pub const FIELD_MANAGER: &str = "ferry-operator";
/// The field manager that owns `spec.replicas` of worker Deployments.
pub const REPLICAS_MANAGER: &str = "ferry-autoscaler";

pub const LABEL_SERVICE: &str = "ferry.dev/inference-service";
pub const LABEL_VERSION: &str = "ferry.dev/model-version";

pub const HTTP_PORT: i32 = 8080;
pub const METRICS_PORT: i32 = 9090;
const MODEL_MOUNT: &str = "/models";
/// Where the tenants Secret is mounted in the sidecar, and the file the sidecar reads there.
const TENANTS_MOUNT: &str = "/etc/ferry/tenants";
const TENANTS_FILE: &str = "tenants.yaml";

/// What the operator puts in pods beyond the resource itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    pub sidecar: String,
}

/// A spec the schema let through but the operator cannot run; it becomes a `Degraded` condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SpecError {
    pub message: String,
}

fn invalid(message: impl Into<String>) -> SpecError {
    SpecError { message: message.into() }
}

/// The spec's numbers, checked and parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub max_wait: Duration,
    pub latency_budget: Duration,
    pub scale_down_delay: Duration,
    pub startup_time: Duration,
    pub batch_time: Duration,
    pub per_item: Duration,
    pub volume: Option<ModelVolume>,
    /// `None`: the service never goes below one pod.
    pub scale_to_zero_after: Option<Duration>,
}

/// A model source that names a PersistentVolumeClaim (`pvc://CLAIM[/PATH]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelVolume {
    pub claim: String,
    pub path: String,
}

/// The checks an API server without CEL support (or an old CRD) would let through.
pub fn check(spec: &InferenceServiceSpec) -> Result<Checked, SpecError> {
    let duration = |field: &str, d: &ferry_core::spec::GatewayDuration| {
        d.parse().map_err(|e| invalid(format!("spec.{field}: {e}")))
    };
    let s = &spec.scaling;
    if s.min_replicas > s.max_replicas {
        return Err(invalid(format!(
            "spec.scaling.minReplicas ({}) is more than spec.scaling.maxReplicas ({})",
            s.min_replicas, s.max_replicas
        )));
    }
    if s.warm_replicas > s.max_replicas {
        return Err(invalid(format!(
            "spec.scaling.warmReplicas ({}) is more than spec.scaling.maxReplicas ({})",
            s.warm_replicas, s.max_replicas
        )));
    }
    if spec.batching.max_batch_size == 0 {
        return Err(invalid("spec.batching.maxBatchSize is 0; it must be at least 1"));
    }
    if spec.engine.kind.beside() && spec.engine.image.as_deref().unwrap_or("").is_empty() {
        return Err(invalid(format!(
            "spec.engine.image is required when spec.engine.kind is {}",
            spec.engine.kind.as_str()
        )));
    }
    if let (Some(after), 1..) = (&s.scale_to_zero_after, s.min_replicas) {
        return Err(invalid(format!(
            "spec.scaling.scaleToZeroAfter ({}) needs spec.scaling.minReplicas: 0, not {}",
            after.as_str(),
            s.min_replicas
        )));
    }
    let scale_to_zero_after = match &s.scale_to_zero_after {
        Some(d) => Some(duration("scaling.scaleToZeroAfter", d)?),
        None => None,
    };
    let latency_budget = duration("batching.latencyBudget", &spec.batching.latency_budget)?;
    if latency_budget.is_zero() {
        return Err(invalid("spec.batching.latencyBudget is 0s; it must be more than 0"));
    }
    let sim = spec.engine.sim.clone().unwrap_or_default();
    let volume = match spec.model.source.as_deref() {
        Some(source) if source.starts_with("pvc://") => {
            let rest = &source["pvc://".len()..];
            let (claim, path) = rest.split_once('/').unwrap_or((rest, ""));
            if claim.is_empty() {
                return Err(invalid(format!("spec.model.source '{source}' names no claim; use pvc://CLAIM[/PATH]")));
            }
            Some(ModelVolume { claim: claim.to_owned(), path: path.trim_matches('/').to_owned() })
        }
        _ => None,
    };
    Ok(Checked {
        max_wait: duration("batching.maxWait", &spec.batching.max_wait)?,
        latency_budget,
        scale_down_delay: duration("scaling.scaleDownDelay", &s.scale_down_delay)?,
        startup_time: duration("scaling.startupTime", &s.startup_time)?,
        batch_time: duration("engine.sim.batchTime", &sim.batch_time)?,
        per_item: duration("engine.sim.perItem", &sim.per_item)?,
        volume,
        scale_to_zero_after,
    })
}

/// Replicas a new worker Deployment starts with: what the autoscaler decides for no load — the
/// warm spares (replicas beyond what the load needs) within `minReplicas`..`maxReplicas` — and at
/// least one, since a service with no pod has no metrics to show load with.
pub fn initial_replicas(spec: &InferenceServiceSpec) -> i32 {
    let s = &spec.scaling;
    s.warm_replicas.clamp(s.min_replicas, s.max_replicas).max(1) as i32
}

/// Labels on every object made for `isvc`.
pub fn labels(isvc: &InferenceService) -> BTreeMap<String, String> {
    let mut labels = selector(isvc);
    labels.extend([
        ("app.kubernetes.io/name".to_owned(), "ferry-worker".to_owned()),
        ("app.kubernetes.io/instance".to_owned(), isvc.name_any()),
        ("app.kubernetes.io/component".to_owned(), "inference".to_owned()),
        ("app.kubernetes.io/managed-by".to_owned(), FIELD_MANAGER.to_owned()),
        ("app.kubernetes.io/version".to_owned(), isvc.spec.model.version.clone()),
        (LABEL_VERSION.to_owned(), isvc.spec.model.version.clone()),
    ]);
    labels
}

/// The pod selector: the InferenceService alone, so that a version change rolls the same
/// Deployment (selectors cannot change).
pub fn selector(isvc: &InferenceService) -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL_SERVICE.to_owned(), isvc.name_any())])
}

fn meta(isvc: &InferenceService) -> ObjectMeta {
    ObjectMeta {
        name: Some(isvc.name_any()),
        namespace: isvc.namespace(),
        labels: Some(labels(isvc)),
        owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
        ..ObjectMeta::default()
    }
}

/// The sidecar's command line for this spec.
pub fn sidecar_args(spec: &InferenceServiceSpec, checked: &Checked) -> Vec<String> {
    let b = &spec.batching;
    let mut args = vec![
        format!("--listen=0.0.0.0:{HTTP_PORT}"),
        format!("--metrics-listen=0.0.0.0:{METRICS_PORT}"),
        format!("--model={}", spec.model.name),
        format!("--model-version={}", spec.model.version),
        format!("--max-batch-size={}", b.max_batch_size),
        format!("--max-wait={}", b.max_wait.as_str()),
        format!("--latency-budget={}", b.latency_budget.as_str()),
        format!("--max-queue={}", b.max_queue),
        format!("--engine={}", spec.engine.kind.as_str()),
    ];
    args.extend(b.max_queue_bytes.map(|n| format!("--max-queue-bytes={n}")));
    args.extend(b.max_request_bytes.map(|n| format!("--max-request-bytes={n}")));
    let source = match (&checked.volume, spec.model.source.as_deref()) {
        (Some(v), _) if v.path.is_empty() => Some(MODEL_MOUNT.to_owned()),
        (Some(v), _) => Some(format!("{MODEL_MOUNT}/{}", v.path)),
        (None, source) => source.map(str::to_owned),
    };
    match spec.engine.kind {
        EngineKind::Sim => {
            let sim = spec.engine.sim.clone().unwrap_or_default();
            args.push(format!("--sim-batch-time={}", sim.batch_time.as_str()));
            args.push(format!("--sim-per-item={}", sim.per_item.as_str()));
        }
        EngineKind::Cuda | EngineKind::Llm => {
            args.extend(source.map(|s| format!("--model-source={s}")));
            // A pod given GPUs must use one: a sidecar that fell back to the CPU would serve at a
            // fraction of the planned capacity, so it fails to start instead, saying why.
            let device = if spec.engine.gpus.unwrap_or(1) > 0 { "cuda" } else { "cpu" };
            args.push(format!("--device={device}"));
        }
        EngineKind::Remote | EngineKind::OpenAi => {
            args.push(format!("--upstream=http://127.0.0.1:{}", spec.engine.port))
        }
        EngineKind::SimLlm => {
            let sim = spec.engine.sim.clone().unwrap_or_default();
            args.extend(sim.step_time.map(|d| format!("--sim-step-time={}", d.as_str())));
            args.extend(sim.prefill_per_token.map(|d| format!("--sim-prefill-per-token={}", d.as_str())));
            args.extend(sim.decode_per_seq.map(|d| format!("--sim-decode-per-seq={}", d.as_str())));
            args.extend(sim.attention_per_slot.map(|d| format!("--sim-attention-per-slot={}", d.as_str())));
        }
    }
    if let Some(g) = &spec.generation {
        args.extend(g.max_batch_tokens.map(|n| format!("--max-batch-tokens={n}")));
        args.extend(g.max_sequences.map(|n| format!("--max-sequences={n}")));
        args.extend(g.ttft_budget.as_ref().map(|d| format!("--ttft-budget={}", d.as_str())));
        args.extend(g.max_inter_token_latency.as_ref().map(|d| format!("--max-inter-token-latency={}", d.as_str())));
        args.extend(g.kv_block_size.map(|n| format!("--kv-block-size={n}")));
        args.extend(g.kv_blocks.map(|n| format!("--kv-blocks={n}")));
        args.extend(g.max_queue_tokens.map(|n| format!("--max-queue-tokens={n}")));
        args.extend(g.prefix_cache.map(|on| format!("--prefix-cache={on}")));
    }
    if let Some(objectives) = spec.routing.as_ref().map(|r| &r.batch_objectives).filter(|o| !o.is_empty()) {
        args.push(format!("--batch-objectives={}", objectives.join(",")));
    }
    if spec.tenants.is_some() {
        args.push(format!("--tenants={TENANTS_MOUNT}/{TENANTS_FILE}"));
    }
    args
}

fn http_probe(path: &str, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        ..Probe::default()
    }
}

fn gpu_limits(gpus: u32) -> ResourceRequirements {
    ResourceRequirements {
        limits: Some(BTreeMap::from([("nvidia.com/gpu".to_owned(), Quantity(gpus.to_string()))])),
        ..ResourceRequirements::default()
    }
}

/// The worker Deployment (without `spec.replicas`, which the autoscaler owns); `running` is the
/// one there is now, if any (its start-up allowance is kept while it fits: [`probe`]).
pub fn deployment(
    isvc: &InferenceService,
    images: &Images,
    running: Option<&Deployment>,
) -> Result<Deployment, SpecError> {
    let spec = &isvc.spec;
    let checked = check(spec)?;
    crate::routing::check(isvc)?;
    let measured = isvc.status.as_ref().and_then(|s| s.measured_startup_time).map(Duration::from_secs_f64);
    let startup = probe::allowance(checked.startup_time, measured, running.and_then(probe::running));
    let gpus = spec.engine.gpus.unwrap_or(1);
    let mounts = checked.volume.as_ref().map(|_| {
        vec![VolumeMount {
            name: "model".into(),
            mount_path: MODEL_MOUNT.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]
    });
    let mut sidecar = Container {
        name: SIDECAR.into(),
        image: Some(images.sidecar.clone()),
        args: Some(sidecar_args(spec, &checked)),
        ports: Some(vec![
            ContainerPort { name: Some("http".into()), container_port: HTTP_PORT, ..ContainerPort::default() },
            ContainerPort { name: Some("metrics".into()), container_port: METRICS_PORT, ..ContainerPort::default() },
        ]),
        readiness_probe: Some(http_probe("/v2/health/ready", 2, 2)),
        liveness_probe: Some(http_probe("/v2/health/live", 10, 3)),
        // The llm engine reads, dequantizes and uploads its weights before it serves any probe:
        // liveness waits for the start-up (three of them) instead of restarting a slow load.
        startup_probe: Some(http_probe("/v2/health/live", probe::PERIOD.as_secs() as i32, probe::failures(startup))),
        ..Container::default()
    };
    let mut containers = Vec::new();
    match spec.engine.kind {
        EngineKind::Sim | EngineKind::SimLlm => {}
        EngineKind::Cuda | EngineKind::Llm => {
            if gpus > 0 {
                sidecar.resources = Some(gpu_limits(gpus));
            }
            sidecar.volume_mounts = mounts.clone();
        }
        EngineKind::Remote | EngineKind::OpenAi => containers.push(Container {
            name: "engine".into(),
            image: spec.engine.image.clone(),
            args: spec.engine.args.clone(),
            ports: Some(vec![ContainerPort {
                name: Some("engine".into()),
                container_port: i32::from(spec.engine.port),
                ..ContainerPort::default()
            }]),
            resources: Some(gpu_limits(gpus)),
            volume_mounts: mounts.clone(),
            ..Container::default()
        }),
    }
    let mut volumes: Vec<Volume> = checked
        .volume
        .as_ref()
        .map(|v| Volume {
            name: "model".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: v.claim.clone(),
                read_only: Some(true),
            }),
            ..Volume::default()
        })
        .into_iter()
        .collect();
    // The tenants file: the Secret's key mounted as a file (a whole-volume mount, not a subPath,
    // so that the kubelet's update of the Secret reaches the running sidecar, which re-reads it).
    if let Some(t) = &spec.tenants {
        volumes.push(Volume {
            name: "tenants".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(t.secret_name.clone()),
                items: Some(vec![KeyToPath {
                    key: t.key.clone().unwrap_or_else(|| TENANTS_FILE.into()),
                    path: TENANTS_FILE.into(),
                    mode: None,
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        sidecar.volume_mounts.get_or_insert_with(Vec::new).push(VolumeMount {
            name: "tenants".into(),
            mount_path: TENANTS_MOUNT.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    let volumes = (!volumes.is_empty()).then_some(volumes);
    containers.insert(0, sidecar);
    // Long enough to drain: the longest deadline a queued request may have — a batch-tier one's,
    // the sidecar's default of 10 × the budget — plus the watchdog's slack for a batch in flight.
    let grace = (checked.latency_budget * 10).as_secs() as i64 + 30;
    let mut template_labels = labels(isvc);
    template_labels.extend(selector(isvc));
    template_labels.extend(crate::routing::pod_labels(isvc));
    Ok(Deployment {
        metadata: meta(isvc),
        spec: Some(DeploymentSpec {
            replicas: None,
            selector: LabelSelector { match_labels: Some(selector(isvc)), ..LabelSelector::default() },
            // Keep serving capacity through a rollout: add a pod before removing one.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(template_labels), ..ObjectMeta::default() }),
                spec: Some(PodSpec {
                    containers,
                    volumes,
                    termination_grace_period_seconds: Some(grace),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}

/// The Service in front of the workers: port 80 to the sidecars' `http` port.
pub fn service(isvc: &InferenceService) -> Service {
    Service {
        metadata: meta(isvc),
        spec: Some(ServiceSpec {
            selector: Some(selector(isvc)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(IntOrString::String("http".into())),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The Deployment's `spec.replicas` alone, applied by [`REPLICAS_MANAGER`].
pub fn replicas_patch(isvc: &InferenceService, replicas: i32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": isvc.name_any(), "namespace": isvc.namespace() },
        "spec": { "replicas": replicas },
    })
}
