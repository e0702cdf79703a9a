"""A real ferry-sidecar process serving the sim-llm engine over real HTTP on 127.0.0.1, and
OpenAI's own Python client pointed at it. (Not a conftest.py: the embedding tests import their
own conftest by name, and pytest keeps one module of that name.)"""

import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"


def sidecar_binary():
    path = Path(os.environ.get("FERRY_SIDECAR_BIN", ROOT / "target/debug/ferry-sidecar"))
    if not path.exists():
        pytest.fail(f"{path} not found: build it with `cargo build -p ferry-sidecar` (scripts/test.sh does)")
    return path


class Sidecar:
    """A ferry-sidecar process on the sim-llm engine; `flags` override the defaults (another
    `engine` drops the sim settings)."""

    def __init__(self, wait_ready=True, **flags):
        settings = {
            "engine": "sim-llm",
            "model": MODEL,
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "sim_step_time": "5ms",
            "sim_prefill_per_token": "20us",
            "sim_decode_per_seq": "100us",
            # Generous: CI machines are noisy (the step time the sidecar learns there can be three
            # times the configured one), and most of these tests check answers, not speed.
            "latency_budget": "60s",
            "ttft_budget": "10s",
            "max_inter_token_latency": "1s",
            **flags,
        }
        if settings["engine"] != "sim-llm":
            settings = {k: v for k, v in settings.items() if not k.startswith("sim_")}
        args = [str(sidecar_binary())] + [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"listening on http://([\d.:]+) \(metrics on http://([\d.:]+)\)", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"ferry-sidecar did not start: {line!r} {self.process.stderr.read()}")
        self.address, self.metrics_address = match.groups()
        self.url = f"http://{self.address}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # stderr is read as it comes (so that its pipe never fills), kept for the errors below.
        self.log, self.loaded = [], threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if wait_ready:
            self.wait_ready()

    def _read_log(self):
        for line in self.process.stderr:
            self.log.append(line)
            if "model loaded; ready" in line:
                self.loaded.set()

    def wait_ready(self, timeout=300):
        """Waits for the model to be ready: at once for sim-llm; the llm engine loads in the
        background and says on stderr when it is ready (waited for rather than polled)."""
        if "--engine=llm" in self.process.args:
            deadline = time.monotonic() + timeout
            while not self.loaded.wait(0.5):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = "".join(self.log[-20:])
                    raise RuntimeError(f"ferry-sidecar's model was not ready (exit {self.process.poll()}):\n{log}")
        with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=30) as r:
            assert r.status == 200

    def metrics(self):
        """The sidecar's metrics of the served model, as {name{labels}: value} without the model labels."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or f'model="{MODEL}"' not in line:
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'(model|version)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            values[name] = float(value)
        return values

    def wait_for(self, condition, what, timeout=20.0):
        """Polls the metrics until `condition(metrics)` holds; the sidecar's own figures say when."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout} s; metrics {m}")
            time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
