//! The decoder outside the server, for timing and for the GPU check (scripts/gpu-check.sh):
//!
//!     cargo run --release -p ferry-llm [--features cuda] --example check -- MODEL \
//!         [--device cpu|cuda[:N]] [--sizes 1,8,32] [--min-cosine 0.9999]
//!
//! Prints JSON lines: with `--min-cosine`, the device's logits against the CPU's on the same
//! steps (two prompts prefilled, then four batched decodes), failing below that cosine; then,
//! for each size, the median time of five decode steps of that many sequences at a context of
//! 64, and of a 512-token prefill.

// No tokio here, so no paused clock to follow: the wall clock is what is measured.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use ferry_llm::{Device, KvSize, Model, Sampling, Seq};
use serde_json::json;

fn device(text: &str) -> Result<Device, String> {
    match text {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => text
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("--device is '{text}'; it must be cpu, cuda or cuda:N")),
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Two prompts prefilled, then four decodes of both in one step each; every step's logits.
fn script(model: &Model, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, String> {
    let greedy = Some(Sampling::GREEDY);
    let tables: Vec<Vec<u32>> = (0..prompts.len() as u32).map(|i| (0..8).map(|b| i + 2 * b).collect()).collect();
    let mut logits = Vec::new();
    let mut last = Vec::new();
    for (p, t) in prompts.iter().zip(&tables) {
        let s = model.step(&[Seq { tokens: p, start: 0, blocks: t, sample: greedy }])?;
        last.push(s.tokens[0]);
        logits.extend(s.logits);
    }
    for k in 0..4 {
        let feeds: Vec<[u32; 1]> = last.iter().map(|t| [*t]).collect();
        let seqs: Vec<Seq> = (0..prompts.len())
            .map(|i| Seq {
                tokens: &feeds[i],
                start: (prompts[i].len() + k) as u32,
                blocks: &tables[i],
                sample: greedy,
            })
            .collect();
        let s = model.step(&seqs)?;
        last = s.tokens;
        logits.extend(s.logits);
    }
    Ok(logits)
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let source = args.first().ok_or("usage: check MODEL [--device D] [--sizes 1,8,32] [--min-cosine X]")?;
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str);
    let on = device(flag("--device").unwrap_or("cpu"))?;
    let sizes: Vec<usize> = flag("--sizes")
        .unwrap_or("1,8,32")
        .split(',')
        .map(|s| s.parse().map_err(|_| format!("--sizes: '{s}' is not a number")))
        .collect::<Result<_, _>>()?;
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let blocks = (largest * 8).max(64) as u32;
    let model = Model::load(source.as_ref(), on, KvSize::Blocks(blocks), 16)?;

    if let Some(min) = flag("--min-cosine") {
        let min: f64 = min.parse().map_err(|_| format!("--min-cosine: '{min}' is not a number"))?;
        let cpu = Model::load(source.as_ref(), Device::Cpu, KvSize::Blocks(64), 16)?;
        let prompts: Vec<Vec<u32>> = ["The capital of France is", "def add(a, b):"]
            .iter()
            .map(|p| cpu.text().encode(p))
            .collect::<Result<_, _>>()?;
        let (a, b) = (script(&cpu, &prompts)?, script(&model, &prompts)?);
        let least = a.iter().zip(&b).map(|(x, y)| cosine(x, y)).fold(1.0, f64::min);
        let worst = a.iter().zip(&b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max);
        println!(
            "{}",
            json!({"compare": format!("{on:?} against Cpu"), "steps": a.len(), "least_cosine": least, "max_difference": worst})
        );
        if least < min {
            return Err(format!("least cosine {least} is below {min}"));
        }
    }

    let median = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<Duration, String> {
        let mut runs = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            f()?;
            runs.push(started.elapsed());
        }
        runs.sort();
        Ok(runs[2])
    };
    let context = 64usize;
    let tables: Vec<Vec<u32>> = (0..largest as u32).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let prompt = vec![100u32; context];
    for t in &tables {
        model.step(&[Seq { tokens: &prompt, start: 0, blocks: t, sample: None }])?;
    }
    for &n in &sizes {
        let seqs: Vec<Seq> = tables[..n]
            .iter()
            .map(|t| Seq { tokens: &[7], start: context as u32, blocks: t, sample: Some(Sampling::GREEDY) })
            .collect();
        let took = median(&mut || model.step(&seqs).map(drop))?;
        println!(
            "{}",
            json!({"device": format!("{on:?}"), "decode_sequences": n, "step_ms": took.as_secs_f64() * 1e3,
                   "tokens_per_s": n as f64 / took.as_secs_f64()})
        );
    }
    let long = vec![100u32; 512.min(model.context_length() as usize - 1)];
    let table: Vec<u32> = (0..(long.len() as u32).div_ceil(16)).collect();
    let took = median(&mut || {
        model.step(&[Seq { tokens: &long, start: 0, blocks: &table, sample: Some(Sampling::GREEDY) }]).map(drop)
    })?;
    println!(
        "{}",
        json!({"device": format!("{on:?}"), "prefill_tokens": long.len(), "ms": took.as_secs_f64() * 1e3,
               "tokens_per_s": long.len() as f64 / took.as_secs_f64()})
    );
    Ok(())
}
