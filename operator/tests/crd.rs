//! The CRD: the checked-in YAML matches the code, and manifests are accepted or refused by it as
//! the API server would (its JSON schema, then its CEL rules).

use std::path::{Path, PathBuf};

use ferry_core::spec::InferenceService;
use ferry_operator::crdgen::{crd_yaml, CRD_PATH};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn schema() -> Value {
    let crd: Value = serde_saphyr::from_str(&std::fs::read_to_string(repo().join(CRD_PATH)).unwrap()).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// Validates a manifest as the API server would: the structural schema, then (after defaulting,
/// which deserializing into the Rust type does) the CEL rules.
fn validate(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).unwrap();
    let value: Value = serde_saphyr::from_str(&text).map_err(|e| e.to_string())?;
    let validator = jsonschema::draft4::new(&schema()).expect("the CRD schema compiles");
    let errors: Vec<String> = validator.iter_errors(&value).map(|e| format!("{}: {e}", e.instance_path)).collect();
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    let isvc: InferenceService = serde_json::from_value(value).map_err(|e| e.to_string())?;
    isvc.validate_cel().map_err(|e| format!("{e:?}"))
}

#[test]
fn the_checked_in_crd_is_what_the_code_generates() {
    let checked_in = std::fs::read_to_string(repo().join(CRD_PATH)).unwrap();
    assert!(
        checked_in == crd_yaml(),
        "{CRD_PATH} is out of date: run `cargo run -p ferry-operator -- crdgen > {CRD_PATH}`"
    );
}

#[test]
fn the_helm_chart_ships_the_same_crd() {
    let chart = std::fs::read(repo().join("charts/ferry/crds/inferenceservice.yaml")).unwrap();
    assert!(chart == std::fs::read(repo().join(CRD_PATH)).unwrap(), "copy {CRD_PATH} to charts/ferry/crds/");
}

#[test]
fn every_example_is_a_valid_inference_service() {
    let mut seen = 0;
    for entry in std::fs::read_dir(repo().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            validate(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen >= 3, "examples/ holds the quickstart, a cuda and a remote example");
}

#[test]
fn bad_manifests_are_refused_with_the_reason() {
    let cases = [
        ("min-over-max.yaml", "scaling.minReplicas must not exceed scaling.maxReplicas"),
        ("unknown-engine.yaml", "tpu"),
        ("remote-without-image.yaml", "engine.image is required when engine.kind is remote or openai"),
        ("openai-without-image.yaml", "engine.image is required when engine.kind is remote or openai"),
        ("bad-duration.yaml", "10 ms"),
        ("zero-batch.yaml", "minimum"),
        ("zero-after-with-min.yaml", "scaling.scaleToZeroAfter needs scaling.minReplicas: 0"),
    ];
    for (file, reason) in cases {
        let path = repo().join("operator/tests/invalid").join(file);
        let err = validate(&path).expect_err(file);
        assert!(err.contains(reason), "{file}: {err}");
    }
}

#[test]
fn the_schema_pins_the_contract() {
    let s = schema();
    let spec = &s["properties"]["spec"];
    assert_eq!(spec["required"], serde_json::json!(["model"]));
    assert_eq!(spec["properties"]["model"]["required"], serde_json::json!(["name", "version"]));
    let batching = &spec["properties"]["batching"]["properties"];
    assert_eq!(batching["maxBatchSize"]["default"], 32);
    assert_eq!(batching["maxWait"]["default"], "10ms");
    assert_eq!(batching["latencyBudget"]["default"], "200ms");
    let scaling = &spec["properties"]["scaling"]["properties"];
    for field in [
        "minReplicas",
        "maxReplicas",
        "warmReplicas",
        "targetUtilization",
        "scaleDownDelay",
        "startupTime",
        "scaleToZeroAfter",
    ] {
        assert!(scaling.get(field).is_some(), "scaling.{field}");
    }
    let status = &s["properties"]["status"]["properties"];
    for field in [
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "desiredReplicas",
        "arrivalRate",
        "queueDepth",
        "oldestQueueAge",
        "batchFill",
        "lastScaleTime",
        "lastScaleReason",
        "conditions",
    ] {
        assert!(status.get(field).is_some(), "status.{field}");
    }
}
