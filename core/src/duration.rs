//! Durations in the Gateway API format (`10ms`, `1s`, `5m`, `1h`, `1m30s`), the format that
//! Kubernetes users already write in HTTPRoute timeouts.
//!
//! Written by hand because the format is a six-line grammar
//! (`^([0-9]{1,5}(h|m|s|ms)){1,4}$`) and the crates that parse durations (humantime and friends)
//! accept a different, much larger language; the manifest must mean the same thing here as in the
//! CRD's validation pattern.

use std::time::Duration;

/// The same grammar as a regular expression: the CRD's validation pattern, tested against
/// [`parse`] so that the cluster and the sidecar refuse the same texts.
pub const PATTERN: &str = "^([0-9]{1,5}(h|m|s|ms)){1,4}$";

/// The grammar of [`parse_fine`]: a Gateway API duration, or whole microseconds (`50us`) or
/// nanoseconds (`20ns`).
pub const FINE_PATTERN: &str = "^(([0-9]{1,5}(h|m|s|ms)){1,4}|[0-9]{1,7}(us|ns))$";

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{text}' is not a duration in the Gateway API format (like 10ms, 1s, 5m, 1h or 1m30s): {why}")]
pub struct DurationError {
    text: String,
    why: &'static str,
}

/// Parses `text` as a Gateway API duration: one to four parts, each 1–5 digits and a unit.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let fail = |why| DurationError { text: text.to_owned(), why };
    if text.is_empty() {
        return Err(fail("it is empty"));
    }
    let bytes = text.as_bytes();
    let mut total = Duration::ZERO;
    let mut parts = 0;
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &text[start..i];
        if digits.is_empty() {
            return Err(fail("each part must start with a number"));
        }
        if digits.len() > 5 {
            return Err(fail("each number has at most 5 digits"));
        }
        let value: u64 = digits.parse().map_err(|_| fail("the number does not parse"))?;
        let unit = if text[i..].starts_with("ms") {
            i += 2;
            Duration::from_millis(1)
        } else {
            let unit = match bytes.get(i) {
                Some(b'h') => Duration::from_secs(3600),
                Some(b'm') => Duration::from_secs(60),
                Some(b's') => Duration::from_secs(1),
                _ => return Err(fail("each number needs a unit: h, m, s or ms")),
            };
            i += 1;
            unit
        };
        total += unit * value as u32;
        parts += 1;
        if parts > 4 {
            return Err(fail("at most 4 parts"));
        }
    }
    Ok(total)
}

/// A Gateway API duration, or a whole number of microseconds (`50us`) or nanoseconds (`20ns`):
/// for the costs of the `sim-llm` engine, where a token's share of a step is a fraction of a
/// millisecond and an attended slot's a few nanoseconds, which the Gateway API format cannot write.
pub fn parse_fine(text: &str) -> Result<Duration, DurationError> {
    for (suffix, per, why) in
        [("us", 1_000, "microseconds are 1 to 7 digits and 'us'"), ("ns", 1, "nanoseconds are 1 to 7 digits and 'ns'")]
    {
        if let Some(digits) = text.strip_suffix(suffix) {
            if (1..=7).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()) {
                return Ok(Duration::from_nanos(digits.parse::<u64>().expect("digits") * per));
            }
            return Err(DurationError { text: text.to_owned(), why });
        }
    }
    parse(text)
}

/// Formats a duration in the same format, choosing the largest exact units (`1m30s`, `250ms`).
pub fn format(duration: Duration) -> String {
    let mut ms = duration.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    for (unit, name) in [(3_600_000, "h"), (60_000, "m"), (1_000, "s"), (1, "ms")] {
        if ms >= unit {
            out.push_str(&format!("{}{}", ms / unit, name));
            ms %= unit;
        }
    }
    out
}

/// Serde adapter so that manifests can hold durations as strings.
pub mod serde_format {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| super::parse(&t).map_err(serde::de::Error::custom)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_combinations() {
        assert_eq!(parse("10ms"), Ok(Duration::from_millis(10)));
        assert_eq!(parse("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1h2m3s4ms"), Ok(Duration::from_millis(3_723_004)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn refuses_what_the_gateway_api_refuses() {
        for bad in ["", "10", "ms", "1.5s", "-1s", "100000ms", "1d", "1s2s3s4s5s", " 1s", "1S"] {
            let err = parse(bad).expect_err(bad);
            assert!(err.to_string().contains(&format!("'{bad}'")), "{err}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Texts over the grammar's alphabet (and a few strangers) are accepted by the parser
        /// exactly when the CRD's pattern matches them.
        #[test]
        fn the_parser_and_the_crd_pattern_agree(text in "[0-9hms. -]{0,14}|([0-9]{1,6}(h|m|s|ms|d)){1,5}") {
            let pattern = regex::Regex::new(PATTERN).unwrap();
            proptest::prop_assert_eq!(parse(&text).is_ok(), pattern.is_match(&text), "{:?}", text);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]
        #[test]
        fn the_fine_parser_and_its_pattern_agree(text in "[0-9hmsun. -]{0,12}|[0-9]{0,9}(us|ns)|([0-9]{1,6}(h|m|s|ms|us|ns)){1,3}") {
            let pattern = regex::Regex::new(FINE_PATTERN).unwrap();
            proptest::prop_assert_eq!(parse_fine(&text).is_ok(), pattern.is_match(&text), "{:?}", text);
        }
    }

    #[test]
    fn microseconds_are_fine() {
        assert_eq!(parse_fine("50us"), Ok(Duration::from_micros(50)));
        assert_eq!(parse_fine("20ns"), Ok(Duration::from_nanos(20)));
        assert!(parse_fine("1us20ns").is_err(), "nanoseconds stand alone");
        assert_eq!(parse_fine("2ms"), Ok(Duration::from_millis(2)));
        assert!(parse_fine("1ms50us").is_err(), "microseconds stand alone");
    }

    #[test]
    fn format_round_trips() {
        for ms in [0, 1, 10, 999, 1000, 1500, 60_000, 90_000, 3_600_000, 3_723_004] {
            let d = Duration::from_millis(ms);
            assert_eq!(parse(&format(d)), Ok(d), "{}", format(d));
        }
        assert_eq!(format(Duration::from_millis(90_000)), "1m30s");
    }
}
