"""The real ferry-operator binary end to end, against a stateful Kubernetes API (PyPI kmock's
emulator, completed in emulator.py) with real ferry-sidecar processes as the worker pods
(cluster.py plays the Deployment controller, the kubelet and the Service).

One service's life, in order: the example InferenceService is applied and gets its Deployment and
Service; malformed and misrouted traffic scales nothing; a 20 req/s trickle ends at what the
arithmetic needs plus the warm spare; 600 req/s of real overload ends there too, not at
maxReplicas; the status carries the figures and every Scaled event names its counts; a spec
change reaches the Deployment. Then a generation service's, on sim-llm pods that take 20 s to
become ready, sized by the pods' own capacity figure. Every wait is on the API's own objects,
with generous limits.
"""

import contextlib
import os
import pathlib
import subprocess
import sys
import re
import socket
import time
import urllib.request

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from cluster import Kubelet, Streams, Traffic, call, wait_for  # noqa: E402
from emulator import Api  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "ml"
NAME = "quickstart"
INFER = f"/v2/models/{NAME}/infer"


def binary(variable, name):
    path = os.environ.get(variable)
    if path:
        assert pathlib.Path(path).exists(), f"{variable}={path} does not exist"
        return path
    path = ROOT / "target" / "debug" / name
    if not path.exists():
        pytest.skip(f"{name} is not built (set {variable})")
    return str(path)


def requests_by_outcome(ip):
    """`ferry_requests_total` of one sidecar, summed by outcome."""
    with urllib.request.urlopen(f"http://{ip}:9090/metrics", timeout=5) as response:
        text = response.read().decode()
    totals = {}
    for line in text.splitlines():
        if line.startswith("ferry_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            totals[outcome] = totals.get(outcome, 0) + float(value)
    return totals


@contextlib.contextmanager
def cluster(tmp_path, ready_after=0.0):
    """The operator on the emulated API, with a kubelet whose pods take `ready_after` s at least."""
    sidecar = binary("FERRY_SIDECAR_BIN", "ferry-sidecar")
    load = binary("FERRY_LOAD_BIN", "ferry-load")
    operator = binary("FERRY_OPERATOR_BIN", "ferry-operator")
    with Api() as api:
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_NAMESPACE="ferry-system", POD_NAME="operator-0",
                   RUST_LOG=os.environ.get("FERRY_E2E_LOG", "info,kube=warn"))
        log = open(tmp_path / "operator.log", "w")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        process = subprocess.Popen(
            [operator, "run", "--listen", address, "--scale-interval", "1s", "--metrics-window", "6s",
             "--watch-inference-pools", "true"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with Kubelet(api.url, NS, sidecar, tmp_path, ready_after) as kubelet:
                yield api, kubelet, load, f"http://{address}"
                assert not kubelet.errors, kubelet.errors
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
            print((tmp_path / "operator.log").read_text()[-6000:])


@pytest.fixture
def world(tmp_path):
    with cluster(tmp_path) as w:
        yield w


@pytest.fixture
def loading_world(tmp_path):
    """Pods that take 20 s to become ready, as a model's weights take to load."""
    with cluster(tmp_path, ready_after=20.0) as w:
        yield w


def get(api, path):
    status, obj = call(api.url + path)
    return obj if status == 200 else None


def test_one_service_from_apply_through_overload_to_a_spec_change(world):
    api, kubelet, load, operator = world
    isvcs = f"/apis/ferry.dev/v1alpha1/namespaces/{NS}/inferenceservices"
    deployment_path = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"

    def isvc():
        return get(api, f"{isvcs}/{NAME}")

    def replicas():
        return (get(api, deployment_path) or {}).get("spec", {}).get("replicas")

    # The example, as a user applies it.
    manifest = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    status, _ = call(api.url + isvcs, "POST", manifest)
    assert status == 201

    # The operator creates the Deployment, then sets its replicas as their own field manager (a
    # second apply): the emulator, unlike an API server, does not default them in between.
    deployment = wait_for("the worker Deployment with its replicas", lambda: (
        (d := get(api, deployment_path)) and d.get("spec", {}).get("replicas") is not None and d))
    assert deployment["spec"]["replicas"] == 1, "no load yet: the warm spare"
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar")
    assert "--max-batch-size=32" in container["args"] and "--engine=sim" in container["args"]
    assert deployment["metadata"]["ownerReferences"][0]["name"] == NAME
    service = wait_for("the worker Service", lambda: get(api, f"/api/v1/namespaces/{NS}/services/{NAME}"))
    assert service["spec"]["selector"] == {"ferry.dev/inference-service": NAME}
    ready = wait_for("the service Ready", lambda: next(
        (c for c in (isvc().get("status") or {}).get("conditions", []) if c["type"] == "Ready" and c["status"] == "True"),
        None))
    assert ready["reason"]
    seen = []  # replicas over time, for the assertions below
    versions = set()  # the InferenceService's resourceVersions seen: each one a write

    def watch(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seen.append(replicas())
            versions.add(isvc()["metadata"]["resourceVersion"])
            time.sleep(0.5)

    def reconciles():
        text = urllib.request.urlopen(operator + "/metrics", timeout=10).read().decode()
        return float(re.search(r"^ferry_operator_reconciles_total (\S+)$", text, re.M).group(1))

    # Malformed (rows=0: 400) and misrouted (unknown model: 404) traffic, 600 req/s: not load.
    with Traffic(kubelet, NAME, load, INFER, 300, 8, ["--rows", "0"]), \
            Traffic(kubelet, NAME, load, "/v2/models/nope/infer", 300, 8):
        watch(8)
    assert set(seen) == {1}, f"malformed traffic scaled the service: {seen}"
    sent = requests_by_outcome(kubelet.ready_ips(NAME)[0])
    assert sent.get("invalid", 0) > 1000 and sent.get("not_found", 0) > 1000, sent
    status = wait_for("a status after the malformed traffic", lambda: (isvc().get("status") or {}).get("arrivalRate")
                      is not None and isvc()["status"])
    assert status["arrivalRate"] < 1.0, status

    # A trickle: 20 req/s needs one replica for the load, plus the warm spare. Its few
    # structural refusals (a request that arrives as a batch leaves waits for the worker, then its
    # own batch) are not capacity pressure.
    seen.clear()
    versions.clear()
    before = reconciles()
    with Traffic(kubelet, NAME, load, INFER, 20, 12):
        watch(12)
    after = reconciles()
    assert max(seen) == 2 and seen[-1] == 2, f"a 20 req/s trickle: {seen}; {isvc()['status']}"
    # The autoscaler wrote the status about once a second (13 writes seen); the controller
    # reconciles what it owns changing (the scale-up's Deployment and its status as the pod
    # starts: 3 seen), not those writes (17 reconciles seen when it did, each re-applying the
    # Deployment and the Service).
    assert len(versions) >= 6, f"the autoscaler's status writes: {sorted(versions)}"
    assert after - before <= 6, f"{after - before:.0f} reconciles for {len(versions)} status writes"

    # Real overload: 600 req/s on 2 replicas of 320 req/s each. The arithmetic needs 2.3 → 3 at
    # 0.8 utilization, plus the warm spare: 4 — or 5 where the measured batch time and rate put it
    # past 3.0. (900 req/s, as this test once sent, is more than two cores drive through the
    # debug builds of six sidecars, the load generator, the operator and the emulator: most
    # requests were then refused for the machine's own slowness.) About a fifth of requests are refused whatever the count
    # (budget = 2 batches: a request that arrives as a batch starts waits it out, then its own);
    # a replica added for that pressure does not relieve it and goes again. It must not climb
    # towards maxReplicas (8), as it once did a replica per tick.
    seen.clear()
    with Traffic(kubelet, NAME, load, INFER, 600, 30):
        watch(10)
        during = wait_for("the status under load", lambda: isvc()["status"])
        watch(20)
    # It ends where the last decision's own arithmetic ("... needs N" for the rate, plus 1 warm)
    # puts it, or one more while a pressure probe is out or its floor keeps a replica that helped;
    # never near maxReplicas.
    final, reason = replicas(), isvc()["status"]["lastScaleReason"]
    needs = int(re.search(r"needs (\d+)", reason).group(1))
    assert needs in (3, 4), reason
    assert needs + 1 <= final <= needs + 2, f"600 req/s ended at {final}; the arithmetic says {needs} + 1: {reason}"
    assert max(seen) <= 7, f"seen {sorted(set(seen))}"
    assert 400 <= during["arrivalRate"] <= 800, during
    # Requests share batches: one request a batch would be a fill of 1/32 = 0.03. How full they are
    # depends on how many replicas share the rate at that moment (0.26-0.4 seen), so only sharing is asserted.
    assert during["desiredReplicas"] >= 4 and during["batchFill"] > 0.1, during
    assert during["startupTime"] == during["measuredStartupTime"] < 30, "time-to-ready measured on the pods"
    # The last change says why, with its arithmetic (a scale-up, or the pressure probe).
    assert "req/s per replica" in during["lastScaleReason"], during

    # Every Scaled event names the counts it is about, from the first (1 → 2) to where it ended.
    events = call(api.url + f"/apis/events.k8s.io/v1/namespaces/{NS}/events")[1]["items"]
    scaled = [e for e in events if e["reason"] == "Scaled"]
    counts = [tuple(int(n) for n in e["action"].removeprefix("Scale ").split(" to ")) for e in scaled]
    for event, (a, b) in zip(scaled, counts):
        assert event["note"].startswith(f"{a} → {b} replicas: "), event
    assert counts[0] == (1, 2), counts
    assert all(b <= 7 for _, b in counts), counts
    # (A repeat of the same change is folded into the first one's event series.)
    assert final in {b for _, b in counts}, counts

    # A spec change reaches the Deployment.
    status, _ = call(api.url + f"{isvcs}/{NAME}", "PATCH", {"spec": {"batching": {"maxBatchSize": 16}}},
                     "application/merge-patch+json")
    assert status == 200
    wait_for("the new batch cap in the Deployment", lambda: "--max-batch-size=16" in next(
        c for c in get(api, deployment_path)["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    )["args"])
    wait_for("the new generation observed", lambda: isvc()["status"].get("observedGeneration") == 2)
    # Replicas stay the autoscaler's: the Deployment follows its decision (a halved batch cap halves
    # each replica's capacity, which the load still in the window may show), never the spec's.
    wait_for("the autoscaler's replicas in the Deployment",
             lambda: replicas() == isvc()["status"].get("desiredReplicas"))
    writers = {manager for manager, _ in api.emulator.replica_writes}
    assert writers == {"ferry-autoscaler"}, api.emulator.replica_writes


def test_a_generation_service_scales_by_what_its_pods_serve(loading_world):
    """sim-llm pods (`examples/generation.yaml`, slowed to about 4.7 requests/s a pod for two
    cores) that take 20 s to become ready: malformed requests and a trickle do not scale it; a
    load of two pods' capacity reaches what the pods' own capacity figure needs, with a pod's
    worth of warm capacity, in one or two decisions sized by rate while the pods load; once it
    stops, scale-down waits its delay, and no stream is cut."""
    api, kubelet, load, _ = loading_world
    name, model = "chat", "smollm2"
    isvcs = f"/apis/ferry.dev/v1alpha1/namespaces/{NS}/inferenceservices"
    deployment_path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    manifest = yaml.safe_load((ROOT / "examples" / "generation.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    spec = manifest["spec"]
    spec["engine"]["sim"] = {"stepTime": "20ms", "prefillPerToken": "100us", "decodePerSeq": "2ms"}
    spec["generation"]["maxSequences"] = 8
    spec["scaling"] = {"minReplicas": 1, "maxReplicas": 8, "warmReplicas": 1, "scaleDownDelay": "20s",
                       "startupTime": "20s"}
    status, _ = call(api.url + isvcs, "POST", manifest)
    assert status == 201
    shape = ["--prompt", "16", "32", "--output", "24", "40"]

    def isvc():
        return get(api, f"{isvcs}/{name}")

    def replicas():
        return (get(api, deployment_path) or {}).get("spec", {}).get("replicas")

    def scaled():
        events = call(api.url + f"/apis/events.k8s.io/v1/namespaces/{NS}/events")[1]["items"]
        return [e["note"] for e in events if e["reason"] == "Scaled"]

    seen = []

    def watch(seconds, until=lambda: False):
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            seen.append(replicas())
            time.sleep(0.5)

    wait_for("the worker Deployment with its replicas", lambda: replicas() is not None)
    wait_for("the first pod ready", lambda: kubelet.ready_ips(name), timeout=60)
    assert replicas() == 1, "no load yet: the warm spare"

    # Malformed (max_tokens below 1: 400) and misrouted (unknown model: 404) requests: not load.
    url = f"http://{kubelet.ready_ips(name)[0]}:8080/v1/completions"
    codes = [call(url, "POST", {"model": m, "prompt": "hello", "max_tokens": t})[0]
             for _ in range(60) for m, t in ((model, 0), ("nope", 8))]
    assert set(codes) == {400, 404}, codes
    watch(8)
    assert set(seen) == {1}, f"malformed requests scaled the service: {seen}"

    # A trickle, 1 request/s: one pod for the load, plus the warm spare.
    seen.clear()
    with Streams(kubelet, name, load, model, 1, 16, shape) as trickle:
        watch(16)
    assert max(seen) == 2 and seen[-1] == 2, f"a trickle: {seen}; {isvc()['status']}"
    assert trickle.summary()["cut"] == 0
    wait_for("the warm spare ready", lambda: len(kubelet.ready_ips(name)) == 2, timeout=60)

    # Two pods' capacity: 9.5 requests/s at about 4.7 a pod (the pods' own figure, 0.8 utilization:
    # 3 pods), with a pod's worth of warm capacity beyond the load (4 at 4.7 a pod; 3 from 5 a
    # pod, whose headroom holds it). Pods asked for are capacity to come for their 20 s: no
    # replica a tick while they load.
    seen.clear()
    before = len(scaled())
    with Streams(kubelet, name, load, model, 9.5, 50, shape) as heavy:
        watch(50)
    status = isvc()["status"]
    reason = status["lastScaleReason"]
    needs = int(re.search(r"needs (\d+)", reason).group(1))
    # The count the arithmetic sized: rule 3's, or more for the warm capacity beyond the load.
    warm = re.search(r", (\d+) with 1 replica\(s\) of warm capacity beyond the load", reason)
    sized = int(warm.group(1)) if warm else needs
    final = replicas()
    ups = [n for n in scaled()[before:] if int(n.split(" ")[2]) > int(n.split(" ")[0])]
    assert "the pods' own figure" in reason and 3.5 <= status["capacityPerReplica"] <= 6.5, status
    assert needs in (3, 4) and sized in (needs, needs + 1) and sized <= final <= sized + 1, \
        f"ended at {final}: {reason}"
    # From the trickle's 2 to what the rate needs with the warm capacity (3 or 4) in one or two
    # decisions (one seen; a later reading of the rate may add one), each sized by rate ("scale
    # up: ... needs N"), none a pressure probe's one replica more ("deadline pressure: ...").
    reached = [int(n.split(" ")[2]) for n in ups]
    assert reached and max(reached[:2]) >= min(sized, 4), ups
    assert len(ups) <= 3 and all(n.split(": ", 1)[1].startswith("scale up: ") for n in ups), ups
    assert max(seen) <= 5, f"seen {sorted(set(seen))}"
    counts = heavy.summary()
    print(f"heavy: seen {seen}, scale-ups {ups}, {reason}, {counts}")
    assert counts["cut"] == 0 and counts["completed"] >= 0.9 * counts["sent"], counts

    # The load stops, but for a trickle: scale-down waits its 20 s delay, then goes to one pod
    # for the trickle plus the warm spare; the streams under way on the pods removed finish.
    stopped = time.monotonic()
    with Streams(kubelet, name, load, model, 1, 60, shape, period=1.0) as tail:
        watch(60, until=lambda: replicas() == 2)
        fell = time.monotonic() - stopped
    print(f"tail: seen {seen}, fell after {fell:.1f} s")
    assert replicas() == 2, f"after the load: {seen}"
    assert fell >= 20, f"scaled down {fell:.0f} s after the load stopped; the delay is 20 s"
    assert tail.summary()["cut"] == 0


def test_a_routed_service_has_an_inference_pool_for_as_long_as_it_asks(world):
    """`spec.routing.inferencePool`: the operator keeps an InferencePool selecting the worker pods
    on their API port, where each pod serves the metrics an endpoint picker reads; pods carry the
    engine-type label the picker's config is chosen by; the pool goes when routing is turned off,
    and, through its owner reference, with the service."""
    api, kubelet, _, _ = world
    name = "chat"
    isvcs = f"/apis/ferry.dev/v1alpha1/namespaces/{NS}/inferenceservices"
    pool_path = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{name}"
    manifest = yaml.safe_load((ROOT / "examples" / "generation.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    manifest["spec"]["routing"] = {"inferencePool": True}
    status, _ = call(api.url + isvcs, "POST", manifest)
    assert status == 201

    pool = wait_for("the InferencePool", lambda: get(api, pool_path))
    assert pool["spec"]["selector"] == {"matchLabels": {"ferry.dev/inference-service": name}}
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": f"{name}-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    owner = get(api, f"{isvcs}/{name}")["metadata"]["uid"]
    assert [o["uid"] for o in pool["metadata"]["ownerReferences"]] == [owner]
    wait_for("status.inferencePool and Routed", lambda: (
        (s := get(api, f"{isvcs}/{name}").get("status") or {}).get("inferencePool") == name
        and any(c["type"] == "Routed" and c["status"] == "True" for c in s.get("conditions", []))))

    # The operator watches the pools it owns: one changed or deleted by anyone else is put back
    # by the reconcile that change triggers, not at the periodic one (5 minutes, far beyond these
    # waits).
    status, _ = call(api.url + pool_path, "PATCH", {"spec": {"targetPorts": [{"number": 9999}]}},
                     "application/merge-patch+json")
    assert status == 200
    wait_for("the pool's port put back",
             lambda: (get(api, pool_path) or {}).get("spec", {}).get("targetPorts") == [{"number": 8080}], timeout=30)
    status, _ = call(api.url + pool_path, "DELETE")
    assert status == 200
    again = wait_for("the deleted pool put back", lambda: get(api, pool_path), timeout=30)
    assert again["spec"]["selector"] == pool["spec"]["selector"], again

    # The pods the pool selects: labelled for the picker, the metrics it reads on the API port.
    pods = wait_for("a labelled pod", lambda: call(
        api.url + f"/api/v1/namespaces/{NS}/pods?labelSelector=llm-d.ai/engine-type%3Dferry")[1].get("items"))
    assert all(p["metadata"]["labels"]["ferry.dev/inference-service"] == name for p in pods)
    ip = wait_for("a ready pod", lambda: (kubelet.ready_ips(name) or [None])[0])
    with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'ferry_sequences{model="smollm2",state="waiting",version="1"} 0' in text, text[:2000]
    assert re.search(r'ferry_kv_cache_config_info\{block_size="16",model="smollm2",num_gpu_blocks="\d+"', text)

    # Routing turned off: the pool goes, and the status says so.
    status, _ = call(api.url + f"{isvcs}/{name}", "PATCH", {"spec": {"routing": {"inferencePool": False}}},
                     "application/merge-patch+json")
    assert status == 200
    wait_for("the pool deleted", lambda: get(api, pool_path) is None)
    wait_for("status without the pool", lambda: "inferencePool" not in (get(api, f"{isvcs}/{name}").get("status") or {}))

    # On again, then the service deleted: its pool, Deployment and Service go with it.
    call(api.url + f"{isvcs}/{name}", "PATCH", {"spec": {"routing": {"inferencePool": True}}},
         "application/merge-patch+json")
    wait_for("the pool again", lambda: get(api, pool_path))
    # Settled first (the label change has rolled out, the reconciles it caused are done), so that
    # no apply in flight re-creates what the garbage collector takes.
    wait_for("the rollout done", lambda: (
        (i := get(api, f"{isvcs}/{name}"))["metadata"]["generation"] == (i.get("status") or {}).get("observedGeneration")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in i["status"].get("conditions", []))
        and any(c["type"] == "Routed" and c["status"] == "True" for c in i["status"].get("conditions", []))), timeout=60)
    status, _ = call(api.url + f"{isvcs}/{name}", "DELETE")
    assert status == 200
    wait_for("the pool collected", lambda: get(api, pool_path) is None)
    assert get(api, f"/apis/apps/v1/namespaces/{NS}/deployments/{name}") is None
