"""Scale to zero and back, end to end: the real ferry-operator on the emulated API, real
ferry-sidecar processes as the worker pods (ready 5 s after they start, as weights take to load),
and the real ferry-holder as the holder's pod.

A generation service with `scaleToZeroAfter` goes to zero once idle, and its EndpointSlice of
holder pods turns ready (the Service's traffic goes to the holder). At zero, 50 requests and a
stream with long deadlines are held, the operator asks for the pods they need in one decision, and
every one is answered within its deadline with no client retry — the stream streams normally
after keep-alive comments; meanwhile a request whose first-token deadline falls before the
start-up is refused at once with an honest `Retry-After`. Then the slice stops being ready. Every wait is on
the API's own objects or the processes' answers, with generous limits.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from cluster import call, ready, wait_for  # noqa: E402
from emulator import now_rfc3339  # noqa: E402
from test_operator import NS, ROOT, binary, cluster, get  # noqa: E402

NAME = "chat"
HOLDER_IP = "127.0.1.1"
ISVCS = f"/apis/ferry.dev/v1alpha1/namespaces/{NS}/inferenceservices"
SLICE = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/{NAME}-holder"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"


@pytest.fixture
def world(tmp_path, monkeypatch):
    holder_bin = binary("FERRY_HOLDER_BIN", "ferry-holder")
    # The operator and the holder share the token of its directions, as the chart's Secret gives it.
    monkeypatch.setenv("FERRY_HOLDER_TOKEN", "e2e-token")
    with cluster(tmp_path, ready_after=5.0) as (api, kubelet, load, operator):
        log = open(tmp_path / "holder.log", "w")
        holder = subprocess.Popen(
            [holder_bin, "--listen", f"{HOLDER_IP}:8080", "--admin-listen", f"{HOLDER_IP}:9090", "--keep-alive", "1s"],
            env=dict(os.environ, RUST_LOG="info"), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for("the holder", lambda: ready(f"http://{HOLDER_IP}:9090/healthz"))
            # Its pod, as the chart's Deployment would have it, ready.
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "ferry-holder-0", "namespace": "ferry-system",
                                "labels": {"app.kubernetes.io/name": "ferry", "app.kubernetes.io/component": "holder"}},
                   "spec": {"containers": [{"name": "holder", "image": "ferry-holder"}]}}
            status, _ = call(api.url + "/api/v1/namespaces/ferry-system/pods", "POST", pod)
            assert status == 201, status
            call(api.url + "/api/v1/namespaces/ferry-system/pods/ferry-holder-0/status", "PATCH",
                 {"status": {"phase": "Running", "podIP": HOLDER_IP, "conditions": [
                     {"type": "Ready", "status": "True", "lastTransitionTime": now_rfc3339()}]}},
                 "application/merge-patch+json")
            yield api, kubelet, operator
        finally:
            holder.terminate()
            holder.wait(10)
            log.close()
            print((tmp_path / "holder.log").read_text()[-3000:])


def complete(timeout_ms, ttft_ms=None, stream=False):
    """A completion sent to the holder as the service's traffic is (its Host is the Service's
    name): (status, Retry-After, seconds taken, the body's lines with when each came)."""
    headers = {"Host": f"{NAME}.{NS}.svc.cluster.local", "Content-Type": "application/json",
               "x-ferry-timeout-ms": str(timeout_ms)}
    if ttft_ms:
        headers["x-ferry-ttft-ms"] = str(ttft_ms)
    body = {"model": "smollm2", "prompt": "one two three four", "max_tokens": 8, "stream": stream}
    request = urllib.request.Request(f"http://{HOLDER_IP}:8080/v1/completions", method="POST",
                                     data=json.dumps(body).encode(), headers=headers)
    sent = time.monotonic()
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), time.monotonic() - sent, [(e.read().decode(), 0.0)]
    lines = []
    with response:
        for line in response:
            lines.append((line.decode().rstrip("\n"), time.monotonic() - sent))
    return response.status, None, time.monotonic() - sent, lines


def decisions(operator):
    """The operator's decisions for the service so far (one a tick)."""
    text = urllib.request.urlopen(operator + "/metrics", timeout=5).read().decode()
    pattern = rf'^ferry_operator_scale_decisions_total{{inferenceservice="{NAME}",namespace="{NS}",reason="\w+"}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_a_service_goes_to_zero_when_idle_and_comes_back_for_what_the_holder_held(world):
    api, kubelet, operator = world
    manifest = yaml.safe_load((ROOT / "examples" / "generation.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    manifest["spec"]["scaling"] = {"minReplicas": 0, "maxReplicas": 4, "warmReplicas": 0,
                                   "scaleToZeroAfter": "8s", "startupTime": "5s"}
    status, _ = call(api.url + ISVCS, "POST", manifest)
    assert status == 201

    def replicas():
        return (get(api, DEPLOYMENT) or {}).get("spec", {}).get("replicas")

    def scaled():
        events = call(api.url + f"/apis/events.k8s.io/v1/namespaces/{NS}/events")[1]["items"]
        return [e["note"] for e in events if e["reason"] == "Scaled"]

    def slice_ready():
        s = get(api, SLICE)
        return s and [(e["addresses"], e["conditions"]["ready"]) for e in s["endpoints"]]

    # One pod to start with; no load for scaleToZeroAfter once it is up: zero, and the
    # Service's traffic goes to the holder.
    # While the first pod starts, the holder is the service's endpoint; once it is ready, not.
    wait_for("the first pod ready", lambda: kubelet.ready_ips(NAME), timeout=60)
    wait_for("the holder's endpoint unready", lambda: slice_ready() == [([HOLDER_IP], False)], timeout=10)
    wait_for("zero replicas", lambda: replicas() == 0, timeout=60)
    wait_for("the pod gone", lambda: not kubelet.pods.get(NAME), timeout=30)
    wait_for("the holder's endpoint ready", lambda: slice_ready() == [([HOLDER_IP], True)], timeout=10)
    s = get(api, SLICE)
    assert s["metadata"]["labels"]["kubernetes.io/service-name"] == NAME
    assert s["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert "scale to zero: no load offered for" in scaled()[-1], scaled()
    measured = get(api, f"{ISVCS}/{NAME}")["status"]["measuredStartupTime"]
    assert 4 <= measured <= 8, measured

    holder_metrics = f"http://{HOLDER_IP}:9090/metrics"
    wait_for("the holder told of the service", lambda: f'service="{NAME}"' in
             urllib.request.urlopen(holder_metrics, timeout=5).read().decode(), timeout=10)

    # 50 requests and a stream whose first tokens may wait 25 s: held, then answered in time.
    # They are sent together just after a decision (the operator decides every second), so that
    # the next one sees them all: the one decision from zero is then for all of them.
    at_zero = len(scaled())
    go = threading.Event()

    def when_told(*args):
        go.wait(30)
        return complete(*args)

    with concurrent.futures.ThreadPoolExecutor(51) as pool:
        stream = pool.submit(when_told, 30_000, 25_000, True)
        held = [pool.submit(when_told, 30_000, 25_000) for _ in range(50)]
        before = decisions(operator)
        wait_for("a decision", lambda: decisions(operator) > before, every=0.01)
        go.set()
        sent = time.monotonic()
        # Meanwhile, a first token due in 1 s (the service's ttftBudget) cannot wait for the
        # start-up: refused at once, with the start-up left as Retry-After — an honest one.
        wait_for("the scale-up from zero", lambda: len(scaled()) > at_zero, every=0.05)
        code, retry_after, took, body = complete(3000)
        refused = time.monotonic()
        results = [f.result(timeout=90) for f in held]
        streamed = stream.result(timeout=90)
    print(f"held: took {sorted(round(r[2], 2) for r in results)}; scaled {scaled()[at_zero:]}; "
          f"refused in {took * 1000:.1f} ms, Retry-After {retry_after}")
    assert code == 503 and took < 0.1, (code, took, body)
    assert "scaled to zero" in body[0][0], body
    first_answer = sent + min(took for _, _, took, _ in results)
    assert 1 <= int(retry_after) <= 10 and refused + int(retry_after) >= first_answer - 0.2, \
        (retry_after, first_answer - refused)
    assert all(code == 200 for code, *_ in results), [r[:3] for r in results if r[0] != 200]
    assert all(took < 25 for _, _, took, _ in results), "every first token (here: every answer) within its deadline"
    assert all(json.loads(lines[0][0])["choices"][0]["text"] for *_, lines in results)
    assert min(took for _, _, took, _ in results) > 3, "answered once a pod was up, not before"

    code, _, took, lines = streamed
    assert code == 200 and took < 30, (code, took)
    comments = [t for line, t in lines if line.startswith(": held")]
    events = [(line, t) for line, t in lines if line.startswith("data: ")]
    assert comments and all(t < events[0][1] for t in comments), "keep-alives while held, then the stream"
    assert events[-1][0] == "data: [DONE]" and len(events) >= 3, lines
    assert all(json.loads(line[6:])["choices"][0]["text"] is not None for line, _ in events[:-1]), events

    # From zero in one decision, for all the held load: 0 → N, and no scale-up after it.
    notes = scaled()[at_zero:]
    assert notes and notes[0].startswith("0 → ") and "scale from zero: 51 requests held" in notes[0], notes
    assert 1 <= int(notes[0].split(" ")[2]) <= 4
    ups = [n for n in notes[1:] if int(n.split(" ")[2]) > int(n.split(" ")[0])]
    assert not ups, notes
    # The pods serve the Service again: the holder's endpoint is not ready.
    wait_for("the holder's endpoint unready", lambda: slice_ready() == [([HOLDER_IP], False)], timeout=10)
    text = urllib.request.urlopen(f"http://{HOLDER_IP}:9090/metrics", timeout=5).read().decode()
    assert f'ferry_holder_finished_total{{namespace="{NS}",outcome="released",service="{NAME}"}} 51' in text, text
    assert f'ferry_holder_requests_total{{namespace="{NS}",outcome="infeasible",service="{NAME}"}} 1' in text, text
