//! The desired worker Deployment and Service for each engine kind: args, ports, probes, GPU
//! limits, volumes, labels and owner references.

use std::path::Path;

use clap::Parser;
use ferry_core::spec::{EngineKind, InferenceService};
use ferry_operator::desired::{self, Images};
use ferry_sidecar::config::{Cli, EngineSettings, Settings};
use k8s_openapi::api::core::v1::Container;

fn example(name: &str) -> InferenceService {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let mut isvc: InferenceService = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    isvc.metadata.namespace = Some("ml".into());
    isvc.metadata.uid = Some("0f1e2d3c".into());
    isvc
}

fn images() -> Images {
    Images { sidecar: "registry.example/ferry-sidecar:1.2.3".into() }
}

fn containers(isvc: &InferenceService) -> Vec<Container> {
    let d = desired::deployment(isvc, &images(), None).unwrap();
    d.spec.unwrap().template.spec.unwrap().containers
}

fn gpus(c: &Container) -> Option<String> {
    c.resources.as_ref()?.limits.as_ref()?.get("nvidia.com/gpu").map(|q| q.0.clone())
}

#[test]
fn the_quickstart_runs_the_sim_engine_with_its_numbers() {
    let isvc = example("quickstart.yaml");
    let c = containers(&isvc);
    assert_eq!(c.len(), 1);
    let sidecar = &c[0];
    assert_eq!(sidecar.image.as_deref(), Some("registry.example/ferry-sidecar:1.2.3"));
    assert_eq!(
        sidecar.args.clone().unwrap(),
        [
            "--listen=0.0.0.0:8080",
            "--metrics-listen=0.0.0.0:9090",
            "--model=quickstart",
            "--model-version=1",
            "--max-batch-size=32",
            "--max-wait=10ms",
            "--latency-budget=200ms",
            "--max-queue=1024",
            "--engine=sim",
            "--sim-batch-time=100ms",
            "--sim-per-item=0ms",
        ]
    );
    let ports: Vec<(Option<String>, i32)> =
        sidecar.ports.clone().unwrap().into_iter().map(|p| (p.name, p.container_port)).collect();
    assert_eq!(ports, [(Some("http".into()), 8080), (Some("metrics".into()), 9090)]);
    let ready = sidecar.readiness_probe.clone().unwrap().http_get.unwrap();
    assert_eq!(ready.path.as_deref(), Some("/v2/health/ready"));
    let live = sidecar.liveness_probe.clone().unwrap().http_get.unwrap();
    assert_eq!(live.path.as_deref(), Some("/v2/health/live"));
    assert_eq!(gpus(sidecar), None, "the sim engine needs no GPU");
}

/// The operator's arguments mean to the sidecar what the spec says: each example's container
/// arguments, parsed by the sidecar's own command-line parser and resolved as it resolves them.
#[test]
fn the_sidecar_reads_its_arguments_as_the_spec_says() {
    for name in ["quickstart.yaml", "cuda.yaml", "remote.yaml", "generation.yaml", "llm.yaml", "vllm.yaml"] {
        let isvc = example(name);
        let args = containers(&isvc)[0].args.clone().unwrap();
        let cli = Cli::try_parse_from(std::iter::once("ferry-sidecar".to_owned()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("{name}: {args:?}: {e}"));
        let settings = Settings::resolve(cli).unwrap_or_else(|e| panic!("{name}: {args:?}: {e}"));
        let (spec, b) = (&isvc.spec, &isvc.spec.batching);
        assert_eq!((settings.model.as_str(), settings.version.as_str()), (&*spec.model.name, &*spec.model.version));
        assert_eq!(settings.max_batch_size, b.max_batch_size, "{name}");
        assert_eq!(settings.max_wait, b.max_wait.duration(), "{name}");
        assert_eq!(settings.latency_budget, b.latency_budget.duration(), "{name}");
        assert_eq!(settings.max_queue, b.max_queue as usize, "{name}");
        let default = Settings::resolve(Cli::try_parse_from(["ferry-sidecar"]).unwrap()).unwrap();
        assert_eq!(settings.max_queue_bytes, b.max_queue_bytes.unwrap_or(default.max_queue_bytes), "{name}");
        assert_eq!(settings.max_request_bytes, b.max_request_bytes.unwrap_or(default.max_request_bytes), "{name}");
        match (spec.engine.kind, &settings.engine) {
            (EngineKind::Sim, EngineSettings::Sim { batch_time, per_item, .. }) => {
                let sim = spec.engine.sim.clone().unwrap_or_default();
                assert_eq!((*batch_time, *per_item), (sim.batch_time.duration(), sim.per_item.duration()));
            }
            (EngineKind::Cuda, EngineSettings::Cuda { source, .. }) => {
                assert_eq!(source.to_str(), Some("/models/all-minilm-l6-v2"))
            }
            (EngineKind::Llm, EngineSettings::Llm { source, device, .. }) => {
                // The claim's file, mounted; a pod without GPUs decodes on the CPU.
                assert_eq!(source.to_str(), Some("/models/SmolLM2-135M-Instruct.Q4_1.gguf"), "{name}");
                assert_eq!(*device, ferry_sidecar::embed::Device::Cpu, "{name}");
                assert_eq!(gpus(&containers(&isvc)[0]), None, "{name}: gpus: 0 asks for none");
                let g = spec.generation.clone().expect("the example sets spec.generation");
                assert_eq!(settings.generation.kv_blocks, g.kv_blocks, "{name}");
                assert_eq!(Some(settings.generation.max_sequences), g.max_sequences, "{name}");
            }
            (EngineKind::Remote, EngineSettings::Remote { upstream, .. }) => {
                assert_eq!(upstream, &format!("http://127.0.0.1:{}", spec.engine.port))
            }
            (EngineKind::SimLlm, EngineSettings::SimLlm { times, .. }) => {
                let sim = spec.engine.sim.clone().unwrap_or_default();
                let fine = |d: &Option<ferry_core::spec::FineDuration>| d.as_ref().map(|d| d.duration());
                assert_eq!(Some(times.step_time), fine(&sim.step_time), "{name}");
                assert_eq!(Some(times.prefill_per_token), fine(&sim.prefill_per_token), "{name}");
                assert_eq!(Some(times.decode_per_seq), fine(&sim.decode_per_seq), "{name}");
                let off = std::time::Duration::ZERO;
                assert_eq!(times.attention_per_slot, fine(&sim.attention_per_slot).unwrap_or(off), "{name}");
                let g = spec.generation.clone().expect("the example sets spec.generation");
                let s = &settings.generation;
                assert_eq!(Some(s.max_batch_tokens), g.max_batch_tokens, "{name}");
                assert_eq!(Some(s.max_sequences), g.max_sequences, "{name}");
                assert_eq!(Some(s.ttft_budget), g.ttft_budget.map(|d| d.duration()), "{name}");
                assert_eq!(Some(s.max_inter_token_latency), g.max_inter_token_latency.map(|d| d.duration()), "{name}");
                assert_eq!(Some(s.kv_block_size), g.kv_block_size, "{name}");
                assert_eq!(s.kv_blocks, g.kv_blocks, "{name}");
                assert_eq!(s.prefix_cache, g.prefix_cache.unwrap_or(true), "{name}");
            }
            (EngineKind::OpenAi, EngineSettings::OpenAi { upstream, model }) => {
                assert_eq!(upstream, &format!("http://127.0.0.1:{}", spec.engine.port), "{name}");
                assert_eq!(model, &spec.model.name, "{name}");
                let engine = &containers(&isvc)[1];
                assert_eq!(engine.args, spec.engine.args, "{name}: the server's own arguments");
                assert_eq!(settings.generation.max_sequences, spec.generation.clone().unwrap().max_sequences.unwrap());
            }
            (kind, engine) => panic!("{name}: spec.engine.kind {kind:?} became {engine:?}"),
        }
    }
    assert_eq!(example("remote.yaml").spec.batching.max_queue_bytes, Some(64 << 20), "an example sets it");
}

#[test]
fn the_cuda_engine_gets_gpus_and_its_model_volume() {
    let isvc = example("cuda.yaml");
    let d = desired::deployment(&isvc, &images(), None).unwrap();
    let pod = d.spec.clone().unwrap().template.spec.unwrap();
    let sidecar = &pod.containers[0];
    assert_eq!(gpus(sidecar).as_deref(), Some("1"));
    let args = sidecar.args.clone().unwrap();
    assert!(args.contains(&"--engine=cuda".to_owned()));
    assert!(args.contains(&"--model-source=/models/all-minilm-l6-v2".to_owned()));
    assert!(args.contains(&"--device=cuda".to_owned()), "a pod given a GPU must not fall back to the CPU");
    let volume = &pod.volumes.unwrap()[0];
    assert_eq!(volume.persistent_volume_claim.as_ref().unwrap().claim_name, "models");
    assert_eq!(sidecar.volume_mounts.clone().unwrap()[0].mount_path, "/models");
    // Long enough to drain: a batch-tier deadline (10 × the 100 ms budget) plus 30 s of slack.
    assert_eq!(pod.termination_grace_period_seconds, Some(31));
}

#[test]
fn the_cuda_engine_without_gpus_runs_on_the_cpu() {
    let mut isvc = example("cuda.yaml");
    isvc.spec.engine.gpus = Some(0);
    let d = desired::deployment(&isvc, &images(), None).unwrap();
    let args = d.spec.unwrap().template.spec.unwrap().containers[0].args.clone().unwrap();
    assert!(args.contains(&"--device=cpu".to_owned()), "{args:?}");
}

#[test]
fn the_remote_engine_runs_beside_the_sidecar() {
    let isvc = example("remote.yaml");
    let c = containers(&isvc);
    assert_eq!(c.len(), 2);
    let (sidecar, engine) = (&c[0], &c[1]);
    assert!(sidecar.args.clone().unwrap().contains(&"--upstream=http://127.0.0.1:8000".to_owned()));
    assert_eq!(engine.image.as_deref(), Some("nvcr.io/nvidia/tritonserver:25.01-py3"));
    assert_eq!(engine.ports.clone().unwrap()[0].container_port, 8000);
    assert_eq!(gpus(engine).as_deref(), Some("1"));
    assert_eq!(gpus(sidecar), None, "the GPU is the engine's");
    assert_eq!(engine.volume_mounts.clone().unwrap()[0].mount_path, "/models");
}

#[test]
fn objects_carry_labels_and_an_owner_reference() {
    let isvc = example("remote.yaml");
    let d = desired::deployment(&isvc, &images(), None).unwrap();
    let s = desired::service(&isvc);
    for meta in [&d.metadata, &s.metadata] {
        let labels = meta.labels.clone().unwrap();
        assert_eq!(labels["ferry.dev/inference-service"], "resnet");
        assert_eq!(labels["ferry.dev/model-version"], "2");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "ferry-operator");
        assert_eq!(labels["app.kubernetes.io/instance"], "resnet");
        let owner = &meta.owner_references.clone().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("InferenceService", "resnet", "0f1e2d3c")
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(meta.namespace.as_deref(), Some("ml"));
    }
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, None, "replicas are the autoscaler's");
    assert_eq!(spec.selector.match_labels.unwrap().len(), 1, "the selector survives version changes");
    let template_labels = spec.template.metadata.unwrap().labels.unwrap();
    assert_eq!(template_labels["ferry.dev/model-version"], "2", "a new version rolls the pods");
    let port = &s.spec.unwrap().ports.unwrap()[0];
    assert_eq!(port.port, 80);
    assert_eq!(
        port.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into()))
    );
}

#[test]
fn initial_replicas_are_the_warm_spares_for_no_load_within_the_bounds() {
    // Warm replicas are beyond what the load needs, at creation as in every decision: with no
    // load yet, min 2 and warm 2 start 2 (the decision for no load), not 4.
    let mut isvc = example("remote.yaml");
    assert_eq!(desired::initial_replicas(&isvc.spec), 2);
    isvc.spec.scaling.warm_replicas = 5;
    assert_eq!(desired::initial_replicas(&isvc.spec), 5);
    isvc.spec.scaling.max_replicas = 3;
    assert_eq!(desired::initial_replicas(&isvc.spec), 3);
    isvc.spec.scaling.min_replicas = 0;
    isvc.spec.scaling.warm_replicas = 0;
    assert_eq!(desired::initial_replicas(&isvc.spec), 1, "one pod, so that load can be seen at all");
}

#[test]
fn a_spec_the_schema_let_through_is_refused_with_the_field() {
    let mut isvc = example("quickstart.yaml");
    isvc.spec.scaling.min_replicas = 9;
    let err = desired::deployment(&isvc, &images(), None).unwrap_err();
    assert_eq!(err.message, "spec.scaling.minReplicas (9) is more than spec.scaling.maxReplicas (8)");
    let mut isvc = example("quickstart.yaml");
    isvc.spec.model.source = Some("pvc://".into());
    assert!(desired::deployment(&isvc, &images(), None).unwrap_err().message.contains("names no claim"));
    let mut isvc = example("quickstart.yaml");
    isvc.spec.scaling.scale_to_zero_after = Some(ferry_core::spec::GatewayDuration::new("15m"));
    let err = desired::deployment(&isvc, &images(), None).unwrap_err();
    assert_eq!(err.message, "spec.scaling.scaleToZeroAfter (15m) needs spec.scaling.minReplicas: 0, not 1");
}

#[test]
fn a_tenants_secret_is_mounted_into_the_sidecar_and_named_by_its_flag() {
    let mut isvc = example("cuda.yaml");
    isvc.spec.tenants =
        Some(ferry_core::spec::TenantsSpec { secret_name: "ferry-tenants".into(), key: Some("t.yaml".into()) });
    let d = desired::deployment(&isvc, &images(), None).unwrap();
    let pod = d.spec.unwrap().template.spec.unwrap();
    let sidecar = &pod.containers[0];
    assert!(sidecar.args.clone().unwrap().contains(&"--tenants=/etc/ferry/tenants/tenants.yaml".to_owned()));
    let volumes = pod.volumes.unwrap();
    assert_eq!(volumes.len(), 2, "the model's and the tenants'");
    let secret = volumes[1].secret.clone().unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("ferry-tenants"));
    let item = &secret.items.unwrap()[0];
    assert_eq!((item.key.as_str(), item.path.as_str()), ("t.yaml", "tenants.yaml"));
    let mounts = sidecar.volume_mounts.clone().unwrap();
    let mount = mounts.iter().find(|m| m.name == "tenants").unwrap();
    assert_eq!(
        (mount.mount_path.as_str(), mount.sub_path.as_deref(), mount.read_only),
        ("/etc/ferry/tenants", None, Some(true))
    );
    // Without it, neither.
    let plain = desired::deployment(&example("quickstart.yaml"), &images(), None).unwrap();
    let pod = plain.spec.unwrap().template.spec.unwrap();
    assert!(pod.volumes.is_none());
    assert!(!pod.containers[0].args.clone().unwrap().iter().any(|a| a.starts_with("--tenants")));
}

fn startup_allowance(d: &k8s_openapi::api::apps::v1::Deployment) -> (Option<i32>, Option<i32>) {
    let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let probe = pod.containers.iter().find(|c| c.name == "sidecar").unwrap().startup_probe.clone().unwrap();
    assert_eq!(probe.http_get.unwrap().path.as_deref(), Some("/v2/health/live"));
    (probe.period_seconds, probe.failure_threshold)
}

#[test]
fn the_start_up_probe_follows_the_declared_then_the_measured_time_to_ready_and_keeps_a_fitting_one() {
    // examples/cuda.yaml declares a 90 s start-up: three of them, 270 s, in whole minutes: 300 s.
    let mut isvc = example("cuda.yaml");
    let first = desired::deployment(&isvc, &images(), None).unwrap();
    assert_eq!(startup_allowance(&first), (Some(5), Some(60)));
    // Its pods measured at 100 s: the running 300 s is still within two to ten start-ups.
    let mut status =
        ferry_core::spec::InferenceServiceStatus { measured_startup_time: Some(100.0), ..Default::default() };
    isvc.status = Some(status.clone());
    let kept = desired::deployment(&isvc, &images(), Some(&first)).unwrap();
    assert_eq!(startup_allowance(&kept), (Some(5), Some(60)), "no rollout for a measurement within the band");
    // Weights that take 4 minutes to load: 12 minutes, or the kubelet would restart them mid-load.
    status.measured_startup_time = Some(240.0);
    isvc.status = Some(status);
    let longer = desired::deployment(&isvc, &images(), Some(&kept)).unwrap();
    assert_eq!(startup_allowance(&longer), (Some(5), Some(144)));
}
