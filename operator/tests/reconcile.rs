//! The reconciler against a scripted API server (kube-rs's tower-test pattern, as controller-rs
//! does it): every request it makes is checked in order — method, path, field manager, body — and
//! answered, each within a one-second timeout.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::spec::InferenceService;
use ferry_operator::desired::Images;
use ferry_operator::metrics::OperatorMetrics;
use ferry_operator::rbac;
use ferry_operator::reconcile::{error_policy, reconcile, Context};
use http::{Request, Response};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::Client;
use serde_json::{json, Value};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const NS: &str = "ml";
const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/ml/deployments/quick";
const SERVICE: &str = "/api/v1/namespaces/ml/services/quick";
const STATUS: &str = "/apis/ferry.dev/v1alpha1/namespaces/ml/inferenceservices/quick/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ml/events";

fn isvc(generation: i64, observed: Option<i64>, max_batch_size: u32) -> InferenceService {
    let mut isvc: InferenceService = serde_json::from_value(json!({
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "quick", "namespace": NS, "uid": "u-1", "generation": generation},
        "spec": {"model": {"name": "quick", "version": "1"}, "batching": {"maxBatchSize": max_batch_size}},
    }))
    .unwrap();
    if let Some(observed) = observed {
        isvc.status =
            Some(serde_json::from_value(json!({"observedGeneration": observed, "desiredReplicas": 2})).unwrap());
    }
    isvc
}

fn context() -> (Arc<Context>, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, NS);
    let reporter = Reporter { controller: "ferry-operator".into(), instance: None };
    let recorder = Recorder::new(client.clone(), reporter);
    let images = Images { sidecar: "ferry-sidecar:test".into() };
    (Arc::new(Context::new(client, images, OperatorMetrics::new(), recorder)), handle)
}

/// The next request must be `method` on `path`, with every `query` part; it is answered with
/// `status` and `reply` (`ECHO`: the request's own body, as the API server returns what it
/// stored). Returns the request's JSON body (null when empty).
async fn expect(handle: &mut Handle, method: &str, path: &str, query: &[&str], status: u16, reply: Value) -> Value {
    let (request, send) = tokio::time::timeout(Duration::from_secs(1), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("no request within 1 s; expected {method} {path}"))
        .expect("the client is still there");
    assert_eq!(request.method().as_str(), method, "method of {}", request.uri());
    let (m, p, q) = (request.method().as_str(), request.uri().path(), request.uri().query().unwrap_or(""));
    assert!(rbac::allows(m, p, q), "{m} {p} is not in the operator's RBAC rules");
    assert_eq!(request.uri().path(), path);
    let q = request.uri().query().unwrap_or("");
    for part in query {
        assert!(q.split('&').any(|p| p == *part), "{path}?{q} lacks {part}");
    }
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() };
    let reply = if reply == ECHO { body.clone() } else { reply };
    let response = Response::builder().status(status).body(Body::from(serde_json::to_vec(&reply).unwrap())).unwrap();
    send.send_response(response);
    body
}

const ECHO: Value = Value::Null;

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

/// What the API server answers a status patch with: the stored object.
fn stored() -> Value {
    serde_json::to_value(isvc(1, None, 32)).unwrap()
}

fn deployment(replicas: i32, ready: i32, generation: i64) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "quick", "namespace": NS, "generation": generation},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"ferry.dev/inference-service": "quick"}},
                 "template": {"spec": {"containers": [{"name": "sidecar"}]}}},
        "status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas, "readyReplicas": ready},
    })
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == type_).unwrap()
}

#[tokio::test]
async fn create_applies_the_deployment_sets_initial_replicas_once_and_reports_progressing() {
    let (ctx, mut api) = context();
    let run = tokio::spawn(reconcile(Arc::new(isvc(1, None, 32)), ctx));

    expect(&mut api, "GET", DEPLOYMENT, &[], 404, not_found()).await;
    let applied =
        expect(&mut api, "PATCH", DEPLOYMENT, &["fieldManager=ferry-operator", "force=true"], 200, deployment(1, 0, 1))
            .await;
    assert!(applied["spec"].get("replicas").is_none(), "the main apply never owns replicas");
    assert_eq!(applied["metadata"]["ownerReferences"][0]["name"], "quick");
    let args = &applied["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(args.as_array().unwrap().contains(&json!("--max-batch-size=32")));
    let replicas =
        expect(&mut api, "PATCH", DEPLOYMENT, &["fieldManager=ferry-autoscaler"], 200, deployment(1, 0, 1)).await;
    // No load yet: the one warm spare (the minimum is 1 too), as the autoscaler's field manager.
    assert_eq!(replicas["spec"], json!({"replicas": 1}));
    let service = expect(&mut api, "PATCH", SERVICE, &["fieldManager=ferry-operator", "force=true"], 200, ECHO).await;
    assert_eq!(service["spec"]["ports"][0]["port"], 80);
    let status = expect(&mut api, "PATCH", STATUS, &[], 200, stored()).await;
    assert_eq!(status["status"]["observedGeneration"], 1);
    assert_eq!(status["status"]["desiredReplicas"], 1);
    assert_eq!(condition(&status, "Ready")["status"], "False");
    assert_eq!(condition(&status, "Progressing")["status"], "True");
    assert_eq!(condition(&status, "Progressing")["message"], "1/1 worker pods updated, 0 ready");
    let event = expect(&mut api, "POST", EVENTS, &[], 201, ECHO).await;
    assert_eq!(event["reason"], "Created");
    assert_eq!(event["type"], "Normal");

    let action = tokio::time::timeout(Duration::from_secs(1), run).await.unwrap().unwrap().unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
}

#[tokio::test]
async fn a_spec_change_is_applied_again_without_touching_replicas() {
    let (ctx, mut api) = context();
    let run = tokio::spawn(reconcile(Arc::new(isvc(2, Some(1), 64)), ctx));

    expect(&mut api, "GET", DEPLOYMENT, &[], 200, deployment(5, 5, 1)).await;
    let applied =
        expect(&mut api, "PATCH", DEPLOYMENT, &["fieldManager=ferry-operator"], 200, deployment(5, 5, 2)).await;
    let args = &applied["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(args.as_array().unwrap().contains(&json!("--max-batch-size=64")));
    // No replicas apply: the next request is the Service.
    expect(&mut api, "PATCH", SERVICE, &["fieldManager=ferry-operator"], 200, ECHO).await;
    let status = expect(&mut api, "PATCH", STATUS, &[], 200, stored()).await;
    assert_eq!(status["status"]["observedGeneration"], 2);
    assert!(status["status"].get("desiredReplicas").is_none(), "the autoscaler's field is left alone");
    assert_eq!(status["status"]["readyReplicas"], 5);
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(condition(&status, "Ready")["reason"], "WorkersReady");
    assert_eq!(condition(&status, "Progressing")["status"], "False");
    let event = expect(&mut api, "POST", EVENTS, &[], 201, ECHO).await;
    assert_eq!(event["reason"], "Updated");
    tokio::time::timeout(Duration::from_secs(1), run).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn an_invalid_spec_is_degraded_not_a_crash_loop() {
    let (ctx, mut api) = context();
    let mut bad = isvc(3, Some(2), 32);
    bad.spec.scaling.min_replicas = 10;
    let run = tokio::spawn(reconcile(Arc::new(bad), ctx));

    // The running Deployment is read (its probe is one input of the desired one), nothing written.
    expect(&mut api, "GET", DEPLOYMENT, &[], 404, not_found()).await;
    let status = expect(&mut api, "PATCH", STATUS, &[], 200, stored()).await;
    let degraded = condition(&status, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "InvalidSpec");
    assert_eq!(degraded["message"], "spec.scaling.minReplicas (10) is more than spec.scaling.maxReplicas (8)");
    let event = expect(&mut api, "POST", EVENTS, &[], 201, ECHO).await;
    assert_eq!(event["type"], "Warning");
    let action = tokio::time::timeout(Duration::from_secs(1), run).await.unwrap().unwrap().unwrap();
    assert_eq!(action, Action::await_change(), "no retry until the spec changes");
}

#[tokio::test]
async fn an_api_error_is_retried_with_exponential_backoff() {
    let (ctx, mut api) = context();
    let object = Arc::new(isvc(1, None, 32));
    let unavailable = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500, "message": "etcdserver: request timed out"});
    let mut event_name = None;
    for wait in [1, 2, 4] {
        let run = tokio::spawn(reconcile(object.clone(), ctx.clone()));
        expect(&mut api, "GET", DEPLOYMENT, &[], 500, unavailable.clone()).await;
        // A Warning event on the object; the repeats join its series (a patch of the same event).
        let event = match &event_name {
            None => expect(&mut api, "POST", EVENTS, &[], 201, ECHO).await,
            Some(name) => expect(&mut api, "PATCH", &format!("{EVENTS}/{name}"), &[], 200, ECHO).await,
        };
        event_name = event["metadata"]["name"].as_str().map(str::to_owned);
        assert_eq!(event["type"], "Warning");
        assert_eq!(event["reason"], "ReconcileFailed");
        let error = tokio::time::timeout(Duration::from_secs(1), run).await.unwrap().unwrap().unwrap_err();
        assert_eq!(error.metric_label(), "get_deployment");
        assert!(error.to_string().starts_with("reading the worker Deployment"), "{error}");
        assert_eq!(error_policy(object.clone(), &error, ctx.clone()), Action::requeue(Duration::from_secs(wait)));
    }
    let metrics = ctx.metrics.render();
    assert!(metrics.contains("ferry_operator_reconcile_failures_total{error=\"get_deployment\"} 3"), "{metrics}");
    assert!(metrics.contains("ferry_operator_reconciles_total 3"));
}

#[test]
fn backoff_doubles_up_to_five_minutes() {
    use ferry_operator::reconcile::backoff;
    let waits: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
    assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
}
