"""A Kubernetes API for the real ferry-operator binary: PyPI kmock's emulator (objects, patches,
watches over real HTTP), with what a kube-rs controller needs that kmock 0.8 lacks filled in here:

- every write stamps `metadata.resourceVersion` (kube-runtime's watcher refuses events without
  one), `uid`, `creationTimestamp`, `namespace` and `generation` (bumped when the spec changes);
- a write that changes nothing is no new version and no event, as on a real API server (else the
  reconciler's own status patch would wake it forever);
- server-side apply creates an absent object; merge and JSON patches apply to a copy, and the
  `status` subresource is the only way to change a status (and changes nothing else);
- a missing object is a 404 with reason `NotFound` (kube's `get_opt` reads it);
- PUT replaces, with 409 Conflict on a stale `resourceVersion` (the leader Lease relies on it);
- deleting an object deletes what it owns (`ownerReferences`), as the garbage collector does;
- lists and watches honour `labelSelector`, watches `timeoutSeconds`, and a watch subscribes to
  changes before it sends the current objects, so that nothing written in between is lost.

kmock keeps the objects (`emu.objects`) and streams the watch events on its per-resource buses;
the parts above reach into its `_objects`, `_buses` and `_lock`, which is why kmock is pinned.
"""

import asyncio
import copy
import datetime
import itertools
import threading
import uuid

import aiohttp.web
import jsonpatch
import kmock
from kmock import action

# Resources whose status only its subresource writes.
WITH_STATUS = {"pods", "deployments", "services", "inferenceservices"}


def now_rfc3339():
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def matches(obj, selector):
    """A label selector of `key`, `!key`, `key=value` and `key!=value` terms."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key) == value
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def merge(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def without_version(obj):
    obj = copy.deepcopy(obj)
    obj.get("metadata", {}).pop("resourceVersion", None)
    return obj


def failure(code, reason, message):
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
              "code": code}
    return aiohttp.web.json_response(status, status=code)


class Emulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._latest = 0
        # (fieldManager, replicas) of every write that changed a Deployment's spec.replicas.
        self.replica_writes = []

    def _version(self):
        self._latest = next(self._versions)
        return str(self._latest)

    async def _handle(self, request):
        if request.resource is None:
            return await super()._handle(request)
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if request.action == action.CREATE:
            return await self._create(request, copy.deepcopy(request.data))
        if request.name is not None and request.action == action.UPDATE:
            return await self._patch(request)
        if request.name is not None and request.action == action.DELETE:
            return await self._delete(request)
        if request.name is not None and method == "PUT":
            return await self._replace(request)
        if request.name is not None and request.action == action.FETCH:
            return await self._fetch(request)
        return await super()._handle(request)

    async def _fetch(self, request):
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                # kube's get_opt reads the reason, as a real API server writes it.
                return failure(404, "NotFound", f"{request.resource.plural} {request.name} not found")
            return aiohttp.web.json_response(copy.deepcopy(self._objects[key].raw))

    def _stamp(self, obj, namespace):
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        meta["generation"] = 1
        meta["resourceVersion"] = self._version()

    async def _create(self, request, obj):
        namespace = request.namespace or (obj.get("metadata") or {}).get("namespace")
        async with self._lock:
            self._stamp(obj, namespace)
            key = (request.resource, namespace, obj["metadata"]["name"])
            if key in self._objects and not self._objects[key].deleted:
                return failure(409, "AlreadyExists", f"{obj['metadata']['name']} already exists")
            if key in self._objects:
                self._objects[key].create(obj)
            else:
                self._objects[key] = obj
            await self._buses[request.resource].put({"type": "ADDED", "object": obj})
        return aiohttp.web.json_response(obj, status=201)

    async def _store(self, request, key, old, new):
        """Stores `new` as the next version of `old` (unless nothing changed) and announces it."""
        for field in ("uid", "creationTimestamp", "namespace", "name", "generation"):
            if field in old.get("metadata", {}):
                new.setdefault("metadata", {})[field] = old["metadata"][field]
        if without_version(new) == without_version(old):
            return old
        if request.subresource is None and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        replicas = (new.get("spec") or {}).get("replicas")
        if request.resource.plural == "deployments" and replicas != (old.get("spec") or {}).get("replicas"):
            self.replica_writes.append((request.params.get("fieldManager"), replicas))
        new["metadata"]["resourceVersion"] = self._version()
        self._objects[key].history.append(new)
        await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
        return new

    def _scope(self, request, old, new):
        """What a write may change: the status through the subresource, the rest otherwise."""
        plural = request.resource.plural
        if request.subresource == "status":
            out = copy.deepcopy(old)
            if "status" in new:
                out["status"] = new["status"]
            else:
                out.pop("status", None)
            return out
        if plural in WITH_STATUS:
            new = copy.deepcopy(new)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        return new

    async def _patch(self, request):
        key = (request.resource, request.namespace, request.name)
        content_type = request.headers.get("Content-Type", "")
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                if content_type.startswith("application/apply-patch") and request.subresource is None:
                    obj = copy.deepcopy(request.data)
                    obj.setdefault("metadata", {})["name"] = request.name
                    obj.pop("status", None)
                    self._stamp(obj, request.namespace)
                    if request.resource.plural == "deployments" and "replicas" in (obj.get("spec") or {}):
                        self.replica_writes.append((request.params.get("fieldManager"), obj["spec"]["replicas"]))
                    if key in self._objects:
                        self._objects[key].create(obj)
                    else:
                        self._objects[key] = obj
                    await self._buses[request.resource].put({"type": "ADDED", "object": obj})
                    return aiohttp.web.json_response(obj, status=201)
                return failure(404, "NotFound", f"{request.resource.plural} {request.name} not found")
            old = copy.deepcopy(self._objects[key].raw)
            if isinstance(request.data, list):
                patched = jsonpatch.apply_patch(old, request.data)
            else:
                patched = merge(old, request.data)
            new = await self._store(request, key, old, self._scope(request, old, patched))
        return aiohttp.web.json_response(new)

    async def _replace(self, request):
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return failure(404, "NotFound", f"{request.resource.plural} {request.name} not found")
            old = copy.deepcopy(self._objects[key].raw)
            sent = (request.data.get("metadata") or {}).get("resourceVersion")
            if sent and sent != old["metadata"].get("resourceVersion"):
                return failure(409, "Conflict", "the object has been modified; apply your changes to the latest version")
            new = await self._store(request, key, old, self._scope(request, old, copy.deepcopy(request.data)))
        return aiohttp.web.json_response(new)

    async def _delete(self, request):
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return failure(404, "NotFound", f"{request.resource.plural} {request.name} not found")
            gone = await self._remove(key)
        return aiohttp.web.json_response(gone)

    async def _remove(self, key):
        """Deletes the object at `key`, then what it owns, as the garbage collector of a cluster
        does in the background (`ownerReferences` naming its uid). Under the lock."""
        gone = copy.deepcopy(self._objects[key].raw)
        gone["metadata"]["resourceVersion"] = self._version()
        self._objects[key].history.append(gone)
        self._objects[key].delete()
        await self._buses[key[0]].put({"type": "DELETED", "object": gone})
        uid = gone["metadata"].get("uid")
        owned = [
            k for k, obj in self._objects.items()
            if not obj.deleted and k[1] == key[1]
            and any(o.get("uid") == uid for o in (obj.raw.get("metadata") or {}).get("ownerReferences") or [])
        ]
        for k in owned:
            await self._remove(k)
        return gone

    def _current(self, request):
        selector = request.params.get("labelSelector")
        return [
            copy.deepcopy(obj.raw)
            for (resource, namespace, _), obj in self._objects.items()
            if resource == request.resource
            and not obj.deleted
            and (request.namespace is None or namespace == request.namespace)
            and matches(obj.raw, selector)
        ]

    async def _serve_list(self, request):
        async with self._lock:
            items = self._current(request)
            version = str(self._latest)
        return {"metadata": {"resourceVersion": version}, "items": items}

    async def _serve_watch(self, request):
        yield b""
        bus = self._buses[request.resource]
        # Subscribe first, then send what is there: a write in between arrives as an event.
        marker = await bus.mark()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + int(request.params.get("timeoutSeconds", 290))
        selector = request.params.get("labelSelector")
        try:
            async with self._lock:
                current = self._current(request)
            for obj in current:
                yield {"type": "ADDED", "object": obj}
            events = bus.stream(since=marker).__aiter__()
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(events.__anext__(), left)
                except (TimeoutError, StopAsyncIteration):
                    return
                obj = event.get("object") or {}
                namespace = (obj.get("metadata") or {}).get("namespace")
                if request.namespace is not None and namespace != request.namespace:
                    continue
                if matches(obj, selector):
                    yield event
        finally:
            await bus.unmark(marker)


RESOURCES = [
    "ferry.dev/v1alpha1/inferenceservices",
    "apps/v1/deployments",
    "v1/services",
    "v1/pods",
    "coordination.k8s.io/v1/leases",
    "events.k8s.io/v1/events",
    "inference.networking.k8s.io/v1/inferencepools",
]


class Api:
    """The emulator served on 127.0.0.1 from a thread of its own, with its own event loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._ready = threading.Event()

    async def _main(self):
        self.emulator = Emulator()
        for resource in RESOURCES:
            self.emulator.resources[resource] = {}
        async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1") as server:
            self.url = str(server.url).rstrip("/")
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self.thread.start()
        self._done = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        if not self._ready.wait(20):
            raise RuntimeError("the API emulator did not start")
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._done.result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(20)

    def kubeconfig(self, path, namespace="default"):
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: kmock, cluster: {{server: \"{self.url}\"}}}}]\n"
            "users: [{name: harness, user: {}}]\n"
            f"contexts: [{{name: kmock, context: {{cluster: kmock, user: harness, namespace: {namespace}}}}}]\n"
            "current-context: kmock\n"
        )
        return path
