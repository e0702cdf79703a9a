#!/usr/bin/env bash
# Regenerates BENCHMARKS.md (and benchmarks/*.svg): real sidecar processes on 127.0.0.1, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p ferry-sidecar -p ferry-load
exec target/release/ferry-load bench --out BENCHMARKS.md "$@"
