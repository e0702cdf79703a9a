//! Leader election against a scripted API server: take a missing or expired Lease, follow a
//! fresh one, and lose a race gracefully.

use std::time::Duration;

use ferry_operator::lease::{step, LeaseConfig};
use ferry_operator::rbac;
use http::{Request, Response};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::client::Body;
use kube::{Api, Client};
use serde_json::{json, Value};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ferry-system/leases";

fn setup() -> (Api<Lease>, Handle, LeaseConfig) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let api = Api::namespaced(Client::new(service, "ferry-system"), "ferry-system");
    let config = LeaseConfig {
        name: "ferry-operator".into(),
        identity: "pod-a".into(),
        duration: Duration::from_secs(15),
        retry: Duration::from_secs(4),
    };
    (api, handle, config)
}

async fn answer(handle: &mut Handle, method: &str, path: &str, status: u16, reply: Value) -> Value {
    let (request, send) = tokio::time::timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
    assert_eq!((request.method().as_str(), request.uri().path()), (method, path));
    assert!(rbac::allows(method, path, ""), "{method} {path} is not in the operator's RBAC rules");
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() };
    send.send_response(
        Response::builder().status(status).body(Body::from(serde_json::to_vec(&reply).unwrap())).unwrap(),
    );
    body
}

fn lease(holder: &str, renewed_ago: i64) -> Value {
    let renewed = Timestamp::now() - SignedDuration::from_secs(renewed_ago);
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "ferry-operator", "namespace": "ferry-system", "resourceVersion": "41"},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renewed.to_string(), "leaseTransitions": 2},
    })
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})
}

#[tokio::test]
async fn a_missing_lease_is_created_and_held() {
    let (api, mut server, config) = setup();
    let run = tokio::spawn(async move { step(&api, &config).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 404, not_found()).await;
    let created = answer(&mut server, "POST", PATH, 201, lease("pod-a", 0)).await;
    assert_eq!(created["spec"]["holderIdentity"], "pod-a");
    assert_eq!(created["spec"]["leaseDurationSeconds"], 15);
    assert!(run.await.unwrap().unwrap(), "we lead");
}

#[tokio::test]
async fn a_fresh_lease_of_another_replica_is_followed() {
    let (api, mut server, config) = setup();
    let run = tokio::spawn(async move { step(&api, &config).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-b", 3)).await;
    assert!(!run.await.unwrap().unwrap(), "pod-b leads; nothing is written");
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_its_resource_version() {
    let (api, mut server, config) = setup();
    let run = tokio::spawn(async move { step(&api, &config).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-b", 60)).await;
    let replaced = answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 200, lease("pod-a", 0)).await;
    assert_eq!(replaced["metadata"]["resourceVersion"], "41", "optimistic concurrency");
    assert_eq!(replaced["spec"]["holderIdentity"], "pod-a");
    assert_eq!(replaced["spec"]["leaseTransitions"], 3);
    assert!(run.await.unwrap().unwrap());
}

#[tokio::test]
async fn losing_the_race_for_an_expired_lease_means_following() {
    let (api, mut server, config) = setup();
    let run = tokio::spawn(async move { step(&api, &config).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-b", 60)).await;
    let conflict =
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409});
    answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 409, conflict).await;
    assert!(!run.await.unwrap().unwrap(), "someone else renewed or took it first");
}
