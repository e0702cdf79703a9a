#!/usr/bin/env bash
# Regenerates BENCHMARKS.md (and benchmarks/*.svg): real sidecar processes on 127.0.0.1, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
cargo build --release --locked -p ferry-sidecar -p ferry-load
# Section 7 writes an F32 copy of SmolLM2 with PyPI gguf (scripts/test.sh made .venv and .cache).
if [ -x .venv/bin/pip ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r benchmarks/requirements.txt
fi
exec "$TARGET/release/ferry-load" bench --out BENCHMARKS.md "$@"
