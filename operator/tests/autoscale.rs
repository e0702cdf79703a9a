//! The autoscaler's actuation against a scripted API server: it patches replicas as the
//! `ferry-autoscaler` field manager only when the count changes, writes the observed figures and
//! the reason into the status, and records an Event.

use std::time::Duration;

use ferry_core::spec::InferenceService;
use ferry_operator::autoscale::decide::Observed;
use ferry_operator::autoscale::scale::Autoscaler;
use ferry_operator::rbac;
use http::{Request, Response};
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use kube::Client;
use serde_json::{json, Value};
use tokio::time::Instant;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/ml/deployments/quick";
const STATUS: &str = "/apis/ferry.dev/v1alpha1/namespaces/ml/inferenceservices/quick/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ml/events";

fn isvc() -> InferenceService {
    serde_json::from_value(json!({
        "apiVersion": "ferry.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "quick", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {"model": {"name": "quick", "version": "1"}},
    }))
    .unwrap()
}

fn setup() -> (Autoscaler, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "ml");
    let recorder = Recorder::new(client.clone(), Reporter { controller: "ferry-operator".into(), instance: None });
    (Autoscaler::new(client, recorder, Duration::from_secs(10)), handle)
}

async fn expect(
    handle: &mut Handle,
    method: &str,
    path: &str,
    query: &str,
    status: u16,
    reply: Option<Value>,
) -> Value {
    let (request, send) = tokio::time::timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
    assert_eq!((request.method().as_str(), request.uri().path()), (method, path));
    let q = request.uri().query().unwrap_or("").to_owned();
    assert!(q.contains(query), "{path}?{q} lacks {query}");
    assert!(rbac::allows(method, path, &q), "{method} {path} is not in the operator's RBAC rules");
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body: Value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() };
    let reply = reply.unwrap_or_else(|| body.clone());
    send.send_response(
        Response::builder().status(status).body(Body::from(serde_json::to_vec(&reply).unwrap())).unwrap(),
    );
    body
}

fn deployment(replicas: i32) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "quick", "namespace": "ml"},
           "spec": {"replicas": replicas, "selector": {}, "template": {}}})
}

fn load(rate: f64) -> Observed {
    Observed {
        arrival_rate: rate,
        latest_rate: rate,
        rows_per_request: 1.0,
        batch_time: Some(Duration::from_millis(100)),
        queue_depth: 3.0,
        oldest_queue_age: Duration::from_millis(4),
        pressure: 0.0,
        starting: 0,
        settling: 0,
    }
}

#[tokio::test]
async fn more_load_patches_replicas_as_the_autoscaler_and_says_why() {
    let (mut scaler, mut api) = setup();
    let stored = serde_json::to_value(isvc()).unwrap();
    let run = tokio::spawn(async move { scaler.scale(&isvc(), &load(1000.0), Some(0.9), Instant::now()).await });
    expect(&mut api, "GET", DEPLOYMENT, "", 200, Some(deployment(2))).await;
    let patch = expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(deployment(5))).await;
    assert_eq!(patch["spec"], json!({"replicas": 5}), "only the replicas field");
    let status = expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    let s = &status["status"];
    assert_eq!((s["desiredReplicas"].clone(), s["arrivalRate"].clone()), (json!(5), json!(1000.0)));
    assert_eq!((s["queueDepth"].clone(), s["batchFill"].clone()), (json!(3.0), json!(0.9)));
    assert_eq!(s["oldestQueueAge"], json!(0.004));
    assert!(s["lastScaleReason"].as_str().unwrap().starts_with("scale up: 1000 req/s"), "{s}");
    assert!(s.get("lastScaleTime").is_some());
    let event = expect(&mut api, "POST", EVENTS, "", 201, None).await;
    assert_eq!(event["reason"], "Scaled");
    assert!(event["note"].as_str().unwrap().starts_with("2 → 5 replicas: scale up"), "{event}");
    let decision = run.await.unwrap().unwrap().unwrap();
    assert_eq!(decision.replicas, 5);
}

#[tokio::test]
async fn a_steady_count_only_updates_the_status() {
    let (mut scaler, mut api) = setup();
    let stored = serde_json::to_value(isvc()).unwrap();
    // 300 req/s needs 2 (at 256 usable each), plus 1 warm: the 3 there are.
    let run = tokio::spawn(async move { scaler.scale(&isvc(), &load(300.0), None, Instant::now()).await });
    expect(&mut api, "GET", DEPLOYMENT, "", 200, Some(deployment(3))).await;
    let status = expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    assert_eq!(status["status"]["desiredReplicas"], 3);
    assert!(status["status"].get("lastScaleTime").is_none(), "nothing changed");
    assert!(status["status"].get("batchFill").is_none(), "no batch ran");
    assert_eq!(run.await.unwrap().unwrap().unwrap().replicas, 3);
}

#[tokio::test]
async fn nothing_is_scaled_before_the_reconciler_made_the_deployment() {
    let (mut scaler, mut api) = setup();
    let run = tokio::spawn(async move { scaler.scale(&isvc(), &load(1000.0), None, Instant::now()).await });
    let missing = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404});
    expect(&mut api, "GET", DEPLOYMENT, "", 404, Some(missing)).await;
    assert!(run.await.unwrap().unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_scrapes_the_ready_pods_of_each_service_and_scales_it() {
    // A real sidecar stands in for the service's one ready pod, at 127.0.0.1.
    let (api_addr, admin) = ferry_sidecar::server::spawn(&[
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--model",
        "quick",
        "--sim-batch-time",
        "5ms",
    ])
    .await
    .unwrap();
    let http = reqwest::Client::new();
    let body = json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]});
    for _ in 0..5 {
        let r = http.post(format!("http://{api_addr}/v2/models/quick/infer")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let (mut scaler, mut api) = setup();
    scaler.metrics_port = admin.port();
    let stored = serde_json::to_value(isvc()).unwrap();
    let list =
        |items: Vec<Value>, kind: &str| json!({"apiVersion": "v1", "kind": kind, "metadata": {}, "items": items});
    let pod = |name: &str, uid: &str, ready: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "ml", "uid": uid, "labels": {"ferry.dev/inference-service": "quick"}},
               "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": ready}]}})
    };
    let t0 = Instant::now();
    let pods = list(vec![pod("quick-a", "uid-a", "True"), pod("quick-b", "uid-b", "False")], "PodList");
    let isvcs = list(vec![stored.clone()], "InferenceServiceList");
    let mut statuses = Vec::new();
    for round in 0..2u32 {
        if round == 1 {
            for _ in 0..5 {
                let r = http.post(format!("http://{api_addr}/v2/models/quick/infer")).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        }
        let run = tokio::spawn(async move {
            scaler.tick(t0 + Duration::from_secs(2 * u64::from(round))).await.unwrap();
            scaler
        });
        expect(&mut api, "GET", "/apis/ferry.dev/v1alpha1/inferenceservices", "", 200, Some(isvcs.clone())).await;
        expect(&mut api, "GET", "/api/v1/pods", "labelSelector=ferry.dev%2Finference-service", 200, Some(pods.clone()))
            .await;
        expect(&mut api, "GET", DEPLOYMENT, "", 200, Some(deployment(1))).await;
        if round == 1 {
            // Traffic now: 1 replica for the rate plus the warm spare.
            let patch =
                expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(deployment(2))).await;
            assert_eq!(patch["spec"]["replicas"], 2);
        }
        statuses.push(expect(&mut api, "PATCH", STATUS, "", 200, Some(stored.clone())).await);
        if round == 1 {
            expect(&mut api, "POST", EVENTS, "", 201, None).await;
        }
        scaler = run.await.unwrap();
    }
    // One scrape has no rate yet; the second sees the 5 requests of the 2 s between the ticks,
    // from the one ready pod (the unready one is not scraped).
    assert_eq!(statuses[0]["status"]["arrivalRate"], 0.0);
    assert_eq!(statuses[1]["status"]["arrivalRate"], 2.5);
    assert!(statuses[1]["status"]["batchFill"].as_f64().unwrap() > 0.0);
    assert_eq!(statuses[0]["status"]["desiredReplicas"], 1, "no load: the minimum (warm spare included)");
    assert_eq!(statuses[1]["status"]["desiredReplicas"], 2);
}
