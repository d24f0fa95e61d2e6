"""Requests the router does not interpret, passed to a vLLM backend untouched.

A request with parameters the HTTP door does not implement (tools, ``response_format``,
guided decoding, ``logit_bias``, vLLM's own extras such as ``min_tokens``) is refused by
name when only our replicas serve; with vLLM backends in the fleet it goes to one of them
as it came: the router still authenticates, tokenizes (the chat rendered with the model's
own template), classifies, hashes and chooses by prefix and load among the vLLM backends,
then forwards the client's own body (the model renamed to the backend's, or to the LoRA
adapter it names, the tenant salt as ``cache_salt``, the class in ``vllm_xargs``) to the
same endpoint and relays vLLM's answer, status and body, streaming or not. So the fleet
keeps every vLLM feature.

Invariants:
    * Only vLLM backends are chosen; a backend that refuses the connection or answers
      502/503/504 before anything was relayed is quarantined and the next one tried (at
      most every backend once); any other answer, an error included, is vLLM's and is
      relayed as it is.
    * Every routed attempt is matched by one ``cluster.finished`` and one
      ``policy.on_request_finished``, and the tenant's lease is released once, whatever
      ends the relay (its end, an error, the client going away: then the upstream
      connection is closed and vLLM aborts the request).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.responses import Response, StreamingResponse

from unicache.contract.vllm_events import EXTRA_ARGS_KEY, class_to_vllm, salt_to_vllm
from unicache.contract.wire import request_class_to_proto
from unicache.router.request_path.core import Prepared, RouterCore
from unicache.router.routing.base import RouteDecision

log = logging.getLogger(__name__)

_REFUSED = frozenset({502, 503, 504})
_RELAYED_HEADERS = ("content-type",)


def backend_body(body: dict, model: str, prep: Prepared) -> dict:
    """The client's body as the backend gets it (see the module docstring)."""
    out = {**body, "model": model}
    salt = salt_to_vllm(prep.salt)
    if salt:
        out["cache_salt"] = salt
    xargs = dict(body.get("vllm_xargs") or {})
    xargs[EXTRA_ARGS_KEY] = class_to_vllm(request_class_to_proto(prep.cls))
    out["vllm_xargs"] = xargs
    return out


class Passthrough:
    """Forwards uninterpreted requests to vLLM backends (see the module docstring)."""

    def __init__(self, core: RouterCore):
        self.core = core

    def available(self) -> bool:
        """Whether a vLLM backend is in the fleet (quarantined or not)."""
        return any(rec.kind == "vllm" for rec in self.core.cluster.replicas.values())

    async def forward(self, path: str, body: dict, prep: Prepared) -> Response:
        core = self.core
        cluster = core.cluster
        lease = core.admit(prep)
        tried = {rid for rid, rec in cluster.replicas.items() if rec.kind != "vllm"}
        tried |= cluster.models.outside(prep.model, cluster.replicas)
        try:
            while True:
                decision = core.choose(prep.routing, tried, prep.prepare_s)
                rid = decision.replica_id
                rec = cluster.replicas[rid]
                cluster.started(rid)
                core.policy.on_request_routed(prep.routing, decision)
                client = core.clients.vllm.client(rec.address)
                model = prep.adapter or core.clients.vllm.models.get(rec.address, "")
                request = client.build_request("POST", path, json=backend_body(body, model, prep),
                                               timeout=httpx.Timeout(core.clients.forward_deadline_s, connect=5.0))
                try:
                    upstream = await client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    upstream, why = None, type(exc).__name__
                else:
                    why = f"HTTP {upstream.status_code}"
                if upstream is None or upstream.status_code in _REFUSED:
                    if upstream is not None:
                        await upstream.aclose()
                    self._end(prep, rid)
                    tried.add(rid)
                    log.info("backend %s refused a passed-through request (%s)", rid, why)
                    if cluster.quarantine(rid):
                        core.metrics.labelled(core.metrics.quarantines, rid).inc()
                    continue
                break
        except BaseException:
            lease.release()
            raise
        headers = {k: upstream.headers[k] for k in _RELAYED_HEADERS if k in upstream.headers}
        headers.update(self._route_headers(decision))
        return StreamingResponse(self._relay(upstream, prep, rid, lease), status_code=upstream.status_code, headers=headers)

    def _route_headers(self, decision: RouteDecision) -> dict[str, str]:
        return {
            "x-unicache-replica": decision.replica_id,
            "x-unicache-route-reason": decision.reason,
            "x-unicache-matched-tokens": str(decision.matched_blocks * self.core.block_size),
        }

    async def _relay(self, upstream: httpx.Response, prep: Prepared, rid: str, lease) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            # NOTE: closing an unfinished upstream response closes its connection: vLLM sees
            # the client go away and aborts the request.
            await upstream.aclose()
            self._end(prep, rid)
            lease.release()

    def _end(self, prep: Prepared, rid: str) -> None:
        self.core.cluster.finished(rid)
        self.core.policy.on_request_finished(prep.routing, rid)
