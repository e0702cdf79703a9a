//! Capacity planning for a generation service: how many pods a load of streams needs, first by
//! arithmetic — one pod's capacity from its step cost, the requests' shape, the three targets
//! and its limits ([`ferry_core::generation::capacity`]) — then checked by simulation: one pod's
//! share of Poisson arrivals (random routing splits a Poisson stream into Poisson streams)
//! replayed through the generation ledger in virtual time ([`ferry_core::generation::trial`]).

use std::time::Duration;

use ferry_core::generation::capacity::{capacity, Capacity, Limits, RequestShape, Targets};
use ferry_core::generation::step::StepCost;
use ferry_core::generation::trial::{trial, Trial};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct GenerationPlanInput {
    /// Requests a second across the service.
    pub rate: f64,
    pub prompt: u32,
    pub output: u32,
    pub targets: Targets,
    pub cost: StepCost,
    pub limits: Limits,
    /// Share of requests that must keep all three deadlines.
    pub goal: f64,
    /// Virtual seconds simulated per pod count (the first fifth fills the pod and is not counted).
    pub seconds: u64,
    pub seed: u64,
}

/// The request rate that keeps `users` streams going at once when each receives
/// `tokens_per_second` of `output` tokens: a stream lasts `output / tokens_per_second` seconds
/// (Little's law).
pub fn rate_for_users(users: f64, output: u32, tokens_per_second: f64) -> f64 {
    users * tokens_per_second / f64::from(output.max(1))
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GenerationPlanRow {
    pub pods: u32,
    /// Each pod's share of the rate.
    pub rate_per_pod: f64,
    /// Share of the counted requests that kept all three deadlines, and share refused.
    pub kept: f64,
    pub refused: f64,
    pub ttft_p99_ms: f64,
    pub itl_p99_ms: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GenerationPlan {
    pub requests_per_pod: f64,
    pub tokens_per_pod: f64,
    /// Sequences decoding in a pod's step at that rate, and the step's mean length.
    pub running_per_pod: f64,
    pub step_ms: f64,
    /// What bounds a pod.
    pub bound: &'static str,
    pub arithmetic: u32,
    /// The fewest pods keeping the goal in simulation (none within the rows tried).
    pub simulated: Option<u32>,
    pub rows: Vec<GenerationPlanRow>,
}

fn tried(input: &GenerationPlanInput, rate: f64, seed: u64) -> Trial {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut t, end) = (0.0, input.seconds as f64);
    let mut at = Vec::new();
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        if t >= end {
            break;
        }
        at.push(Duration::from_secs_f64(t));
    }
    let settle = Duration::from_secs(input.seconds / 5);
    trial(input.cost, (input.prompt, input.output), &input.targets, &input.limits, &at, settle)
}

pub fn plan(input: &GenerationPlanInput) -> GenerationPlan {
    let shape = RequestShape { prompt: f64::from(input.prompt), output: f64::from(input.output) };
    let pod: Capacity = capacity(&input.cost, &shape, &input.targets, &input.limits);
    let arithmetic = if pod.requests_per_second > 0.0 {
        (input.rate / pod.requests_per_second).ceil().clamp(1.0, f64::from(u32::MAX)) as u32
    } else {
        1
    };
    let mut rows = Vec::new();
    let mut simulated = None;
    // From one pod fewer than the arithmetic (the figure is tight: that may be enough) to the
    // arithmetic at least, then up to a few more until the goal is kept.
    for pods in arithmetic.saturating_sub(1).max(1)..arithmetic.saturating_add(5) {
        let rate = input.rate / f64::from(pods);
        let t = tried(input, rate, input.seed + u64::from(pods));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        rows.push(GenerationPlanRow {
            pods,
            rate_per_pod: rate,
            kept: t.kept,
            refused: t.refused,
            ttft_p99_ms: ms(t.ttft_p99),
            itl_p99_ms: ms(t.itl_p99),
        });
        if t.kept >= input.goal {
            simulated.get_or_insert(pods);
            if pods >= arithmetic {
                break;
            }
        }
    }
    GenerationPlan {
        requests_per_pod: pod.requests_per_second,
        tokens_per_pod: pod.tokens_per_second,
        running_per_pod: pod.running,
        step_ms: pod.step.as_secs_f64() * 1e3,
        bound: pod.bound.as_str(),
        arithmetic,
        simulated,
        rows,
    }
}

/// The plan for people: the arithmetic row by row, then the simulated check.
pub fn table(input: &GenerationPlanInput, plan: &GenerationPlan) -> String {
    let ms = |d: Duration| d.as_millis();
    let mut out = format!(
        "one pod: {:.1} req/s, {:.0} tokens/s, {:.1} sequences decoding in steps of {:.1} ms (bound: {})\n",
        plan.requests_per_pod, plan.tokens_per_pod, plan.running_per_pod, plan.step_ms, plan.bound
    );
    let pods = |n: u32| format!("{n} pod{}", if n == 1 { "" } else { "s" });
    out += &format!(
        "arithmetic: {} ({:.1} req/s of {} + {} tokens over {:.1} req/s per pod, first token within {} ms, \
         {} ms between tokens, all within {} ms, for {:.1} % of requests)\n",
        pods(plan.arithmetic),
        input.rate,
        input.prompt,
        input.output,
        plan.requests_per_pod,
        ms(input.targets.ttft),
        ms(input.targets.itl),
        ms(input.targets.timeout),
        100.0 - 100.0 * ferry_core::generation::capacity::TAIL,
    );
    out += "pods  req/s per pod  all deadlines met  refused  TTFT p99 (ms)  ITL p99 (ms)\n";
    for r in &plan.rows {
        out += &format!(
            "{:>4}  {:>13.2}  {:>15.2} %  {:>5.2} %  {:>13.0}  {:>12.1}\n",
            r.pods,
            r.rate_per_pod,
            r.kept * 100.0,
            r.refused * 100.0,
            r.ttft_p99_ms,
            r.itl_p99_ms
        );
    }
    out += &match plan.simulated {
        Some(n) => format!(
            "simulated answer: {} ({:.1} % of requests keep all three deadlines, {} s of Poisson arrivals a pod)\n",
            pods(n),
            input.goal * 100.0,
            input.seconds
        ),
        None => format!("simulated answer: more than {}\n", pods(plan.rows.last().map_or(0, |r| r.pods))),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// `examples/generation.yaml`'s pods: sim-llm at 10 ms a step, 200 µs a decoding sequence,
    /// 50 µs a prompt token; 64 sequences, 2048 tokens a step, 4096 blocks of 16.
    fn example(rate: f64) -> GenerationPlanInput {
        GenerationPlanInput {
            rate,
            prompt: 100,
            output: 256,
            targets: Targets { ttft: 1000 * MS, itl: 100 * MS, timeout: 26_600 * MS, margin: 2 * MS },
            cost: StepCost {
                fixed: 10 * MS,
                per_decode: Duration::from_micros(200),
                per_prefill_token: Duration::from_micros(50),
                ..StepCost::default()
            },
            limits: Limits { blocks: 4096, block_size: 16, watermark: 40, max_sequences: 64, max_batch_tokens: 2048 },
            goal: 0.99,
            seconds: 60,
            seed: 1,
        }
    }

    #[test]
    fn users_streaming_at_once_are_a_rate() {
        // 1000 users each reading 10 tokens a second of 256-token answers: a new stream every
        // 25.6 ms, 39 requests a second.
        assert!((rate_for_users(1000.0, 256, 10.0) - 39.0625).abs() < 1e-9);
    }

    #[test]
    fn the_arithmetic_is_checked_by_the_ledger_within_a_tenth() {
        let input = example(rate_for_users(1000.0, 256, 10.0));
        let plan = plan(&input);
        assert_eq!(plan.bound, "maxSequences", "{plan:?}");
        assert_eq!(plan.arithmetic, (input.rate / plan.requests_per_pod).ceil() as u32);
        // The rows: one pod fewer than the arithmetic, then the arithmetic, which keeps the goal.
        let pods: Vec<u32> = plan.rows.iter().map(|r| r.pods).collect();
        assert_eq!(pods, [plan.arithmetic - 1, plan.arithmetic], "{plan:?}");
        assert!(plan.rows[1].kept >= 0.99, "{plan:?}");
        // The fewest pods the simulation says keep it serve each at most a tenth more than the
        // figure: the arithmetic is not a safe guess far below what a pod sustains.
        let answer = plan.simulated.expect("an answer");
        let at = plan.rows.iter().find(|r| r.pods == answer).expect("its row");
        assert!(at.kept >= 0.99 && at.rate_per_pod <= 1.1 * plan.requests_per_pod, "{plan:?}");
        let table = table(&input, &plan);
        assert!(
            table.contains(&format!("arithmetic: {} pods (39.1 req/s of 100 + 256 tokens", plan.arithmetic)),
            "{table}"
        );
        assert!(table.contains("simulated answer: "), "{table}");
    }
}
