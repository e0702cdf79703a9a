"""The built-in decoder's sampling controls and log-probabilities against llama.cpp's server (PyPI
xllamacpp) on the same weights at the same precision: SmolLM2-135M-Instruct dequantized to F32
(benchmarks/llm/f32_gguf.py, PyPI gguf's dequantizers), both KV caches in f32, llama.cpp's
attention without flash attention (whose CPU kernel rounds queries to f16). Greedy, each
answer's tokens must be the same and every log-probability within 1e-3 (measured: 2.3e-4 at most).

Where the two define a control alike, it is compared here: logit_bias (added to the logits,
greedy included), top_k (1 at temperature 1 is the greedy answer), and the repetition penalty
(both divide a positive logit and multiply a negative one of every token seen; llama.cpp's
window, the last 64 tokens of prompt and answer, holds all of these short answers, so it is
vLLM's prompt-and-answer set). Log-probabilities are the model's own in both, before bias and
penalties. Where they differ — presence and frequency penalties, which llama.cpp counts over the
prompt too and vLLM (and Ferry) over the answer alone — Ferry's are held to transformers'
reference logits instead (tests/generation/test_llm.py)."""

import json
import subprocess
import sys
import threading

import pytest

from test_upstream import HERE, MODEL, ROOT, Llama, Sidecar, free_port, gguf

PROMPTS = ["The capital of France is", "Once upon a time", "The three primary colors are"]
TOLERANCE = 1e-3
# The largest difference seen, printed at the end (pytest -s).
WORST = [0.0]


class ExactLlama(Llama):
    """llama.cpp's server on `path`, KV cache in f32, no flash attention."""

    def __init__(self, path, port):
        self.path = path
        super().__init__(port, parallel=2)

    def start(self):
        args = [sys.executable, str(HERE / "llama_server.py"), str(self.path), str(self.port), "2", "exact"]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"llama server did not start: {line!r}")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    f32 = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/llm/f32_gguf.py"), str(gguf()), str(f32)], check=True,
                   stdout=subprocess.DEVNULL)
    llama = ExactLlama(f32, free_port())
    ferry = Sidecar(None, engine="llm", model_source=f32, device="cpu", kv_cache_dtype="f32")
    yield llama, ferry
    ferry.stop()
    llama.kill()
    f32.unlink()


def both(servers, prompt, **controls):
    """Each server's greedy answer to `prompt` under `controls` (Ferry's names; llama.cpp's where
    they differ): a list of (token, logprob, {token: logprob} of the top 5) per token."""
    llama, ferry = servers
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 5, **controls}
    theirs_body = dict(body)
    if "repetition_penalty" in theirs_body:
        theirs_body["repeat_penalty"] = theirs_body.pop("repetition_penalty")
    theirs = [
        (c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
        for c in llama.complete(**theirs_body)["choices"][0]["logprobs"]["content"]
    ]
    openai_fields = {k: v for k, v in body.items() if k not in ("top_k", "repetition_penalty")}
    vllm_fields = {k: v for k, v in body.items() if k in ("top_k", "repetition_penalty")}
    lp = ferry.client.completions.create(model=MODEL, **openai_fields, extra_body=vllm_fields).choices[0].logprobs
    ours = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    return ours, theirs


def assert_same(ours, theirs, what):
    assert [t for t, _, _ in ours] == [t for t, _, _ in theirs], what
    for i, ((token, ours_lp, ours_top), (_, theirs_lp, theirs_top)) in enumerate(zip(ours, theirs)):
        WORST[0] = max(WORST[0], abs(ours_lp - theirs_lp))
        assert abs(ours_lp - theirs_lp) <= TOLERANCE, (what, i, token, ours_lp, theirs_lp)
        for t in set(ours_top) & set(theirs_top):
            assert abs(ours_top[t] - theirs_top[t]) <= TOLERANCE, (what, i, t, ours_top[t], theirs_top[t])
        assert len(set(ours_top) & set(theirs_top)) >= 4, (what, i, ours_top, theirs_top)


def test_greedy_answers_and_their_logprobs_are_llama_cpps(servers):
    for prompt in PROMPTS:
        ours, theirs = both(servers, prompt)
        assert_same(ours, theirs, prompt)


def test_logit_bias_top_k_and_the_repetition_penalty_act_as_in_llama_cpp(servers):
    llama, _ = servers
    for prompt in PROMPTS:
        greedy, _ = both(servers, prompt)
        # Ban the greedy first token (its id as llama.cpp names it) and favour a token slightly:
        # the answer changes, the same way in both.
        first = llama.complete(prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
        banned = first["choices"][0]["logprobs"]["content"][0]["id"]
        favoured = "13" if banned != 13 else "30"
        ours, theirs = both(servers, prompt, logit_bias={str(banned): -100, favoured: 1.5})
        assert_same(ours, theirs, f"{prompt} with logit_bias")
        assert ours[0][0] != greedy[0][0], "the banned token is not drawn"
        # top_k 1 leaves only the most likely token, at any temperature.
        ours, theirs = both(servers, prompt, top_k=1, temperature=1.0, seed=3)
        assert_same(ours, theirs, f"{prompt} with top_k 1")
        assert [t for t, _, _ in ours] == [t for t, _, _ in greedy]
        # The repetition penalty: the same set of seen tokens in both (under 64 in all).
        ours, theirs = both(servers, prompt, repetition_penalty=1.5)
        assert_same(ours, theirs, f"{prompt} with repetition_penalty 1.5")
        assert [t for t, _, _ in ours] != [t for t, _, _ in greedy], "a penalty of 1.5 changes these answers"
    print(f"largest logprob difference from llama.cpp: {WORST[0]:.2e}")
