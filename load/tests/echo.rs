//! The echo server (the bare-HTTP reference of the overhead benchmark), and its closed-loop
//! throughput probe. The probe saturates both cores, so it has this test binary to itself: cargo
//! runs test binaries one after another, never beside the timing-sensitive load tests.

use std::time::Duration;

use ferry_load::{echo, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_echo_server_answers_with_the_body_and_sustains_a_closed_loop() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/echo", listener.local_addr().unwrap());
    tokio::spawn(echo::serve(listener));
    let client = run::clients(1).unwrap().remove(0);
    let answer = client.post(&url).body("{\"x\":1}").send().await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "{\"x\":1}");
    let rps = run::max_throughput(&url, 8, Duration::from_millis(500)).await.unwrap();
    assert!(rps > 100.0, "{rps}");
}
