//! The load generator against a real sidecar (in this process, over real HTTP on 127.0.0.1).
//! Timing-sensitive: the echo server's throughput probe, which saturates both cores, lives in its
//! own test binary (`echo.rs`), which cargo never runs beside this one.

use std::time::Duration;

use ferry_load::record::Summary;
use ferry_load::run::{self, LoadSpec};
use ferry_load::schedule::Arrivals;
use ferry_load::{plot, report};
use ferry_sidecar::server;

/// The two runs of this binary take turns: cargo runs a binary's tests on parallel threads, and two
/// open-loop runs on two cores delay each other's clients by tens of milliseconds (CI saw 50 ms).
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A sidecar on a runtime of its own (its own threads), as a separate process would be, so that
/// the load generator's tasks never queue behind the sidecar's on the test's runtime.
async fn sidecar(args: &[&str]) -> String {
    let mut all: Vec<String> = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"].map(String::from).into();
    all.extend(args.iter().map(|a| a.to_string()));
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async move {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            let (api, _) = server::spawn(&args).await.unwrap();
            tx.send(api).unwrap();
            std::future::pending::<()>().await
        })
    });
    let api = rx.await.unwrap();
    format!("http://{api}/v2/models/m/infer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_run_is_summarised() {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let url =
        sidecar(&["--model", "m", "--sim-batch-time", "20ms", "--max-batch-size", "16", "--latency-budget", "2s"])
            .await;
    let mut spec = LoadSpec::new(url, 200.0, Duration::from_secs(2));
    spec.arrivals = Arrivals::Constant;
    spec.deadline = Duration::from_secs(2);
    spec.send_deadline = true;
    spec.rows = 2;
    let samples = run::run(&spec, false).await.unwrap();
    assert_eq!(samples.len(), 399, "one sample per scheduled request");
    let summary = Summary::of(&samples, spec.duration, Some(16));
    // A 2 s deadline against 20 ms batches at a tenth of capacity: every answer is a 200 in time,
    // however busy the machine; goodput is what was answered in time over the run's length.
    assert_eq!(summary.count("200"), 399, "{:?}", summary.statuses);
    assert_eq!(summary.within_deadline, 1.0);
    assert!((summary.goodput_rps - 399.0 / 2.0).abs() < 1e-9, "{}", summary.goodput_rps);
    let fill = summary.batch_fill.unwrap();
    assert!(fill > 0.1 && fill <= 1.0, "requests shared batches: {fill}");
    let p = summary.latency_ms.clone().unwrap();
    assert!(p.p50 >= 20.0 && p.p99 < 1000.0, "{p:?}");
    assert_eq!(summary.per_second.len(), 2);

    let json = serde_json::to_value(&summary).unwrap();
    for key in
        ["sent", "statuses", "goodput_rps", "within_deadline", "rejected", "latency_ms", "batch_fill", "per_second"]
    {
        assert!(json.get(key).is_some(), "{key} in --json");
    }
    assert!(report::table(&summary).contains(&format!("goodput         {:.1} req/s", summary.goodput_rps)));
    let dir = std::env::temp_dir().join(format!("ferry-load-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("run.svg");
    plot::svg(&summary, 200.0, "test", &svg).unwrap();
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_early_and_never_answered_late() {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    // One worker, 4 rows per 50 ms: 80 req/s of capacity, offered twice that.
    let url =
        sidecar(&["--model", "m", "--sim-batch-time", "50ms", "--max-batch-size", "4", "--latency-budget", "200ms"])
            .await;
    let samples = run::run(&LoadSpec::new(url, 160.0, Duration::from_secs(2)), false).await.unwrap();
    let summary = Summary::of(&samples, Duration::from_secs(2), Some(4));
    assert!(summary.rejected > 0.3, "most of the excess is refused at admission: {:?}", summary.statuses);
    assert_eq!(summary.late_server, 0, "no 200 after its deadline by the sidecar's clock");
    // By the client's clock, a 200 may arrive after its deadline only by the time the request and
    // its answer spend outside the sidecar, which is small even on two busy cores, save for the
    // rare moment the machine does not run the client at all (latency counts from the scheduled
    // send): at most three answers in a hundred past 5 ms, none past 100 ms. (CI once saw two of
    // about 160 past 5 ms — 10 and 50 ms, their server times 160 and 195 ms of a 200 ms budget.)
    let ok: Vec<_> = samples.iter().filter(|s| s.status == Some(200)).collect();
    let late: Vec<(Duration, Option<f64>)> = ok
        .iter()
        .filter(|s| s.latency > s.deadline + Duration::from_millis(5))
        .map(|s| (s.latency - s.deadline, s.server_ms))
        .collect();
    assert!(late.len() * 100 <= 3 * ok.len(), "200s more than 5 ms past their deadline at the client: {late:?}");
    assert!(
        late.iter().all(|(by, _)| *by <= Duration::from_millis(100)),
        "a 200 more than 100 ms past its deadline at the client: {late:?}"
    );
    assert!(summary.count("200") > 80, "{:?}", summary.statuses);
}
