//! The GPU's algorithm (`device::forward`: the projections as cuBLAS calls them and the kernels
//! of `kernels.cu`), run by the host emulation of its operations, against the CPU path, on the
//! same weights and the same steps: a prefill, decodes, and a batched step of two sequences in
//! scattered blocks. Their logits must agree to rounding (cosine and largest difference).

use std::path::Path;

use ferry_llm::device::{self, DeviceCache, DeviceWeights, Ops, StepIndex};
use ferry_llm::host::Host;
use ferry_llm::{Device, KvSize, Model, Sampling, Seq};

mod common;
use common::{root, smollm_path};

const BLOCK: u32 = 16;
const BLOCKS: u32 = 16;

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Runs the same steps through the CPU path and the emulated GPU path, comparing each step's
/// logits; returns the least cosine and the largest difference seen.
fn compare(source: &Path, prompts: &[Vec<u32>]) -> (f64, f32) {
    // The GPU path uploads f32: the CPU path's f32 weights are its reference.
    let cpu = Model::load_dequantized(source, Device::Cpu, KvSize::Blocks(BLOCKS), BLOCK).expect("load");
    let (weights, _) = ferry_llm::read(source).expect("read");
    let c = weights.config.clone();
    let host = Host;
    let dw = DeviceWeights::upload(&host, &weights).expect("upload");
    let slots = (BLOCKS * BLOCK) as usize;
    let positions = cpu.context_length() as usize;
    let (cos, sin) = device::rope_tables(&c, positions);
    let mut cache = DeviceCache {
        keys: host.zeros(c.layers * slots * c.kv_dim()).unwrap(),
        values: host.zeros(c.layers * slots * c.kv_dim()).unwrap(),
        cos: host.upload(&cos).unwrap(),
        sin: host.upload(&sin).unwrap(),
    };
    let greedy = Some(Sampling::GREEDY);
    let (mut least, mut worst) = (1.0f64, 0.0f32);
    let mut run = |seqs: &[Seq<'_>]| -> Vec<u32> {
        let on_cpu = cpu.step(seqs).expect("cpu step");
        let ix = StepIndex::of(seqs, &c, positions, BLOCK as usize, BLOCKS as usize).expect("index");
        let on_device = device::forward(&host, &dw, &c, &mut cache, &ix, slots).expect("device step");
        assert_eq!(on_cpu.logits.len(), on_device.len());
        for (a, b) in on_cpu.logits.iter().zip(&on_device) {
            least = least.min(cosine(a, b));
            worst = worst.max(a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max));
        }
        on_cpu.tokens
    };
    // Sequence i in blocks i, i + 3, i + 6, …: tables interleave.
    let tables: Vec<Vec<u32>> = (0..prompts.len() as u32).map(|i| (0..4).map(|b| i + 3 * b).collect()).collect();
    let mut produced: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| run(&[Seq { tokens: p, start: 0, blocks: t, sample: greedy }]))
        .collect();
    for _ in 0..2 {
        let lasts: Vec<[u32; 1]> = produced.iter().map(|p| [*p.last().unwrap()]).collect();
        let seqs: Vec<Seq> = (0..prompts.len())
            .map(|i| Seq {
                tokens: &lasts[i],
                start: (prompts[i].len() + produced[i].len() - 1) as u32,
                blocks: &tables[i],
                sample: greedy,
            })
            .collect();
        for (p, t) in produced.iter_mut().zip(run(&seqs)) {
            p.push(t);
        }
    }
    (least, worst)
}

#[test]
fn the_gpu_algorithm_on_the_host_matches_the_cpu_path_on_smollm2() {
    let model = Model::load(&smollm_path(), Device::Cpu, KvSize::Blocks(2), BLOCK).expect("load");
    let prompts: Vec<Vec<u32>> =
        ["The capital of France is", "def add(a, b):"].iter().map(|p| model.text().encode(p).unwrap()).collect();
    let (least, worst) = compare(&smollm_path(), &prompts);
    eprintln!("SmolLM2: least cosine {least}, largest logit difference {worst:e}");
    assert!(least > 0.999_999, "least cosine {least}");
    assert!(worst < 1e-3, "largest logit difference {worst}");
}

#[test]
fn the_gpu_algorithm_on_the_host_matches_the_cpu_path_on_the_tiny_models() {
    for family in ["llama", "qwen2", "llama3"] {
        let dir = root().join(format!("tests/llm/reference/tiny-{family}"));
        let prompts = vec![b"hello world".iter().map(|&b| u32::from(b)).collect(), vec![70, 101, 114, 114, 121]];
        let (least, worst) = compare(&dir, &prompts);
        eprintln!("tiny {family}: least cosine {least}, largest logit difference {worst:e}");
        assert!(least > 0.999_999, "{family}: least cosine {least}");
        assert!(worst < 1e-4, "{family}: largest logit difference {worst}");
    }
}

#[test]
fn a_step_the_cache_cannot_hold_is_refused_before_anything_runs() {
    let dir = root().join("tests/llm/reference/tiny-llama");
    let (weights, _) = ferry_llm::read(&dir).unwrap();
    let c = &weights.config;
    let table = [3u32];
    let seq = |tokens: &'static [u32], start| Seq { tokens, start, blocks: &table, sample: None };
    // Position 16 needs a second block.
    let e = StepIndex::of(&[seq(&[1], 16)], c, 256, 16, 4).unwrap_err();
    assert!(e.contains("beyond the block table"), "{e}");
    // Block 3 of a 2-block cache.
    let e = StepIndex::of(&[seq(&[1], 0)], c, 256, 16, 2).unwrap_err();
    assert!(e.contains("block 3 is not in the cache"), "{e}");
    let e = StepIndex::of(&[seq(&[999], 0)], c, 256, 16, 4).unwrap_err();
    assert!(e.contains("outside the vocabulary"), "{e}");
    let e = StepIndex::of(&[seq(&[1], 300)], c, 256, 16, 400).unwrap_err();
    assert!(e.contains("past the model's context"), "{e}");
}
