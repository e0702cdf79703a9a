//! The GPU kernels compile: NVRTC (libnvrtc.so, which scripts/test.sh installs from PyPI into
//! .cache/nvrtc and puts on LD_LIBRARY_PATH) turns `kernels.cu` into PTX with every entry point
//! the GPU path loads. Needs no GPU. Only in builds with the `cuda` feature.
#![cfg(feature = "cuda")]

use ferry_llm::gpu;

#[test]
fn nvrtc_compiles_every_kernel_the_gpu_path_loads() {
    assert!(gpu::nvrtc_present(), "NVRTC (libnvrtc.so) cannot be loaded: put its directory on LD_LIBRARY_PATH");
    let ptx = gpu::compile().expect("the kernels compile").to_src();
    let entries: Vec<&str> = ptx
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l))
        .collect();
    for name in ["gather", "rms_norm", "rope_store", "attention", "silu_mul", "add"] {
        assert!(entries.contains(&name), "{name} is not among the PTX's entries {entries:?}");
    }
}
