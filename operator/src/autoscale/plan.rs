//! Capacity planning: how many replicas a load needs, first by arithmetic (full batches, no
//! waiting), then by simulation — the sidecar's own dispatch rule and admission, replayed in
//! virtual time on Poisson arrivals — because a replica at 100 % of its arithmetic capacity
//! misses deadlines.

use std::time::Duration;

use ferry_core::estimate::Estimator;
use ferry_core::replay::{replay, Arrival, Fate};
use ferry_core::scheduler::{capacity, Policy, Scheduler};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct PlanInput {
    /// Requests per second (one row each).
    pub rate: f64,
    pub batch_time: Duration,
    pub max_batch_size: u32,
    pub max_wait: Duration,
    pub latency_budget: Duration,
    /// Workers (concurrent batches) per replica.
    pub workers: u32,
    /// Share of requests that must be answered within their deadline.
    pub goal: f64,
    /// Virtual seconds simulated per replica count.
    pub seconds: u64,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanRow {
    pub replicas: u32,
    /// Offered load over arithmetic capacity.
    pub utilization: f64,
    pub within_deadline: f64,
    pub refused: f64,
    /// Of answered requests, in ms.
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Plan {
    pub capacity_per_replica: f64,
    pub arithmetic: u32,
    /// The fewest replicas meeting the goal in simulation (none within the rows tried).
    pub simulated: Option<u32>,
    pub rows: Vec<PlanRow>,
}

/// One replica receiving `rate` req/s (random routing splits a Poisson stream into Poisson
/// streams), replayed for `seconds`.
fn simulate(input: &PlanInput, rate: f64, seed: u64) -> (f64, f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut t, end) = (0.0, input.seconds as f64);
    let mut arrivals = Vec::new();
    let timeout = input.latency_budget.as_millis() as u64;
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        if t >= end {
            break;
        }
        let mut a = Arrival::new(0, timeout);
        a.at = Duration::from_secs_f64(t);
        arrivals.push(a);
    }
    let policy = Policy {
        max_batch_rows: input.max_batch_size,
        max_wait: input.max_wait,
        deadline_margin: Duration::ZERO,
        max_queue: 1 << 20,
        max_queue_bytes: u64::MAX,
    };
    let scheduler = Scheduler::new(policy, input.workers as usize, Estimator::new(input.batch_time, Duration::ZERO));
    let batch_time = input.batch_time;
    let trace = replay(scheduler, move |_| batch_time, &arrivals);
    let mut latencies = Vec::new();
    let (mut ok, mut refused) = (0usize, 0usize);
    for (a, fate) in arrivals.iter().zip(&trace.fates) {
        match fate {
            Some(Fate::Done { finished, .. }) => {
                ok += 1;
                latencies.push(*finished - a.at);
            }
            Some(Fate::Refused { .. }) => refused += 1,
            _ => {}
        }
    }
    latencies.sort();
    let n = arrivals.len().max(1) as f64;
    let p99 = latencies.get(((latencies.len() as f64 * 0.99) as usize).min(latencies.len().saturating_sub(1)));
    (ok as f64 / n, refused as f64 / n, p99.map_or(0.0, |d| d.as_secs_f64() * 1000.0))
}

pub fn plan(input: &PlanInput) -> Plan {
    let capacity = capacity::per_replica(input.workers, input.max_batch_size, input.batch_time, 1.0);
    let arithmetic = (input.rate / capacity).ceil().max(1.0) as u32;
    let mut rows = Vec::new();
    let mut simulated = None;
    for replicas in arithmetic..arithmetic + 6 {
        let (within, refused, p99) =
            simulate(input, input.rate / f64::from(replicas), input.seed + u64::from(replicas));
        rows.push(PlanRow {
            replicas,
            utilization: input.rate / (capacity * f64::from(replicas)),
            within_deadline: within,
            refused,
            p99_ms: p99,
        });
        if within >= input.goal {
            simulated = Some(replicas);
            break;
        }
    }
    Plan { capacity_per_replica: capacity, arithmetic, simulated, rows }
}

/// The plan as a table for people.
pub fn table(input: &PlanInput, plan: &Plan) -> String {
    let mut out = String::from("replicas  utilization  within deadline  refused  p99 (ms)\n");
    for r in &plan.rows {
        out += &format!(
            "{:>8}  {:>10.0} %  {:>13.2} %  {:>5.2} %  {:>8.1}\n",
            r.replicas,
            r.utilization * 100.0,
            r.within_deadline * 100.0,
            r.refused * 100.0,
            r.p99_ms
        );
    }
    let replicas = |n: u32| format!("{n} replica{}", if n == 1 { "" } else { "s" });
    out += &format!(
        "arithmetic lower bound: {} ({:.0} req/s over {:.0} req/s per replica at full batches)\n",
        replicas(plan.arithmetic),
        input.rate,
        plan.capacity_per_replica
    );
    out += &match plan.simulated {
        Some(n) => format!(
            "simulated answer: {} ({:.1} % of requests within their {} ms deadline, {} s of Poisson arrivals)\n",
            replicas(n),
            input.goal * 100.0,
            input.latency_budget.as_millis(),
            input.seconds
        ),
        None => format!("simulated answer: more than {} replicas\n", plan.rows.last().map_or(0, |r| r.replicas)),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_problem_statement_needs_more_than_its_arithmetic() {
        let input = PlanInput {
            rate: 1000.0,
            batch_time: Duration::from_millis(100),
            max_batch_size: 32,
            max_wait: Duration::from_millis(10),
            latency_budget: Duration::from_millis(200),
            workers: 1,
            goal: 0.99,
            seconds: 30,
            seed: 1,
        };
        let plan = plan(&input);
        assert_eq!(plan.capacity_per_replica, 320.0);
        assert_eq!(plan.arithmetic, 4, "1000 / 320, rounded up");
        let at_four = &plan.rows[0];
        assert!((at_four.utilization - 0.78125).abs() < 1e-9);
        let answer = plan.simulated.expect("a few replicas more suffice");
        assert!(answer >= 4, "{plan:?}");
        let chosen = plan.rows.iter().find(|r| r.replicas == answer).unwrap();
        assert!(chosen.within_deadline >= 0.99 && chosen.p99_ms <= 200.0, "{chosen:?}");
        assert!(table(&input, &plan).contains("arithmetic lower bound: 4 replicas (1000 req/s over 320 req/s"));
    }
}
