//! The collector's arithmetic: a sidecar's `/metrics` (the Prometheus text format, parsed with
//! `prometheus-parse`) reduced to the few numbers the decision needs, and counters turned into
//! rates over a sliding window — handling counter resets (a restarted pod starts from zero, as
//! Prometheus' `rate()` handles them), pods that come and go, and scrapes that fail.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use ferry_core::metric;
use ferry_core::outcome::Outcome;
use prometheus_parse::{Scrape, Value};
use std::time::Instant;

use super::decide::Observed;

/// One scrape of one pod.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodSample {
    /// `ferry_requests_total` of the outcomes that are offered load (admitted, `queue_full`,
    /// `infeasible`): a flood of malformed or misrouted requests is not load.
    pub requests: f64,
    /// `ferry_requests_total{outcome="ok"}`.
    pub ok: f64,
    /// `ferry_requests_total{outcome=~"infeasible|expired"}`: deadline pressure.
    pub pressure: f64,
    pub queue_depth: f64,
    /// `ferry_sequences{state="running"}`: generation streams being sent.
    pub running: f64,
    /// Seconds.
    pub oldest_age: f64,
    /// `ferry_batch_size` count and sum (rows), `ferry_batch_duration_seconds` sum.
    pub batches: f64,
    pub batch_rows: f64,
    pub batch_seconds: f64,
    /// `ferry_admission_locked`: model versions refusing every request while idle.
    pub locked: f64,
    /// `ferry_capacity_requests_per_second`: the requests a second a generation pod serves with
    /// its deadlines kept, by its own account (its learned step cost, the shape of its recent
    /// requests, its targets); `None` where it has no figure (NaN: no request finished yet, or
    /// no step engine) or says it can serve none at its targets, which more replicas would not mend.
    pub capacity: Option<f64>,
    /// `ferry_queue_tokens`: prompt tokens waiting to be prefilled.
    pub queue_tokens: f64,
    /// `ferry_preemptions_total`, and `ferry_kv_usage_ratio` (the fullest model version's).
    pub preemptions: f64,
    pub kv_usage: f64,
    /// `ferry_generation_tokens_total`.
    pub generated: f64,
    /// `ferry_step_cost_seconds{term="prefill_token"}`: its learned cost of a prompt token (the
    /// largest over its model versions); `None` without a step engine (NaN).
    pub prefill_cost: Option<f64>,
}

fn value(v: &Value) -> f64 {
    match v {
        Value::Counter(x) | Value::Gauge(x) | Value::Untyped(x) => *x,
        _ => 0.0,
    }
}

/// Reads a sidecar's metrics text.
pub fn parse(text: &str) -> Result<PodSample, String> {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).map_err(|e| e.to_string())?;
    let mut s = PodSample::default();
    let mut seen = false;
    let (ok, infeasible, expired) = (Outcome::Ok.label(), Outcome::Infeasible.label(), Outcome::Expired.label());
    for sample in &scrape.samples {
        let x = value(&sample.value);
        // Histograms come as NAME_count and NAME_sum samples beside their buckets.
        let name = sample.metric.as_str();
        let (base, part) = match name.rsplit_once('_') {
            Some((base, part @ ("count" | "sum"))) => (base, part),
            _ => (name, ""),
        };
        match (base, part) {
            // Requests that named no model the sidecar serves (`model=""`) are no load of this one.
            (metric::REQUESTS, "") if sample.labels.get(metric::MODEL).is_none_or(str::is_empty) => seen = true,
            (metric::REQUESTS, "") => {
                seen = true;
                let outcome = sample.labels.get(metric::OUTCOME);
                if outcome
                    .and_then(|o| Outcome::ALL.into_iter().find(|k| k.label() == o))
                    .is_some_and(Outcome::is_offered_load)
                {
                    s.requests += x;
                }
                match outcome {
                    Some(o) if o == ok => s.ok += x,
                    Some(o) if o == infeasible || o == expired => s.pressure += x,
                    _ => {}
                }
            }
            (metric::QUEUE_DEPTH, "") => s.queue_depth += x,
            (metric::SEQUENCES, "") if sample.labels.get(metric::STATE) == Some("running") => s.running += x,
            (metric::QUEUE_OLDEST_AGE, "") => s.oldest_age = s.oldest_age.max(x),
            (metric::BATCH_SIZE, "count") => s.batches += x,
            (metric::BATCH_SIZE, "sum") => s.batch_rows += x,
            (metric::BATCH_DURATION, "sum") => s.batch_seconds += x,
            (metric::ADMISSION_LOCKED, "") => s.locked += x,
            (metric::QUEUE_TOKENS, "") => s.queue_tokens += x,
            (metric::PREEMPTIONS, "") => s.preemptions += x,
            (metric::GENERATION_TOKENS, "") => s.generated += x,
            (metric::KV_USAGE, "") => s.kv_usage = s.kv_usage.max(x),
            (metric::STEP_COST, "")
                if sample.labels.get(metric::TERM) == Some("prefill_token") && x.is_finite() && x > 0.0 =>
            {
                s.prefill_cost = Some(s.prefill_cost.unwrap_or(0.0).max(x));
            }
            (metric::CAPACITY_REQUESTS, "") if x.is_finite() && x > 0.0 => {
                s.capacity = Some(s.capacity.unwrap_or(0.0) + x);
            }
            _ => {}
        }
    }
    if !seen {
        return Err(format!("no {}: not a Ferry sidecar", metric::REQUESTS));
    }
    Ok(s)
}

/// Scrapes one sidecar's metrics (`url`: `http://POD_IP:9090/metrics`).
pub async fn scrape(client: &reqwest::Client, url: &str) -> Result<PodSample, String> {
    parse(&fetch(client, url).await?)
}

/// A metrics page's text (a sidecar's, or the holder's).
pub async fn fetch(client: &reqwest::Client, url: &str) -> Result<String, String> {
    let response = client.get(url).send().await.map_err(|e| format!("{url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("{url} answered {}", response.status()));
    }
    response.text().await.map_err(|e| format!("{url}: {e}"))
}

/// How much a counter grew between samples, where a drop means the process restarted and counts
/// from zero again.
fn increase(values: impl Iterator<Item = f64>) -> f64 {
    let mut total = 0.0;
    let mut last: Option<f64> = None;
    for v in values {
        if let Some(prev) = last {
            total += if v >= prev { v - prev } else { v };
        }
        last = Some(v);
    }
    total
}

/// Recent scrapes of one pod.
#[derive(Debug, Clone, Default)]
struct Window {
    samples: VecDeque<(Instant, PodSample)>,
}

/// Sliding-window rates for every pod of every service.
///
/// Every pod's counters are read over the same window, ending now: the service's rate is all the
/// window's requests over its one duration. Summing per-pod rates over unequal spans would count
/// a pod that joined late at its short-span rate beside the others' long-span rates, which still
/// include the share it took over from them: after a scale-up, more than was sent.
#[derive(Debug, Clone)]
pub struct Collector {
    span: Duration,
    pods: HashMap<String, Window>,
}

impl Collector {
    /// Rates are taken over the last `span`.
    pub fn new(span: Duration) -> Self {
        Collector { span, pods: HashMap::new() }
    }

    /// The span rates are taken over.
    pub fn span(&self) -> Duration {
        self.span
    }

    /// Records a scrape of `pod` (its UID) at `at`.
    pub fn observe(&mut self, pod: &str, at: Instant, sample: PodSample) {
        let w = self.pods.entry(pod.to_owned()).or_default();
        w.samples.push_back((at, sample));
        // Keep one sample older than the span, so the window covers all of it.
        while w.samples.len() > 2 && w.samples[1].0 + self.span <= at {
            w.samples.pop_front();
        }
    }

    /// A pod that became ready at `at` counted from zero then (a sidecar counts from its start,
    /// and no request reaches a pod before it is ready): what it served before its first scrape
    /// is in the window too. Ignored once the pod has samples.
    pub fn started(&mut self, pod: &str, at: Instant) {
        let w = self.pods.entry(pod.to_owned()).or_default();
        if w.samples.is_empty() {
            w.samples.push_back((at, PodSample::default()));
        }
    }

    /// A pod's latest scrape.
    pub fn last(&self, pod: &str) -> Option<&PodSample> {
        self.pods.get(pod).and_then(|w| w.samples.back()).map(|(_, s)| s)
    }

    /// Forgets pods that are gone.
    pub fn retain(&mut self, alive: &[String]) {
        self.pods.retain(|pod, _| alive.contains(pod));
    }

    /// Each pod's samples from the last one at or before `from` (or its first) on.
    fn windows<'a>(
        &'a self,
        pods: &'a [String],
        from: Option<Instant>,
    ) -> impl Iterator<Item = Vec<(Instant, PodSample)>> + 'a {
        self.windows_of(pods, from).map(|(_, w)| w)
    }

    /// [`Self::windows`], with the pod each is of.
    fn windows_of<'a>(
        &'a self,
        pods: &'a [String],
        from: Option<Instant>,
    ) -> impl Iterator<Item = (&'a String, Vec<(Instant, PodSample)>)> + 'a {
        pods.iter().filter_map(|p| self.pods.get(p).map(|w| (p, w))).filter(|(_, w)| !w.samples.is_empty()).map(
            move |(p, w)| {
                let start = match from {
                    Some(from) => w.samples.iter().rposition(|(at, _)| *at <= from).unwrap_or(0),
                    None => 0,
                };
                (p, w.samples.iter().skip(start).copied().collect())
            },
        )
    }

    /// What `pods` add up to over the window ending `now`. The `settling` ones (ready for less
    /// than a window) count in everything but the capacity figure while another pod has one: a
    /// fresh pod exports its prior (the step timings taken at load), a settled pod what it learned
    /// from the steps it ran.
    pub fn observed(&self, pods: &[String], settling: &[String], now: Instant) -> Observed {
        let (mut depth, mut oldest, mut locked) = (0.0, 0.0f64, 0);
        // (sum, pods) of the capacity figures: of settled pods, and of settling ones.
        let (mut settled_capacity, mut settling_capacity) = ((0.0, 0u32), (0.0, 0u32));
        let (mut queue_tokens, mut prefill_rate, mut prefilling) = (0.0, 0.0, 0u32);
        let mut kv_usage: Option<f64> = None;
        for (pod, w) in self.windows_of(pods, now.checked_sub(self.span)) {
            let (last_at, last) = *w.last().expect("not empty");
            // Gauges from a pod that has not answered for a whole window are stale.
            if last_at + self.span > now {
                depth += last.queue_depth;
                oldest = oldest.max(last.oldest_age);
                locked += u32::from(last.locked > 0.0);
                if let Some(c) = last.capacity {
                    let fit = if settling.contains(pod) { &mut settling_capacity } else { &mut settled_capacity };
                    fit.0 += c;
                    fit.1 += 1;
                }
                queue_tokens += last.queue_tokens;
                // A pod with a step engine (it exports its prefill cost) has a KV cache.
                if let Some(cost) = last.prefill_cost {
                    prefill_rate += 1.0 / cost;
                    prefilling += 1;
                    kv_usage = Some(kv_usage.unwrap_or(0.0).max(last.kv_usage));
                }
            }
        }
        let window = self.since(pods, now.checked_sub(self.span), now);
        // The latest interval: since the newest scrape before the last, of any pod. A pod's
        // start at zero is no scrape: a pod ready just before the last scrape is counted whole
        // over the others' interval, not the others over its short one (their load moved to it).
        let latest_from = self
            .windows(pods, now.checked_sub(self.span))
            .filter_map(|w| w.len().checked_sub(2).map(|i| w[i]))
            .filter(|(_, s)| *s != PodSample::default())
            .map(|(at, _)| at)
            .max();
        let latest = latest_from.map_or(Growth::default(), |from| self.since(pods, Some(from), now));
        let (requests, ok, batches) = (window.requests, window.ok, window.batches);
        Observed {
            arrival_rate: window.rate(),
            latest_rate: latest.rate(),
            window_seconds: window.duration,
            latest_seconds: latest.duration,
            rows_per_request: if ok > 0.0 && batches > 0.0 { (window.rows / ok).max(1.0) } else { 1.0 },
            batch_time: (batches > 0.0).then(|| Duration::from_secs_f64(window.seconds / batches)),
            queue_depth: depth,
            oldest_queue_age: Duration::from_secs_f64(oldest),
            pressure: if requests > 0.0 { (window.pressure / requests).min(1.0) } else { 0.0 },
            starting: 0,
            settling: 0,
            stuck: 0,
            rolling_out: false,
            locked,
            capacity: [settled_capacity, settling_capacity]
                .into_iter()
                .find(|&(_, n)| n > 0)
                .map(|(sum, n)| sum / f64::from(n)),
            queue_tokens,
            prefill_rate: (prefilling > 0).then(|| prefill_rate / f64::from(prefilling)),
            tokens_rate: if window.duration > 0.0 { window.generated / window.duration } else { 0.0 },
            kv_usage,
        }
    }

    /// Mean rows per batch over the window, for `batchFill`.
    pub fn rows_per_batch(&self, pods: &[String], now: Instant) -> Option<f64> {
        let window = self.since(pods, now.checked_sub(self.span), now);
        (window.batches > 0.0).then(|| window.rows / window.batches)
    }

    /// What the counters of `pods` grew by from `from` to `now`, and over how long: from `from`,
    /// or from the earliest Ready of a pod that started later. A pod's interval that straddles
    /// `from` counts in proportion to its part after it (as Prometheus' `rate()` extrapolates),
    /// so a pod whose scrapes paused does not stretch everyone's window.
    fn since(&self, pods: &[String], from: Option<Instant>, now: Instant) -> Growth {
        let mut g = Growth::default();
        let mut start: Option<Instant> = None;
        for w in self.windows(pods, from).filter(|w| w.len() >= 2) {
            let first = from.map_or(w[0].0, |from| from.max(w[0].0));
            start = Some(start.map_or(first, |s| s.min(first)));
            for pair in w.windows(2) {
                let ((t0, a), (t1, b)) = (pair[0], pair[1]);
                let share = match from {
                    Some(from) if t0 < from => ((t1 - from.min(t1)).as_secs_f64() / (t1 - t0).as_secs_f64()).min(1.0),
                    _ => 1.0,
                };
                let grew = |f: fn(&PodSample) -> f64| increase([f(&a), f(&b)].into_iter()) * share;
                g.requests += grew(|s| s.requests);
                g.ok += grew(|s| s.ok);
                // Refusals of a pod locked at the interval's end are its lock's, not deadline
                // pressure: more replicas would not relieve them.
                if b.locked == 0.0 {
                    g.pressure += grew(|s| s.pressure);
                }
                // A sequence preempted while the KV cache is all but full is recomputed: pressure
                // for want of capacity, as a refusal is (the decision's probe tells whether more
                // replicas relieve it). Preemptions with room in the cache are not.
                if b.kv_usage >= KV_FULL {
                    g.pressure += grew(|s| s.preemptions);
                }
                g.generated += grew(|s| s.generated);
                g.batches += grew(|s| s.batches);
                g.rows += grew(|s| s.batch_rows);
                g.seconds += grew(|s| s.batch_seconds);
            }
        }
        g.duration = start.map_or(0.0, |s| (now - s).as_secs_f64());
        g
    }
}

/// KV-cache usage from which a pod's preemptions count as deadline pressure.
const KV_FULL: f64 = 0.9;

/// Counter growth over one interval of several pods.
#[derive(Debug, Clone, Copy, Default)]
struct Growth {
    requests: f64,
    generated: f64,
    ok: f64,
    pressure: f64,
    batches: f64,
    rows: f64,
    seconds: f64,
    duration: f64,
}

impl Growth {
    fn rate(&self) -> f64 {
        if self.duration > 0.0 {
            self.requests / self.duration
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn sample(requests: f64, ok: f64, pressure: f64, batches: f64, rows: f64) -> PodSample {
        PodSample {
            requests,
            ok,
            pressure,
            batches,
            batch_rows: rows,
            batch_seconds: batches * 0.1,
            ..PodSample::default()
        }
    }

    #[test]
    fn counters_become_rates_over_the_window() {
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        for i in 0..=10 {
            let n = f64::from(i) * 100.0;
            c.observe("a", t0 + 2 * i * S, sample(n, n, 0.0, n / 10.0, n));
        }
        let o = c.observed(&["a".into()], &[], t0 + 20 * S);
        // 100 requests every 2 s: 50 req/s over the last 10 s, and over the last 2 s.
        assert!((o.arrival_rate - 50.0).abs() < 1e-9, "{o:?}");
        assert!((o.latest_rate - 50.0).abs() < 1e-9, "{o:?}");
        assert_eq!(o.batch_time, Some(Duration::from_millis(100)));
        assert_eq!(o.rows_per_request, 1.0);
        assert_eq!(c.rows_per_batch(&["a".into()], t0 + 20 * S), Some(10.0));
    }

    #[test]
    fn a_restarted_pod_counts_from_zero_without_a_negative_rate() {
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(60 * S);
        c.observe("a", t0, sample(1000.0, 1000.0, 5.0, 100.0, 1000.0));
        c.observe("a", t0 + 10 * S, sample(1500.0, 1500.0, 5.0, 150.0, 1500.0));
        c.observe("a", t0 + 20 * S, sample(200.0, 200.0, 2.0, 20.0, 200.0)); // restarted
        let o = c.observed(&["a".into()], &[], t0 + 20 * S);
        assert!((o.arrival_rate - 35.0).abs() < 1e-9, "(500 + 200) / 20 s: {o:?}");
        assert_eq!(o.pressure, 2.0 / 700.0, "the restarted pod's 2 count; the old 5 were before the window");
    }

    #[test]
    fn a_locked_pod_is_capacity_whose_refusals_are_not_pressure() {
        // Pod a serves 100 requests in 10 s, 1 refused; pod b refuses all 100 and says it is
        // locked. Its refusals are no sign of too little capacity: the pressure is a's 1 in 200.
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(60 * S);
        for pod in ["a", "b"] {
            c.observe(pod, t0, sample(0.0, 0.0, 0.0, 0.0, 0.0));
        }
        c.observe("a", t0 + 10 * S, sample(100.0, 99.0, 1.0, 10.0, 99.0));
        c.observe("b", t0 + 10 * S, PodSample { locked: 1.0, ..sample(100.0, 0.0, 100.0, 0.0, 0.0) });
        let o = c.observed(&["a".into(), "b".into()], &[], t0 + 10 * S);
        assert!((o.arrival_rate - 20.0).abs() < 1e-9, "its requests are offered load all the same: {o:?}");
        assert_eq!((o.pressure, o.locked), (1.0 / 200.0, 1));
        // Once it admits again, its refusals count as before.
        c.observe("b", t0 + 20 * S, sample(150.0, 0.0, 150.0, 0.0, 0.0));
        let later = c.observed(&["a".into(), "b".into()], &[], t0 + 20 * S);
        assert_eq!((later.pressure, later.locked), (51.0 / 250.0, 0));
        let text = "ferry_requests_total{model=\"m\",version=\"1\",outcome=\"infeasible\"} 3\n\
                    ferry_admission_locked{model=\"m\",version=\"1\"} 1\n";
        assert_eq!(parse(text).unwrap().locked, 1.0);
    }

    #[test]
    fn pods_add_up_and_gone_pods_are_forgotten() {
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(60 * S);
        for pod in ["a", "b"] {
            c.observe(pod, t0, PodSample { queue_depth: 3.0, oldest_age: 0.5, ..sample(0.0, 0.0, 0.0, 0.0, 0.0) });
            c.observe(
                pod,
                t0 + 10 * S,
                PodSample {
                    queue_depth: 4.0,
                    oldest_age: if pod == "a" { 0.2 } else { 0.7 },
                    ..sample(100.0, 90.0, 10.0, 9.0, 180.0)
                },
            );
        }
        let both = c.observed(&["a".into(), "b".into()], &[], t0 + 10 * S);
        assert!((both.arrival_rate - 20.0).abs() < 1e-9);
        assert_eq!((both.queue_depth, both.pressure), (8.0, 0.1));
        assert_eq!(both.oldest_queue_age, Duration::from_millis(700));
        assert_eq!(both.rows_per_request, 2.0, "180 rows for 90 answered requests");
        c.retain(&["a".into()]);
        assert!((c.observed(&["a".into(), "b".into()], &[], t0 + 10 * S).arrival_rate - 10.0).abs() < 1e-9);
    }

    #[test]
    fn every_pod_is_read_over_one_window_and_a_new_pod_from_zero() {
        // 60 req/s throughout; pod b is ready at 16 s and from then on takes half.
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        for i in 0..=10u32 {
            let t = f64::from(2 * i);
            let a = if t <= 16.0 { 60.0 * t } else { 960.0 + 30.0 * (t - 16.0) };
            c.observe("a", t0 + 2 * i * S, sample(a, a, 0.0, 0.0, 0.0));
            if i == 8 {
                c.started("b", t0 + 16 * S);
            }
            if t > 16.0 {
                let b = 30.0 * (t - 16.0);
                c.observe("b", t0 + 2 * i * S, sample(b, b, 0.0, 0.0, 0.0));
            }
        }
        // 480 on a and 120 on b over the last 10 s: 60 req/s. (Each pod's rate over its own
        // span, summed, would say 48 + 30 = 78.)
        let o = c.observed(&["a".into(), "b".into()], &[], t0 + 20 * S);
        assert!((o.arrival_rate - 60.0).abs() < 1e-9, "{o:?}");
        assert!((o.latest_rate - 60.0).abs() < 1e-9, "60 + 60 over the last 2 s: {o:?}");
        // A pod ready 0.5 s before the last scrape: the latest interval is still the others'
        // last 2 s, with the new pod counted whole (not their 2 s prorated over its half second,
        // as if their load had not moved to it).
        c.started("d", t0 + 19 * S + S / 2);
        c.observe("d", t0 + 20 * S, sample(15.0, 15.0, 0.0, 0.0, 0.0));
        let o = c.observed(&["a".into(), "b".into(), "d".into()], &[], t0 + 20 * S);
        assert!((o.latest_rate - 67.5).abs() < 1e-9, "(60 + 60 + 15) / 2 s: {o:?}");
    }

    #[test]
    fn a_pod_whose_scrapes_paused_does_not_stretch_the_window() {
        // 30 req/s on each of two pods; b's scrapes failed from 4 s to 16 s.
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        for i in 0..=10u32 {
            let n = 60.0 * f64::from(i);
            c.observe("a", t0 + 2 * i * S, sample(n, n, 0.0, 0.0, 0.0));
            if !(2..8).contains(&i) {
                c.observe("b", t0 + 2 * i * S, sample(n, n, 0.0, 0.0, 0.0));
            }
        }
        // b's 2 s → 16 s interval counts for its 6 s inside the window: 60 req/s, not the 46.7
        // of everything since b's sample at 2 s over 18 s.
        let o = c.observed(&["a".into(), "b".into()], &[], t0 + 20 * S);
        assert!((o.arrival_rate - 60.0).abs() < 1e-9, "{o:?}");
        // A pod that has not answered for a whole window adds no stale gauges.
        c.observe("c", t0, PodSample { queue_depth: 50.0, ..PodSample::default() });
        assert_eq!(c.observed(&["c".into()], &[], t0 + 20 * S).queue_depth, 0.0);
    }

    #[test]
    fn the_sidecars_exposition_parses() {
        let text = "# HELP ferry_requests_total x\n# TYPE ferry_requests_total counter\n\
            ferry_requests_total{model=\"m\",outcome=\"ok\",version=\"1\"} 40\n\
            ferry_requests_total{model=\"m\",outcome=\"infeasible\",version=\"1\"} 3\n\
            ferry_requests_total{model=\"m\",outcome=\"expired\",version=\"1\"} 1\n\
            ferry_requests_total{model=\"m\",outcome=\"invalid\",version=\"1\"} 600\n\
            ferry_requests_total{model=\"m\",outcome=\"not_found\",version=\"1\"} 300\n\
            ferry_requests_total{model=\"m\",outcome=\"queue_full\",version=\"1\"} 2\n\
            # TYPE ferry_queue_depth gauge\nferry_queue_depth{model=\"m\",version=\"1\"} 7\n\
            # TYPE ferry_queue_oldest_age_seconds gauge\nferry_queue_oldest_age_seconds{model=\"m\",version=\"1\"} 0.25\n\
            # TYPE ferry_batch_size histogram\nferry_batch_size_bucket{model=\"m\",version=\"1\",le=\"+Inf\"} 5\n\
            ferry_batch_size_sum{model=\"m\",version=\"1\"} 40\nferry_batch_size_count{model=\"m\",version=\"1\"} 5\n\
            # TYPE ferry_batch_duration_seconds histogram\nferry_batch_duration_seconds_bucket{model=\"m\",version=\"1\",le=\"+Inf\"} 5\n\
            ferry_batch_duration_seconds_sum{model=\"m\",version=\"1\"} 0.5\nferry_batch_duration_seconds_count{model=\"m\",version=\"1\"} 5\n";
        let s = parse(text).unwrap();
        // 600 malformed and 300 misrouted requests are not load; the queue_full ones are.
        assert_eq!((s.requests, s.ok, s.pressure), (46.0, 40.0, 4.0));
        assert_eq!((s.queue_depth, s.oldest_age), (7.0, 0.25));
        assert_eq!((s.batches, s.batch_rows, s.batch_seconds), (5.0, 40.0, 0.5));
        assert!(parse("up 1\n").unwrap_err().contains("not a Ferry sidecar"));
        assert_eq!(s.capacity, None, "a request-level pod has no capacity gauge");
    }

    #[test]
    fn a_generation_pods_own_capacity_is_read_and_averaged_over_the_pods() {
        let text = |capacity: &str| {
            format!(
                "# TYPE ferry_requests_total counter\n\
                 ferry_requests_total{{model=\"m\",outcome=\"ok\",version=\"1\"}} 4\n\
                 # TYPE ferry_capacity_requests_per_second gauge\n\
                 ferry_capacity_requests_per_second{{model=\"m\",version=\"1\"}} {capacity}\n"
            )
        };
        assert_eq!(parse(&text("9.5")).unwrap().capacity, Some(9.5));
        let streaming = "# TYPE ferry_requests_total counter\n\
            ferry_requests_total{model=\"m\",outcome=\"ok\",version=\"1\"} 4\n\
            # TYPE ferry_sequences gauge\n\
            ferry_sequences{model=\"m\",state=\"running\",version=\"1\"} 12\n\
            ferry_sequences{model=\"m\",state=\"waiting\",version=\"1\"} 3\n";
        assert_eq!(parse(streaming).unwrap().running, 12.0, "the streams it sends, not those waiting");
        let costs = "# TYPE ferry_requests_total counter\n\
            ferry_requests_total{model=\"m\",outcome=\"ok\",version=\"1\"} 4\n\
            # TYPE ferry_queue_tokens gauge\n\
            ferry_queue_tokens{model=\"m\",version=\"1\"} 3000\n\
            # TYPE ferry_step_cost_seconds gauge\n\
            ferry_step_cost_seconds{model=\"m\",term=\"fixed\",version=\"1\"} 0.01\n\
            ferry_step_cost_seconds{model=\"m\",term=\"prefill_token\",version=\"1\"} 0.00005\n";
        let s = parse(costs).unwrap();
        assert_eq!((s.queue_tokens, s.prefill_cost), (3000.0, Some(0.00005)));
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        c.observe("a", t0, s);
        let o = c.observed(&["a".to_owned()], &[], t0 + S);
        assert_eq!(o.queue_tokens, 3000.0);
        // 100 requests; 10 sequences preempted with the cache 95 % full: pressure of a tenth.
        // The same with the cache half full is not pressure.
        let mut c = Collector::new(10 * S);
        let preempting = |kv_usage, preemptions| PodSample {
            requests: 100.0,
            ok: 100.0,
            preemptions,
            kv_usage,
            ..PodSample::default()
        };
        c.observe("a", t0, PodSample::default());
        c.observe("a", t0 + S, preempting(0.95, 10.0));
        assert!((c.observed(&["a".to_owned()], &[], t0 + 2 * S).pressure - 0.1).abs() < 1e-9);
        let mut c = Collector::new(10 * S);
        c.observe("a", t0, PodSample::default());
        c.observe("a", t0 + S, preempting(0.5, 10.0));
        assert_eq!(c.observed(&["a".to_owned()], &[], t0 + 2 * S).pressure, 0.0);
        assert!((o.prefill_rate.expect("a rate") - 20_000.0).abs() < 1e-6, "{o:?}");
        // No request finished yet, or no rate keeps the targets: no figure to size by.
        assert_eq!(parse(&text("NaN")).unwrap().capacity, None);
        assert_eq!(parse(&text("0")).unwrap().capacity, None);
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        for (pod, capacity) in [("a", Some(9.0)), ("b", Some(11.0)), ("c", None)] {
            c.observe(pod, t0, PodSample { capacity, ..PodSample::default() });
        }
        let pods: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        assert_eq!(c.observed(&pods, &[], t0 + S).capacity, Some(10.0), "the mean of the pods that have one");
        assert_eq!(c.observed(&pods, &[], t0 + 11 * S).capacity, None, "stale gauges are no figure");
    }

    #[test]
    fn a_settling_pods_prior_stays_out_of_the_capacity_while_a_settled_pod_has_a_figure() {
        let t0 = ferry_core::clock::now();
        let mut c = Collector::new(10 * S);
        // a has served for a while (its learned figure, 9); b just became ready and exports the
        // prior it took at load (30), far from what it will learn.
        c.observe("a", t0, PodSample { capacity: Some(9.0), ..PodSample::default() });
        c.observe("b", t0, PodSample { capacity: Some(30.0), ..PodSample::default() });
        let both: Vec<String> = ["a", "b"].map(String::from).to_vec();
        let fresh = ["b".to_owned()];
        assert_eq!(c.observed(&both, &fresh, t0 + S).capacity, Some(9.0), "the settled pod's figure alone");
        assert_eq!(c.observed(&both, &[], t0 + S).capacity, Some(19.5), "once b has settled, the mean of both");
        // Only settling pods (a service's first): their prior is the figure there is.
        assert_eq!(c.observed(&fresh, &fresh, t0 + S).capacity, Some(30.0));
    }
}
