//! Every quantized format the GGUF reader decodes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants
//! Q4_K, Q5_K, Q6_K), against PyPI gguf's own numpy dequantizers on random blocks:
//! `tests/llm/dequantize.py` writes the blocks as a GGUF file with gguf's writer and what its
//! dequantizers make of them, with the Python environment scripts/test.sh makes (`.venv`, or
//! FERRY_TEST_PYTHON).

use std::path::{Path, PathBuf};
use std::process::Command;

use ferry_llm::gguf::Gguf;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn every_format_decodes_as_ggufs_own_dequantizers_do() {
    let python =
        std::env::var_os("FERRY_TEST_PYTHON").map(PathBuf::from).unwrap_or_else(|| root().join(".venv/bin/python"));
    assert!(
        python.exists(),
        "{} not found: run scripts/test.sh once (it makes .venv with PyPI gguf)",
        python.display()
    );
    let out = std::env::temp_dir().join(format!("ferry-dequantize-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let status = Command::new(&python).arg(root().join("tests/llm/dequantize.py")).arg(&out).status().unwrap();
    assert!(status.success(), "tests/llm/dequantize.py failed: {status}");
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(out.join("expected.json")).unwrap()).unwrap();
    let file = Gguf::open(&out.join("blocks.gguf")).unwrap();
    let formats = expected.as_object().unwrap();
    assert_eq!(formats.len(), 8, "{:?}", formats.keys().collect::<Vec<_>>());
    for (name, values) in formats {
        let want: Vec<f32> = values.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let got = file.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The same products in the same order: equal but for a rounding of the last bit.
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{name}[{i}]: {g} where gguf has {w}");
        }
    }
    std::fs::remove_dir_all(&out).unwrap();
}
