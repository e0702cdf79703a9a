//! Rule 2's reading of the offered rate over time: a jump in the latest interval, a rise both
//! halves of the recent decisions agree on (looked ahead by the time-to-ready), and rule 7's
//! steady fall. Each compares what it reads with what a Poisson count strays by chance, so that
//! noise about a steady load neither starts pods nor gives them up early.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{Needed, Observed, Target};

/// The latest interval's rate replaces the window's when it is this much higher, and by more
/// than `JUMP_SPREADS` of the spread a count over the latest interval has by chance: it is
/// tested every decision, so it must not fire on a count a steady load gives once a day (at
/// 20 req/s a 1 s interval strays by ±4.5 by chance; 20 % is one spread).
const JUMP: f64 = 1.2;
const JUMP_SPREADS: f64 = 4.0;
/// A look ahead counts when it adds at least this share of the rate now, and when the rise it
/// was fitted to, in each half of the span, is more than `TREND_SPREADS` of what two readings of
/// the window differ by chance. A steady fall ([`steady_fall`]) is at least this share of the
/// rate now over the scale-down window.
const MIN_RISE: f64 = 0.1;
const TREND_SPREADS: f64 = 3.0;
/// A steady fall ([`steady_fall`]) counts when its fall within each half of the scale-down
/// window is more than this many of what two readings of the window differ by chance. Lower than
/// `TREND_SPREADS`: each half's slope is a median over all its readings (75 at 2 s over half of 5
/// minutes; of 10 s windows, so about 15 independent ones), not one reading against another; a
/// fall read wrongly costs a scale-down a minute early where a rise read wrongly starts pods; and
/// at tens of requests a second and more, `MIN_RISE` (a tenth of the rate) binds first.
const FALL_SPREADS: f64 = 2.0;
/// [`steady_fall`] reads at most this many of the window's decisions, evenly spread (a 30-minute
/// delay holds 900): the slopes between every two points grow with the square of their number.
const FALL_POINTS: usize = 160;
/// A look ahead never more than doubles the rate now.
const MAX_GROWTH: f64 = 2.0;
/// The trend is fitted over at least this span (and at most `TREND_SPAN_MAX`), one time-to-ready.
const TREND_SPAN_MIN: Duration = Duration::from_secs(30);
const TREND_SPAN_MAX: Duration = Duration::from_secs(600);

/// The rate's slope over time (req/s per second), as a rise both halves of the span agree on:
/// the lower of the two halves' median slopes between every two points (Theil–Sen). A step — a
/// rise that has already happened — lies in one half and leaves the other flat, so it does not
/// read as a trend, as it would through a line fitted to the whole span; a steady rise does.
/// 0 with fewer than 6 points.
pub fn trend(rates: &VecDeque<(Instant, f64)>) -> f64 {
    if rates.len() < 6 {
        return 0.0;
    }
    let points: Vec<(Instant, f64)> = rates.iter().copied().collect();
    let (older, newer) = points.split_at(points.len() / 2);
    median_slope(older).min(median_slope(newer))
}

/// Rule 7's test of a load that falls rather than wavers: over the decisions of the last
/// `scaleDownDelay`, a fall both halves agree on (the less steep of the two halves' Theil–Sen
/// slopes, as [`trend`] reads a rise) that, within each half, is more than `FALL_SPREADS` of what
/// two readings of the window differ by chance (at the window's highest rate: a half still at a
/// high load strays by more than the rate now), and at least `MIN_RISE` of the rate now over the
/// window. A drop that already happened lies in one half and leaves the other flat; noise about
/// a steady load, bursts and a load that turned lie in neither: those wait out the delay.
pub fn steady_fall(needs: &VecDeque<Needed>, rate: f64, window_seconds: f64) -> bool {
    if needs.len() < 6 {
        return false;
    }
    let stride = needs.len().div_ceil(FALL_POINTS);
    let points: Vec<(Instant, f64)> = needs.iter().step_by(stride).map(|n| (n.at, n.rate)).collect();
    let (older, newer) = points.split_at(points.len() / 2);
    let slope = median_slope(older).max(median_slope(newer));
    let span = (points[points.len() - 1].0 - points[0].0).as_secs_f64();
    let highest = points.iter().map(|p| p.1).fold(rate, f64::max);
    let noise = FALL_SPREADS * std::f64::consts::SQRT_2 * spread(highest, window_seconds);
    slope < 0.0 && -slope * span / 2.0 > noise && -slope * span >= MIN_RISE * rate
}

fn median_slope(points: &[(Instant, f64)]) -> f64 {
    let mut slopes = Vec::with_capacity(points.len() * points.len() / 2);
    for (i, (ti, ri)) in points.iter().enumerate() {
        for (tj, rj) in &points[i + 1..] {
            let dt = (*tj - *ti).as_secs_f64();
            if dt > 0.0 {
                slopes.push((rj - ri) / dt);
            }
        }
    }
    if slopes.is_empty() {
        return 0.0;
    }
    slopes.sort_by(f64::total_cmp);
    let mid = slopes.len() / 2;
    if slopes.len() % 2 == 1 {
        slopes[mid]
    } else {
        (slopes[mid - 1] + slopes[mid]) / 2.0
    }
}

/// The offered rate now, and one time-to-ready ahead (rule 2).
pub(super) struct Rate {
    pub(super) now: f64,
    /// req/s per second, from [`trend`].
    pub(super) slope: f64,
    pub(super) ahead: f64,
}

/// Rule 2: records this decision's rate in `rates` (kept over one time-to-ready) and looks the
/// rate ahead by its trend.
pub(super) fn look_ahead(
    observed: &Observed,
    target: &Target,
    rates: &mut VecDeque<(Instant, f64)>,
    now: Instant,
) -> Rate {
    let span = target.startup.clamp(TREND_SPAN_MIN, TREND_SPAN_MAX);
    rates.push_back((now, observed.arrival_rate));
    while rates.front().is_some_and(|(at, _)| *at + span < now) {
        rates.pop_front();
    }
    let window = observed.arrival_rate;
    // A rate that jumped in the latest interval, by more than chance, is the rate now.
    let jumped = observed.latest_rate > JUMP * window
        && observed.latest_rate - window > JUMP_SPREADS * spread(window, observed.latest_seconds);
    let rate = if jumped { observed.latest_rate } else { window };
    let slope = trend(rates);
    let rise = slope.max(0.0) * target.startup.as_secs_f64();
    // A rise smaller than the noise of the rates it was fitted to is not a trend: within each
    // half of the span (the trend is the lower half's slope), more than two window readings
    // differ by chance.
    let half = rates.back().zip(rates.front()).map_or(0.0, |(b, f)| (b.0 - f.0).as_secs_f64() / 2.0);
    let noise = TREND_SPREADS * std::f64::consts::SQRT_2 * spread(window, observed.window_seconds);
    let trend_is_real = rise >= MIN_RISE * rate && slope * half > noise;
    let ahead = if trend_is_real { (rate + rise).min(rate * MAX_GROWTH) } else { rate };
    Rate { now: rate, slope, ahead }
}

/// How far a rate counted over `seconds` strays by chance: a Poisson count's spread, √n.
fn spread(rate: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        (rate.max(0.0) / seconds).sqrt()
    } else {
        f64::INFINITY
    }
}
