"""The rest of a cluster around the emulated API: what the Deployment controller, the kubelet and
a Service would do for the operator's worker Deployments, with real ferry-sidecar processes as
the pods.

Each replica is one `ferry-sidecar` run with the Deployment's own container args, on a loopback
address of its own (127.0.0.N, the Pod's IP: the operator scrapes port 9090 of the pod IP, and the
Service port 8080). A Pod object is created for it through the API (so the operator's watches see
it), marked Ready once the sidecar answers its readiness probe, and deleted with its process when
a scale-down removes it — unready pods first, then the lowest `pod-deletion-cost`, as a
ReplicaSet chooses. The Deployment's status is reported the way the Deployment controller does.
`Traffic` is the Service: an open-loop load from `ferry-load`, split evenly across the ready pods
and re-split whenever they change; `Streams` is the same for streamed generations, re-split every
few seconds without cutting the streams under way (a Service balances connections as they open).
"""

import itertools
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

from emulator import now_rfc3339

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def call(url, method="GET", body=None, content_type="application/json"):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, method=method, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def ready(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_for(what, check, timeout=30.0, every=0.2):
    """Polls `check` until it returns something truthy; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def template_args(args):
    return [a for a in args if not a.startswith(("--listen=", "--metrics-listen="))]


class Pod:
    def __init__(self, name, ip, template, process):
        # `template`: the Deployment's args it was started from (its own addresses aside).
        self.name, self.ip, self.template, self.process = name, ip, template, process
        self.ready = False
        self.started = time.monotonic()


class Kubelet:
    def __init__(self, api, namespace, sidecar, logs, ready_after=0.0):
        # `ready_after`: seconds a pod takes to become ready at the least (a model's weights
        # loading), however soon its sidecar answers.
        self.api, self.namespace, self.sidecar, self.logs = api, namespace, sidecar, logs
        self.ready_after = ready_after
        self.pods = {}  # by deployment: [Pod]
        self.lock = threading.Lock()
        self._addresses = (f"127.0.0.{n}" for n in itertools.count(2))
        self._names = itertools.count(1)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.errors = []

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(60)
        for pods in self.pods.values():
            for pod in pods:
                pod.process.kill()
                pod.process.wait(10)

    def ready_ips(self, deployment):
        with self.lock:
            return [p.ip for p in self.pods.get(deployment, []) if p.ready]

    def _url(self, path):
        return f"{self.api}/api/v1/namespaces/{self.namespace}/{path}"

    def _run(self):
        while not self._stop.is_set():
            try:
                status, listed = call(f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments")
                for deployment in listed.get("items", []) if status == 200 else []:
                    self._sync(deployment)
            except Exception as e:  # reported by the test, which fails on any
                self.errors.append(repr(e))
            self._stop.wait(0.2)

    def _start(self, name, labels, args):
        ip = next(self._addresses)
        pod_name = f"{name}-{next(self._names)}"
        template = template_args(args)
        args = [*template, f"--listen={ip}:8080", f"--metrics-listen={ip}:9090"]
        log = open(self.logs / f"{pod_name}.log", "w")
        process = subprocess.Popen([self.sidecar, *args], stdout=log, stderr=subprocess.STDOUT)
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": self.namespace, "labels": labels},
                "spec": {"containers": [{"name": "sidecar", "image": "ferry-sidecar", "args": args}]}}
        status, _ = call(self._url("pods"), "POST", body)
        assert status == 201, status
        conditions = [{"type": "Ready", "status": "False", "lastTransitionTime": now_rfc3339()}]
        call(self._url(f"pods/{pod_name}/status"), "PATCH",
             {"status": {"phase": "Running", "podIP": ip, "conditions": conditions}},
             "application/merge-patch+json")
        return Pod(pod_name, ip, template, process)

    def _remove(self, pod):
        pod.process.terminate()
        try:
            pod.process.wait(10)
        except subprocess.TimeoutExpired:
            pod.process.kill()
        call(self._url(f"pods/{pod.name}"), "DELETE")

    def _cost(self, pod):
        status, obj = call(self._url(f"pods/{pod.name}"))
        annotations = (obj.get("metadata") or {}).get("annotations") or {} if status == 200 else {}
        return int(annotations.get(DELETION_COST, "0"))

    def _sync(self, deployment):
        name = deployment["metadata"]["name"]
        spec = deployment["spec"]
        want = spec.get("replicas", 1)
        template = spec["template"]
        labels = template["metadata"]["labels"]
        args = next(c for c in template["spec"]["containers"] if c["name"] == "sidecar")["args"]
        with self.lock:
            pods = self.pods.setdefault(name, [])
        # A new template rolls out: its pods replace the old ones (one at a time, surge first).
        stale = [p for p in pods if p.template != template_args(args)]
        if stale and all(p.ready for p in pods):
            new = self._start(name, labels, args)
            with self.lock:
                pods.append(new)
            self._remove(stale[0])
            with self.lock:
                pods.remove(stale[0])
        while len(pods) < want:
            pod = self._start(name, labels, args)
            with self.lock:
                pods.append(pod)
        if len(pods) > want:
            ranked = sorted(pods, key=lambda p: (p.ready, self._cost(p)))
            for pod in ranked[: len(pods) - want]:
                with self.lock:
                    pods.remove(pod)
                self._remove(pod)
        for pod in pods:
            if pod.process.poll() is not None:
                raise RuntimeError(f"sidecar {pod.name} at {pod.ip} exited with {pod.process.returncode}; see its log")
            loaded = time.monotonic() - pod.started >= self.ready_after
            if not pod.ready and loaded and ready(f"http://{pod.ip}:8080/v2/health/ready"):
                conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": now_rfc3339()}]
                call(self._url(f"pods/{pod.name}/status"), "PATCH", {"status": {"conditions": conditions}},
                     "application/merge-patch+json")
                with self.lock:
                    pod.ready = True
        ready_count = sum(p.ready for p in pods)
        status = {"observedGeneration": deployment["metadata"].get("generation", 1), "replicas": len(pods),
                  "updatedReplicas": len(pods), "readyReplicas": ready_count, "availableReplicas": ready_count}
        if deployment.get("status") != status:
            call(f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/status", "PATCH",
                 {"status": status}, "application/merge-patch+json")


class Background:
    """A thread that runs `_run` while a `with` block lasts, asked to stop when it ends."""

    def __init__(self):
        self.processes = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(20)


class Traffic(Background):
    """An open-loop Poisson load at `rate` req/s on `path` of the ready pods, for `seconds`."""

    def __init__(self, kubelet, deployment, load, path, rate, seconds, extra=()):
        super().__init__()
        self.kubelet, self.deployment, self.load = kubelet, deployment, load
        self.path, self.rate, self.extra = path, rate, list(extra)
        self.end = time.monotonic() + seconds

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._kill()

    def _kill(self):
        for p in self.processes:
            p.kill()
            p.wait(10)
        self.processes = []

    def _run(self):
        targets = None
        seed = itertools.count(1)
        while not self._stop.is_set() and time.monotonic() < self.end:
            now = self.kubelet.ready_ips(self.deployment)
            if now != targets and now:
                self._kill()
                targets = now
                left = max(self.end - time.monotonic(), 0.1)
                for ip in targets:
                    self.processes.append(subprocess.Popen(
                        [self.load, "run", "--url", f"http://{ip}:8080{self.path}", "--rate",
                         str(self.rate / len(targets)), "--duration", f"{int(left * 1000)}ms", "--seed", str(next(seed)),
                         "--connections", "4", *self.extra],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self._stop.wait(0.2)


class Streams(Background):
    """An open-loop Poisson load of streamed completions at `rate` req/s on the ready pods, for
    `seconds`: every `period` seconds a `ferry-load generate` per ready pod, at its share of the
    rate for that period; each runs its streams to their end. `summary()` adds up their counts."""

    def __init__(self, kubelet, deployment, load, model, rate, seconds, extra=(), period=4.0):
        super().__init__()
        self.kubelet, self.deployment, self.load, self.model = kubelet, deployment, load, model
        self.rate, self.seconds, self.extra, self.period = rate, seconds, list(extra), period

    def _run(self):
        end = time.monotonic() + self.seconds
        seed = itertools.count(1)
        while not self._stop.is_set() and time.monotonic() < end:
            targets = self.kubelet.ready_ips(self.deployment)
            span = min(self.period, end - time.monotonic())
            for ip in targets:
                self.processes.append(subprocess.Popen(
                    [self.load, "generate", "--url", f"http://{ip}:8080/v1/completions", "--model", self.model,
                     "--rate", str(self.rate / len(targets)), "--duration", f"{int(span * 1000)}ms",
                     "--seed", str(next(seed)), "--json", *self.extra],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
            self._stop.wait(span)

    def summary(self):
        """The counts of every stream sent, once all have ended."""
        total = {}
        for p in self.processes:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, p.returncode
            for key, value in json.loads(out).items():
                if key in ("sent", "completed", "refused", "cut", "unanswered", "late"):
                    total[key] = total.get(key, 0) + value
        return total
