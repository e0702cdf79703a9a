#!/usr/bin/env bash
# Runs every test of Ferry: formatting, lints, the Rust tests (unit, property, paused-clock,
# black-box HTTP and Prometheus tests of the sidecar; CRD, reconciler and lease tests of the
# operator), then the Helm chart tests. Installs what the tests need first: Debian's prometheus
# package (as root, with apt-get) and a Python virtual environment in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

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

# The Helm chart tests use the real Helm library and kubernetes-validate, from PyPI.
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
.venv/bin/pytest -q tests/chart
