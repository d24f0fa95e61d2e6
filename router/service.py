"""The router's gRPC servicer (``unicache.v1.Router``).

``Generate`` authenticates from metadata (``authorization: Bearer KEY`` or
``x-api-key``), renders chat JSON if given, and streams ``RouterCore.forward``; the first
response carries ``RouteInfo``. ``ListReplicas`` and ``GetClusterState`` expose no tenant
data and need no key (like ``/metrics``).

Invariants:
    * Errors surface as gRPC status codes from ``RouterError`` (never a traceback), and
      their messages never contain keys or salts.
    * When the client cancels, grpc.aio cancels this handler; the ``forward`` generator's
      finally cancels the replica call.
"""

from __future__ import annotations


import grpc

from unicache.router.auth import AuthError, api_key_from_headers
from unicache.router.chat_template import ChatFormatError, render_chat_json
from unicache.router.cluster_state import cluster_state
from unicache.router.core import Labelled, RouterCore, RouterError
from unicache.v1 import replica_pb2, router_pb2, router_pb2_grpc


_parse_router_response = router_pb2.RouterGenerateResponse.FromString


def router_response(msg: replica_pb2.GenerateResponse) -> router_pb2.RouterGenerateResponse:
    """The replica's message as the router's (``route`` unset).

    Fields 1-5 of ``RouterGenerateResponse`` are ``GenerateResponse``'s, same names and
    types (``tests/test_router_units.py`` checks it), so re-parsing the replica message's
    bytes copies every field; it costs a third of setting them one by one, per token.
    """
    return _parse_router_response(msg.SerializeToString())


def _metadata_getter(context: grpc.aio.ServicerContext):
    md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
    return lambda name: md.get(name)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, policy_name: str):
        self.core = core
        self.policy_name = policy_name

    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext):
        core = self.core
        outcome = "error"
        try:
            try:
                tenant = core.auth.authenticate(api_key_from_headers(_metadata_getter(context)))
                which = request.WhichOneof("prompt")
                if which is None:
                    raise RouterError("invalid", "missing prompt: set text or chat_json")
                text = request.text if which == "text" else render_chat_json(request.chat_json)
                labels = Labelled(
                    session_id=request.session_id or None,
                    task=request.task or None,
                    template=request.template if request.HasField("template") else None,
                )
                prep = core.prepare(tenant, core.encode(text), labels)
                async for route, msg in core.forward(prep, request.sampling):
                    out = router_response(msg)
                    if route is not None:
                        out.route.CopyFrom(route)
                    yield out
                outcome = "ok"
            except AuthError as exc:
                outcome = "unauthenticated"
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            except ChatFormatError as exc:
                outcome = "invalid"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RouterError as exc:
                outcome = exc.kind
                await context.abort(exc.grpc_code, str(exc))
        finally:
            core.metrics.labelled(core.metrics.requests, "grpc", outcome).inc()

    async def ListReplicas(self, request, context):
        cluster = self.core.cluster
        out = router_pb2.ListReplicasResponse()
        for rid in sorted(cluster.replicas):
            rec = cluster.replicas[rid]
            out.replicas.append(
                router_pb2.ReplicaInfo(
                    replica_id=rid, address=rec.address, healthy=cluster.healthy(rid), device=rec.heartbeat.device if rec.heartbeat else ""
                )
            )
        return out

    async def GetClusterState(self, request, context):
        return await cluster_state(self.core, self.policy_name)
