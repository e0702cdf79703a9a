//! The window to the millisecond: an upstream whose first token takes 50 ms + 0.2 ms per prompt
//! token + 5 ms per request in flight, and whose tokens come every 20 ms + 2 ms per request in
//! flight.

use std::time::Duration;

use std::time::Instant;

use super::*;
use crate::tenant::TenantId;

const MS: Duration = Duration::from_millis(1);
const HOUR: Duration = Duration::from_secs(3600);

fn policy() -> WindowPolicy {
    WindowPolicy {
        max_in_flight: 4,
        max_queue: 64,
        max_queue_bytes: 1 << 20,
        max_queue_tokens: 1 << 20,
        max_context: 4096,
        max_attempts: 2,
    }
}

struct Harness {
    w: Window,
    start: Instant,
    effects: Vec<Effect>,
}

impl Harness {
    fn new(policy: WindowPolicy) -> Self {
        let mut h = Harness {
            w: Window::new(policy, UpstreamCost::default(), Duration::ZERO),
            start: Instant::now(),
            effects: vec![],
        };
        h.at(0, vec![Event::Ready(true)]);
        h
    }

    fn at(&mut self, ms: u64, events: Vec<Event>) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.w.step(self.start + MS * ms as u32, events, &mut effects);
        self.effects.extend(effects.clone());
        effects
    }

    fn request(&self, id: SeqId, at_ms: u64, prompt: u32, max_tokens: u32) -> Request {
        let arrival = self.start + MS * at_ms as u32;
        Request {
            id,
            arrival,
            priority: Priority::Interactive,
            tenant: 0,
            weight: 1,
            prompt,
            max_tokens,
            bytes: 10,
            ttft_deadline: arrival + HOUR,
            itl: HOUR,
            deadline: arrival + HOUR,
        }
    }
}

fn released(effects: &[Effect]) -> Vec<SeqId> {
    effects.iter().filter_map(|e| if let Effect::Release { id } = e { Some(*id) } else { None }).collect()
}

fn refusal(effects: &[Effect], id: SeqId) -> Refusal {
    effects
        .iter()
        .find_map(|e| match e {
            Effect::End { id: i, end: End::Unfinished(r), .. } if *i == id => Some(r.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no refusal of {id} in {effects:?}"))
}

#[test]
fn at_most_the_window_is_in_flight_and_a_finished_request_makes_room_at_once() {
    let mut h = Harness::new(policy());
    let submits: Vec<Event> = (0..6).map(|i| Event::Submit(h.request(i, 0, 10, 5))).collect();
    assert_eq!(released(&h.at(0, submits)), vec![0, 1, 2, 3]);
    assert_eq!((h.w.running(), h.w.waiting()), (4, 2));
    let e = h.at(80, vec![Event::First(2), Event::Done { id: 2, reason: FinishReason::Stop }]);
    assert_eq!(released(&e), vec![4], "the next in line goes the moment a slot frees");
    assert!(e.contains(&Effect::Started { id: 4, waited: 80 * MS }));
}

#[test]
fn a_tight_inter_token_target_narrows_the_window() {
    // 20 ms + 2 ms per request in flight: a 26 ms target allows 3 at once.
    let mut h = Harness::new(WindowPolicy { max_in_flight: 16, ..policy() });
    let submits: Vec<Event> =
        (0..6).map(|i| Event::Submit(Request { itl: 26 * MS, ..h.request(i, 0, 10, 5) })).collect();
    assert_eq!(released(&h.at(0, submits)), vec![0, 1, 2]);
    assert_eq!(h.w.window(), 3);
}

#[test]
fn a_one_token_request_has_no_inter_token_target() {
    // 22 ms a token alone: a 10 ms target is refused for two tokens, and means nothing for one,
    // which neither is refused for it nor narrows the window of those beside it.
    let mut h = Harness::new(policy());
    let two = Request { itl: 10 * MS, ..h.request(0, 0, 10, 2) };
    let r = refusal(&h.at(0, vec![Event::Submit(two)]), 0);
    assert!(r.message.contains("inter-token time is 22.0 ms even alone"), "{}", r.message);
    let submits: Vec<Event> =
        (1..5).map(|i| Event::Submit(Request { itl: 10 * MS, ..h.request(i, 0, 10, 1) })).collect();
    assert_eq!(released(&h.at(0, submits)), vec![1, 2, 3, 4]);
    assert_eq!(h.w.window(), 4);
}

#[test]
fn a_gap_is_learned_at_the_concurrency_it_began_with() {
    // Two in flight; the second ends as the first's next token comes, 24 ms after its first (20
    // ms + 2 ms for each of the two). Learned at one in flight, as the window's count then says,
    // the gap would teach that one alone takes 24 ms.
    let mut h = Harness::new(policy());
    let submits: Vec<Event> = (0..2).map(|i| Event::Submit(h.request(i, 0, 10, 3))).collect();
    h.at(0, submits);
    h.at(60, vec![Event::First(0), Event::First(1)]);
    let before = h.w.model().itl(1);
    h.at(84, vec![Event::Done { id: 1, reason: FinishReason::Stop }, Event::Token(0)]);
    assert!(h.w.model().itl(2) <= 24 * MS + MS, "{:?}", h.w.model().itl(2));
    assert!(h.w.model().itl(1) <= before, "{:?} then {:?}", before, h.w.model().itl(1));
}

#[test]
fn a_slot_frees_after_the_tokens_left_from_the_latest_one() {
    // One slot. The first request has had 40 of its 50 tokens (its first at 75 ms, then one
    // every 22 ms): its last comes 10 tokens after its 40th, at 933 + 220 = 1153 ms, and the
    // second's first token 75 ms later, 295 ms after it arrives at 933 ms — past a first-token
    // deadline of 200 ms. Counted from the first token, the slot would look free already.
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    h.at(0, vec![Event::Submit(h.request(0, 0, 100, 50))]);
    h.at(75, vec![Event::First(0)]);
    for k in 1..40 {
        h.at(75 + 22 * k, vec![Event::Token(0)]);
    }
    let second = Request { ttft_deadline: h.start + 1133 * MS, ..h.request(1, 933, 100, 5) };
    let r = refusal(&h.at(933, vec![Event::Submit(second)]), 1);
    assert!(r.message.contains("first token is forecast 295 ms after arrival"), "{}", r.message);
}

#[test]
fn a_request_that_cannot_get_its_first_token_in_time_is_refused_at_arrival_with_the_forecast() {
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    let first = h.request(0, 0, 100, 50);
    h.at(0, vec![Event::Submit(first)]);
    // The first request holds the only slot until 50 + 20 + 5 + 49 × 22 = 1153 ms; the second's
    // first token would come 75 ms after that.
    let second = Request { ttft_deadline: h.start + 1000 * MS, ..h.request(1, 0, 100, 5) };
    let e = h.at(0, vec![Event::Submit(second)]);
    let r = refusal(&e, 1);
    assert_eq!(r.outcome, Outcome::Infeasible);
    assert!(r.message.contains("first token is forecast 1228 ms after arrival"), "{}", r.message);
    assert!(r.retry_after.is_some());
}

#[test]
fn a_completion_that_cannot_fit_names_the_max_tokens_that_would() {
    let mut h = Harness::new(policy());
    // Alone on an idle upstream: the first token at 50 + 2 + 5 = 57 ms, then 22 ms a token (one
    // in flight); 500 ms hold 21.
    let r = Request { deadline: h.start + 500 * MS, ..h.request(0, 0, 10, 100) };
    let e = h.at(0, vec![Event::Submit(r)]);
    let r = refusal(&e, 0);
    assert!(r.message.contains("about 22.0 ms a token upstream"), "{}", r.message);
    assert!(r.message.contains("a max_tokens of 21 would fit"), "{}", r.message);
    let ok = Request { deadline: h.start + 500 * MS, ..h.request(1, 0, 10, 21) };
    assert_eq!(released(&h.at(0, vec![Event::Submit(ok)])), vec![1]);
    // A second in flight would make its tokens 24 ms apart and its end 57 + 20 × 24 = 537 ms:
    // refused, though alone it would fit.
    let e = h.at(0, vec![Event::Submit(h.request(2, 0, 10, 5))]);
    let r = refusal(&e, 2);
    assert!(r.message.contains("would make 1 running or waiting request(s) miss"), "{}", r.message);
    // With one token left (at 57 + 19 × 22 = 475 ms) a second fits: the first ends at 475 + 24.
    h.at(57, vec![Event::First(1)]);
    for k in 1..20 {
        h.at(57 + 22 * k, vec![Event::Token(1)]);
    }
    assert!(released(&h.at(475, vec![Event::Submit(h.request(3, 475, 10, 5))])).contains(&3));
}

#[test]
fn a_queued_request_past_its_ttft_deadline_is_never_sent_and_a_running_one_is_aborted_at_its_deadline() {
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    // Admitted on the prior's figures; the upstream turns out slower.
    let a = Request { ttft_deadline: h.start + 100 * MS, deadline: h.start + 2000 * MS, ..h.request(0, 0, 10, 10) };
    let b = Request { ttft_deadline: h.start + 600 * MS, ..h.request(1, 0, 10, 5) };
    h.at(0, vec![Event::Submit(a), Event::Submit(b)]);
    assert_eq!(released(&h.effects), vec![0]);
    h.at(80, vec![Event::First(0)]);
    let e = h.at(600, vec![]);
    assert_eq!(refusal(&e, 1).outcome, Outcome::Expired);
    assert!(released(&e).is_empty(), "never sent");
    let e = h.at(2000, vec![]);
    assert!(e.contains(&Effect::Abort { id: 0 }));
    assert_eq!(refusal(&e, 0).outcome, Outcome::Expired);
    assert!(h.w.is_idle());
}

#[test]
fn an_upstream_error_before_the_first_token_is_retried_and_after_it_ends_the_stream() {
    let mut h = Harness::new(policy());
    h.at(0, vec![Event::Submit(h.request(0, 0, 10, 5)), Event::Submit(h.request(1, 0, 10, 5))]);
    let e = h.at(10, vec![Event::Failed { id: 0, refusal: Refusal::new(Outcome::Failed, "connection reset") }]);
    assert_eq!(released(&e), vec![0], "sent again at once");
    assert!(!e.iter().any(|e| matches!(e, Effect::Started { id: 0, .. })), "its wait was counted once");
    let e = h.at(20, vec![Event::Failed { id: 0, refusal: Refusal::new(Outcome::Failed, "connection reset") }]);
    assert_eq!(refusal(&e, 0).outcome, Outcome::Failed, "two attempts were its budget");
    h.at(60, vec![Event::First(1)]);
    let e = h.at(70, vec![Event::Failed { id: 1, refusal: Refusal::new(Outcome::Failed, "upstream closed") }]);
    assert_eq!(refusal(&e, 1).message, "upstream closed", "after its first token, never retried");
}

#[test]
fn nothing_is_sent_while_the_upstream_is_not_ready() {
    let mut h = Harness::new(policy());
    h.at(0, vec![Event::Ready(false)]);
    assert!(released(&h.at(1, vec![Event::Submit(h.request(0, 1, 10, 5))])).is_empty());
    assert_eq!(released(&h.at(5, vec![Event::Ready(true)])), vec![0]);
}

#[test]
fn admitting_a_request_never_breaks_the_promise_of_one_waiting() {
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    h.at(0, vec![Event::Submit(h.request(0, 0, 10, 10))]);
    // Waiting: b's first token is forecast at 57 + 9 × 22 + 57 = 312 ms; its TTFT deadline is 320.
    let b = Request { ttft_deadline: h.start + 320 * MS, ..h.request(1, 0, 10, 5) };
    h.at(0, vec![Event::Submit(b)]);
    assert_eq!(h.w.waiting(), 1);
    // c, with an earlier TTFT deadline, would go first and push b past its deadline.
    let c = Request { ttft_deadline: h.start + 319 * MS, ..h.request(2, 0, 10, 5) };
    let e = h.at(0, vec![Event::Submit(c)]);
    let r = refusal(&e, 2);
    assert!(
        r.message.contains("first token is forecast") || r.message.contains("would make 1 running or waiting"),
        "{}",
        r.message
    );
}

/// Releases one request at a time (a window of one), each done as soon as it is sent, and says
/// whose each was.
fn tenants_released(h: &mut Harness, n: usize) -> Vec<TenantId> {
    let mut order = Vec::new();
    let mut at = 0;
    let mut running = released(&h.effects);
    while order.len() < n {
        let id = running.pop().expect("one in flight");
        order.push(h.w.entries[&id].request.tenant);
        at += 100;
        let e = h.at(at, vec![Event::First(id), Event::Done { id, reason: FinishReason::Stop }]);
        running = released(&e);
    }
    order
}

#[test]
fn slots_go_to_the_tenants_by_weight_each_tenants_own_in_deadline_order() {
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    // Tenant 1 (weight 3) sent 8 before tenant 2 (weight 1) sent 8, all alike: in deadline order
    // tenant 1's would all go first. By start-time fair queueing of their tokens (15 each), tenant
    // 2 has one slot in four: 1, 2, 1, 1, 1, 2, 1, 1.
    let of =
        |h: &Harness, id: SeqId, tenant: TenantId, weight: u32| Request { tenant, weight, ..h.request(id, 0, 10, 5) };
    let mut submits: Vec<Event> = (0..8).map(|i| Event::Submit(of(&h, i, 1, 3))).collect();
    submits.extend((8..16).map(|i| Event::Submit(of(&h, i, 2, 1))));
    h.at(0, submits);
    assert_eq!(tenants_released(&mut h, 8), vec![1, 2, 1, 1, 1, 2, 1, 1]);
    // Each tenant's own go in their deadline order: tenant 2's latest deadline goes last.
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    let late = Request { ttft_deadline: h.start + 2 * HOUR, deadline: h.start + 2 * HOUR, ..of(&h, 8, 2, 1) };
    h.at(0, vec![Event::Submit(of(&h, 0, 1, 1)), Event::Submit(late), Event::Submit(of(&h, 9, 2, 1))]);
    let mut ids = released(&h.effects);
    for at in [100, 200] {
        let id = *ids.last().unwrap();
        ids.extend(released(&h.at(at, vec![Event::First(id), Event::Done { id, reason: FinishReason::Stop }])));
    }
    assert_eq!(ids, vec![0, 9, 8]);
}

#[test]
fn admission_forecasts_the_fair_order() {
    // A window of one. Tenant 1's first request runs (its last token at 57 + 9 × 22 = 255 ms)
    // with another of its own waiting (so its slot is charged to it); then a third of its own
    // waits, due a first token by 320 ms (forecast at 255 + 57 = 312). Tenant 2 has had no slot:
    // its request, due in an hour, would go after that one in deadline order, but goes before it
    // in the fair order, and would push it to about 570 ms: refused.
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    let of = |h: &Harness, id: SeqId, tenant: TenantId| Request { tenant, ..h.request(id, 0, 10, 10) };
    h.at(0, vec![Event::Submit(of(&h, 0, 1)), Event::Submit(of(&h, 1, 1))]);
    let due = Request { ttft_deadline: h.start + 320 * MS, ..of(&h, 2, 1) };
    h.at(0, vec![Event::Submit(due)]);
    let r = refusal(&h.at(0, vec![Event::Submit(of(&h, 3, 2))]), 3);
    assert!(r.message.contains("would make 1 running or waiting"), "{}", r.message);
    // Without the request due soon, tenant 2's is taken, and is sent next.
    let mut h = Harness::new(WindowPolicy { max_in_flight: 1, ..policy() });
    h.at(0, vec![Event::Submit(of(&h, 0, 1)), Event::Submit(of(&h, 1, 1))]);
    let e = h.at(0, vec![Event::Submit(of(&h, 3, 2))]);
    assert!(!e.iter().any(|e| matches!(e, Effect::End { .. })), "admitted: {e:?}");
    let e = h.at(255, vec![Event::First(0), Event::Done { id: 0, reason: FinishReason::Stop }]);
    assert_eq!(released(&e), vec![3]);
}

#[test]
fn the_window_is_sized_for_the_next_request_the_fair_order_sends() {
    // Four slots, all taken by tenant 1's, two more of its own waiting. Tenant 2's request wants
    // a token every 26 ms, which 20 ms + 2 ms per request in flight keeps at 3 in flight. It
    // goes next (tenant 2 has had no slot), so a slot freeing at 4 in flight sends nothing: at 3
    // its tokens would be late. The next freeing sends it.
    let mut h = Harness::new(policy());
    let submits: Vec<Event> = (0..6).map(|i| Event::Submit(Request { tenant: 1, ..h.request(i, 0, 10, 5) })).collect();
    assert_eq!(released(&h.at(0, submits)), vec![0, 1, 2, 3]);
    let tight = Request { tenant: 2, itl: 26 * MS, ..h.request(10, 0, 10, 5) };
    assert_eq!(released(&h.at(0, vec![Event::Submit(tight)])), Vec::<SeqId>::new());
    let done = |id| vec![Event::First(id), Event::Done { id, reason: FinishReason::Stop }];
    assert_eq!(released(&h.at(80, done(0))), Vec::<SeqId>::new());
    assert_eq!(released(&h.at(90, done(1))), vec![10]);
    assert_eq!(h.w.window(), 3);
}
