//! Drawing the next token from logits, in vLLM's order: `logit_bias` added to the logits; the
//! repetition, frequency and presence penalties (vLLM's definitions: the first over the prompt and
//! the answer, the others over the answer); the end tokens masked while an answer is shorter
//! than its `min_tokens`; every token a structured output does not allow masked; greedy at
//! temperature 0; else the softmax at the temperature, cut to the tokens at least `min_p` times
//! as likely as the most likely one, then to the `top_k` most likely, then to the nucleus of
//! `top_p` (the smallest set of most likely tokens whose mass reaches it).
//!
//! A draw is a function of the request's seed and the token's position only, so a sequence
//! that was preempted and recomputed draws the very tokens it drew before, and the same
//! request with the same seed answers the same.
//!
//! [`logprobs`] are the log-softmax of the model's own logits, before bias, penalties and
//! temperature (vLLM's default, `raw_logprobs`, and llama.cpp's `n_probs`): what the model says,
//! whatever the request did with it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::Sampling;

pub fn sample(logits: &[f32], s: &Sampling, position: u32) -> u32 {
    let adjusted;
    let logits = if s.logit_bias.is_empty() && !s.penalised() && s.suppress.is_empty() && s.allowed.is_none() {
        logits
    } else {
        let mut l = logits.to_vec();
        for &(token, bias) in s.logit_bias {
            if let Some(l) = l.get_mut(token as usize) {
                *l += bias;
            }
        }
        if s.penalised() {
            penalise(&mut l, s);
        }
        let allowed = |token: usize| {
            s.allowed.is_none_or(|bits| bits.get(token / 32).is_some_and(|w| w >> (token % 32) & 1 == 1))
        };
        // Suppressed only where the format leaves something else (it may allow only the end).
        let suppressed = |token: usize| s.suppress.contains(&(token as u32));
        let other = s.allowed.is_none() || (0..l.len()).any(|t| allowed(t) && !suppressed(t));
        if other {
            for &token in s.suppress {
                if let Some(l) = l.get_mut(token as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if s.allowed.is_some() {
            for (t, l) in l.iter_mut().enumerate() {
                if !allowed(t) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        adjusted = l;
        &adjusted
    };
    if s.temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Each token's probability relative to the most likely one's (which is 1).
    let mut probs: Vec<(u32, f32)> =
        logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l - max) / s.temperature).exp())).collect();
    if s.min_p > 0.0 {
        probs.retain(|p| p.1 >= s.min_p);
    }
    let by_likelihood = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if s.top_k > 0 && (s.top_k as usize) < probs.len() {
        probs.sort_unstable_by(by_likelihood);
        probs.truncate(s.top_k as usize);
    }
    let total: f32 = probs.iter().map(|p| p.1).sum();
    // The nucleus: the most likely tokens whose mass reaches top_p (at least one).
    let mass = if s.top_p < 1.0 {
        probs.sort_unstable_by(by_likelihood);
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

/// A token's log-probability under the model, and the most likely tokens'.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first (of equals, the lower id first).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability in the softmax of `logits` (summed in f64: a vocabulary of 10⁵
/// terms), with the `top` most likely tokens'.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> Logprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let norm = f64::from(max) + sum.ln();
    let logprob = |l: f32| (f64::from(l) - norm) as f32;
    let by_likelihood = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let mut best: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(best.len());
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, by_likelihood);
    }
    best.truncate(top);
    best.sort_unstable_by(by_likelihood);
    Logprobs {
        logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| logprob(l)),
        top: best.into_iter().map(|t| (t, logprob(logits[t as usize]))).collect(),
    }
}

/// The penalties, on logits already biased.
fn penalise(logits: &mut [f32], s: &Sampling) {
    let prompt = (s.prompt as usize).min(s.history.len());
    // Times each token occurs in the answer, and whether it occurs at all.
    let mut answer: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in &s.history[prompt..] {
        *answer.entry(t).or_default() += 1;
    }
    if s.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = s.history.to_vec();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / s.repetition_penalty } else { *l * s.repetition_penalty };
            }
        }
    }
    for (&t, &n) in &answer {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= s.frequency_penalty * n as f32 + s.presence_penalty;
        }
    }
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
        let s = Sampling { temperature: 0.0, top_p: 1.0, seed: 1, ..Sampling::GREEDY };
        assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0], &s, 0), 1);
    }

    #[test]
    fn draws_depend_on_seed_and_position_only() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = Sampling { temperature: 1.0, top_p: 1.0, seed: 42, ..Sampling::GREEDY };
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
        let s = Sampling { temperature: 1.0, top_p: 0.5, seed: 0, ..Sampling::GREEDY };
        assert!((0..200).all(|p| sample(&logits, &s, p) == 3));
        // Without the cut, the others are drawn sometimes.
        let all = Sampling { top_p: 1.0, ..s };
        assert!((0..200).any(|p| sample(&logits, &all, p) != 3));
    }

    #[test]
    fn the_empirical_distribution_follows_the_softmax() {
        // p = softmax([ln 1, ln 2, ln 7]) = [0.1, 0.2, 0.7].
        let logits = [0.0f32, 2f32.ln(), 7f32.ln()];
        let s = Sampling { temperature: 1.0, top_p: 1.0, seed: 9, ..Sampling::GREEDY };
        let mut counts = [0u32; 3];
        for p in 0..10_000 {
            counts[sample(&logits, &s, p) as usize] += 1;
        }
        let share = |i: usize| counts[i] as f64 / 10_000.0;
        assert!((share(0) - 0.1).abs() < 0.02 && (share(1) - 0.2).abs() < 0.02 && (share(2) - 0.7).abs() < 0.02);
    }

    #[test]
    fn a_logit_bias_moves_greedy_and_random_draws_alike() {
        let logits = [1.0, 3.0, 2.0];
        let greedy = Sampling::GREEDY;
        assert_eq!(sample(&logits, &greedy, 0), 1);
        // OpenAI's -100 bans a token; +100 all but forces one.
        let banned = Sampling { logit_bias: &[(1, -100.0)], ..greedy };
        assert_eq!(sample(&logits, &banned, 0), 2);
        let forced = Sampling { temperature: 1.0, logit_bias: &[(0, 100.0)], ..greedy };
        assert!((0..200).all(|p| sample(&logits, &forced, p) == 0));
        // An id past the vocabulary is no token (the front refuses it before it gets here).
        assert_eq!(sample(&logits, &Sampling { logit_bias: &[(7, 100.0)], ..greedy }, 0), 1);
    }

    #[test]
    fn top_k_and_min_p_cut_the_unlikely_tokens() {
        // Likelihoods 1 : 0.5 : 0.25 : 0.125 relative to the best (logits ln of those).
        let logits = [0.0f32, -(2f32.ln()), -(4f32.ln()), -(8f32.ln())];
        let all = Sampling { temperature: 1.0, seed: 3, ..Sampling::GREEDY };
        let drawn = |s: &Sampling| {
            let mut seen: Vec<u32> = (0..2000).map(|p| sample(&logits, s, p)).collect();
            seen.sort();
            seen.dedup();
            seen
        };
        assert_eq!(drawn(&all), vec![0, 1, 2, 3]);
        assert_eq!(drawn(&Sampling { top_k: 2, ..all }), vec![0, 1]);
        assert_eq!(drawn(&Sampling { top_k: 9, ..all }), vec![0, 1, 2, 3], "more than the vocabulary: all");
        assert_eq!(drawn(&Sampling { min_p: 0.3, ..all }), vec![0, 1], "0.25 < 0.3 of the best");
        assert_eq!(drawn(&Sampling { min_p: 0.2, ..all }), vec![0, 1, 2]);
        // Within what is kept, the draw follows the renormalised likelihoods: 2/3 and 1/3.
        let s = Sampling { top_k: 2, ..all };
        let first = (0..6000).filter(|p| sample(&logits, &s, *p) == 0).count() as f64 / 6000.0;
        assert!((first - 2.0 / 3.0).abs() < 0.03, "{first}");
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_logits() {
        // softmax([ln 1, ln 2, ln 7, ln 2]) = [0.1, 0.2, 0.7, 0.2] / 1.2.
        let logits = [0.0f32, 2f32.ln(), 7f32.ln(), 2f32.ln()];
        let p = |x: f64| (x / 1.2).ln() as f32;
        let l = logprobs(&logits, 0, 3);
        assert!((l.logprob - p(0.1)).abs() < 1e-6, "{l:?}");
        // Most likely first; of the two equals, token 1 before token 3.
        assert_eq!(l.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1, 3]);
        assert!(l.top.iter().zip([0.7, 0.2, 0.2]).all(|(t, q)| (t.1 - p(q)).abs() < 1e-6), "{l:?}");
        // Shifting every logit changes nothing; asking more than the vocabulary gives all of it.
        let shifted: Vec<f32> = logits.iter().map(|l| l + 1000.0).collect();
        assert!((logprobs(&shifted, 2, 0).logprob - p(0.7)).abs() < 1e-4);
        assert_eq!(logprobs(&logits, 2, 9).top.len(), 4);
        assert!(logprobs(&logits, 2, 0).top.is_empty());
        // A large vocabulary: the probabilities sum to one.
        let wide: Vec<f32> = (0..50_000).map(|i| ((i as f32) * 0.013).sin() * 8.0).collect();
        let all = logprobs(&wide, 0, wide.len());
        let total: f64 = all.top.iter().map(|t| f64::from(t.1).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
    }

    #[test]
    fn penalties_follow_vllms_definitions() {
        // Tokens 0..4; the prompt is [3], the answer so far [1, 1, 2].
        let logits = [2.0f32, 4.0, -1.0, 3.0];
        let history = [3, 1, 1, 2];
        let s = Sampling { history: &history, prompt: 1, ..Sampling::GREEDY };
        let adjusted = |s: &Sampling| {
            let mut l = logits.to_vec();
            penalise(&mut l, s);
            l
        };
        // Frequency: once per occurrence in the answer (the prompt's token 3 is not counted).
        assert_eq!(adjusted(&Sampling { frequency_penalty: 1.5, ..s }), vec![2.0, 1.0, -2.5, 3.0]);
        // Presence: once for any occurrence.
        assert_eq!(adjusted(&Sampling { presence_penalty: 0.5, ..s }), vec![2.0, 3.5, -1.5, 3.0]);
        // Repetition: prompt and answer, dividing positive logits and multiplying negative ones.
        assert_eq!(adjusted(&Sampling { repetition_penalty: 2.0, ..s }), vec![2.0, 2.0, -2.0, 1.5]);
        // Greedy follows: token 1 (4.0) loses to token 3 (3.0) under a frequency penalty of 1.
        assert_eq!(sample(&logits, &s, 0), 1);
        assert_eq!(sample(&logits, &Sampling { frequency_penalty: 1.0, ..s }, 0), 3);
        assert!(!s.penalised() && Sampling { repetition_penalty: 1.1, ..s }.penalised());
        // A suppressed token is never drawn, greedy or not.
        let ended = Sampling { suppress: &[1, 3], ..s };
        assert_eq!(sample(&logits, &ended, 0), 0);
        assert!((0..100).all(|p| sample(&logits, &Sampling { temperature: 1.0, ..ended }, p).is_multiple_of(2)));
    }
}
