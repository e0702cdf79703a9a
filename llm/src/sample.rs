//! Drawing the next token from logits: greedy at temperature 0, else from the softmax at the
//! temperature, cut to the nucleus of `top_p`.
//!
//! A draw is a function of the request's seed and the token's position only, so a sequence
//! that was preempted and recomputed draws the very tokens it drew before, and the same
//! request with the same seed answers the same.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Sampling;

pub fn sample(logits: &[f32], s: &Sampling, position: u32) -> u32 {
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> =
        logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l - max) / s.temperature).exp())).collect();
    let total: f32 = probs.iter().map(|p| p.1).sum();
    // The nucleus: the most likely tokens whose mass reaches top_p (at least one).
    let mass = if s.top_p < 1.0 {
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut kept, mut cumulative) = (0, 0.0);
        for p in &probs {
            cumulative += p.1;
            kept += 1;
            if cumulative >= s.top_p * total {
                break;
            }
        }
        probs.truncate(kept);
        cumulative
    } else {
        total
    };
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&s.seed.to_le_bytes());
    seed[8..12].copy_from_slice(&position.to_le_bytes());
    let mut u = StdRng::from_seed(seed).random::<f32>() * mass;
    for &(id, p) in &probs {
        if u < p {
            return id;
        }
        u -= p;
    }
    probs.last().map_or(0, |p| p.0)
}

/// The most likely token (the first of equals, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let s = Sampling { temperature: 0.0, top_p: 1.0, seed: 1 };
        assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0], &s, 0), 1);
    }

    #[test]
    fn draws_depend_on_seed_and_position_only() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = Sampling { temperature: 1.0, top_p: 1.0, seed: 42 };
        let draws: Vec<u32> = (0..64).map(|p| sample(&logits, &s, p)).collect();
        assert_eq!(draws, (0..64).map(|p| sample(&logits, &s, p)).collect::<Vec<_>>());
        let other = Sampling { seed: 43, ..s };
        assert_ne!(draws, (0..64).map(|p| sample(&logits, &other, p)).collect::<Vec<_>>());
        // Many distinct tokens at temperature 1 over a flat-ish distribution.
        let mut distinct = draws.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 10, "{distinct:?}");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 3 holds ~93 % of the mass; top_p 0.5 leaves only it.
        let logits = [0.0, 0.0, 0.0, 4.0, 0.0];
        let s = Sampling { temperature: 1.0, top_p: 0.5, seed: 0 };
        assert!((0..200).all(|p| sample(&logits, &s, p) == 3));
        // Without the cut, the others are drawn sometimes.
        let all = Sampling { top_p: 1.0, ..s };
        assert!((0..200).any(|p| sample(&logits, &all, p) != 3));
    }

    #[test]
    fn the_empirical_distribution_follows_the_softmax() {
        // p = softmax([ln 1, ln 2, ln 7]) = [0.1, 0.2, 0.7].
        let logits = [0.0f32, 2f32.ln(), 7f32.ln()];
        let s = Sampling { temperature: 1.0, top_p: 1.0, seed: 9 };
        let mut counts = [0u32; 3];
        for p in 0..10_000 {
            counts[sample(&logits, &s, p) as usize] += 1;
        }
        let share = |i: usize| counts[i] as f64 / 10_000.0;
        assert!((share(0) - 0.1).abs() < 0.02 && (share(1) - 0.2).abs() < 0.02 && (share(2) - 0.7).abs() < 0.02);
    }
}
