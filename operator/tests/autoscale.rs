//! The autoscaler's actuation against a scripted API server: it patches replicas as the
//! `ferry-autoscaler` field manager only when the count changes, writes the observed figures and
//! the reason into the status (typed), records an Event that names the counts, sets deletion
//! costs before a scale-down, and reads everything else from its watches' stores.

use std::time::Duration;

use ferry_core::spec::InferenceService;
use ferry_operator::autoscale::decide::{Observed, Reason};
use ferry_operator::autoscale::scale::{self, Autoscaler, Stores, WorkerPod, DELETION_COST};
use ferry_operator::metrics::OperatorMetrics;
use ferry_operator::rbac;
use http::{Request, Response};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::Client;
use serde_json::{json, Value};

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

fn store<K>(objects: Vec<K>) -> Store<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    reader
}

fn ready_pod(name: &str, work: f64) -> WorkerPod {
    WorkerPod {
        uid: format!("uid-{name}"),
        name: name.into(),
        ip: Some("10.0.0.1".into()),
        ready_for: Some(Duration::from_secs(600)),
        deletion_cost: None,
        work,
        age: Some(Duration::from_secs(900)),
    }
}

fn setup() -> (Autoscaler, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "ml");
    let recorder = Recorder::new(client.clone(), Reporter { controller: "ferry-operator".into(), instance: None });
    (Autoscaler::new(client, recorder, Duration::from_secs(10), OperatorMetrics::new()), handle)
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

fn deployment(replicas: i32) -> Deployment {
    serde_json::from_value(json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "quick", "namespace": "ml", "labels": {"ferry.dev/inference-service": "quick"}},
        "spec": {"replicas": replicas, "selector": {}, "template": {}}}))
    .unwrap()
}

fn load(rate: f64) -> Observed {
    Observed {
        arrival_rate: rate,
        latest_rate: rate,
        window_seconds: f64::INFINITY,
        latest_seconds: f64::INFINITY,
        rows_per_request: 1.0,
        batch_time: Some(Duration::from_millis(100)),
        queue_depth: 3.0,
        oldest_queue_age: Duration::from_millis(4),
        pressure: 0.0,
        starting: 0,
        settling: 0,
        stuck: 0,
        rolling_out: false,
        locked: 0,
        capacity: None,
        queue_tokens: 0.0,
        prefill_rate: None,
        tokens_rate: 0.0,
        kv_usage: None,
    }
}

#[tokio::test]
async fn more_load_patches_replicas_as_the_autoscaler_and_says_why() {
    let (mut scaler, mut api) = setup();
    let stored = serde_json::to_value(isvc()).unwrap();
    let pods = vec![ready_pod("a", 1.0), ready_pod("b", 2.0)];
    let run = tokio::spawn(async move {
        scaler.act(&isvc(), &deployment(2), &pods, load(1000.0), Some(0.9), ferry_core::clock::now()).await
    });
    let reply = serde_json::to_value(deployment(5)).unwrap();
    let patch = expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(reply)).await;
    assert_eq!(patch["spec"], json!({"replicas": 5}), "only the replicas field");
    let status = expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    let s = &status["status"];
    assert_eq!((s["desiredReplicas"].clone(), s["arrivalRate"].clone()), (json!(5), json!(1000.0)));
    assert_eq!((s["queueDepth"].clone(), s["batchFill"].clone()), (json!(3.0), json!(0.9)));
    assert_eq!(s["oldestQueueAge"], json!(0.004));
    // The default sim engine: 32 rows per 100 ms batch; a request-level service has no tokens or KV.
    assert_eq!(s["capacityPerReplica"], json!(320.0));
    assert!(s.get("tokensPerSecond").is_none() && s.get("kvUsage").is_none());
    assert_eq!(s["startupTime"], json!(60.0), "spec.scaling.startupTime until one is measured");
    assert!(s.get("measuredStartupTime").is_none());
    assert!(s.get("replicas").is_none() && s.get("conditions").is_none(), "the reconciler's fields are left alone");
    assert!(s["lastScaleReason"].as_str().unwrap().starts_with("scale up: 1000 req/s"), "{s}");
    assert!(s.get("lastScaleTime").is_some());
    let event = expect(&mut api, "POST", EVENTS, "", 201, None).await;
    assert_eq!((event["reason"].clone(), event["action"].clone()), (json!("Scaled"), json!("Scale 2 to 5")));
    assert!(event["note"].as_str().unwrap().starts_with("2 → 5 replicas: scale up"), "{event}");
    let decision = run.await.unwrap().unwrap().unwrap();
    assert_eq!((decision.replicas, decision.reason), (5, Reason::Load));
}

#[tokio::test]
async fn a_steady_count_only_updates_the_status() {
    let (mut scaler, mut api) = setup();
    let stored = serde_json::to_value(isvc()).unwrap();
    // 300 req/s needs 2 (at 256 usable each), plus 1 warm: the 3 there are.
    let pods = vec![ready_pod("a", 0.0), ready_pod("b", 0.0), ready_pod("c", 0.0)];
    let run = tokio::spawn(async move {
        scaler.act(&isvc(), &deployment(3), &pods, load(300.0), None, ferry_core::clock::now()).await
    });
    let status = expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    assert_eq!(status["status"]["desiredReplicas"], 3);
    assert!(status["status"].get("lastScaleTime").is_none(), "nothing changed");
    assert!(status["status"].get("batchFill").is_none(), "no batch ran");
    assert_eq!(run.await.unwrap().unwrap().unwrap().replicas, 3);
}

#[tokio::test]
async fn a_scale_down_first_marks_the_pods_with_the_least_work_as_cheapest_to_delete() {
    let (mut scaler, mut api) = setup();
    let mut quick = isvc();
    quick.spec.scaling.scale_down_delay = ferry_core::spec::GatewayDuration::new("0s");
    let stored = serde_json::to_value(&quick).unwrap();
    // No load on 3 replicas, no delay: down to the one warm spare.
    let mut idle = ready_pod("c", 0.0);
    idle.deletion_cost = Some("0".into());
    let pods = vec![ready_pod("a", 7.4), ready_pod("b", 2.0), idle];
    let run = tokio::spawn(async move {
        let idle = Observed { queue_depth: 9.4, ..load(0.0) };
        scaler.act(&quick, &deployment(3), &pods, idle, None, ferry_core::clock::now()).await
    });
    let a = expect(&mut api, "PATCH", "/api/v1/namespaces/ml/pods/a", "", 200, Some(json!({}))).await;
    assert_eq!(a, json!({"metadata": {"annotations": {DELETION_COST: "7"}}}));
    let b = expect(&mut api, "PATCH", "/api/v1/namespaces/ml/pods/b", "", 200, Some(json!({}))).await;
    assert_eq!(b["metadata"]["annotations"][DELETION_COST], "2");
    // Pod c already says 0: no call. Then the replicas.
    let reply = serde_json::to_value(deployment(1)).unwrap();
    let patch = expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(reply)).await;
    assert_eq!(patch["spec"]["replicas"], 1);
    expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    let event = expect(&mut api, "POST", EVENTS, "", 201, None).await;
    assert_eq!(event["action"], "Scale 3 to 1");
    assert_eq!(run.await.unwrap().unwrap().unwrap().reason, Reason::ScaleDown);
}

#[tokio::test]
/// A fresh operator (its window of needs not a minute old yet) holds the replicas while a pod
/// starts: it does not know what the starting pod was asked for.
async fn a_starting_pod_holds_a_scale_down_back_while_the_window_is_new() {
    let (mut scaler, mut api) = setup();
    let mut quick = isvc();
    quick.spec.scaling.scale_down_delay = ferry_core::spec::GatewayDuration::new("0s");
    let stored = serde_json::to_value(&quick).unwrap();
    let warming = WorkerPod { ip: None, ready_for: None, age: Some(Duration::from_secs(20)), ..ready_pod("c", 0.0) };
    let pods = vec![ready_pod("a", 0.0), ready_pod("b", 0.0), warming];
    let run = tokio::spawn(async move {
        scaler.act(&quick, &deployment(3), &pods, load(0.0), None, ferry_core::clock::now()).await
    });
    // No deletion costs, no replicas patch: only the status.
    let status = expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    assert_eq!(status["status"]["desiredReplicas"], 3);
    assert_eq!(run.await.unwrap().unwrap().unwrap().reason, Reason::Warming);
}

#[tokio::test]
async fn a_pod_unready_for_far_longer_than_a_start_up_is_stuck_not_starting() {
    let (mut scaler, mut api) = setup();
    let mut quick = isvc();
    quick.spec.scaling.scale_down_delay = ferry_core::spec::GatewayDuration::new("0s");
    let stored = serde_json::to_value(&quick).unwrap();
    // Unschedulable for 10 minutes (startupTime 60 s): it holds the scale-down back no longer.
    let stuck = WorkerPod { ip: None, ready_for: None, age: Some(Duration::from_secs(600)), ..ready_pod("c", 0.0) };
    let pods = vec![ready_pod("a", 0.0), ready_pod("b", 0.0), stuck];
    let run = tokio::spawn(async move {
        scaler.act(&quick, &deployment(3), &pods, load(0.0), None, ferry_core::clock::now()).await
    });
    for pod in ["a", "b"] {
        expect(&mut api, "PATCH", &format!("/api/v1/namespaces/ml/pods/{pod}"), "", 200, Some(json!({}))).await;
    }
    let reply = serde_json::to_value(deployment(1)).unwrap();
    expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(reply)).await;
    expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    expect(&mut api, "POST", EVENTS, "", 201, None).await;
    assert_eq!(run.await.unwrap().unwrap().unwrap().reason, Reason::ScaleDown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_scrapes_the_ready_pods_of_each_service_from_its_stores_and_scales_it() {
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
    let pod = |name: &str, uid: &str, ready: &str, ip: &str| {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "ml", "uid": uid, "labels": {"ferry.dev/inference-service": "quick"},
                            "creationTimestamp": "2026-12-02T08:00:00Z"},
               "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready,
                                                        "lastTransitionTime": "2026-12-02T08:00:45Z"}]}}))
        .unwrap()
    };
    // The unready pod's IP answers nothing: it must not be scraped (a scrape would time out
    // and count a failure).
    let stores = Stores {
        services: store(vec![isvc()]),
        deployments: store(vec![deployment(1)]),
        pods: store(vec![pod("quick-a", "uid-a", "True", "127.0.0.1"), pod("quick-b", "uid-b", "False", "192.0.2.1")]),
        holders: None,
    };
    let t0 = ferry_core::clock::now();
    let wall: Timestamp = "2026-12-02T08:02:00Z".parse().unwrap();
    let mut statuses = Vec::new();
    for round in 0..2u32 {
        if round == 1 {
            for _ in 0..5 {
                let r = http.post(format!("http://{api_addr}/v2/models/quick/infer")).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        }
        let stores = stores.clone();
        let run = tokio::spawn(async move {
            let at = Duration::from_secs(2 * u64::from(round));
            scaler.tick(&stores, t0 + at, wall + at).await;
            scaler
        });
        if round == 1 {
            // Traffic now: 1 replica for the rate plus the warm spare.
            let reply = serde_json::to_value(deployment(2)).unwrap();
            let patch = expect(&mut api, "PATCH", DEPLOYMENT, "fieldManager=ferry-autoscaler", 200, Some(reply)).await;
            assert_eq!(patch["spec"]["replicas"], 2);
        }
        statuses.push(expect(&mut api, "PATCH", STATUS, "", 200, Some(stored.clone())).await);
        if round == 1 {
            expect(&mut api, "POST", EVENTS, "", 201, None).await;
        }
        scaler = run.await.unwrap();
    }
    // One scrape has no rate yet; the second sees the 5 requests of the 2 s between the ticks,
    // from the one ready pod.
    assert_eq!(statuses[0]["status"]["arrivalRate"], 0.0);
    assert_eq!(statuses[1]["status"]["arrivalRate"], 2.5);
    assert!(statuses[1]["status"]["batchFill"].as_f64().unwrap() > 0.0);
    assert_eq!(statuses[0]["status"]["desiredReplicas"], 1, "no load: the warm spare");
    assert_eq!(statuses[1]["status"]["desiredReplicas"], 2);
    // The ready pod took 45 s from creation to Ready: that is the service's time-to-ready now.
    assert_eq!(statuses[0]["status"]["measuredStartupTime"], 45.0);
    assert_eq!(statuses[0]["status"]["startupTime"], 45.0);
    assert!(tokio::time::timeout(Duration::from_millis(50), api.next_request()).await.is_err(), "no other call");
}

#[tokio::test]
async fn a_service_without_its_deployment_yet_is_left_alone_and_a_deleted_one_forgotten() {
    let (service, mut api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "ml");
    let recorder = Recorder::new(client.clone(), Reporter { controller: "ferry-operator".into(), instance: None });
    let metrics = OperatorMetrics::new();
    let mut scaler = Autoscaler::new(client, recorder, Duration::from_secs(10), metrics.clone());
    let stores =
        Stores { services: store(vec![isvc()]), deployments: store(vec![]), pods: store(vec![]), holders: None };
    scaler.tick(&stores, ferry_core::clock::now(), Timestamp::now()).await;
    assert!(tokio::time::timeout(Duration::from_millis(50), api.next_request()).await.is_err(), "no API call");
    assert_eq!(scaler.remembered(), vec!["ml/quick".to_owned()]);
    assert!(!metrics.render().contains("ferry_operator_scale_decisions_total{"), "no decision without a Deployment");
    // The service is deleted: its history goes with it.
    let gone = Stores { services: store(vec![]), ..stores };
    scaler.tick(&gone, ferry_core::clock::now(), Timestamp::now()).await;
    assert!(scaler.remembered().is_empty());
}

#[tokio::test]
async fn decisions_are_counted_by_reason() {
    let (service, mut api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "ml");
    let recorder = Recorder::new(client.clone(), Reporter { controller: "ferry-operator".into(), instance: None });
    let metrics = OperatorMetrics::new();
    let mut scaler = Autoscaler::new(client, recorder, Duration::from_secs(10), metrics.clone());
    let stored = serde_json::to_value(isvc()).unwrap();
    let pods = vec![ready_pod("a", 0.0), ready_pod("b", 0.0), ready_pod("c", 0.0)];
    let run = tokio::spawn(async move {
        let decided = scaler.act(&isvc(), &deployment(3), &pods, load(300.0), None, ferry_core::clock::now()).await;
        (scaler, decided)
    });
    expect(&mut api, "PATCH", STATUS, "", 200, Some(stored)).await;
    let (mut scaler, decided) = run.await.unwrap();
    decided.unwrap();
    let text = metrics.render();
    // The text format orders labels by name.
    let series = |name: &str, extra: &str| {
        let (before, after) = if extra.starts_with(",b") { (&extra[1..], "") } else { ("", extra) };
        let sep = if before.is_empty() { "" } else { "," };
        format!("{name}{{{before}{sep}inferenceservice=\"quick\",namespace=\"ml\"{after}}}")
    };
    for line in [
        format!("{} 1", series("ferry_operator_scale_decisions_total", ",reason=\"steady\"")),
        format!("{} 3", series("ferry_operator_replicas", ",state=\"desired\"")),
        format!("{} 3", series("ferry_operator_replicas", ",state=\"ready\"")),
        format!("{} 0", series("ferry_operator_replicas", ",state=\"starting\"")),
        format!("{} 8", series("ferry_operator_replica_limit", ",bound=\"max\"")),
        format!("{} 300", series("ferry_operator_offered_requests_per_second", "")),
        format!("{} 60", series("ferry_operator_startup_seconds", ",source=\"configured\"")),
    ] {
        assert!(text.lines().any(|l| l == line), "no line {line} in\n{text}");
    }
    // The service is deleted: its series go with it.
    let gone = Stores { services: store(vec![]), deployments: store(vec![]), pods: store(vec![]), holders: None };
    scaler.tick(&gone, ferry_core::clock::now(), Timestamp::now()).await;
    let text = metrics.render();
    assert!(!text.contains("inferenceservice=\"quick\""), "{text}");
}

#[test]
fn a_generation_services_target_carries_its_first_token_budget() {
    let generation = |generation: Value| -> InferenceService {
        serde_json::from_value(json!({
            "apiVersion": "ferry.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-2", "generation": 1},
            "spec": {"model": {"name": "chat", "version": "1"}, "engine": {"kind": "sim-llm"}, "generation": generation},
        }))
        .unwrap()
    };
    let budget = |isvc: &InferenceService| scale::target(isvc, None).expect("a valid spec").ttft_budget;
    assert_eq!(budget(&generation(json!({"ttftBudget": "250ms"}))), Some(Duration::from_millis(250)));
    assert_eq!(budget(&generation(json!({}))), Some(Duration::from_secs(1)), "the sidecar's default");
    assert_eq!(budget(&isvc()), None, "a request-level service prefills nothing");
}
