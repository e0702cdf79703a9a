//! The autoscaling policies compared in simulation (virtual time, seeded): the figures the issue
//! holds Ferry to.

use ferry_operator::autoscale::simulate::{self, PolicyKind, Scenario, World};

#[test]
fn on_a_step_ferry_meets_deadlines_after_start_up_at_no_more_than_the_oracles_gpu_seconds() {
    let world = World::problem_statement();
    let outcomes = simulate::compare(&world, Scenario::Step);
    let get = |k| outcomes.iter().find(|o| o.name == k).unwrap();
    let (ferry, oracle) = (get(PolicyKind::Ferry), get(PolicyKind::Oracle));
    assert!(ferry.within_deadline_settled >= 0.99, "{ferry:?}");
    assert!(ferry.gpu_seconds <= 1.15 * oracle.gpu_seconds, "{ferry:?} vs {oracle:?}");
    assert!(ferry.peak_replicas <= world.target.max_replicas);
    // The JSON the command prints has the documented shape.
    let json = serde_json::json!({"scenario": "step", "policies": outcomes});
    let first = &json["policies"][0];
    for key in ["name", "within_deadline", "rejected", "gpu_seconds", "peak_replicas"] {
        assert!(first.get(key).is_some(), "{key}");
    }
    assert_eq!(first["name"], "ferry");
}

#[test]
fn on_every_scenario_ferry_uses_fewer_gpu_seconds_than_the_hpa_style_policy() {
    let world = World::problem_statement();
    for scenario in Scenario::ALL {
        let outcomes = simulate::compare(&world, scenario);
        let get = |k| outcomes.iter().find(|o| o.name == k).unwrap();
        let (ferry, hpa) = (get(PolicyKind::Ferry), get(PolicyKind::Hpa));
        assert!(ferry.gpu_seconds <= hpa.gpu_seconds, "{}: {ferry:?} vs {hpa:?}", scenario.name());
        assert!(ferry.peak_replicas <= world.target.max_replicas, "{}: {ferry:?}", scenario.name());
    }
}

#[test]
fn a_run_is_deterministic() {
    let world = World::problem_statement();
    assert_eq!(
        simulate::run(&world, Scenario::Spike, PolicyKind::Ferry),
        simulate::run(&world, Scenario::Spike, PolicyKind::Ferry)
    );
}
