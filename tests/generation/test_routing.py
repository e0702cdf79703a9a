"""What an endpoint picker (the Gateway API Inference Extension's, the llm-d router's) reads from a
Ferry pod: the real sidecar on sim-llm scraped at `/metrics` on its API port (the port its
InferencePool targets) while streams run, parsed by two strict parsers (promtool's and
prometheus_client's), and the names and labels of the engine config the Helm chart ships looked up
in that scrape with the values the client itself can tell."""

import http.client
import json
import pathlib
import re
import subprocess
import time

import helm_python as helm
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from generation_sidecar import MODEL, Sidecar

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKS, BLOCK_SIZE, STREAMS = 96, 16, 3


@pytest.fixture(scope="module")
def sidecar():
    # Steps of 20 ms: a 400-token answer streams for seconds, so the streams opened below are
    # still running when the pod is scraped.
    s = Sidecar(kv_blocks=BLOCKS, kv_block_size=BLOCK_SIZE, sim_step_time="20ms")
    yield s
    s.stop()


def engine_config():
    """The `ferry` entry of the chart's EndpointPickerConfig (the picker on, for pool `chat`)."""
    values = {"routing": {"endpointPicker": {"enabled": True, "pool": "chat", "image": {"tag": "v0"}}}}
    out = helm.Chart.load(str(ROOT / "charts" / "ferry")).render(values, name="ferry", namespace="ml", is_install=True)
    documents = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    maps = [d for d in documents if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(next(m for m in maps if m["metadata"]["name"] == "chat-epp")["data"]["config.yaml"])
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    assert extractor["engineLabelKey"] == "llm-d.ai/engine-type"
    return next(e for e in extractor["engineConfigs"] if e["name"] == "ferry")


def spec(text):
    """A picker's metric spec, `name` or `name{label=value,...}`, as (name, {label: value})."""
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", text)
    assert m, text
    labels = dict(kv.split("=", 1) for kv in filter(None, (m.group(2) or "").split(",")))
    return m.group(1), {k.strip(): v.strip().strip('"') for k, v in labels.items()}


def samples(exposition, name, labels):
    return [
        s for f in text_string_to_metric_families(exposition) for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def stream(sidecar):
    """A running stream's connection. A 503 is admission's early "no" — its step-time estimate,
    taken at load, can be high on a busy machine until steps teach it better — and is asked again
    after the Retry-After it names, as a client would; this test is about the scrape."""
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": 400, "stream": True}
    for _ in range(30):
        conn = http.client.HTTPConnection(sidecar.address, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 503:
            assert response.status == 200, response.read()
            return conn, response
        retry = float(response.getheader("retry-after", "1"))
        print("refused:", response.read().decode(), "retry after", retry)
        conn.close()
        time.sleep(min(retry, 2.0))
    raise AssertionError("refused 30 times")


def test_the_api_port_serves_what_the_charts_engine_config_names(sidecar):
    streams = []
    for _ in range(STREAMS):
        conn, response = stream(sidecar)
        # The first token: this stream is running.
        assert response.readline().startswith(b"data:")
        streams.append(conn)
    conn = http.client.HTTPConnection(sidecar.address, timeout=10)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/plain; version=0.0.4")
    exposition = response.read().decode()
    for c in streams:
        c.close()

    # Prometheus' own parser and linter take it as it is.
    check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    families = {f.name for f in text_string_to_metric_families(exposition)}

    config = engine_config()
    found = {}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        name, labels = spec(config[key])
        assert name in families or name.removesuffix("_info") in families, (key, name, sorted(families))
        hits = samples(exposition, name, labels)
        assert len(hits) == 1, (key, config[key], hits)
        found[key] = hits[0]
    assert config["loraSpec"] == ""  # Ferry serves no adapters

    # What the client can tell: its streams are running and nothing waits.
    assert found["runningRequestsSpec"].value == STREAMS
    assert found["queuedRequestsSpec"].value == 0
    # The KV cache as the sidecar was started, and its usage as used over all blocks.
    info = found["cacheInfoSpec"].labels
    assert (int(info["block_size"]), int(info["num_gpu_blocks"])) == (BLOCK_SIZE, BLOCKS)
    used = samples(exposition, "ferry_kv_blocks", {"state": "used"})[0].value
    free = samples(exposition, "ferry_kv_blocks", {"state": "free"})[0].value
    assert used + free == BLOCKS and used >= STREAMS
    assert found["kvUsageSpec"].value == pytest.approx(used / BLOCKS)
