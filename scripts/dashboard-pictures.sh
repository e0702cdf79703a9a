#!/usr/bin/env bash
# Draws the README's pictures of the dashboards (docs/dashboards/*.svg) from live data: the
# monitoring test's real operator, sidecars, load and Prometheus server, with two minutes of load
# (about three minutes in all). Needs what scripts/test.sh sets up (.venv, Debian's prometheus).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked -p ferry-sidecar -p ferry-load -p ferry-operator
FERRY_DASHBOARD_PICTURES="$PWD/docs/dashboards" .venv/bin/pytest -q \
  tests/monitoring/test_monitoring.py::test_every_panel_and_alert_returns_data_from_a_real_prometheus_scraping_real_pods
ls -l docs/dashboards
