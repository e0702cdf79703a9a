//! Routing behind the Gateway API Inference Extension: the `InferencePool`
//! (`inference.networking.k8s.io/v1`) that the operator keeps for a service with
//! `spec.routing.inferencePool`, selecting its worker pods on their API port and naming the
//! endpoint picker that chooses one per request. No crate carries that API's types, so the pool
//! is written as JSON here and applied as a dynamic object.

use kube::api::{ApiResource, GroupVersionKind};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

use crate::desired::{labels, selector, SpecError, HTTP_PORT};
use ferry_core::spec::{FailureMode, InferenceService};

/// The label by which an endpoint picker (llm-d's `core-metrics-extractor`) finds the engine
/// config for a pod's metrics; the chart's picker config has an entry of this name.
pub const ENGINE_TYPE_LABEL: &str = "llm-d.ai/engine-type";
pub const ENGINE_TYPE: &str = "ferry";

/// The InferencePool API.
pub fn pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    )
}

/// Whether `isvc` asks for an InferencePool.
pub fn routed(isvc: &InferenceService) -> bool {
    isvc.spec.routing.as_ref().is_some_and(|r| r.inference_pool)
}

/// Labels the worker pods carry beyond the usual ones: the engine type, where routed.
pub fn pod_labels(isvc: &InferenceService) -> Vec<(String, String)> {
    if routed(isvc) {
        vec![(ENGINE_TYPE_LABEL.to_owned(), ENGINE_TYPE.to_owned())]
    } else {
        Vec::new()
    }
}

/// A routed service whose picker would be named past a Service name's 63 characters (the
/// default, `<name>-epp`, of a name over 59) cannot be routed: said as an invalid spec.
pub fn check(isvc: &InferenceService) -> Result<(), SpecError> {
    let Some(routing) = isvc.spec.routing.as_ref().filter(|r| r.inference_pool) else { return Ok(()) };
    let picker = routing.picker(&isvc.name_any()).name.unwrap_or_default();
    if picker.len() > 63 {
        return Err(SpecError {
            message: format!(
                "spec.routing.endpointPicker.name: the default '{picker}' is {} characters, over a Service name's 63; name the picker",
                picker.len()
            ),
        });
    }
    Ok(())
}

/// The InferencePool of `isvc` (named as the service, owned by it, so that deleting the service
/// deletes the pool), or `None` where routing is off.
pub fn inference_pool(isvc: &InferenceService) -> Option<Value> {
    let routing = isvc.spec.routing.as_ref().filter(|r| r.inference_pool)?;
    let name = isvc.name_any();
    let picker = routing.picker(&name);
    let failure_mode = match picker.failure_mode {
        FailureMode::FailClose => "FailClose",
        FailureMode::FailOpen => "FailOpen",
    };
    let owner = isvc.controller_owner_ref(&()).map(|o| vec![o]);
    Some(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": name,
            "namespace": isvc.namespace(),
            "labels": labels(isvc),
            "ownerReferences": owner,
        },
        "spec": {
            "selector": { "matchLabels": selector(isvc) },
            // The sidecar's API port: where requests go and where the picker scrapes /metrics.
            "targetPorts": [{ "number": HTTP_PORT }],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": { "number": picker.port },
                "failureMode": failure_mode,
            },
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::spec::{EndpointPickerSpec, InferenceServiceSpec, RoutingSpec};

    fn service(routing: Option<RoutingSpec>) -> InferenceService {
        let spec: InferenceServiceSpec =
            serde_json::from_value(json!({"model": {"name": "chat", "version": "3"}})).unwrap();
        let mut isvc = InferenceService::new("chat", InferenceServiceSpec { routing, ..spec });
        isvc.metadata.namespace = Some("ml".into());
        isvc.metadata.uid = Some("u-1".into());
        isvc
    }

    #[test]
    fn a_routed_service_has_a_pool_on_its_pods_api_port_and_its_picker() {
        let isvc = service(Some(RoutingSpec { inference_pool: true, ..RoutingSpec::default() }));
        let pool = inference_pool(&isvc).expect("routed");
        assert_eq!(pool["metadata"]["name"], "chat");
        assert_eq!(pool["metadata"]["namespace"], "ml");
        assert_eq!(pool["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(pool["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(pool["spec"]["selector"]["matchLabels"], json!({"ferry.dev/inference-service": "chat"}));
        assert_eq!(pool["spec"]["targetPorts"], json!([{"number": 8080}]));
        assert_eq!(
            pool["spec"]["endpointPickerRef"],
            json!({"group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailClose"})
        );
        assert_eq!(pod_labels(&isvc), vec![("llm-d.ai/engine-type".to_owned(), "ferry".to_owned())]);
    }

    #[test]
    fn the_picker_is_the_specs_where_given() {
        let picker =
            EndpointPickerSpec { name: Some("shared-epp".into()), port: 9102, failure_mode: FailureMode::FailOpen };
        let isvc = service(Some(RoutingSpec {
            inference_pool: true,
            endpoint_picker: Some(picker),
            ..RoutingSpec::default()
        }));
        let pool = inference_pool(&isvc).unwrap();
        assert_eq!(pool["spec"]["endpointPickerRef"]["name"], "shared-epp");
        assert_eq!(pool["spec"]["endpointPickerRef"]["port"]["number"], 9102);
        assert_eq!(pool["spec"]["endpointPickerRef"]["failureMode"], "FailOpen");
    }

    #[test]
    fn a_default_picker_name_past_63_characters_is_an_invalid_spec() {
        let routing = RoutingSpec { inference_pool: true, ..RoutingSpec::default() };
        let mut isvc = service(Some(routing.clone()));
        isvc.metadata.name = Some("x".repeat(60));
        let e = check(&isvc).unwrap_err();
        assert!(e.message.contains("spec.routing.endpointPicker.name") && e.message.contains("64 characters"), "{e}");
        let named = EndpointPickerSpec { name: Some("epp".into()), ..EndpointPickerSpec::default() };
        isvc.spec.routing = Some(RoutingSpec { endpoint_picker: Some(named), ..routing });
        assert!(check(&isvc).is_ok());
        isvc.metadata.name = Some("x".repeat(59));
        isvc.spec.routing = Some(RoutingSpec { inference_pool: true, ..RoutingSpec::default() });
        assert!(check(&isvc).is_ok());
    }

    #[test]
    fn batch_objectives_reach_the_sidecar() {
        let routing = RoutingSpec { batch_objectives: vec!["offline".into(), "eval".into()], ..RoutingSpec::default() };
        let isvc = service(Some(routing));
        let checked = crate::desired::check(&isvc.spec).unwrap();
        let args = crate::desired::sidecar_args(&isvc.spec, &checked);
        assert!(args.contains(&"--batch-objectives=offline,eval".to_owned()), "{args:?}");
        assert!(!crate::desired::sidecar_args(&service(None).spec, &checked).iter().any(|a| a.contains("objectives")));
    }

    #[test]
    fn an_unrouted_service_has_no_pool_and_no_engine_label() {
        for routing in [None, Some(RoutingSpec::default())] {
            let isvc = service(routing);
            assert!(inference_pool(&isvc).is_none());
            assert!(pod_labels(&isvc).is_empty());
        }
    }
}
