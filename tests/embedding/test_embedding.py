"""The embedding engine against an independent float64 reference, through real clients: plain
OIP JSON, the OpenAI Python client and the Triton HTTP client, all over real HTTP."""

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from openai import OpenAI, BadRequestError

from conftest import MODEL_NAME, Sidecar, model_dir, sidecar_binary
from reference import cosines

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Deadlines shape batching: a batch leaves when it is full, when its oldest request has waited "
    "long enough, or when waiting longer would break a promise.",
    "Kubernetes schedules GPU pods.",
    "Il pleut à Paris aujourd'hui. 東京は晴れです。",
    "",
]


def post(url, body, headers=None):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def oip(sidecar, texts):
    status, body = post(
        f"{sidecar.url}/v2/models/{MODEL_NAME}/infer",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]},
    )
    assert status == 200, body
    (out,) = body["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("embedding", "FP32", [len(texts), 384])
    return np.array(out["data"], dtype=np.float64).reshape(len(texts), 384)


@pytest.fixture(scope="module")
def expected(reference):
    return reference.embed(SENTENCES)


def test_cpu_path_matches_the_float64_reference(sidecar, expected):
    got = oip(sidecar, SENTENCES)
    sims = cosines(got, expected)
    assert sims.min() >= 0.9999, sims
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_padding_does_not_change_an_embedding(sidecar, expected):
    # Alone, and in a batch with a much longer sentence: the same vector.
    alone = oip(sidecar, [SENTENCES[0]])
    together = oip(sidecar, [SENTENCES[0], SENTENCES[4]])
    assert cosines(alone[0], together[0]) >= 0.99999
    assert cosines(alone[0], expected[0]) >= 0.9999


def test_meaning_survives(sidecar):
    e = oip(sidecar, SENTENCES[:4])
    sims = e @ e.T
    # "eating food" is closer to "eating bread" than to "carrying a baby" or "riding a horse".
    assert sims[0, 1] > sims[0, 2] + 0.2 and sims[0, 1] > sims[0, 3] + 0.2, sims


@pytest.mark.parametrize("encoding", ["base64", "float"])
def test_openai_client(sidecar, reference, expected, encoding):
    client = OpenAI(base_url=f"{sidecar.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = {} if encoding == "base64" else {"encoding_format": "float"}  # the client's default is base64
    response = client.embeddings.create(model=MODEL_NAME, input=SENTENCES, **kwargs)
    got = np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
    assert got.shape == (len(SENTENCES), 384)
    assert cosines(got, expected).min() >= 0.9999
    assert response.model == MODEL_NAME
    # usage counts the tokens the model read: [CLS] + word pieces + [SEP] per text.
    assert response.usage.prompt_tokens == sum(len(reference.tokens(t)) for t in SENTENCES)


def test_openai_client_single_string_and_errors(sidecar, expected):
    client = OpenAI(base_url=f"{sidecar.url}/v1", api_key="unused", max_retries=0, timeout=120)
    one = client.embeddings.create(model=MODEL_NAME, input=SENTENCES[2])
    assert len(one.data) == 1 and cosines(one.data[0].embedding, expected[2]) >= 0.9999
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model=MODEL_NAME, input="x", dimensions=128)
    assert "'dimensions' is 128" in str(e.value)
    status, body = post(f"{sidecar.url}/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["type"] == "not_found_error" and "unknown model 'nope'" in body["error"]["message"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_triton_http_client(sidecar, expected, binary):
    # binary=True is the client's default: Triton's binary tensor data extension both ways.
    client = triton.InferenceServerClient(url=sidecar.address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL_NAME)
    meta = client.get_model_metadata(MODEL_NAME)
    assert meta["inputs"][0]["name"] == "text" and meta["outputs"][0]["shape"] == [-1, 384]
    text = triton.InferInput("text", [len(SENTENCES), 1], "BYTES")
    text.set_data_from_numpy(np.array(SENTENCES, dtype=object).reshape(-1, 1), binary_data=binary)
    result = client.infer(MODEL_NAME, [text], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)])
    got = result.as_numpy("embedding")
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    assert cosines(got, expected).min() >= 0.9999
    # No outputs named: the client asks for all of them as binary.
    everything = client.infer(MODEL_NAME, [text]).as_numpy("embedding")
    assert np.array_equal(everything, got)


def test_long_inputs_are_truncated_or_refused(reference):
    long_text = "word " * 600  # 600 pieces + [CLS] + [SEP]: past the model's 256
    truncating = Sidecar()
    refusing = Sidecar(long_inputs="refuse")
    try:
        got = oip(truncating, [long_text])
        assert cosines(got[0], reference.embed_one(long_text)) >= 0.9999  # the reference truncates too
        status, body = post(
            f"{refusing.url}/v2/models/{MODEL_NAME}/infer",
            {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["short", long_text]}]},
        )
        assert status == 400
        assert "text[1] is 602 tokens; this model takes at most 256" in body["error"], body
        # The refusing sidecar still serves what fits.
        assert cosines(oip(refusing, ["short"])[0], reference.embed_one("short")) >= 0.9999
    finally:
        truncating.stop()
        refusing.stop()


def test_bad_oip_inputs_name_the_field(sidecar):
    url = f"{sidecar.url}/v2/models/{MODEL_NAME}/infer"
    cases = [
        ({"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}, "input 'text' has datatype FP32; it must be BYTES"),
        ({"name": "txt", "datatype": "BYTES", "shape": [1], "data": ["a"]}, "input 'txt' is not an input of this model"),
        ({"name": "text", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}, "it must be [rows] or [rows, 1]"),
    ]
    for tensor, message in cases:
        status, body = post(url, {"inputs": [tensor]})
        assert status == 400 and message in body["error"], body


def test_admission_prices_a_request_by_its_tokens():
    # The batch-time estimate is calibrated at start-up and learns from every batch: a short text
    # fits a 1 s budget many times over, 64 texts of 256 tokens each take several seconds on the
    # CPU, and are refused at once (503) rather than answered late.
    s = Sidecar(latency_budget="1s", max_batch_size=64)
    try:
        url = f"{s.url}/v2/models/{MODEL_NAME}/infer"
        status, body = post(url, {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["short"]}]})
        assert status == 200, body
        long_texts = ["word " * 300] * 64
        status, body = post(url, {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [64], "data": long_texts}]})
        assert status == 503 and "deadline cannot be met" in body["error"], body
    finally:
        s.stop()


def test_a_model_that_cannot_load_stops_the_sidecar(tmp_path):
    # config.json is read at start-up; the weights load in the background, and when they cannot
    # the sidecar exits non-zero naming the file, rather than staying up unready forever.
    for name in ["config.json", "tokenizer.json"]:
        shutil.copy(model_dir() / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    done = subprocess.run(
        [str(sidecar_binary()), "--engine=cuda", "--device=cpu", f"--model-source={tmp_path}",
         "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done
    assert "cannot load the model" in done.stderr and "model.safetensors" in done.stderr, done.stderr


def test_a_large_request_is_checked_off_the_runtime_and_answered(sidecar, reference):
    # 8 texts of 10 kB (80 kB: checked on the blocking pool), each truncated to 256 tokens.
    texts = ["word " * 2000] * 8
    got = oip(sidecar, texts)
    assert cosines(got, np.tile(reference.embed_one("word " * 600), (8, 1))).min() >= 0.9999


def test_weights_stored_as_f16_serve_like_the_original(tmp_path, expected):
    # scripts/f16-weights.py halves the model for carrying (scripts/gpu-pack.sh); the loader
    # reads F16 and computes in F32.
    for name in ["config.json", "tokenizer.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(model_dir() / name, tmp_path / name)
    original = model_dir() / "model.safetensors"
    half = tmp_path / "model.safetensors"
    script = Path(__file__).resolve().parents[2] / "scripts/f16-weights.py"
    subprocess.run([sys.executable, str(script), str(original), str(half)], check=True, timeout=120)
    with open(half, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {t["dtype"] for name, t in header.items() if name != "__metadata__"}
    assert "F16" in dtypes and "F32" not in dtypes, dtypes  # integer buffers (position_ids) stay
    assert half.stat().st_size < 0.51 * original.stat().st_size
    s = Sidecar(model_source=tmp_path)
    try:
        assert cosines(oip(s, SENTENCES), expected).min() >= 0.9999
    finally:
        s.stop()
