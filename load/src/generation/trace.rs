//! A generation trace: Poisson arrivals, prompt and output lengths drawn uniformly from ranges,
//! and each request's deadlines from a service-level objective in llm-d's terms — time to first
//! token, time per output token — so that its completion deadline is `ttft + max_tokens × tpot`.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::schedule::{schedule, Arrivals};

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Since the start of the run.
    pub at: Duration,
    /// Words of its prompt (a word is a token for the `sim-llm` engine).
    pub prompt: u32,
    pub max_tokens: u32,
    pub ttft: Duration,
    /// Its inter-token target.
    pub itl: Duration,
    /// Its whole answer's deadline, from its arrival.
    pub timeout: Duration,
}

/// The shape of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub rate: f64,
    pub duration: Duration,
    /// Inclusive ranges.
    pub prompt: (u32, u32),
    pub output: (u32, u32),
    pub ttft: Duration,
    /// Time per output token: the inter-token target, and the completion deadline's slope.
    pub tpot: Duration,
    pub seed: u64,
}

impl Shape {
    pub fn mean_prompt(&self) -> f64 {
        f64::from(self.prompt.0 + self.prompt.1) / 2.0
    }

    pub fn mean_output(&self) -> f64 {
        f64::from(self.output.0 + self.output.1) / 2.0
    }
}

pub fn trace(shape: &Shape) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(shape.seed ^ 0x9e37_79b9);
    schedule(Arrivals::Poisson, shape.rate, shape.duration, shape.seed)
        .into_iter()
        .map(|at| {
            let prompt = rng.random_range(shape.prompt.0..=shape.prompt.1);
            let max_tokens = rng.random_range(shape.output.0..=shape.output.1);
            Request {
                at,
                prompt,
                max_tokens,
                ttft: shape.ttft,
                itl: shape.tpot,
                timeout: shape.ttft + shape.tpot * max_tokens,
            }
        })
        .collect()
}

/// A prompt of `words` distinct-looking words (`w0 w1 …`, cycling over 50 words).
pub fn prompt_text(words: u32) -> String {
    (0..words).map(|i| format!("w{}", i % 50)).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_stay_in_their_ranges_and_deadlines_follow_the_objective() {
        let shape = Shape {
            rate: 50.0,
            duration: Duration::from_secs(10),
            prompt: (10, 100),
            output: (5, 50),
            ttft: Duration::from_secs(1),
            tpot: Duration::from_millis(50),
            seed: 3,
        };
        let t = trace(&shape);
        assert!((t.len() as f64 - 500.0).abs() < 80.0, "{}", t.len());
        assert!(t.iter().all(|r| (10..=100).contains(&r.prompt) && (5..=50).contains(&r.max_tokens)));
        assert!(t.iter().all(|r| r.timeout == r.ttft + r.itl * r.max_tokens));
        assert_eq!(t, trace(&shape), "seeded");
        assert_eq!(prompt_text(3), "w0 w1 w2");
    }
}
