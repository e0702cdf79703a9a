//! Leader election against a scripted API server: take a missing Lease, follow a held one for a
//! whole duration from when it was seen, take it over then, lose a race gracefully, stop leading
//! at the renew deadline when the API stops answering, and release the Lease.

use std::time::Duration;

use ferry_operator::lease::{hold, release, step, Candidate, LeaseConfig};
use ferry_operator::rbac;
use http::{Request, Response};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::client::Body;
use kube::{Api, Client};
use serde_json::{json, Value};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ferry-system/leases";

fn setup() -> (Api<Lease>, Handle, Candidate) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let api = Api::namespaced(Client::new(service, "ferry-system"), "ferry-system");
    (api, handle, Candidate::new(config()))
}

fn config() -> LeaseConfig {
    LeaseConfig {
        name: "ferry-operator".into(),
        identity: "pod-a".into(),
        duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry: Duration::from_secs(2),
    }
}

async fn answer(handle: &mut Handle, method: &str, path: &str, status: u16, reply: Value) -> Value {
    // Generous: under the paused clock this bound must outlast the steps' own sleeps.
    let (request, send) = tokio::time::timeout(Duration::from_secs(60), handle.next_request()).await.unwrap().unwrap();
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
    let (api, mut server, mut candidate) = setup();
    let run = tokio::spawn(async move { (step(&api, &mut candidate).await, candidate) });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 404, not_found()).await;
    let created = answer(&mut server, "POST", PATH, 201, lease("pod-a", 0)).await;
    assert_eq!(created["spec"]["holderIdentity"], "pod-a");
    assert_eq!(created["spec"]["leaseDurationSeconds"], 15);
    let (led, candidate) = run.await.unwrap();
    assert!(led.unwrap(), "we lead");
    assert!(candidate.leading(ferry_core::clock::now()));
}

#[tokio::test(start_paused = true)]
async fn a_held_lease_is_followed_for_a_whole_duration_from_when_it_was_seen_then_taken_over() {
    let (api, mut server, mut candidate) = setup();
    // Renewed a minute ago by its holder's clock: still followed, since this replica has not
    // seen it unrenewed for a whole duration by its own clock.
    let stale = lease("pod-b", 60);
    let run = tokio::spawn(async move {
        let first = step(&api, &mut candidate).await.unwrap();
        tokio::time::sleep(Duration::from_secs(15)).await;
        let second = step(&api, &mut candidate).await.unwrap();
        (first, second)
    });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, stale.clone()).await;
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, stale).await;
    let replaced = answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 200, lease("pod-a", 0)).await;
    assert_eq!(replaced["metadata"]["resourceVersion"], "41", "optimistic concurrency");
    assert_eq!(replaced["spec"]["holderIdentity"], "pod-a");
    assert_eq!(replaced["spec"]["leaseTransitions"], 3);
    assert_eq!(run.await.unwrap(), (false, true));
}

#[tokio::test(start_paused = true)]
async fn losing_the_race_for_an_expired_lease_means_following() {
    let (api, mut server, mut candidate) = setup();
    let run = tokio::spawn(async move {
        assert!(!step(&api, &mut candidate).await.unwrap());
        tokio::time::sleep(Duration::from_secs(15)).await;
        step(&api, &mut candidate).await
    });
    // The same record twice, 15 s apart: expired by this replica's clock.
    let stale = lease("pod-b", 60);
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, stale.clone()).await;
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, stale).await;
    let conflict =
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409});
    answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 409, conflict).await;
    assert!(!run.await.unwrap().unwrap(), "someone else renewed or took it first");
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_api_stops_answering_stops_leading_at_its_renew_deadline() {
    let (api, mut server, _) = setup();
    let (tx, mut leading) = tokio::sync::watch::channel(false);
    tokio::spawn(hold(api, config(), tx));
    let t0 = ferry_core::clock::now();
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 404, not_found()).await;
    answer(&mut server, "POST", PATH, 201, lease("pod-a", 0)).await;
    leading.wait_for(|l| *l).await.unwrap();
    // While the API answers, the leader renews every 2 s and leads past its 10 s deadline.
    for _ in 0..6 {
        answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-a", 0)).await;
        answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 200, lease("pod-a", 0)).await;
    }
    let renewed = ferry_core::clock::now();
    assert!(renewed - t0 >= Duration::from_secs(12) && *leading.borrow(), "still leading after 6 renewals");
    // From now on every request hangs: the renewals time out, and leadership ends at the renew
    // deadline, 10 s after the last renewal began — 5 s before a follower that saw it may take over.
    let mut hung = Vec::new();
    let drain = tokio::spawn(async move {
        while let Some((request, send)) = server.next_request().await {
            assert_eq!(request.method(), "GET");
            hung.push(send);
        }
    });
    leading.wait_for(|l| !*l).await.unwrap();
    // The last renewal began with its GET, just before `renewed`.
    let lost = ferry_core::clock::elapsed(renewed);
    assert!(lost <= Duration::from_secs(10) && lost > Duration::from_millis(9_900), "{lost:?}");
    drain.abort();
}

#[tokio::test]
async fn the_leader_releases_its_lease_on_shutdown() {
    let (api, mut server, _) = setup();
    let run = tokio::spawn(async move { release(&api, &config()).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-a", 1)).await;
    let released = answer(&mut server, "PUT", &format!("{PATH}/ferry-operator"), 200, lease("", 0)).await;
    assert!(released["spec"].get("holderIdentity").is_none_or(|h| h.is_null()), "{released}");
    assert_eq!(released["spec"]["leaseDurationSeconds"], 1);
    run.await.unwrap().unwrap();
    // A Lease someone else holds is left alone.
    let (api, mut server, _) = setup();
    let run = tokio::spawn(async move { release(&api, &config()).await });
    answer(&mut server, "GET", &format!("{PATH}/ferry-operator"), 200, lease("pod-b", 1)).await;
    run.await.unwrap().unwrap();
}
