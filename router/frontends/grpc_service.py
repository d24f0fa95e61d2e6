"""The router's gRPC servicer (``unicache.v1.Router``).

``Generate`` authenticates from metadata (``authorization: Bearer KEY`` or
``x-api-key``), renders chat JSON if given, and streams ``RouterCore.forward``; the first
response carries ``RouteInfo``. ``ListReplicas`` and ``GetClusterState`` expose no tenant
data; like ``/metrics`` they need the admin key when one is set (router/frontends/admin.py).

Invariants:
    * Every error reaches the client through ``grpc_status``, the one table from
      exception to status code; never a traceback or UNKNOWN, and messages never contain
      keys, salts or replica addresses. ``chat_json`` is depth-checked before it is
      parsed (``unicache.router.frontends.json_input``).
    * The client's own deadline (if set) bounds the router's retries.
    * When the client cancels, grpc.aio cancels this handler; the ``forward`` generator's
      finally cancels the replica call.
"""

from __future__ import annotations

import logging

import grpc

from unicache.contract.chat_template import ChatFormatError
from unicache.router.frontends.admin import presents_admin_key
from unicache.router.frontends.chat_template import render_chat_json
from unicache.router.observability.cluster_state import cluster_state, replica_info
from unicache.router.request_path.auth import AuthError, api_key_from_headers
from unicache.router.request_path.core import Labelled, RouterCore, RouterError
from unicache.router.request_path.overload import retry_trailers
from unicache.v1 import router_pb2, router_pb2_grpc


log = logging.getLogger(__name__)

class ModelNotFound(Exception):
    """A request naming a model this router does not serve (HTTP: 404 model_not_found)."""


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str, str]:
    """(status code, client message, outcome label) of an error on the Generate path.

    AuthError -> UNAUTHENTICATED; ModelNotFound -> NOT_FOUND (HTTP's 404); ChatFormatError
    (bad or too deeply nested chat_json) -> INVALID_ARGUMENT; RouterError -> its kind's code; anything else is a router bug:
    INTERNAL with a fixed message (the exception goes to the log).
    """
    if isinstance(exc, RouterError):
        return exc.grpc_code, str(exc), exc.kind
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc), "unauthenticated"
    if isinstance(exc, ChatFormatError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid"
    if isinstance(exc, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc), "invalid"
    log.error("Generate failed in the router", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal router error", "error"


def _metadata_getter(context: grpc.aio.ServicerContext):
    md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
    return lambda name: md.get(name)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, policy_name: str, admin_key: str = "", served_model_name: str = "unicache-default"):
        self.core = core
        self.policy_name = policy_name
        self.admin_key = admin_key
        self.served_model_name = served_model_name
        core.cluster.models.alias = served_model_name

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> None:
        if not presents_admin_key(self.admin_key, api_key_from_headers(_metadata_getter(context))):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin key required")

    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext):
        core = self.core
        outcome = "error"
        try:
            try:
                tenant = core.auth.authenticate(api_key_from_headers(_metadata_getter(context)))
                models = core.cluster.models
                if request.model and not models.knows(request.model):  # empty: the router's own
                    names = ", ".join(repr(card.name) for card in models.cards())
                    raise ModelNotFound(f"The model {request.model!r} does not exist; this server serves {names}")
                which = request.WhichOneof("prompt")
                if which is None:
                    raise RouterError("invalid", "missing prompt: set text or chat_json")
                text = request.text if which == "text" else render_chat_json(request.chat_json, core.tokenizer.chat_template)
                labels = Labelled(
                    session_id=request.session_id or None,
                    task=request.task or None,
                    template=request.template if request.HasField("template") else None,
                )
                prep = core.prepare(tenant, core.encode(text, add_special_tokens=which == "text"), labels, request.model)
                # NOTE: the replica's messages arrive as RouterGenerateResponse
                # (router/upstream/replica_client.py), so each is passed on as it came.
                async for route, msg in core.forward(prep, request.sampling, context.time_remaining()):
                    if route is not None:
                        msg.route.CopyFrom(route)
                    yield msg
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - every error gets a status (grpc_status)
                code, message, outcome = grpc_status(exc)
                await context.abort(code, message, retry_trailers(exc))
        finally:
            core.metrics.labelled(core.metrics.requests, "grpc", outcome).inc()

    async def ListReplicas(self, request, context):
        await self._require_admin(context)
        cluster = self.core.cluster
        out = router_pb2.ListReplicasResponse()
        for rid in sorted(cluster.replicas):
            out.replicas.append(replica_info(cluster, rid, self.core.clients.transport))
        return out

    async def GetClusterState(self, request, context):
        await self._require_admin(context)
        return await cluster_state(self.core, self.policy_name)
