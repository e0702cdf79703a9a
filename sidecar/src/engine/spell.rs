//! A slow spell of the sim engines (fault injection): batches or steps that start within a window
//! of the process' life take a multiple of their usual time, as a throttled or contended GPU
//! would. The fault tests use it to show that what admission learned of the slow engine stops
//! counting once the engine is fast again (ferry-core's `evidence`).
//!
//! `--sim-slow-spell 3x@5s+4s`: from 5 s after the engine was built, for 4 s, three times as slow.

use std::time::Duration;

use ferry_core::duration;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowSpell {
    pub factor: f64,
    /// From the engine's start.
    pub after: Duration,
    pub lasting: Duration,
}

impl SlowSpell {
    /// Parses `FACTORx@AFTER+LASTING`, e.g. `3x@5s+4s`.
    pub fn parse(text: &str) -> Result<SlowSpell, String> {
        let wrong = |why: &str| format!("--sim-slow-spell is '{text}': {why}; it must read like 3x@5s+4s");
        let (factor, rest) = text.split_once("x@").ok_or_else(|| wrong("no 'x@'"))?;
        let (after, lasting) = rest.split_once('+').ok_or_else(|| wrong("no '+'"))?;
        let factor: f64 = factor.parse().map_err(|_| wrong("the factor is not a number"))?;
        if !(factor.is_finite() && (1.0..=1000.0).contains(&factor)) {
            return Err(wrong("the factor must be between 1 and 1000"));
        }
        Ok(SlowSpell {
            factor,
            after: duration::parse(after).map_err(|e| wrong(&e.to_string()))?,
            lasting: duration::parse(lasting).map_err(|e| wrong(&e.to_string()))?,
        })
    }

    /// What a batch of usual time `took` takes when it starts at `now`, the engine having started
    /// at `start`.
    pub fn time(spell: Option<&SlowSpell>, start: Instant, now: Instant, took: Duration) -> Duration {
        match spell {
            Some(s) if (start + s.after..start + s.after + s.lasting).contains(&now) => took.mul_f64(s.factor),
            _ => took,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spell_reads_factor_start_and_length_and_slows_only_within_it() {
        let s = SlowSpell::parse("3x@5s+4s").unwrap();
        assert_eq!(s, SlowSpell { factor: 3.0, after: Duration::from_secs(5), lasting: Duration::from_secs(4) });
        let t0 = ferry_core::clock::now();
        let ms = Duration::from_millis;
        assert_eq!(SlowSpell::time(Some(&s), t0, t0 + ms(4999), ms(10)), ms(10));
        assert_eq!(SlowSpell::time(Some(&s), t0, t0 + ms(5000), ms(10)), ms(30));
        assert_eq!(SlowSpell::time(Some(&s), t0, t0 + ms(9000), ms(10)), ms(10));
        assert_eq!(SlowSpell::time(None, t0, t0 + ms(6000), ms(10)), ms(10));
        for bad in ["3@5s+4s", "3x@5s", "0.5x@5s+4s", "3x@5q+4s"] {
            let e = SlowSpell::parse(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("3x@5s+4s"), "{e}");
        }
    }
}
