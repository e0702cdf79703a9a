//! One pod tried at a load: requests of one shape, arriving when the caller says, replayed
//! through the generation ledger in virtual time with steps that take exactly the step cost, and
//! the share of them that kept all three promises — the check of [`super::capacity`]'s figure, in
//! its tests and in `ferry-operator plan-generation`.

use std::time::Duration;

use super::capacity::{Limits, Targets};
use super::replay::{replay, Arrival, Ending, Setup};
use super::scheduler::{Discipline, Policy};
use super::step::StepCost;

/// What the requests counted saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trial {
    pub counted: usize,
    /// Share that got every token, the first within its TTFT, each next within the inter-token
    /// target and the last within the completion deadline.
    pub kept: f64,
    /// Share refused at admission.
    pub refused: f64,
    /// Of the admitted ones: the 99th percentile of time to first token and of the gaps between
    /// tokens.
    pub ttft_p99: Duration,
    pub itl_p99: Duration,
}

/// Requests of `prompt` tokens asking for `output` arrive at each of `at` (since the start), with
/// `targets`' deadlines, at a pod of `limits` whose steps cost `cost` (known to its estimator from
/// the start); those that arrive before `settle` fill the pod and are not counted.
pub fn trial(
    cost: StepCost,
    (prompt, output): (u32, u32),
    targets: &Targets,
    limits: &Limits,
    at: &[Duration],
    settle: Duration,
) -> Trial {
    let setup = pod(cost, targets, limits);
    let arrivals: Vec<Arrival> = at
        .iter()
        .map(|&at| Arrival {
            at,
            ttft: targets.ttft,
            itl: targets.itl,
            timeout: targets.timeout,
            ..Arrival::new(0, prompt, output)
        })
        .collect();
    let trace = replay(setup, &arrivals);
    let (mut kept, mut refused) = (0, 0);
    let (mut ttfts, mut gaps) = (Vec::new(), Vec::new());
    let counted: Vec<usize> = (0..arrivals.len()).filter(|&i| arrivals[i].at >= settle).collect();
    for &i in &counted {
        let (a, f) = (&arrivals[i], &trace.fates[i]);
        if !f.admitted {
            refused += 1;
            continue;
        }
        if let Some(first) = f.tokens.first() {
            ttfts.push(*first - a.at);
        }
        gaps.extend(f.tokens.windows(2).map(|w| w[1] - w[0]));
        let finished = matches!(f.end, Some((_, Ending::Finished(_))));
        let in_time = f.tokens.len() == a.max_tokens as usize
            && f.tokens[0] - a.at <= a.ttft
            && f.tokens.windows(2).all(|w| w[1] - w[0] <= a.itl)
            && *f.tokens.last().expect("tokens") - a.at <= a.timeout;
        kept += usize::from(finished && in_time);
    }
    let share = |n: usize| if counted.is_empty() { 0.0 } else { n as f64 / counted.len() as f64 };
    Trial {
        counted: counted.len(),
        kept: share(kept),
        refused: share(refused),
        ttft_p99: p99(&mut ttfts),
        itl_p99: p99(&mut gaps),
    }
}

/// The pod of `limits` the trial replays, its steps costing `cost` and known to cost so.
pub(crate) fn pod(cost: StepCost, targets: &Targets, limits: &Limits) -> Setup {
    Setup {
        policy: Policy {
            max_batch_tokens: limits.max_batch_tokens,
            max_sequences: limits.max_sequences,
            max_queue: 4096,
            max_queue_bytes: u64::MAX,
            max_queue_tokens: u64::MAX,
            max_context: 1 << 20,
            watermark: limits.watermark,
            discipline: Discipline::Deadlines,
        },
        blocks: limits.blocks,
        block_size: limits.block_size,
        cost,
        prior: cost,
        margin: targets.margin,
    }
}

fn p99(samples: &mut [Duration]) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((samples.len() as f64 * 0.99).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}
