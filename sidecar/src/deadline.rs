//! A request's deadline: `x-ferry-timeout-ms` (relative milliseconds), else the Triton-style
//! `parameters.timeout` in the body (microseconds), else the service's `latencyBudget`. A request
//! may shorten its deadline freely and lengthen it up to `--max-timeout`.

use std::time::Duration;

use serde_json::{Map, Value};

use ferry_core::outcome::Refusal;
use ferry_core::ticket::Priority;

pub const TIMEOUT_HEADER: &str = "x-ferry-timeout-ms";

#[derive(Debug, Clone, Copy)]
pub struct DeadlinePolicy {
    /// `latencyBudget`: the deadline of a request that asks for none.
    pub budget: Duration,
    /// `--batch-latency-budget`: the deadline of a batch-tier request that asks for none.
    pub batch_budget: Duration,
    /// The longest deadline a request may ask for.
    pub max_timeout: Duration,
}

impl DeadlinePolicy {
    /// The time a request of `priority` may take from its arrival.
    pub fn timeout(
        &self,
        priority: Priority,
        header: Option<&str>,
        parameters: Option<&Map<String, Value>>,
    ) -> Result<Duration, Refusal> {
        let asked = if let Some(text) = header {
            let ms: u64 = text.trim().parse().map_err(|_| {
                Refusal::invalid(format!("{TIMEOUT_HEADER} is '{text}'; it must be a whole number of milliseconds"))
            })?;
            Some((Duration::from_millis(ms), format!("{TIMEOUT_HEADER} is {ms}")))
        } else if let Some(value) = parameters.and_then(|p| p.get("timeout")) {
            let us = value.as_u64().ok_or_else(|| {
                Refusal::invalid(format!("parameters.timeout is {value}; it must be a whole number of microseconds"))
            })?;
            Some((Duration::from_micros(us), format!("parameters.timeout is {us} µs")))
        } else {
            None
        };
        let Some((timeout, what)) = asked else {
            return Ok(match priority {
                Priority::Interactive => self.budget,
                Priority::Batch => self.batch_budget,
            });
        };
        if timeout.is_zero() {
            return Err(Refusal::invalid(format!("{what}; a deadline must be in the future")));
        }
        if timeout > self.max_timeout {
            return Err(Refusal::invalid(format!(
                "{what}; this service allows at most {} ms (--max-timeout)",
                self.max_timeout.as_millis()
            )));
        }
        Ok(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const POLICY: DeadlinePolicy = DeadlinePolicy {
        budget: Duration::from_millis(200),
        batch_budget: Duration::from_millis(5000),
        max_timeout: Duration::from_millis(1000),
    };
    const I: Priority = Priority::Interactive;

    #[test]
    fn batch_tier_requests_default_to_the_batch_budget() {
        assert_eq!(POLICY.timeout(Priority::Batch, None, None), Ok(Duration::from_millis(5000)));
        assert_eq!(POLICY.timeout(Priority::Batch, Some("300"), None), Ok(Duration::from_millis(300)));
    }

    fn params(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn the_budget_is_the_default() {
        assert_eq!(POLICY.timeout(I, None, None), Ok(Duration::from_millis(200)));
        assert_eq!(POLICY.timeout(I, None, Some(&params(json!({"other": 1})))), Ok(Duration::from_millis(200)));
    }

    #[test]
    fn the_header_wins_over_the_body_and_may_lengthen_up_to_the_maximum() {
        let p = params(json!({"timeout": 50_000}));
        assert_eq!(POLICY.timeout(I, Some("700"), Some(&p)), Ok(Duration::from_millis(700)));
        assert_eq!(POLICY.timeout(I, None, Some(&p)), Ok(Duration::from_millis(50)));
        assert_eq!(POLICY.timeout(I, Some("1000"), None), Ok(Duration::from_millis(1000)));
    }

    #[test]
    fn bad_or_too_long_timeouts_name_the_value_and_the_limit() {
        let err = POLICY.timeout(I, Some("1001"), None).unwrap_err();
        assert_eq!(err.message, "x-ferry-timeout-ms is 1001; this service allows at most 1000 ms (--max-timeout)");
        assert!(POLICY.timeout(I, Some("soon"), None).unwrap_err().message.contains("'soon'"));
        assert!(POLICY.timeout(I, Some("0"), None).unwrap_err().message.contains("in the future"));
        let err = POLICY.timeout(I, None, Some(&params(json!({"timeout": "fast"})))).unwrap_err();
        assert!(err.message.contains("parameters.timeout is \"fast\""), "{err}");
    }
}
