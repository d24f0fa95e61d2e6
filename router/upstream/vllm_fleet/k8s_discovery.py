"""Kubernetes discovery of vLLM backends: the ready endpoints of the EndpointSlices a label
selector picks in a namespace, listed then watched through the official ``kubernetes``
client, so pods join the router's fleet as they become ready and leave as they stop being
ready or go.

``backend_discovery`` is ``k8s://NAMESPACE?selector=SELECTOR&port=P[&kv-events=P][&replay=P]``:

* ``NAMESPACE``: where the slices are (empty, ``k8s://?...``: the router pod's own
  namespace, else ``default``);
* ``selector``: a Kubernetes label selector of EndpointSlices (``app=vllm,tier!=canary``).
  The EndpointSlice controller labels each slice ``kubernetes.io/service-name=<Service>``
  and copies the Service's own labels onto it, so either picks a Service's pods;
* ``port``, ``kv-events``, ``replay``: the endpoint's HTTP, KV events and replay ports, each
  a number or the name of a port the slice lists (a Service port named ``http``).

Each ready endpoint address is a backend with the id of the pod behind it (its
``targetRef``; ``vllm-<ip>-<port>`` without one) at ``http://ip:port``. The client reads
the router pod's service account in a cluster (``KUBERNETES_SERVICE_HOST`` set), else the
kubeconfig (``KUBECONFIG``, ``~/.kube/config``); it needs get, list and watch on
``endpointslices.discovery.k8s.io`` in the namespace (the chart's Role).

Invariants:
    * The backends handed on are exactly the ready endpoints of the slices the latest list
      and the watch events after it describe (an endpoint whose ``ready`` condition is
      absent counts as ready, as Kubernetes documents).
    * A failed list or watch changes nothing (an API server restart does not empty the
      fleet): it is logged once per distinct error and retried with a bounded backoff; a
      watch whose resource version expired (410 Gone) lists again at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from unicache.plumbing.errors import UsageError
from unicache.router.upstream.vllm_fleet.spec import BackendSpec

log = logging.getLogger(__name__)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_KEYS = {"selector", "port", "kv-events", "replay"}


def _port_value(value: str) -> int | str:
    return int(value) if value.isdigit() else value


class K8sDiscovery:
    """A parsed ``k8s://`` ``backend_discovery`` value (see the module docstring).

    Args:
        value: the setting.
        watch_timeout_s: each watch call ends after this long and is resumed from its last
            resource version (bounds how long a silently dropped connection goes unseen).
        max_backoff_s: bound of the retry interval after a failed list or watch.
    """

    def __init__(self, value: str, watch_timeout_s: float = 300.0, max_backoff_s: float = 30.0):
        parts = urlsplit(value)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = set(query) - _KEYS
        usage = "expected k8s://NAMESPACE?selector=LABEL_SELECTOR&port=PORT[&kv-events=PORT][&replay=PORT]"
        if parts.scheme != "k8s" or parts.port or parts.path.strip("/") or unknown:
            raise UsageError(f"backend_discovery {value!r}: {usage}" + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""))
        for key in ("selector", "port"):
            if not query.get(key):
                raise UsageError(f"backend_discovery {value!r}: {key}= is required ({usage})")
        self.namespace = parts.hostname or ""
        self.selector = query["selector"]
        self.port = _port_value(query["port"])
        self.events_port = _port_value(query["kv-events"]) if query.get("kv-events") else None
        self.replay_port = _port_value(query["replay"]) if query.get("replay") else None
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s

    def resolved_namespace(self) -> str:
        """The namespace to watch: the given one, else the pod's own, else ``default``."""
        if self.namespace:
            return self.namespace
        try:
            with open(NAMESPACE_FILE) as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"

    # --- slices -> backends -------------------------------------------------------------
    def specs(self, slices: dict[str, Any]) -> dict[str, BackendSpec]:
        """The backends of the ready endpoints of ``slices`` (name -> ``V1EndpointSlice``)."""
        out: dict[str, BackendSpec] = {}
        for name in sorted(slices):
            sl = slices[name]
            ports = {p.name or "": p.port for p in sl.ports or () if p.port}
            http = self._port(ports, self.port)
            if http is None:
                log.warning("backend discovery: EndpointSlice %s has no port %r; its endpoints are skipped", name, self.port)
                continue
            events = self._port(ports, self.events_port)
            replay = self._port(ports, self.replay_port)
            for ep in sl.endpoints or ():
                cond = ep.conditions
                if cond is not None and cond.ready is False:
                    continue
                for ip in (ep.addresses or ())[:1]:  # an endpoint's addresses are one pod's (fungible)
                    host = f"[{ip}]" if ":" in ip else ip
                    ref = ep.target_ref
                    rid = ref.name if ref is not None and ref.name else f"vllm-{ip}-{http}"
                    out[rid] = BackendSpec(
                        rid, f"http://{host}:{http}",
                        f"tcp://{host}:{events}" if events else "", f"tcp://{host}:{replay}" if replay else "",
                    )
        return out

    @staticmethod
    def _port(ports: dict[str, int], want: int | str | None) -> int | None:
        if want is None or isinstance(want, int):
            return want
        return ports.get(want)

    # --- the watch ------------------------------------------------------------------------
    async def follow(self, reconcile: Callable[[dict[str, BackendSpec]], Awaitable[None]]) -> None:
        """List and watch forever, calling ``reconcile`` with the backends after every
        change (runs until cancelled)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        watcher = _SliceWatcher(self, lambda snapshot: loop.call_soon_threadsafe(queue.put_nowait, snapshot))
        watcher.start()
        try:
            while True:
                snapshot = await queue.get()
                while not queue.empty():  # only the latest state matters
                    snapshot = queue.get_nowait()
                await reconcile(self.specs(snapshot))
        finally:
            watcher.stop()


def api_client():
    """The official client's ``ApiClient``: the pod's service account in a cluster, else the
    kubeconfig (``KUBECONFIG`` or ``~/.kube/config``)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        # NOTE: KUBECONFIG read now: the client's own default is read once, at its import.
        config.load_kube_config(os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config"), client_configuration=cfg)
    return client.ApiClient(cfg)


class _SliceWatcher:
    """Lists then watches the slices in one daemon thread and hands every new state (name
    -> slice) to ``publish``.

    NOTE: a thread, because the official client is synchronous; it is one per router, and
    ``stop`` shuts its watch's socket so the thread ends at once."""

    def __init__(self, discovery: K8sDiscovery, publish: Callable[[dict[str, Any]], None]):
        self.d = discovery
        self.publish = publish
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, name="router-k8s-discovery", daemon=True)
        self._last_error = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _problem(self, what: str) -> None:
        if what != self._last_error:
            log.warning("backend discovery: %s; keeping the backends found so far and retrying", what)
            self._last_error = what

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        d = self.d
        ns = d.resolved_namespace()
        backoff = 0.5
        api = None
        while not self._stop.is_set():
            try:
                if api is None:
                    api = client.DiscoveryV1Api(api_client())
                listed = api.list_namespaced_endpoint_slice(ns, label_selector=d.selector, _request_timeout=10)
                slices = {s.metadata.name: s for s in listed.items}
                version = listed.metadata.resource_version
                self.publish(dict(slices))
                if self._last_error:
                    log.info("backend discovery: listing EndpointSlices in %s works again", ns)
                    self._last_error = ""
                backoff = 0.5
                while not self._stop.is_set():
                    self._watch = w = watch.Watch()
                    started, events = time.monotonic(), 0
                    for event in w.stream(
                        api.list_namespaced_endpoint_slice, ns, label_selector=d.selector, resource_version=version,
                        allow_watch_bookmarks=True, timeout_seconds=int(d.watch_timeout_s),
                        _request_timeout=(10, d.watch_timeout_s + 30),
                    ):
                        if not event:  # a blank line
                            continue
                        kind, obj = event["type"], event["object"]
                        if kind in ("ADDED", "MODIFIED"):
                            slices[obj.metadata.name] = obj
                        elif kind == "DELETED":
                            slices.pop(obj.metadata.name, None)
                        else:  # BOOKMARK: only a newer resource version
                            continue
                        events += 1
                        self.publish(dict(slices))
                    version = w.resource_version or version
                    if not events and time.monotonic() - started < 1.0:
                        # NOTE: a watch that ends at once (a proxy closing it) must not spin.
                        self._stop.wait(backoff)
                        backoff = min(backoff * 2, d.max_backoff_s)
                    else:
                        backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:  # the watch's resource version expired: list again
                    log.info("backend discovery: the EndpointSlice watch expired (410 Gone); listing again")
                    continue
                hint = ": the router's service account needs get, list and watch on endpointslices.discovery.k8s.io" if exc.status in (401, 403) else ""
                self._problem(f"EndpointSlices in namespace {ns} answered {exc.status} {exc.reason}{hint}")
            except Exception as exc:  # noqa: BLE001 - the API server unreachable, a kubeconfig missing: retried
                if self._stop.is_set():
                    break
                self._problem(f"cannot list or watch EndpointSlices in namespace {ns} ({type(exc).__name__}: {exc})")
                if not isinstance(exc, OSError) and "urllib3" not in type(exc).__module__:
                    api = None  # a configuration problem: load the configuration again next time
            self._stop.wait(backoff)
            backoff = min(backoff * 2, d.max_backoff_s)
