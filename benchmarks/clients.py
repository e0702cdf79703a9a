"""The benchmarking clients people point at an OpenAI-compatible server, run against Ferry: vLLM's
guidellm, NVIDIA's aiperf and LiteLLM, each in a short run of its ordinary invocation, against
the sidecar on the sim-llm engine and on the llm engine (SmolLM2). Writes benchmarks/clients.md.

    python clients.py SIDECAR_BIN SMOLLM2_GGUF TOKENIZER_DIR CLIENTS_VENV OUT.md

The clients bring PyTorch and transformers (several GB): scripts/bench-clients.sh installs them
into .cache/clients-venv, apart from the test environment. They need a Hugging Face tokenizer to
make prompts of a given length; with no hub to reach, the test model's (all-MiniLM-L6-v2) serves,
so their token counts are that tokenizer's, not the served model's. The sidecar runs with
generous deadlines (60 s): the clients send no deadline of their own and aiperf no max_tokens,
and a benchmark of throughput should not be refused for the default 200 ms budget.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sidecar_bin, gguf, tokenizer, venv, out = sys.argv[1:6]
bin_dir = Path(venv) / "bin"
# Not HF_HUB_OFFLINE: aiperf's offline mode looks a local tokenizer path up in the hub's cache and
# fails; online, a local path loads as it is (a hub request fails at once: no name resolves).
ENV = {k: v for k, v in os.environ.items() if not k.startswith("HF_HUB_OFFLINE")}
ENV.update({"HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"})


def start(engine):
    args = [sidecar_bin, f"--engine={engine}", "--model=m", "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
            "--latency-budget=60s", "--max-timeout=60s", "--ttft-budget=30s", "--max-inter-token-latency=5s"]
    if engine == "llm":
        args += [f"--model-source={gguf}", "--device=cpu"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    match = re.search(r"listening on (http://[\d.:]+)", line)
    if not match:
        process.kill()
        raise RuntimeError(f"the sidecar did not start: {line!r}")
    base = match.group(1)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return process, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{engine}: not ready in 300 s")
        time.sleep(0.2)


def run(args, timeout=600):
    started = time.monotonic()
    done = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def guidellm(base, work):
    path = work / "guidellm.json"
    code, log, took = run([
        str(bin_dir / "guidellm"), "run", f"--backend=kind=openai_http,target={base}",
        "--profile=kind=synchronous", "--constraint=kind=max_requests,count=10",
        "--data=kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        f"--tokenizer=kind=huggingface_auto,model={tokenizer}", "--disable-progress",
        f"--output=kind=json,path={path}",
    ])
    if code != 0 or not path.exists():
        return code, "–", "–", took, log
    m = json.loads(path.read_text())["benchmarks"][0]["metrics"]
    ok = int(m["request_totals"]["successful"])
    rate = m["requests_per_second"]["successful"]["mean"]
    ttft = m["time_to_first_token_ms"]["successful"]["median"]
    return code, f"{ok} of 10", f"{rate:.2f} req/s, TTFT median {ttft:.0f} ms", took, log


def aiperf(base, work):
    artifacts = work / "aiperf"
    code, log, took = run([
        str(bin_dir / "aiperf"), "profile", "--model", "m", "--url", base, "--endpoint-type", "chat", "--streaming",
        "--request-count", "10", "--concurrency", "2", "--tokenizer", tokenizer, "--ui", "none",
        "--artifact-dir", str(artifacts),
    ])
    result = artifacts / "profile_export_aiperf.json"
    if code != 0 or not result.exists():
        return code, "–", "–", took, log
    r = json.loads(result.read_text())
    ok = int(r["request_count"]["avg"])
    figures = (f"{r['request_throughput']['avg']:.2f} req/s, TTFT p50 {r['time_to_first_token']['p50']:.0f} ms, "
               f"{r['output_token_throughput']['avg']:.0f} tokens/s")
    return code, f"{ok} of 10", figures, took, log


LITELLM = """
import sys, litellm
base = sys.argv[1]
ask = dict(model="openai/m", api_base=base + "/v1", api_key="unused", max_tokens=16,
           messages=[{"role": "user", "content": "Name three colours."}])
whole = litellm.completion(**ask)
text = whole.choices[0].message.content
streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**ask, stream=True))
assert text and streamed, (text, streamed)
print(f"{whole.usage.completion_tokens} tokens whole; {len(streamed)} characters streamed")
"""


def litellm(base, work):
    code, log, took = run([str(bin_dir / "python"), "-c", LITELLM, base])
    last = log.strip().splitlines()[-1] if log.strip() else ""
    return code, "2 of 2" if code == 0 else "–", last if code == 0 else "–", took, log


rows, failed = [], []
with tempfile.TemporaryDirectory() as tmp:
    for engine in ["sim-llm", "llm"]:
        process, base = start(engine)
        try:
            for name, client in [("guidellm", guidellm), ("aiperf", aiperf), ("LiteLLM", litellm)]:
                work = Path(tmp) / engine / name
                work.mkdir(parents=True)
                code, answered, figures, took, log = client(base, work)
                rows.append(f"| {engine} | {name} | {'ok' if code == 0 else f'failed ({code})'} | {answered} | {figures} | {took:.0f} |")
                print(rows[-1], flush=True)
                if code != 0:
                    failed.append(f"{engine} {name}:\n{log[-3000:]}")
        finally:
            process.terminate()
            process.wait(timeout=30)

versions = subprocess.run([str(bin_dir / "pip"), "freeze"], capture_output=True, text=True).stdout
pinned = [line for line in versions.splitlines() if re.match(r"(guidellm|aiperf|litellm)==", line, re.I)]
Path(out).write_text(
    "# The benchmarking clients against Ferry\n\n"
    "Regenerate with `scripts/bench-clients.sh`. Each client's ordinary invocation, a short run "
    f"({', '.join(pinned)}), against `ferry-sidecar` on 127.0.0.1 with the `sim-llm` engine and with the `llm` "
    "engine on SmolLM2-135M-Instruct (Q4_1, 2 CPU threads): guidellm's synchronous profile, 10 requests of "
    "64 synthetic prompt tokens and 16 output tokens; aiperf's streamed chat profile, 10 requests, 2 at a time "
    "(no max_tokens: the model's own length); LiteLLM's `completion` whole and streamed. Token counts are "
    "the all-MiniLM-L6-v2 tokenizer's (no hub to fetch the served model's from). PyPI `inference-perf` needs "
    "Python 3.12 or later, which this machine (Debian 12, Python 3.11) does not have.\n\n"
    "| engine | client | run | answered | figures | seconds |\n|---|---|---|---|---|---|\n"
    + "\n".join(rows) + "\n"
)
if failed:
    print("\n\n".join(failed), file=sys.stderr)
    sys.exit(1)
