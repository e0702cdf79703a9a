//! The step rule to the millisecond, on a replayed engine whose step takes
//! 10 ms + 1 ms per decoding sequence + 0.1 ms per prefill token.

use std::time::Duration;

use super::replay::{replay, Arrival, Ending, Setup, Trace};
use super::scheduler::{Discipline, Policy};
use super::sequence::FinishReason;
use super::step::StepCost;
use crate::outcome::Outcome;
use crate::ticket::Priority;

const MS: Duration = Duration::from_millis(1);
const US: Duration = Duration::from_micros(1);

fn cost() -> StepCost {
    StepCost { fixed: 10 * MS, per_decode: MS, per_prefill_token: 100 * US, ..StepCost::default() }
}

fn policy() -> Policy {
    Policy {
        max_batch_tokens: 2048,
        max_sequences: 64,
        max_queue: 1024,
        max_queue_bytes: 1 << 30,
        max_queue_tokens: 1 << 30,
        max_context: 100_000,
        watermark: 0,
        discipline: Discipline::Deadlines,
    }
}

fn setup() -> Setup {
    Setup { policy: policy(), blocks: 10_000, block_size: 16, cost: cost(), prior: cost(), margin: Duration::ZERO }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn times(trace: &Trace, i: usize) -> Vec<f64> {
    trace.fates[i].tokens.iter().map(|d| ms(*d)).collect()
}

fn finished(trace: &Trace, i: usize) -> bool {
    matches!(trace.fates[i].end, Some((_, Ending::Finished(_))))
}

#[test]
fn a_request_arriving_while_others_decode_gets_its_first_token_after_one_step() {
    // A: its 10-token prefill takes 11 ms, then each decode 11 ms.
    // B arrives at 30 during A's step 22..33; the next step (33..45) decodes A and prefills B.
    let trace = replay(setup(), &[Arrival::new(0, 10, 20), Arrival::new(30, 10, 5)]);
    let a = times(&trace, 0);
    assert_eq!(&a[..4], &[11.0, 22.0, 33.0, 45.0]);
    assert_eq!(times(&trace, 1)[0], 45.0, "B's first token one step after it could join, not after A ends");
    let b = times(&trace, 1);
    assert_eq!(b, vec![45.0, 57.0, 69.0, 81.0, 93.0], "then A and B decode together, 12 ms a step");
    assert!(finished(&trace, 0) && finished(&trace, 1));
    assert_eq!(trace.fates[1].ids, trace.fates[1].expected);
    // After B leaves at 93, A's steps are 11 ms again.
    assert_eq!(a[8], 104.0);
    assert_eq!(*a.last().unwrap(), 104.0 + 11.0 * 11.0);
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_short_sequences_keep_their_inter_token_target() {
    // A decodes with a 20 ms inter-token target; B's 1000-token prompt arrives during A's
    // prefill (0..11). A step with A's decode takes 11 ms, so 90 prefill tokens fit beside it
    // (20 ms): 11 chunks of 90, then 10.
    let trace = replay(setup(), &[Arrival::new(0, 10, 40).itl_ms(20), Arrival::new(5, 1000, 2)]);
    let chunks: Vec<u32> =
        trace.steps.iter().filter_map(|s| s.plan.members.iter().find(|m| m.id == 1).map(|m| m.len)).take(13).collect();
    assert_eq!(chunks, [vec![90; 11], vec![10], vec![1]].concat());
    for step in &trace.steps {
        if step.plan.members.iter().any(|m| m.id == 0 && m.decode) {
            assert!(step.took <= 20 * MS, "a step of {:?} while A decodes: {:?}", step.took, step.plan.shape);
        }
    }
    let a = times(&trace, 0);
    let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|g| *g <= 20.0), "{gaps:?}");
    assert_eq!(&gaps[..11], &[20.0; 11], "every step with a chunk is cut to exactly the target");
    // B's first token: the 12th chunk (10 tokens, 12 ms) ends at 11 + 11 × 20 + 12.
    assert_eq!(times(&trace, 1)[0], 243.0);
    assert!(finished(&trace, 0) && finished(&trace, 1));
}

#[test]
fn kv_exhaustion_preempts_the_cheapest_sequence_which_later_finishes_with_exactly_its_tokens() {
    // 8 blocks of 4 tokens; A and B each need 5 blocks at their longest, 10 together. B is
    // batch-tier, so B gives its blocks back when a decode finds none free.
    let s = Setup { blocks: 8, block_size: 4, ..setup() };
    let trace = replay(s, &[Arrival::new(0, 8, 12), Arrival::new(0, 8, 12).priority(Priority::Batch)]);
    assert_eq!((trace.fates[0].preempted, trace.fates[1].preempted), (0, 1));
    for i in 0..2 {
        assert_eq!(trace.fates[i].ids, trace.fates[i].expected, "sequence {i}'s tokens");
        assert_eq!(trace.fates[i].end.as_ref().unwrap().1, Ending::Finished(FinishReason::Length));
    }
    // Both decoded side by side until, with 16 tokens computed each, A's decode found no fifth block: B,
    // batch-tier, gave its 4 blocks back in that step, which ran A alone; the next step began
    // B's recompute from its prompt and the 9 tokens it had produced, in the blocks still free.
    let evicting = trace.steps.iter().position(|s| s.plan.members.iter().any(|m| m.id == 0 && m.start == 16)).unwrap();
    let step = &trace.steps[evicting];
    assert_eq!(step.plan.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![0], "the evicting step runs A alone");
    let next = &trace.steps[evicting + 1];
    let b = next.plan.members.iter().find(|m| m.id == 1).expect("B restarts in the next step");
    assert_eq!((b.start, b.len), (0, 12), "from its first token, as much as the 3 free blocks hold");
    assert_eq!(next.started, step.started + step.took);
    assert_eq!(trace.fates[1].tokens.iter().filter(|t| **t <= step.started).count(), 9);
    assert!(trace.steps.iter().all(|s| s.held_blocks <= 8));
    assert!(trace.quiet.iter().all(|(used, held)| used == held));
}

#[test]
fn an_infeasible_ttft_is_refused_at_arrival_with_the_estimate() {
    // A 1000-token prefill takes 110 ms; the caller allows 50.
    let trace = replay(setup(), &[Arrival::new(5, 1000, 10).ttft_ms(50)]);
    let (at, ending) = trace.fates[0].end.clone().unwrap();
    assert_eq!(at, 5 * MS);
    assert!(!trace.fates[0].admitted);
    let Ending::Unfinished(refusal) = ending else { panic!("refused") };
    assert_eq!(refusal.outcome, Outcome::Infeasible);
    assert!(refusal.message.contains("first token is forecast 110 ms after arrival"), "{}", refusal.message);
    assert!(refusal.message.contains("the TTFT deadline is 50 ms"), "{}", refusal.message);
    assert!(trace.steps.is_empty());
}

#[test]
fn a_completion_that_cannot_fit_is_refused_with_the_max_tokens_that_would() {
    // 11 ms for the prefill and the first token, then 11 ms a token: 100 ms hold 9 tokens.
    let trace = replay(setup(), &[Arrival::new(0, 10, 50).timeout_ms(100)]);
    let Some((_, Ending::Unfinished(refusal))) = trace.fates[0].end.clone() else { panic!("refused") };
    assert_eq!(refusal.outcome, Outcome::Infeasible);
    assert!(
        refusal.message.contains("max_tokens 50 is forecast to finish 550 ms after arrival"),
        "{}",
        refusal.message
    );
    assert!(refusal.message.contains("a max_tokens of 9 would fit"), "{}", refusal.message);
    let trace = replay(setup(), &[Arrival::new(0, 10, 9).timeout_ms(100)]);
    assert!(finished(&trace, 0), "and 9 does");
    assert_eq!(*times(&trace, 0).last().unwrap(), 99.0);
}

#[test]
fn a_sequence_past_its_completion_deadline_ends_at_it() {
    // The estimate says 10 ms a step; the engine takes 200. The deadline (100 ms) passes
    // during the first step: the sequence ends at 100, and the step's token is late.
    let slow = StepCost { fixed: 200 * MS, ..StepCost::default() };
    let trace = replay(Setup { cost: slow, ..setup() }, &[Arrival::new(0, 4, 2).timeout_ms(100)]);
    let (at, ending) = trace.fates[0].end.clone().unwrap();
    assert_eq!(at, 100 * MS);
    let Ending::Unfinished(refusal) = ending else { panic!("expired") };
    assert_eq!(refusal.outcome, Outcome::Expired);
    assert!(trace.fates[0].tokens.is_empty(), "no token after the deadline");
}

#[test]
fn a_sequence_that_can_no_longer_finish_is_ended_at_once() {
    // Admitted on a 10 ms estimate; the engine takes 30 ms a step, and the estimator learns it
    // from the first one. At 30 ms, 9 tokens are left and need at least 9 × 30 ms: past the
    // 150 ms deadline, so the sequence ends then rather than decoding in vain.
    let slow = StepCost { fixed: 30 * MS, ..StepCost::default() };
    let trace = replay(Setup { cost: slow, ..setup() }, &[Arrival::new(0, 4, 10).timeout_ms(150)]);
    let (at, ending) = trace.fates[0].end.clone().unwrap();
    assert_eq!(at, 30 * MS);
    assert_eq!(times(&trace, 0), vec![30.0], "its first token was sent");
    let Ending::Unfinished(refusal) = ending else { panic!("ended") };
    assert_eq!(refusal.outcome, Outcome::Expired);
    assert!(refusal.message.contains("deadline cannot be met: after 1 of 10 tokens"), "{}", refusal.message);
}

#[test]
fn a_new_sequence_waits_for_a_seat() {
    let s = Setup { policy: Policy { max_sequences: 1, ..policy() }, ..setup() };
    let trace = replay(s, &[Arrival::new(0, 10, 3), Arrival::new(0, 10, 3)]);
    assert_eq!(times(&trace, 0), vec![11.0, 22.0, 33.0]);
    assert_eq!(times(&trace, 1), vec![44.0, 55.0, 66.0], "B starts when A leaves its seat");
}

#[test]
fn a_cancelled_sequence_frees_its_blocks_at_once() {
    let trace = replay(setup(), &[Arrival::new(0, 40, 100).cancel_after_ms(50), Arrival::new(0, 10, 5)]);
    assert_eq!(trace.fates[0].end.as_ref().unwrap().1, Ending::Cancelled);
    assert!(trace.steps.iter().filter(|s| s.started >= 50 * MS).all(|s| s.plan.members.iter().all(|m| m.id != 0)));
    assert!(trace.quiet.iter().all(|(used, held)| used == held));
    assert_eq!(trace.quiet.last(), Some(&(0, 0)));
}

fn with(discipline: Discipline) -> Setup {
    Setup { policy: Policy { discipline, ..policy() }, ..setup() }
}

#[test]
fn static_batching_makes_a_newcomer_wait_for_the_whole_batch() {
    let trace = replay(with(Discipline::Static), &[Arrival::new(0, 10, 20), Arrival::new(30, 10, 5)]);
    let a_end = *times(&trace, 0).last().unwrap();
    assert_eq!(a_end, 11.0 + 19.0 * 11.0);
    assert_eq!(times(&trace, 1)[0], a_end + 11.0, "B starts only when A's batch has left");
}

#[test]
fn first_come_first_served_admits_everything_and_finishes_late() {
    // The same request that Ferry refuses at arrival (a 110 ms prefill against a 50 ms TTFT) is
    // admitted and answered after its deadlines, as a server without deadlines does.
    let trace = replay(with(Discipline::Fcfs), &[Arrival::new(5, 1000, 10).ttft_ms(50).timeout_ms(100)]);
    assert!(trace.fates[0].admitted);
    assert_eq!(times(&trace, 0)[0], 115.0);
    assert!(finished(&trace, 0));
    assert_eq!(trace.fates[0].tokens.len(), 10);
}

/// Tokens fed to each tenant's sequences (tenant by arrival) over the steps that start in
/// `[from_ms, to_ms)`.
fn tokens_by_tenant(trace: &Trace, arrivals: &[Arrival], from_ms: f64, to_ms: f64) -> [u32; 3] {
    let mut fed = [0; 3];
    for step in trace.steps.iter().filter(|s| (from_ms..to_ms).contains(&ms(s.started))) {
        for m in &step.plan.members {
            fed[usize::from(arrivals[m.id as usize].tenant)] += m.len;
        }
    }
    fed
}

#[test]
fn backlogged_tenants_of_equal_weight_share_step_tokens_whatever_they_send() {
    // Four sequences at once, each a 50-token prompt and 20 tokens: about 14 sequences a second.
    // Tenant 1 sends 100 a second, tenant 2 a tenth of that: both more than their half.
    let setup = Setup { policy: Policy { max_sequences: 4, ..policy() }, ..setup() };
    let arrivals: Vec<Arrival> = (0..300)
        .map(|k| Arrival::new(k * 10, 50, 20).tenant(1))
        .chain((0..30).map(|k| Arrival::new(k * 100, 50, 20).tenant(2)))
        .collect();
    let trace = replay(setup, &arrivals);
    let fed = tokens_by_tenant(&trace, &arrivals, 500.0, 3000.0);
    let ratio = f64::from(fed[2]) / f64::from(fed[1]);
    assert!((0.8..=1.25).contains(&ratio), "tokens fed 1:2 = {fed:?}");
    // Without tenants the same trace starts sequences in TTFT-deadline (arrival) order: the light
    // caller gets about one token in eleven.
    let single: Vec<Arrival> = arrivals.iter().map(|a| a.tenant(0)).collect();
    let plain = replay(setup, &single);
    let fed = tokens_by_tenant(&plain, &arrivals, 500.0, 3000.0);
    assert!(f64::from(fed[2]) / f64::from(fed[1]) < 0.3, "tokens fed without fair shares {fed:?}");
}

#[test]
fn weights_three_to_one_give_step_tokens_three_to_one() {
    let setup = Setup { policy: Policy { max_sequences: 4, ..policy() }, ..setup() };
    let arrivals: Vec<Arrival> = (0..300)
        .map(|k| Arrival::new(k * 10, 50, 20).tenant(1).weight(3))
        .chain((0..300).map(|k| Arrival::new(k * 10, 50, 20).tenant(2)))
        .collect();
    let trace = replay(setup, &arrivals);
    let fed = tokens_by_tenant(&trace, &arrivals, 500.0, 3000.0);
    let ratio = f64::from(fed[1]) / f64::from(fed[2]);
    assert!((2.5..=3.5).contains(&ratio), "tokens fed 1:2 = {fed:?}");
}

#[test]
fn a_burst_that_arrives_as_a_step_ends_does_not_hold_the_next_step() {
    // A decodes with a 20 ms inter-token target (its prefill 0..11, then a step each 11 ms);
    // 100 requests arrive at 22, the instant a step ends. The next step leaves at 22 with A
    // alone — composed before any of them is admitted, so their forecasts never keep A waiting —
    // and they join at 33, in chunks cut to A's target.
    let mut arrivals = vec![Arrival::new(0, 10, 40).itl_ms(20)];
    arrivals.extend((0..100).map(|_| Arrival::new(22, 4, 2)));
    let trace = replay(setup(), &arrivals);
    let at = |ms: u64| trace.steps.iter().find(|s| s.started == Duration::from_millis(ms)).expect("a step then");
    let ids = |ms: u64| at(ms).plan.members.iter().map(|m| m.id).collect::<Vec<_>>();
    assert_eq!(ids(22), vec![0], "the step at 22 is A's decode alone");
    assert!(ids(33).len() > 1 && ids(33)[0] == 0, "the newcomers join at 33: {:?}", ids(33));
    let a = times(&trace, 0);
    assert_eq!(&a[..3], &[11.0, 22.0, 33.0]);
    assert!(a.windows(2).all(|w| w[1] - w[0] <= 20.0), "A's tokens within its target: {a:?}");
    let admitted = (1..=100).filter(|i| !trace.fates[*i].tokens.is_empty()).count();
    assert!(admitted > 0, "the burst is served");
}

#[test]
fn a_prompt_that_starts_with_a_cached_one_prefills_only_the_rest() {
    // A's 1520 tokens prefill in one step: 10 + 152 ms. B shares A's first 1500 tokens: the 93
    // blocks of 16 wholly within them are cached once A's prefill is done (the 94th holds tokens
    // of A's own), so B prefills 1530 − 1488 = 42 tokens: 10 + 4.2 ms.
    let shared = |at, prompt| Arrival::new(at, prompt, 2).shared(0, 1500);
    let trace = replay(setup(), &[shared(0, 1520), shared(1000, 1530)]);
    assert_eq!(times(&trace, 0)[0], 162.0);
    let b = times(&trace, 1)[0] - 1000.0;
    assert!((b - 14.2).abs() < 1e-9, "B's first token after {b} ms");
    assert!(b <= 0.15 * 162.0);
    let chunks: Vec<(u32, u32)> = trace
        .steps
        .iter()
        .flat_map(|s| s.plan.members.iter().filter(|m| m.id == 1 && !m.decode).map(|m| (m.start, m.len)))
        .collect();
    assert_eq!(chunks, vec![(1488, 42)]);
    assert_eq!(trace.fates[1].ids, trace.fates[1].expected, "the cached blocks hold B's tokens: its answer is its own");
    assert!(trace.pool_errors.is_empty(), "{:?}", trace.pool_errors);
}

#[test]
fn admission_counts_a_cached_prefix_as_prefill_not_needed() {
    // A 50 ms first-token deadline: B's whole prompt takes 163 ms to prefill, its uncached rest
    // 14.2 ms. The same prompt without the shared start is refused at once.
    let a = Arrival::new(0, 1520, 2).shared(0, 1500);
    let cached = Arrival::new(1000, 1530, 2).shared(0, 1500).ttft_ms(50);
    let uncached = Arrival::new(1000, 1530, 2).ttft_ms(50);
    let trace = replay(setup(), &[a, cached]);
    assert!(finished(&trace, 1) && trace.fates[1].admitted);
    let trace = replay(setup(), &[a, uncached]);
    assert!(!trace.fates[1].admitted, "{:?}", trace.fates[1].end);
    let Some((at, Ending::Unfinished(refusal))) = &trace.fates[1].end else { panic!("refused") };
    assert_eq!((*at, refusal.outcome), (Duration::from_millis(1000), Outcome::Infeasible));
}

#[test]
fn blocks_a_waiting_sequence_took_from_the_cache_come_back_when_the_lone_running_one_needs_them() {
    // Eight blocks of 16. A (64 tokens, 4 blocks) caches its prompt and ends; C (80 tokens) takes
    // the 4 empty blocks and evicts A's last; B, admitted while C decodes, takes A's first 3
    // cached blocks (its last token is computed) and waits. C's 6th block finds none free: B gives
    // its 3 back rather than C being preempted, and will compute its prompt whole (it starts in
    // the room left, and is the one preempted when C needs its 7th).
    let s = Setup { blocks: 8, ..setup() };
    let a = Arrival::new(0, 64, 1).shared(0, 64);
    let c = Arrival::new(100, 80, 30);
    let b = Arrival::new(110, 64, 2).shared(0, 64);
    let trace = replay(s, &[a, c, b]);
    assert_eq!(trace.fates[1].preempted, 0);
    let b_chunks: Vec<(u32, u32)> = trace
        .steps
        .iter()
        .flat_map(|s| s.plan.members.iter().filter(|m| m.id == 2 && !m.decode).map(|m| (m.start, m.len)))
        .collect();
    assert_eq!(b_chunks[0].0, 0, "B computes its prompt from the start: {b_chunks:?}");
    for i in 0..3 {
        assert!(finished(&trace, i), "{i}: {:?}", trace.fates[i].end);
        assert_eq!(trace.fates[i].ids, trace.fates[i].expected);
    }
    assert!(trace.pool_errors.is_empty(), "{:?}", trace.pool_errors);
}

#[test]
fn n_sequences_of_one_prompt_are_sequences_of_their_own_that_the_prefix_cache_serves_later() {
    // A 100-token prompt, three sequences (OpenAI's n = 3), the prefix cache on: admitted
    // together, they prefill side by side in the first step (300 tokens: 10 + 30 ms), each its
    // own tokens — as vLLM fans out n — and decode together (10 + 3 ms a step). The same prompt
    // arriving after that step finds its 6 full blocks of 16 in the cache and computes only the
    // last 4 tokens.
    let a = Arrival::new(0, 100, 5).shared(0, 100);
    let later = Arrival::new(45, 100, 5).shared(0, 100);
    let trace = replay(setup(), &[a, a.fork_of(0), a.fork_of(0), later]);
    let chunks = |id: u64| -> Vec<(u32, u32)> {
        trace
            .steps
            .iter()
            .flat_map(|s| s.plan.members.iter().filter(|m| m.id == id && !m.decode).map(|m| (m.start, m.len)))
            .collect()
    };
    for i in 0..3 {
        assert_eq!(chunks(i), vec![(0, 100)], "{i}");
        assert_eq!(times(&trace, i as usize)[..2], [40.0, 53.0], "{i}");
    }
    assert_eq!(chunks(3), vec![(96, 4)]);
    for i in 0..4 {
        assert!(finished(&trace, i), "{i}: {:?}", trace.fates[i].end);
        assert_eq!(trace.fates[i].ids, trace.fates[i].expected, "each answer its own: {i}");
    }
    assert!(trace.pool_errors.is_empty(), "{:?}", trace.pool_errors);
}

#[test]
fn a_group_the_queue_could_never_hold_is_too_large_not_full() {
    // Three sequences where the queue holds two: no wait would let them in, so the answer is
    // 413 naming the bound (a 503 would be retried for ever), and nothing is held.
    let mut s = setup();
    s.policy.max_queue = 2;
    let a = Arrival::new(0, 10, 5);
    let trace = replay(s, &[a, a.fork_of(0), a.fork_of(0)]);
    for fate in &trace.fates {
        let Some((_, Ending::Unfinished(refusal))) = &fate.end else { panic!("refused: {:?}", fate.end) };
        assert_eq!(refusal.outcome, Outcome::TooLarge);
        assert!(
            refusal.message.contains("3 sequences") && refusal.message.contains("at most 2"),
            "{}",
            refusal.message
        );
        assert!(!fate.admitted);
    }
    assert!(replay(s, &[a, a.fork_of(0)]).fates.iter().all(|f| f.admitted), "two fit");
    assert!(trace.pool_errors.is_empty(), "{:?}", trace.pool_errors);
}

#[test]
fn a_group_is_admitted_whole_or_refused_whole() {
    // A 300-token prompt and a 40-token answer take 40 ms to prefill and 39 decodes of 11 ms:
    // 469 ms alone; two side by side, 70 + 39 x 12 = 538 ms. With a 500 ms deadline one fits
    // and two do not: neither is admitted, each refused saying which choice failed. With 600 ms
    // both are.
    let a = Arrival::new(0, 300, 40).timeout_ms(600);
    let trace = replay(setup(), &[a, a.fork_of(0)]);
    assert!(trace.fates.iter().all(|f| finished(&trace, 0) && f.admitted && f.ids == f.expected));
    let tight = a.timeout_ms(500);
    assert!(replay(setup(), &[tight]).fates[0].admitted, "one alone fits");
    let trace = replay(setup(), &[tight, tight.fork_of(0)]);
    for fate in &trace.fates {
        assert!(!fate.admitted && fate.tokens.is_empty(), "{:?}", fate.end);
        let Some((_, Ending::Unfinished(refusal))) = &fate.end else { panic!("refused: {:?}", fate.end) };
        assert!(refusal.message.starts_with("choice 2 of 2: "), "{}", refusal.message);
        assert_eq!(refusal.outcome, Outcome::Infeasible);
    }
    assert!(trace.pool_errors.is_empty(), "{:?}", trace.pool_errors);
}
