//! How a request ended: the rows of DESIGN.md's error table, each with its HTTP status and the
//! stable `outcome` label of `ferry_requests_total`.

use std::time::Duration;

/// Every way a request can end. Admitted requests end in exactly one of `Ok`, `Expired`,
/// `Cancelled` or `Failed`; `Replayed` was answered from the idempotency store; the others are
/// refusals before admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    Invalid,
    /// No known `authorization: Bearer` token, with tenants configured.
    Unauthorized,
    NotFound,
    TooLarge,
    Quota,
    QueueFull,
    Infeasible,
    Expired,
    Cancelled,
    Failed,
    Draining,
    /// An `idempotency-key` reused for a different request.
    Conflict,
    /// The engine is not ready yet (a remote server still loading its model).
    Unavailable,
    /// Answered from the idempotency store: a request that repeated an `idempotency-key` got the
    /// first one's response (it did no work of its own, so it is no load).
    Replayed,
}

impl Outcome {
    pub const ALL: [Outcome; 15] = [
        Outcome::Ok,
        Outcome::Invalid,
        Outcome::Unauthorized,
        Outcome::NotFound,
        Outcome::TooLarge,
        Outcome::Quota,
        Outcome::QueueFull,
        Outcome::Infeasible,
        Outcome::Expired,
        Outcome::Cancelled,
        Outcome::Failed,
        Outcome::Draining,
        Outcome::Conflict,
        Outcome::Unavailable,
        Outcome::Replayed,
    ];

    /// The `outcome` label value; dashboards and the autoscaler match on these strings.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Invalid => "invalid",
            Outcome::Unauthorized => "unauthorized",
            Outcome::NotFound => "not_found",
            Outcome::TooLarge => "too_large",
            Outcome::Quota => "quota",
            Outcome::QueueFull => "queue_full",
            Outcome::Infeasible => "infeasible",
            Outcome::Expired => "expired",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "failed",
            Outcome::Draining => "draining",
            Outcome::Conflict => "conflict",
            Outcome::Unavailable => "unavailable",
            Outcome::Replayed => "replayed",
        }
    }

    /// Whether a request that ended so is load the service was asked to carry (DESIGN.md,
    /// "Autoscaling principle"): the admitted ones and those refused for want of capacity.
    /// Malformed, unauthenticated, unknown-model, oversized, over-quota, draining, conflicting, not-yet-ready and
    /// replayed requests are not: they must never scale a service up.
    pub fn is_offered_load(self) -> bool {
        matches!(
            self,
            Outcome::Ok
                | Outcome::Expired
                | Outcome::Cancelled
                | Outcome::Failed
                | Outcome::QueueFull
                | Outcome::Infeasible
        )
    }

    /// The HTTP status code sent for this outcome. `Cancelled` has none on the wire (nobody is
    /// listening); 499 is what the logs show, as nginx does.
    pub fn status_code(self) -> u16 {
        match self {
            Outcome::Ok => 200,
            Outcome::Invalid => 400,
            Outcome::Unauthorized => 401,
            Outcome::NotFound => 404,
            Outcome::TooLarge => 413,
            Outcome::Quota => 429,
            Outcome::QueueFull | Outcome::Infeasible | Outcome::Draining | Outcome::Unavailable => 503,
            Outcome::Expired => 504,
            Outcome::Cancelled => 499,
            Outcome::Failed => 500,
            Outcome::Conflict => 409,
            // The first request's status is replayed; 200 is the usual one.
            Outcome::Replayed => 200,
        }
    }
}

/// A request that did not end in `Ok`: the outcome, the sentence for the `{"error": ...}` body,
/// and, for refusals a client should retry later, how long to wait (`Retry-After`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub outcome: Outcome,
    pub message: String,
    pub retry_after: Option<Duration>,
}

impl Refusal {
    pub fn new(outcome: Outcome, message: impl Into<String>) -> Self {
        Refusal { outcome, message: message.into(), retry_after: None }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Refusal::new(Outcome::Invalid, message)
    }

    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// `Retry-After` in whole seconds, rounded up and at least 1 (the header has no fractions).
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| d.as_secs() + u64::from(d.subsec_nanos() > 0)).map(|s| s.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_load_is_what_was_admitted_or_refused_for_want_of_capacity() {
        let load: Vec<&str> = Outcome::ALL.into_iter().filter(|o| o.is_offered_load()).map(Outcome::label).collect();
        assert_eq!(load, ["ok", "queue_full", "infeasible", "expired", "cancelled", "failed"]);
    }
}
