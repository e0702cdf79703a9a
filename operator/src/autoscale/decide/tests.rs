use super::*;

const S: Duration = Duration::from_secs(1);

/// `look_ahead` after one reading a second rising by `per_second` from 20 req/s for 30 s,
/// each counted over a 6 s window (or exactly).
fn looked_ahead(per_second: f64, window_seconds: f64) -> Rate {
    let t0 = ferry_core::clock::now();
    let mut rates: VecDeque<(Instant, f64)> = (0..29).map(|i| (t0 + i * S, 20.0 + per_second * f64::from(i))).collect();
    let now = 20.0 + per_second * 29.0;
    let observed = Observed { window_seconds, ..load(now) };
    look_ahead(&observed, &target(), &mut rates, t0 + 29 * S)
}

#[test]
fn a_jump_or_a_trend_within_chance_is_not_taken_for_one() {
    // 20 req/s over a 6 s window; the latest 1 s counted 25: one spread (√20 ≈ 4.5) above,
    // which a steady load gives every few seconds. 45 is 5.6 spreads above: a jump.
    let steady = |latest: f64, seconds: f64| Observed {
        latest_rate: latest,
        window_seconds: 6.0,
        latest_seconds: seconds,
        ..load(20.0)
    };
    let t0 = ferry_core::clock::now();
    let now = |o: &Observed| look_ahead(o, &target(), &mut VecDeque::new(), t0).now;
    assert_eq!(now(&steady(25.0, 1.0)), 20.0);
    assert_eq!(now(&steady(45.0, 1.0)), 45.0);
    // Counted exactly, 25 is 25 % above: a jump.
    assert_eq!(now(&steady(25.0, f64::INFINITY)), 25.0);
    // A rise of 0.1 req/s a second (1.5 req/s over each 15 s half) is within what two 6 s
    // readings of ~23 req/s differ by chance (3 × √2 × √(23 / 6) ≈ 8.3): no look ahead. Read
    // exactly, it is one: 60 s of start-up ahead, +6 req/s.
    let slow = looked_ahead(0.1, 6.0);
    assert_eq!(slow.ahead, slow.now, "slope {}", slow.slope);
    let exact = looked_ahead(0.1, f64::INFINITY);
    assert!((exact.ahead - (exact.now + 6.0)).abs() < 1e-6, "{} → {}", exact.now, exact.ahead);
    // 1 req/s a second (15 req/s over each half) is a trend: the rate doubles ahead, at most.
    let ramp = looked_ahead(1.0, 6.0);
    assert!((ramp.ahead - 2.0 * ramp.now).abs() < 1e-6, "{} → {}", ramp.now, ramp.ahead);
}

fn target() -> Target {
    // The problem statement's replica: 1 worker, 32 rows per 100 ms batch = 320 req/s.
    Target {
        workers: 1,
        max_batch_size: 32,
        max_wait: Duration::from_millis(10),
        latency_budget: Duration::from_millis(200),
        batch_time: Duration::from_millis(100),
        target_utilization: 0.8,
        min_replicas: 1,
        max_replicas: 20,
        warm_replicas: 1,
        scale_down_delay: 300 * S,
        pressure_tolerance: 0.01,
        startup: 60 * S,
        ttft_budget: None,
        scale_to_zero_after: None,
    }
}

fn load(rate: f64) -> Observed {
    Observed {
        arrival_rate: rate,
        latest_rate: rate,
        window_seconds: f64::INFINITY,
        latest_seconds: f64::INFINITY,
        rows_per_request: 1.0,
        batch_time: None,
        queue_depth: 0.0,
        oldest_queue_age: Duration::ZERO,
        pressure: 0.0,
        starting: 0,
        settling: 0,
        stuck: 0,
        rolling_out: false,
        locked: 0,
        capacity: None,
        queue_tokens: 0.0,
        prefill_rate: None,
        tokens_rate: 0.0,
        kv_usage: None,
    }
}

fn once(o: &Observed, t: &Target, current: u32) -> ScaleDecision {
    decide(o, t, current, &History::default(), ferry_core::clock::now())
}

fn to_zero_after(after: Duration) -> Target {
    Target { min_replicas: 0, warm_replicas: 0, scale_to_zero_after: Some(after), ..target() }
}

#[test]
fn no_load_for_scale_to_zero_after_goes_to_zero_and_load_at_zero_comes_back_in_one_decision() {
    let t = to_zero_after(60 * S);
    let t0 = ferry_core::clock::now();
    let mut h = History::default();
    let at = |o: &Observed, current: u32, secs: u32, h: &mut History| {
        let d = decide(o, &t, current, h, t0 + secs * S);
        *h = d.history.clone();
        d
    };
    // A stream still generating (and nothing arriving) is no idleness.
    let streaming = Observed { tokens_rate: 40.0, ..load(0.0) };
    let mut busy = History::default();
    for secs in [0, 100, 200] {
        let d = at(&streaming, 1, secs, &mut busy);
        assert_eq!(d.replicas, 1, "{}", d.message);
    }
    // Idle from t0: one replica until 60 s have passed, then zero.
    assert_eq!(at(&load(0.0), 1, 0, &mut h).replicas, 1);
    assert_eq!(at(&load(0.0), 1, 59, &mut h).replicas, 1);
    // A request at 59 s starts the count again.
    assert_eq!(at(&load(0.2), 1, 60, &mut h).replicas, 1);
    assert_eq!(at(&load(0.0), 1, 61, &mut h).replicas, 1);
    assert_eq!(at(&load(0.0), 1, 120, &mut h).replicas, 1);
    let d = at(&load(0.0), 1, 121, &mut h);
    assert_eq!((d.replicas, d.reason), (0, Reason::ToZero), "{}", d.message);
    assert!(d.message.contains("no load offered for 60 s"), "{}", d.message);
    // At zero with nothing held: zero.
    let d = at(&load(0.0), 0, 200, &mut h);
    assert_eq!((d.replicas, d.reason), (0, Reason::Steady), "{}", d.message);
    // 1000 req/s arriving at the holder (320 req/s per replica at 0.8): ceil(1000 / 256) = 4
    // at once, not one to wait on.
    let d = at(&load(1000.0), 0, 201, &mut h);
    assert_eq!((d.replicas, d.reason), (4, Reason::FromZero), "{}", d.message);
    // One request held, its rate not counted yet: one replica.
    let held = Observed { queue_depth: 1.0, oldest_queue_age: Duration::from_millis(5), ..load(0.0) };
    let d = at(&held, 0, 202, &mut h);
    assert_eq!((d.replicas, d.reason), (1, Reason::FromZero), "{}", d.message);
    // A held backlog too old for its batch to wait counts as one: 50 held for 2 s drain at
    // 320 req/s × 0.2 s = 64 per replica: one; 200 need four. Beside a rate, the replicas
    // asked for the rate drain it first: 100 req/s (one replica) and 50 held need one.
    let backlog = |n: f64, rate: f64| Observed { queue_depth: n, oldest_queue_age: 2 * S, ..load(rate) };
    assert_eq!(at(&backlog(50.0, 0.0), 0, 203, &mut h).replicas, 1);
    assert_eq!(at(&backlog(200.0, 0.0), 0, 204, &mut h).replicas, 4);
    let d = at(&backlog(50.0, 100.0), 0, 205, &mut h);
    assert_eq!(d.replicas, 1, "{}", d.message);
    assert_eq!(at(&backlog(200.0, 100.0), 0, 206, &mut h).replicas, 4);
}

#[test]
fn scale_to_zero_waits_for_starting_pods_and_is_off_without_its_field() {
    let t0 = ferry_core::clock::now();
    let starting = Observed { starting: 1, ..load(0.0) };
    let t = to_zero_after(10 * S);
    let h = decide(&starting, &t, 2, &History::default(), t0).history;
    let d = decide(&starting, &t, 2, &h, t0 + 100 * S);
    assert_ne!(d.replicas, 0, "{}", d.message);
    // minReplicas 0 alone is no door to zero: a service without pods has none to show its
    // load with, and nothing to bring it back.
    let t = Target { scale_to_zero_after: None, ..to_zero_after(10 * S) };
    let mut h = History::default();
    for secs in [0, 400, 800, 1200] {
        let d = decide(&load(0.0), &t, 1, &h, t0 + secs * S);
        assert_eq!(d.replicas, 1, "{}", d.message);
        h = d.history;
    }
    // From zero without the field (it was removed): back to one.
    assert_eq!(decide(&load(0.0), &t, 0, &History::default(), t0).replicas, 1);
}

#[test]
fn a_generation_load_is_sized_by_the_pods_own_capacity() {
    // 20 req/s of generations: the batch arithmetic (320 req/s per replica) says one replica
    // plus the warm one; pods that serve 9.5 req/s each with their deadlines kept need
    // ceil(20 / (9.5 x 0.8)) = 3; those leave 0.9 of a pod's capacity spare beyond the 2.1
    // the load keeps busy, less than the warm pod's worth: 4.
    assert_eq!(once(&load(20.0), &target(), 1).replicas, 2);
    let d = once(&Observed { capacity: Some(9.5), ..load(20.0) }, &target(), 1);
    assert_eq!((d.replicas, d.reason), (4, Reason::Load), "{}", d.message);
    assert!(
        d.message.contains("at 9.5 req/s per replica, the pods' own figure, (×0.80 utilization) needs 3"),
        "{}",
        d.message
    );
}

#[test]
fn prompts_waiting_beyond_what_the_ready_pods_prefill_in_time_add_pods() {
    // 5 req/s on 2 pods of 9.5 req/s: 1 for the rate. But 200 000 prompt tokens wait, and a
    // pod prefills 20 000 a second: the 2 ready pods take 40 000 within the 1 s budget, and
    // the other 160 000 need 8 more pods: 1 + 8 + 1 warm.
    let t = Target { ttft_budget: Some(S), ..target() };
    let o = Observed { capacity: Some(9.5), queue_tokens: 200_000.0, prefill_rate: Some(20_000.0), ..load(5.0) };
    let d = once(&o, &t, 2);
    assert_eq!((d.replicas, d.reason), (10, Reason::Backlog), "{}", d.message);
    assert!(d.message.contains("200000 prompt tokens waiting, more than the ready pods prefill within the 1000 ms first-token budget, need 8 more"), "{}", d.message);
    // What the ready pods prefill in time is no backlog; nor is a request-level service's.
    let within = Observed { queue_tokens: 40_000.0, ..o.clone() };
    assert_eq!(once(&within, &t, 2).replicas, 2);
    assert_eq!(once(&o, &target(), 2).replicas, 2, "no first-token budget: not a generation service");
    // While a pod starts, it is the capacity to come.
    assert_eq!(once(&Observed { starting: 1, ..o }, &t, 3).reason, Reason::Warming);
}

#[test]
fn replicas_follow_the_arithmetic_plus_warm_spares() {
    // 1000 req/s over 256 usable req/s per replica: 4, plus 1 warm.
    let d = once(&load(1000.0), &target(), 1);
    assert_eq!((d.replicas, d.reason), (5, Reason::Load));
    assert!(
        d.message.starts_with("scale up: 1000 req/s at 320 req/s per replica (×0.80 utilization) needs 4"),
        "{}",
        d.message
    );
    assert!(d.message.ends_with(", 5 with 1 replica(s) of warm capacity beyond the load"), "{}", d.message);
    // A generation service counts warm capacity in its pods' own figure, the headroom too:
    // 520 req/s at 320 a pod needs 3 at 0.8 utilization, which leave 1.4 pods' capacity
    // spare, more than the warm one; 1000 req/s keeps 3.1 pods busy, and 4 leave 0.9: one
    // pod's capacity beyond the load takes 5. A request-level service adds the warm one.
    let generation = |rate: f64| Observed { capacity: Some(320.0), ..load(rate) };
    let covered = once(&generation(520.0), &target(), 1);
    assert_eq!((covered.replicas, covered.reason), (3, Reason::Load), "{}", covered.message);
    assert!(covered.message.ends_with("its utilization headroom covering 1 replica(s) of warm capacity"));
    assert_eq!((once(&generation(1000.0), &target(), 1).replicas, once(&load(520.0), &target(), 1).replicas), (5, 4));
    // Measured batches and rows change the capacity: 2 rows per request halve it.
    let o = Observed { rows_per_request: 2.0, batch_time: Some(Duration::from_millis(50)), ..load(1000.0) };
    assert_eq!(once(&o, &target(), 1).replicas, 5);
    // No load: the warm spare alone, the same count a new service starts with.
    assert_eq!(once(&load(0.0), &target(), 1).replicas, 1);
    // 300 req/s with 2 warm: 2 plus 2 warm; for a generation service, 1 busy pod + 2 warm.
    let t = Target { min_replicas: 0, warm_replicas: 2, ..target() };
    assert_eq!((once(&load(0.0), &t, 2).replicas, once(&load(300.0), &t, 2).replicas), (2, 4));
    assert_eq!(once(&generation(300.0), &t, 2).replicas, 3);
}

#[test]
fn a_rising_rate_is_sized_one_time_to_ready_ahead_and_at_most_doubled() {
    let t0 = ferry_core::clock::now();
    let mut h = History::default();
    // 5 req/s more every second, for 30 s: 150 → 300 req/s.
    let mut d = None;
    for i in 0..=15u32 {
        let rate = 150.0 + 10.0 * f64::from(i);
        let next = decide(&load(rate), &target(), 2, &h, t0 + 2 * i * S);
        h = next.history.clone();
        d = Some(next);
    }
    let d = d.unwrap();
    // 300 req/s now and 5 more each second for 60 s: 600 req/s, 3 replicas, plus 1 warm.
    assert_eq!((d.replicas, d.reason), (4, Reason::Load), "{}", d.message);
    assert!(d.message.contains("300 req/s (rising 5.0 req/s per s: 600 in 60 s)"), "{}", d.message);
    // A longer time-to-ready would look further, but never past twice the rate now.
    let slow = Target { startup: 600 * S, ..target() };
    let far = decide(&load(300.0), &slow, 2, &h, t0 + 32 * S);
    assert_eq!(far.replicas, 4, "600 req/s at most: {}", far.message);
    // A falling rate is not projected: only the rate now counts.
    let mut h = History::default();
    for i in 0..=15u32 {
        h = decide(&load(600.0 - 10.0 * f64::from(i)), &target(), 4, &h, t0 + 2 * i * S).history;
    }
    assert!(trend(&h.rates) < -4.9);
    let d = decide(&load(440.0), &target(), 3, &h, t0 + 80 * S);
    assert_eq!(d.replicas, 3, "440 / 256 → 2, plus 1 warm: {}", d.message);
    // Points older than one time-to-ready are forgotten: those of 20 s to 30 s, and now.
    assert_eq!(d.history.rates.len(), 7);
}

#[test]
fn a_backlog_older_than_max_wait_plus_batch_time_adds_replicas() {
    let o = Observed { queue_depth: 640.0, oldest_queue_age: Duration::from_millis(150), ..load(500.0) };
    // 500 req/s needs 2; of 640 queued, 3 ready replicas drain 192 within 0.2 s; the other
    // 448 at 64 per replica need 7 more; 1 warm.
    let d = once(&o, &target(), 3);
    assert_eq!((d.replicas, d.reason), (10, Reason::Backlog));
    assert!(d.message.contains("a backlog of 640 (oldest waited 150 ms) needs 7 more"), "{}", d.message);
    // A young queue is normal batching, not a backlog.
    let young = Observed { oldest_queue_age: Duration::from_millis(50), ..o.clone() };
    assert_eq!(once(&young, &target(), 3).replicas, 3);
    // Pods already starting will arrive after this backlog is gone: no extra for it.
    let coming = Observed { starting: 1, ..o };
    assert_eq!(once(&coming, &target(), 3).replicas, 3);
}

#[test]
fn deadline_pressure_on_busy_replicas_scales_up_at_once_and_blocks_scale_down() {
    let now = ferry_core::clock::now();
    // 900 req/s on 5 replicas (1600 req/s at full batches) is busy; the rate alone needs 4 + 1 warm.
    let o = Observed { pressure: 0.05, ..load(900.0) };
    let d = once(&o, &target(), 5);
    assert_eq!((d.replicas, d.reason), (6, Reason::Pressure), "{}", d.message);
    assert!(d.message.starts_with("deadline pressure: 5.0 % of requests infeasible or expired"), "{}", d.message);
    assert_eq!(d.history.probe, Some(Probe { from: 5, replicas: 6, pressure: 0.05 }));
    // A backlog is capacity pressure too, whatever the rate.
    let backlog = Observed { queue_depth: 50.0, oldest_queue_age: Duration::from_millis(150), ..load(100.0) };
    assert_eq!(once(&Observed { pressure: 0.05, ..backlog.clone() }, &target(), 5).reason, Reason::Pressure);
    let h = History { lower_since: Some(now - 600 * S), ..History::default() };
    let held = decide(&Observed { pressure: 0.05, ..backlog.clone() }, &target(), 20, &h, now);
    assert_eq!(held.replicas, 20, "no scale-down (and max bounds the scale-up) under pressure");
    assert_eq!(held.history.lower_since, None);
}

#[test]
fn locked_pods_are_capacity_and_named() {
    // 400 req/s on 4 replicas, one of them locked: it counts as a replica (no scale-up for
    // it), and the message says where to look.
    let d = once(&Observed { locked: 1, ..load(400.0) }, &target(), 4);
    let plain = once(&load(400.0), &target(), 4);
    assert_eq!((d.replicas, d.reason), (plain.replicas, plain.reason));
    assert!(d.message.ends_with("1 pod(s) refuse every request while idle (ferry_admission_locked), not for want of capacity: see their /v2/health/ready"), "{}", d.message);
}

#[test]
fn stuck_pods_are_no_capacity() {
    // 400 req/s with pressure on 4 replicas: idle ones if all 4 serve, busy ones if 2 are
    // stuck (unschedulable), which is want of capacity.
    let o = Observed { pressure: 0.05, ..load(400.0) };
    let idle = once(&o, &target(), 4);
    assert_eq!((idle.replicas, idle.reason), (4, Reason::Cooling));
    assert!(idle.message.contains("not for want of capacity"), "{}", idle.message);
    let d = once(&Observed { stuck: 2, ..o }, &target(), 4);
    assert_eq!((d.replicas, d.reason), (5, Reason::Pressure), "{}", d.message);
}

#[test]
fn pressure_at_low_utilization_is_a_floor_of_the_service_not_load() {
    // The quickstart's trickle: 20 req/s on 2 replicas, 1.7 % refused because a request
    // that arrives just after a batch leaves waits a whole batch for the worker.
    let d = once(&Observed { pressure: 0.017, ..load(20.0) }, &target(), 2);
    assert_eq!((d.replicas, d.reason), (2, Reason::Structural), "{}", d.message);
    assert!(d.message.contains("not for want of capacity: the ready replicas are not busy (20 of 640 req/s)"));
}

#[test]
fn pressure_stops_scaling_once_added_replicas_stop_helping() {
    let t0 = ferry_core::clock::now();
    let t = target();
    let strained = Observed { pressure: 0.04, ..load(1000.0) };
    // Busy and pressured on 5: one more.
    let up = decide(&strained, &t, 5, &History::default(), t0);
    assert_eq!((up.replicas, up.reason), (6, Reason::Pressure));
    // While the new pod starts, and for a window after it is ready, the same refusals are
    // still in the window: it holds instead of climbing a replica a tick.
    let starting = decide(&Observed { starting: 1, ..strained.clone() }, &t, 6, &up.history, t0 + 2 * S);
    assert_eq!((starting.replicas, starting.reason), (6, Reason::Settling), "{}", starting.message);
    let settling = decide(&Observed { settling: 1, ..strained.clone() }, &t, 6, &starting.history, t0 + 62 * S);
    assert_eq!((settling.replicas, settling.reason), (6, Reason::Settling));
    // A window later the pressure has halved: it helped, so one more.
    let helped = decide(&Observed { pressure: 0.015, ..strained.clone() }, &t, 6, &settling.history, t0 + 72 * S);
    assert_eq!((helped.replicas, helped.reason), (7, Reason::Pressure), "{}", helped.message);
    assert_eq!(helped.history.floor, None);
    // The 7th did not: 1.2 % stays. That is the floor: the 7th goes again at once, and no
    // more scale-ups are made for it.
    let ready = Observed { pressure: 0.012, ..strained.clone() };
    let h = decide(&Observed { starting: 1, ..ready.clone() }, &t, 7, &helped.history, t0 + 74 * S).history;
    let floor = decide(&ready, &t, 7, &h, t0 + 144 * S);
    assert_eq!((floor.replicas, floor.reason), (6, Reason::Structural), "{}", floor.message);
    assert_eq!(floor.history.floor, Some(Floor { pressure: 0.012, rate: 1000.0, replicas: 6 }));
    assert!(floor.message.contains("after the scale-up from 6 to 7 for 1.5 %, not for want of capacity: back to 6"));
    let later = decide(&ready, &t, 6, &floor.history, t0 + 146 * S);
    assert_eq!((later.replicas, later.reason), (6, Reason::Structural));
    // Once the pressure is gone, so is the floor: the load alone (5) decides again.
    let calm = decide(&load(1000.0), &t, 6, &later.history, t0 + 147 * S);
    assert_eq!((calm.history.floor, calm.reason), (None, Reason::Cooling));
    assert!(later.message.contains("replicas added at 1000 req/s did not relieve it; keeping 6"), "{}", later.message);
    // The replicas that helped stay while the load stays near where the floor was seen...
    let near = decide(&Observed { pressure: 0.012, ..load(800.0) }, &t, 6, &later.history, t0 + 148 * S);
    assert_eq!((near.replicas, near.reason), (6, Reason::Structural), "{}", near.message);
    // ...and a load that moved by more than a quarter is a new situation: at 600 req/s the
    // replicas are not busy, so the pressure holds nothing back and scale-down waits its delay.
    let lower = decide(&Observed { pressure: 0.012, ..load(600.0) }, &t, 6, &near.history, t0 + 150 * S);
    assert_eq!(lower.history.floor, None);
    assert_eq!((lower.replicas, lower.reason), (6, Reason::Cooling), "{}", lower.message);
    // At 1300 req/s the pressure counts again.
    let more = decide(&Observed { pressure: 0.02, ..load(1300.0) }, &t, 6, &lower.history, t0 + 152 * S);
    assert_eq!(more.history.floor, None);
    assert!(more.replicas > 6, "{}", more.message);
}

#[test]
fn pressure_waits_for_pods_already_starting_and_ignores_a_tolerated_trickle() {
    let starting = Observed { pressure: 0.05, starting: 2, ..load(700.0) };
    let d = once(&starting, &target(), 4);
    assert_eq!((d.replicas, d.reason), (4, Reason::Settling));
    assert!(d.message.contains("holding 4: 5.0 % of requests infeasible or expired, and 2 pods"), "{}", d.message);
    // The rate alone still scales up past what is starting.
    assert_eq!(once(&Observed { pressure: 0.05, starting: 2, ..load(1000.0) }, &target(), 4).replicas, 5);
    // Half a percent refused is within the 99 % goal: no pressure.
    let trickle = once(&Observed { pressure: 0.005, ..load(300.0) }, &target(), 3);
    assert_eq!((trickle.replicas, trickle.reason), (3, Reason::Steady), "{}", trickle.message);
}

#[test]
fn scale_down_waits_for_the_delay_then_follows_the_peak_need_over_it() {
    let t0 = ferry_core::clock::now();
    let target = target();
    // 300 req/s needs 2, plus 1 warm, on 6 replicas.
    let first = decide(&load(300.0), &target, 6, &History::default(), t0);
    assert_eq!((first.replicas, first.reason), (6, Reason::Cooling));
    assert!(
        first.message.starts_with("holding 6: need fell to 3 0 s ago, scale-down waits 300 s"),
        "{}",
        first.message
    );
    // A brief rise within the window to 900 req/s needs 4, plus 1 warm.
    let mid = decide(&load(900.0), &target, 6, &first.history, t0 + 100 * S);
    assert_eq!((mid.replicas, mid.history.lower_since), (6, Some(t0)));
    let before = decide(&load(300.0), &target, 6, &mid.history, t0 + 299 * S);
    assert_eq!(before.replicas, 6);
    // The delay is over: down to the highest need of the last 300 s, the rise's 5.
    let after = decide(&load(300.0), &target, 6, &before.history, t0 + 300 * S);
    assert_eq!((after.replicas, after.reason), (5, Reason::ScaleDown), "{}", after.message);
    assert!(after.message.starts_with("scale down: the highest need over the last 300 s is 5;"), "{}", after.message);
    // While the rise is within the window, 5 stay; once it is older than the delay, the need
    // now — no second delay to wait out.
    let held = decide(&load(300.0), &target, 5, &after.history, t0 + 399 * S);
    assert_eq!((held.replicas, held.reason), (5, Reason::Peak), "{}", held.message);
    let lower = decide(&load(300.0), &target, 5, &held.history, t0 + 401 * S);
    assert_eq!((lower.replicas, lower.reason), (3, Reason::ScaleDown), "{}", lower.message);
    // Need at the replicas again starts the delay anew.
    let steady = decide(&load(300.0), &target, 3, &lower.history, t0 + 402 * S);
    assert_eq!((steady.replicas, steady.reason, steady.history.lower_since), (3, Reason::Steady, None));
}

/// Decisions for `target` every 2 s for `seconds`, the rate at each from `rate` (counted over
/// a 10 s window), the replicas following each decision: the last decision.
fn follow(target: &Target, rate: impl Fn(f64) -> f64, seconds: u32, from: u32) -> ScaleDecision {
    let t0 = ferry_core::clock::now();
    let (mut current, mut history) = (from, History::default());
    let mut last = None;
    for s in (0..=seconds).step_by(2) {
        let observed = Observed { window_seconds: 10.0, latest_seconds: 2.0, ..load(rate(f64::from(s))) };
        let d = decide(&observed, target, current, &history, t0 + s * S);
        (current, history) = (d.replicas, d.history.clone());
        last = Some(d);
    }
    last.expect("one decision at least")
}

#[test]
fn a_load_that_falls_steadily_is_followed_a_minute_behind_not_a_delay() {
    // 1500 req/s at t = 300 s falling by 2 req/s a second to 300 at t = 900 s (at 256 req/s a
    // replica, 7 then 3 with the warm one): a fall of 300 req/s within each 150 s half of the
    // delay, where two 10 s readings of 1500 req/s differ by √2 × 12 by chance.
    let falling = |s: f64| if s < 300.0 { 1500.0 } else { (1500.0 - 2.0 * (s - 300.0)).max(300.0) };
    let d = follow(&target(), falling, 800, 7);
    // At t = 800 s: 500 req/s now needs 2 + 1; a minute ago, 620 req/s needed 3 + 1 — where
    // the delay's window would hold what 1100 req/s needed (5 + 1).
    assert_eq!((d.replicas, d.reason), (4, Reason::Peak), "{}", d.message);
    assert_eq!(
        d.message,
        "holding 4: the load fell steadily over the last 300 s: the highest need over the last 60 s (4) does \
         not fit on 3"
    );
    // The same fall as a drop at t = 600 s: nothing goes before the delay is over.
    let dropped = follow(&target(), |s| if s < 600.0 { 1500.0 } else { 500.0 }, 800, 7);
    assert_eq!((dropped.replicas, dropped.reason), (7, Reason::Peak), "{}", dropped.message);
    // A load that falls from 1500 req/s at t = 0 and turns at 500 req/s at t = 500 s: followed
    // down a minute behind while it falls (at t = 520 s, the 580 req/s of a minute ago need 3
    // + 1, where the delay's window would hold what 1060 req/s needed, 5 + 1); once the newer
    // half of the window rises, no longer a fall.
    let turned = |s: f64| if s < 500.0 { 1500.0 - 2.0 * s } else { 500.0 + 2.0 * (s - 500.0) };
    let falling = follow(&target(), turned, 520, 7);
    assert_eq!(falling.replicas, 4, "{}", falling.message);
    let risen = follow(&target(), turned, 640, 7);
    assert!(!steady_fall(&risen.history.needs, turned(640.0), 10.0));
    // A fall within chance is no fall: 0.05 req/s a second over 10 s readings of ~110 req/s
    // (7.5 req/s within each half, against 2 × √2 × √(115 / 10) ≈ 9.6).
    let slow = |s: f64| 140.0 - 0.05 * s;
    let noise = follow(&target(), slow, 800, 2);
    assert!(!steady_fall(&noise.history.needs, slow(800.0), 10.0));
    assert!(steady_fall(&noise.history.needs, slow(800.0), f64::INFINITY), "read exactly, it is a fall");
    // A delay no longer than a forecast window is not shortened.
    let short = Target { scale_down_delay: 60 * S, ..target() };
    let d = follow(&short, |s: f64| (1500.0 - 2.0 * s).max(300.0), 400, 7);
    assert!(d.message.contains("over the last 60 s") && !d.message.contains("fell"), "{}", d.message);
}

#[test]
fn a_starting_pod_goes_before_a_ready_one_and_no_ready_pod_goes_while_one_warms() {
    let t0 = ferry_core::clock::now();
    // Need fell to 3 on 6 replicas, one of them starting, right after a restart: the
    // window is not whole, so lower need waits a forecast window first.
    let starting = Observed { starting: 1, ..load(300.0) };
    let first = decide(&starting, &target(), 6, &History::default(), t0);
    assert_eq!((first.replicas, first.reason), (6, Reason::Warming), "{}", first.message);
    assert!(first.message.contains("1 pods are starting and a ready pod is not removed while one warms"));
    let cancel = decide(&starting, &target(), 6, &first.history, t0 + 60 * S);
    assert_eq!((cancel.replicas, cancel.reason), (5, Reason::ScaleDown), "{}", cancel.message);
    assert!(cancel.message.starts_with("scale down: 1 of 1 pods still starting are no longer needed"));
    // The ready ones wait out the delay from the first lower need, then go to the peak.
    let cooling = decide(&load(300.0), &target(), 5, &cancel.history, t0 + 299 * S);
    assert_eq!((cooling.replicas, cooling.reason), (5, Reason::Cooling), "{}", cooling.message);
    let down = decide(&load(300.0), &target(), 5, &cooling.history, t0 + 300 * S);
    assert_eq!((down.replicas, down.reason), (3, Reason::ScaleDown), "{}", down.message);
}

/// A history watched for longer than any window, whose one decision at `t0` asked for 6
/// replicas while the load seen then needed `seen`.
fn asked_ahead(t0: Instant, seen: u32) -> History {
    History {
        watched_since: Some(t0 - 900 * S),
        window: 300 * S,
        needs: [Needed { at: t0, ahead: 6, seen, rate: 300.0 }].into(),
        ..History::default()
    }
}

#[test]
fn pods_asked_for_a_rise_that_stopped_go_after_a_forecast_window_not_a_delay() {
    let t0 = ferry_core::clock::now();
    // The look-ahead asked for 6 while the load seen needed 3, and the rise stopped: 300
    // req/s needs 3. Three pods are still starting.
    let starting = Observed { starting: 3, ..load(300.0) };
    let early = decide(&starting, &target(), 6, &asked_ahead(t0, 3), t0 + 30 * S);
    assert_eq!((early.replicas, early.reason), (6, Reason::Warming), "{}", early.message);
    let cancel = decide(&starting, &target(), 6, &early.history, t0 + 61 * S);
    assert_eq!((cancel.replicas, cancel.reason), (3, Reason::ScaleDown), "{}", cancel.message);
    assert!(
        cancel.message.starts_with(
            "scale down: 3 of 3 pods still starting are no longer needed: the highest need over the last 300 s \
             is 3 (the look-ahead's over the last 60 s)"
        ),
        "{}",
        cancel.message
    );
    // Ready already: they go as soon, the load having never needed them...
    let ready = decide(&load(300.0), &target(), 6, &asked_ahead(t0, 3), t0 + 61 * S);
    assert_eq!((ready.replicas, ready.reason), (3, Reason::ScaleDown), "{}", ready.message);
    // ...where replicas the load seen needed wait for the delay's window.
    let seen = decide(&load(300.0), &target(), 6, &asked_ahead(t0, 6), t0 + 61 * S);
    assert_eq!((seen.replicas, seen.reason), (6, Reason::Peak), "{}", seen.message);
    let after = decide(&load(300.0), &target(), 6, &seen.history, t0 + 301 * S);
    assert_eq!((after.replicas, after.reason), (3, Reason::ScaleDown), "{}", after.message);
}

#[test]
fn a_pressure_probe_still_starting_is_not_cancelled() {
    let t0 = ferry_core::clock::now();
    let h = History {
        watched_since: Some(t0 - 900 * S),
        window: 300 * S,
        lower_since: Some(t0 - 120 * S),
        probe: Some(Probe { from: 5, replicas: 6, pressure: 0.05 }),
        ..History::default()
    };
    let d = decide(&Observed { starting: 1, ..load(300.0) }, &target(), 6, &h, t0);
    assert_eq!((d.replicas, d.reason), (6, Reason::Warming), "{}", d.message);
    // Without the probe, the same starting pod goes...
    let plain = History { probe: None, ..h };
    let d = decide(&Observed { starting: 1, ..load(300.0) }, &target(), 6, &plain, t0);
    assert_eq!((d.replicas, d.reason), (5, Reason::ScaleDown), "{}", d.message);
    assert!(d.message.contains("the highest need over the last 300 s is 3 (the look-ahead's over the last 60 s), and the 5 ready stay while one warms"), "{}", d.message);
    // ...but not during a rollout, which would take a ready pod of the old ReplicaSet.
    let rolling = Observed { starting: 1, rolling_out: true, ..load(300.0) };
    let d = decide(&rolling, &target(), 6, &plain, t0);
    assert_eq!((d.replicas, d.reason), (6, Reason::Warming), "{}", d.message);
}

#[test]
fn replicas_added_for_pressure_stay_a_whole_window_once_it_is_relieved() {
    let t0 = ferry_core::clock::now();
    let watched = History { watched_since: Some(t0 - 900 * S), window: 300 * S, ..History::default() };
    // Busy and pressured on 5 (900 req/s needs 5): a probe to 6, which relieves it.
    let strained = Observed { pressure: 0.04, ..load(900.0) };
    let up = decide(&strained, &target(), 5, &watched, t0);
    assert_eq!((up.replicas, up.reason), (6, Reason::Pressure), "{}", up.message);
    let settled = decide(&load(900.0), &target(), 6, &up.history, t0 + 120 * S);
    assert_eq!(settled.history.probe, None, "judged: it helped");
    assert_eq!((settled.replicas, settled.reason), (6, Reason::Peak), "{}", settled.message);
    // Once the pressure's decision is older than the delay, the need alone decides.
    let later = decide(&load(900.0), &target(), 6, &settled.history, t0 + 301 * S);
    assert_eq!((later.replicas, later.reason), (5, Reason::ScaleDown), "{}", later.message);
}

#[test]
fn consolidation_is_refused_when_the_load_does_not_fit_on_one_fewer() {
    let t0 = ferry_core::clock::now();
    // Need 3 now, but 4 was needed within the window: 4 replicas stay.
    let needs = [Needed { at: t0 + 100 * S, ahead: 4, seen: 4, rate: 700.0 }].into();
    let h = History { lower_since: Some(t0), watched_since: Some(t0), window: 300 * S, needs, ..History::default() };
    let d = decide(&load(300.0), &target(), 4, &h, t0 + 300 * S);
    assert_eq!((d.replicas, d.reason), (4, Reason::Peak));
    assert!(d.message.contains("does not fit on 3"), "{}", d.message);
}

#[test]
fn replicas_stay_within_bounds() {
    let now = ferry_core::clock::now();
    let t = Target { min_replicas: 2, max_replicas: 6, ..target() };
    assert_eq!(once(&load(10_000.0), &t, 3).replicas, 6);
    assert_eq!(once(&load(0.0), &t, 2).replicas, 2);
    // The spec was lowered below the count: down to maxReplicas at once, not after the delay.
    assert_eq!((once(&load(100.0), &t, 9).replicas, once(&load(100.0), &t, 9).reason), (6, Reason::ScaleDown));
    let zero_min = Target { min_replicas: 0, warm_replicas: 0, ..target() };
    let h = History { lower_since: Some(now - 300 * S), ..History::default() };
    let idle = decide(&load(0.0), &zero_min, 1, &h, now);
    assert_eq!(idle.replicas, 1, "zero only with scaleToZeroAfter: {}", idle.message);
}

#[test]
fn starting_pods_count_as_capacity_to_come() {
    // 5 replicas requested, 3 of them still starting, a backlog and deadline pressure: the
    // starting pods are the relief on its way, so nothing more is asked for...
    let strained = Observed {
        queue_depth: 640.0,
        oldest_queue_age: Duration::from_millis(150),
        pressure: 0.05,
        starting: 3,
        ..load(1000.0)
    };
    let d = once(&strained, &target(), 5);
    assert_eq!((d.replicas, d.reason), (5, Reason::Settling), "{}", d.message);
    // ...while the same strain on 5 ready replicas scales up.
    let ready = once(&Observed { starting: 0, ..strained }, &target(), 5);
    assert!(ready.replicas > 5, "{ready:?}");
}

#[test]
fn every_reason_has_its_own_label() {
    let labels: std::collections::HashSet<_> = Reason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(labels.len(), Reason::ALL.len());
}
