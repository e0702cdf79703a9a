#!/usr/bin/env bash
# Runs every test of Ferry: formatting, lints, then unit, property, paused-clock, black-box HTTP
# and Prometheus tests. Installs what the tests need first when it can (as root, with apt-get).
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

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
