"""A Kubernetes API server's EndpointSlice list and watch on loopback, for testing the
router's Kubernetes discovery (router/upstream/vllm_fleet/k8s_discovery.py) with the
official client pointed at it by a kubeconfig (``write_kubeconfig``).

It serves ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` as a list
(``EndpointSliceList`` with its ``resourceVersion``) and, with ``watch=true``, as a watch
stream (one JSON event per line: ADDED, MODIFIED, DELETED, or an ERROR with code 410 when
the asked version is older than ``compacted``), filtered by an equality ``labelSelector``.
The test changes the slices (``put``, ``delete``), expires the watch (``expire``), drops
every watch (``drop_watchers``: an API server restart) or refuses every request
(``refuse``: a status, 403 for a missing Role). ``requests`` records what
was asked: the kind (list or watch), the query, the bearer token.

Invariants:
    * Binds 127.0.0.1 on a free port only; ``stop`` ends it.
    * Every change bumps the resource version by one and reaches each open watch once.
"""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from unicache.testing.loopback_asgi import LoopbackAsgi


def endpoint(ip: str, pod: str, ready: bool | None = True, namespace: str = "default") -> dict:
    """One endpoint of a slice: a pod's address and its ready condition (None: absent)."""
    conditions = {} if ready is None else {"ready": ready, "serving": ready, "terminating": False}
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": pod, "namespace": namespace}}


def write_kubeconfig(path: str, server: str, token: str, namespace: str = "default") -> str:
    """A kubeconfig whose one context points at ``server`` with a bearer ``token``."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": server}}],
        "users": [{"name": "stub", "user": {"token": token}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": namespace}}],
    }
    with open(path, "w") as f:
        json.dump(config, f)  # JSON is YAML
    return path


def _matches(labels: dict, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class EndpointSliceApi:
    """See the module docstring."""

    def __init__(self, namespace: str = "default"):
        self.namespace = namespace
        self.slices: dict[str, dict] = {}
        self.version = 1
        self.compacted = 0  # a watch from an older version gets 410 Gone
        self.history: list[tuple[int, str, dict]] = []  # (version, event type, object)
        self.requests: list[dict] = []
        self.refuse = 0  # an HTTP status every request gets instead (403: the service account lacks the Role)
        self._watchers: set[asyncio.Queue] = set()
        self._stopping = False  # a watch that arrives while stopping ends at once
        self.url = ""
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self._server = LoopbackAsgi(Starlette(routes=[Route(path, self._endpointslices)]))

    async def start(self) -> "EndpointSliceApi":
        self.url = await self._server.start()
        return self

    async def stop(self) -> None:
        # NOTE: a client that reconnects between the drop and the server's stop would hold a
        # watch the stop waits for (a CI teardown hung 300 s): later watches end at once.
        self._stopping = True
        self.drop_watchers()
        await self._server.stop()

    # --- what the test changes ------------------------------------------------------------
    def put(self, name: str, endpoints: list[dict], ports: list[tuple[str, int]], labels: dict[str, str]) -> None:
        """Create or replace the slice ``name`` (ports as (name, number) pairs)."""
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.version += 1
        obj = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels, "resourceVersion": str(self.version)},
            "endpoints": endpoints, "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
        }
        self.slices[name] = obj
        self._emit(kind, obj)

    def delete(self, name: str) -> None:
        obj = self.slices.pop(name)
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        self._emit("DELETED", obj)

    def expire(self) -> None:
        """Every version so far is compacted: open watches get 410 Gone and end."""
        self.compacted = self.version
        for q in self._watchers:
            q.put_nowait(("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                                    "message": "too old resource version"}))
            q.put_nowait(None)

    def drop_watchers(self) -> None:
        for q in self._watchers:
            q.put_nowait(None)

    def watchers(self) -> int:
        return len(self._watchers)

    def _emit(self, kind: str, obj: dict) -> None:
        self.history.append((self.version, kind, obj))
        for q in self._watchers:
            q.put_nowait((kind, obj))

    # --- the API ------------------------------------------------------------------------
    async def _endpointslices(self, request: Request) -> Response:
        q = request.query_params
        selector = q.get("labelSelector", "")
        watching = q.get("watch", "").lower() in ("true", "1")  # the client sends "True", as Go's ParseBool reads
        self.requests.append({"kind": "watch" if watching else "list", "query": dict(q),
                              "authorization": request.headers.get("authorization", "")})
        if self.refuse:
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": self.refuse,
                                 "reason": "Forbidden", "message": "endpointslices is forbidden"}, status_code=self.refuse)
        if not watching:
            items = [s for s in self.slices.values() if _matches(s["metadata"]["labels"], selector)]
            return JSONResponse({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                 "metadata": {"resourceVersion": str(self.version)}, "items": items})
        since = int(q.get("resourceVersion") or 0)
        timeout_s = float(q.get("timeoutSeconds") or 300)
        queue: asyncio.Queue = asyncio.Queue()
        if since < self.compacted:
            queue.put_nowait(("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}))
            queue.put_nowait(None)
        else:
            for version, kind, obj in self.history:
                if version > since:
                    queue.put_nowait((kind, obj))
        self._watchers.add(queue)
        if self._stopping:
            queue.put_nowait(None)

        async def events():
            try:
                async with asyncio.timeout(timeout_s):
                    while (item := await queue.get()) is not None:
                        kind, obj = item
                        if kind != "ERROR" and not _matches(obj["metadata"]["labels"], selector):
                            continue
                        yield json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            except TimeoutError:
                pass
            finally:
                self._watchers.discard(queue)

        return StreamingResponse(events(), media_type="application/json")
