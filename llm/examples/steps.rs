//! Times the decoder's steps on a model file: decodes of 1, 8 and 32 sequences at a context of
//! 64, and prefills of 64 and 512 tokens; the median of five of each.
//!
//!     cargo run --release -p ferry-llm --example steps -- MODEL.gguf

// No tokio here, so no paused clock to follow: the wall clock is what is measured.
#![allow(clippy::disallowed_types)]

use std::time::{Duration, Instant};

use ferry_llm::{KvSize, Model, Sampling, Seq};

fn main() -> Result<(), String> {
    let path = std::env::args().nth(1).ok_or("usage: steps MODEL.gguf")?;
    let model = Model::load(path.as_ref(), KvSize::Blocks(2048), 16)?;
    let greedy = Some(Sampling::GREEDY);
    let time = |seqs: &[Seq<'_>]| -> Result<Duration, String> {
        let mut runs = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            model.step(seqs)?;
            runs.push(started.elapsed());
        }
        runs.sort();
        Ok(runs[2])
    };
    let tables: Vec<Vec<u32>> = (0..32).map(|s| (s * 40..s * 40 + 40).collect()).collect();
    let context = 64;
    let prompt = vec![100u32; context];
    for t in &tables {
        model.step(&[Seq { tokens: &prompt, start: 0, blocks: t, sample: None }])?;
    }
    for n in [1usize, 8, 32] {
        let seqs: Vec<Seq> = tables[..n]
            .iter()
            .map(|t| Seq { tokens: &[7], start: context as u32, blocks: t, sample: greedy })
            .collect();
        let took = time(&seqs)?;
        println!("decode {n:>2} sequences: {took:>10.2?} a step, {:>7.1} tokens/s", n as f64 / took.as_secs_f64());
    }
    for len in [64usize, 512] {
        let tokens = vec![100u32; len];
        let took = time(&[Seq { tokens: &tokens, start: 0, blocks: &tables[0], sample: greedy }])?;
        println!("prefill {len:>3} tokens:    {took:>10.2?},        {:>7.1} tokens/s", len as f64 / took.as_secs_f64());
    }
    Ok(())
}
