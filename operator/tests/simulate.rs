//! The autoscaling policies compared in simulation (virtual time, seeded): the figures the issue
//! holds Ferry to, and the README's table, which must be what the simulation gives.

use ferry_operator::autoscale::simulate::{self, Outcome, PolicyKind, Scenario, World};

fn get(outcomes: &[Outcome], kind: PolicyKind) -> &Outcome {
    outcomes.iter().find(|o| o.name == kind).unwrap()
}

#[test]
fn on_every_scenario_ferry_meets_its_figures_and_the_readme_shows_them() {
    let world = World::problem_statement();
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    for scenario in Scenario::ALL {
        let outcomes = simulate::compare(&world, scenario);
        let name = scenario.name();
        let (ferry, hpa, oracle) =
            (get(&outcomes, PolicyKind::Ferry), get(&outcomes, PolicyKind::Hpa), get(&outcomes, PolicyKind::Oracle));
        // Once a pod started in reaction to the change could be ready, deadlines are met.
        assert!(ferry.within_deadline_settled >= 0.995, "{name}: {ferry:?}");
        assert!(ferry.peak_replicas <= world.target.max_replicas, "{name}: {ferry:?}");
        // Far fewer GPUs than the HPA-style policy, everywhere.
        assert!(ferry.gpu_seconds <= 0.7 * hpa.gpu_seconds, "{name}: {ferry:?} vs {hpa:?}");
        match scenario {
            // Load that rises over minutes: as many deadlines met as the HPA-style policy meets
            // with three times the GPUs, to within 0.01 percentage points (a handful of the
            // ~360 000 requests: Poisson clumps on one pod).
            Scenario::Ramp | Scenario::Diurnal => {
                assert!(ferry.within_deadline >= hpa.within_deadline - 1e-4, "{name}: {ferry:?} vs {hpa:?}");
            }
            Scenario::Step => assert!(ferry.gpu_seconds <= 1.10 * oracle.gpu_seconds, "{ferry:?} vs {oracle:?}"),
            _ => {}
        }
        let rows = simulate::markdown(scenario, &outcomes);
        assert!(
            readme.contains(&rows),
            "the README's simulation table is stale; regenerate it with \
             `ferry-operator simulate --markdown`. Rows for {name}:\n{rows}"
        );
    }
}

#[test]
fn a_run_is_deterministic_and_its_json_has_the_documented_shape() {
    let world = World::problem_statement();
    let once = simulate::run(&world, Scenario::Spike, PolicyKind::Ferry);
    assert_eq!(once, simulate::run(&world, Scenario::Spike, PolicyKind::Ferry));
    let json = serde_json::json!({"scenario": "spike", "policies": [once]});
    let first = &json["policies"][0];
    for key in ["name", "within_deadline", "within_deadline_settled", "rejected", "gpu_seconds", "peak_replicas"] {
        assert!(first.get(key).is_some(), "{key}");
    }
    assert_eq!(first["name"], "ferry");
}

#[test]
fn scale_to_zero_halves_the_gpu_hours_of_an_office_service_and_answers_everything_in_time_or_at_once() {
    use ferry_operator::autoscale::zero_simulate::{self, Policy};
    let world = zero_simulate::World::office();
    let outcomes = zero_simulate::compare(&world);
    let get = |p: Policy| outcomes.iter().find(|o| o.policy == p).unwrap();
    let (zero, one) = (get(Policy::ScaleToZero), get(Policy::MinOne));
    // Nights at zero: less than 60 % of the GPU-hours of keeping one pod.
    assert!(zero.gpu_hours < 0.6 * one.gpu_hours && zero.hours_at_zero > 20.0, "{zero:?} vs {one:?}");
    // Every request answered in time or refused at once, every refusal's Retry-After honest, nothing
    // held to its deadline, nothing late; some did wait for a start-up (held) and some were refused.
    assert_eq!(zero.in_time + zero.refused, zero.requests, "{zero:?}");
    assert!(zero.refused > 0 && zero.honest_retry_after == zero.refused && zero.held > 0, "{zero:?}");
    assert_eq!((zero.expired, zero.late), (0, 0), "{zero:?}");
    assert_eq!((one.in_time, one.refused), (one.requests, 0), "{one:?}");
    assert_eq!(zero.requests, one.requests, "the same trace");
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let rows = zero_simulate::markdown(&outcomes);
    assert!(
        readme.contains(&rows),
        "the README's scale-to-zero table is stale; regenerate it with `ferry-operator simulate-zero --markdown`:\n{rows}"
    );
}
