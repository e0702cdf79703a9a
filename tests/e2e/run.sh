#!/usr/bin/env bash
# End-to-end on a real cluster (kind): install the CRD, run the operator, apply the quickstart,
# wait for Ready, send a request through the Service. Needs docker, kind, kubectl and cargo.
# CI machines have none of these clusters; run it where you have them.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

cluster=${FERRY_E2E_CLUSTER:-ferry-e2e}
image=ferry-sidecar:e2e
workdir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  kubectl delete -f examples/quickstart.yaml --ignore-not-found --wait=false >/dev/null 2>&1 || true
  [ -n "${FERRY_E2E_KEEP:-}" ] || kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
  rm -rf "$workdir"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "cluster $cluster"
kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
kubectl config use-context "kind-$cluster" >/dev/null

step "sidecar image"
docker build --target sidecar -t "$image" .
kind load docker-image "$image" --name "$cluster"

step "CRD"
kubectl apply -f crds/inferenceservice.yaml
kubectl wait --for=condition=Established crd/inferenceservices.ferry.dev --timeout=60s

step "operator (local process, your kubeconfig)"
cargo build --release -p ferry-operator
"$TARGET/release/ferry-operator" run --sidecar-image "$image" --leader-elect=false --listen 127.0.0.1:18081 \
  >"$workdir/operator.log" 2>&1 &
pids+=($!)

step "quickstart"
kubectl apply -f examples/quickstart.yaml
if ! kubectl wait --for=condition=Ready inferenceservice/quickstart --timeout=300s; then
  kubectl describe inferenceservice quickstart; kubectl get pods -o wide; tail -50 "$workdir/operator.log"
  exit 1
fi
kubectl get inferenceservices

step "a request through the Service"
kubectl port-forward service/quickstart 18080:80 >"$workdir/port-forward.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -fs localhost:18080/v2/health/ready >/dev/null && break; sleep 0.2; done
answer=$(curl -fsS localhost:18080/v2/models/quickstart/infer \
  -d '{"inputs":[{"name":"INPUT0","shape":[1,2],"datatype":"FP32","data":[1,2]}]}')
echo "$answer"
echo "$answer" | grep -q '"data":\[2.0,4.0\]' || { echo "unexpected answer" >&2; exit 1; }
curl -fs localhost:18081/metrics | grep -q '^ferry_operator_reconciles_total' || { echo "no operator metrics" >&2; exit 1; }

step "passed"
