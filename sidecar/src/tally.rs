//! The one place that counts how requests ended (`ferry_requests_total{outcome}`): every request
//! the API receives for inference gets a [`Tally`] when it arrives, which travels with it — through
//! the front's checks, into the batcher with its submission, back with its reply — and counts
//! exactly one outcome: the one its caller got. Dropped without one, it counts `cancelled` (the
//! caller went away, and with it whatever held the tally), or `failed` when it is dropped by a
//! panic (the request was lost to a bug). So the sum over outcomes is the number of requests.

use ferry_core::outcome::Outcome;

use crate::metrics::Outcomes;

#[must_use = "a tally counts `cancelled` when dropped without an outcome"]
pub struct Tally {
    series: Outcomes,
    /// The caller's tenant's series, once it is known.
    tenant: Option<Outcomes>,
    counted: bool,
}

impl Tally {
    /// A request has arrived; its outcome will count in `series` (until [`Tally::model`] says
    /// which model it is for).
    pub fn new(series: Outcomes) -> Self {
        Tally { series, tenant: None, counted: false }
    }

    /// The request turned out to be for this model version.
    pub fn model(&mut self, series: &Outcomes) {
        self.series = series.clone();
    }

    /// The caller turned out to be this tenant (`ferry_tenant_requests_total`).
    pub fn tenant(&mut self, series: Outcomes) {
        self.tenant = Some(series);
    }

    /// How the request ended.
    pub fn count(mut self, outcome: Outcome) {
        self.counted = true;
        self.record(outcome);
    }

    fn record(&self, outcome: Outcome) {
        self.series.count(outcome);
        if let Some(tenant) = &self.tenant {
            tenant.count(outcome);
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if !self.counted {
            let outcome = if std::thread::panicking() { Outcome::Failed } else { Outcome::Cancelled };
            self.record(outcome);
        }
    }
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tally").field("counted", &self.counted).finish()
    }
}
