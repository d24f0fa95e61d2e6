"""ReplicaServicer unit tests (called directly) and integration tests through an in-process
grpc.aio server on port 0, both on the real engine with a tiny seeded model.

Outputs are checked against the same request run on the engine directly (greedy, so the
tokens must be identical); every failed or cancelled request must leave no referenced block.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import ModelConfig
from unicache.replica.serving.server import SERVICE_NAME, ReplicaServer, ReplicaServicer
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc

BS = 4
NUM_BLOCKS = 32


def tiny_config() -> EngineConfig:
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=256)
    return EngineConfig(model=model, num_blocks=NUM_BLOCKS, block_size=BS, eviction_policy="lru", device="cpu")


@pytest.fixture
async def engine():
    eng = AsyncEngine(tiny_config())
    await eng.start()
    yield eng
    await eng.stop()


class Aborted(Exception):
    pass


class RecordingContext:
    """The part of grpc.aio.ServicerContext the servicer uses: ``abort`` raises, like grpc's."""

    def __init__(self):
        self.code = None
        self.details = None
        self.trailing_metadata = ()

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata
        raise Aborted(details)


def make_request(ids=None, text=None, max_tokens=5, rid="", **sampling) -> replica_pb2.GenerateRequest:
    req = replica_pb2.GenerateRequest(request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    if ids is not None:
        req.token_ids.ids.extend(ids)
    if text is not None:
        req.text = text
    return req


async def direct(engine, ids, max_tokens=5, **kw):
    """Run a request on the engine itself: (token ids, text, last output)."""
    toks, text, last = [], "", None
    async for out in engine.generate(EngineRequest(f"direct-{len(ids)}-{max_tokens}", list(ids), SamplingParams(max_tokens=max_tokens, **kw))):
        toks += out.new_token_ids
        text += out.text_delta
        last = out
    return toks, text, last


async def no_blocks_referenced(engine, timeout_s: float = 10.0) -> bool:
    """Aborts reach the engine thread asynchronously: wait (with a deadline) for ref counts 0."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while engine.num_referenced_blocks() and loop.time() < end:
        await asyncio.sleep(0.01)
    return engine.num_referenced_blocks() == 0


PROMPT = [7, 3, 9, 11, 2, 5, 8, 1, 4, 6]  # 2 full blocks + 2 tokens


# ------------------------------------------------------------------ servicer, directly
async def test_generate_streams_the_engine_tokens_text_and_usage(engine):
    want_toks, want_text, want_last = await direct(engine, PROMPT, max_tokens=5)
    svc = ReplicaServicer(engine, "r0")
    msgs = [m async for m in svc.Generate(make_request(PROMPT, max_tokens=5, rid="g1"), RecordingContext())]
    assert [t for m in msgs for t in m.token_ids] == want_toks
    assert "".join(m.text for m in msgs) == want_text
    assert [m.finish_reason for m in msgs] == [common_pb2.FINISH_REASON_UNSPECIFIED] * 4 + [common_pb2.FINISH_REASON_LENGTH]
    assert [m.HasField("usage") for m in msgs] == [False] * 4 + [True]
    u = msgs[-1].usage
    # The direct run cached the prompt's 2 full blocks (8 tokens): this run hits them.
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (10, 8, 5)
    assert want_last.usage.cached_tokens == 0
    assert await no_blocks_referenced(engine)


async def test_text_prompt_is_tokenized_by_the_engine_and_n_samples_are_indexed(engine):
    svc = ReplicaServicer(engine, "r0", default_max_tokens=3)
    msgs = [m async for m in svc.Generate(make_request(text="hello world", max_tokens=0, n=2), RecordingContext())]
    assert sorted({m.index for m in msgs}) == [0, 1]
    for idx in (0, 1):
        mine = [m for m in msgs if m.index == idx]
        assert len([t for m in mine for t in m.token_ids]) == 3  # max_tokens 0 -> default 3
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert mine[-1].usage.prompt_tokens == len(engine.encode("hello world"))
    assert await no_blocks_referenced(engine)


@pytest.mark.parametrize(
    "request_, code, fragment",
    [
        (make_request(), grpc.StatusCode.INVALID_ARGUMENT, "missing prompt"),
        (make_request(ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
        (make_request(text=""), grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
        (make_request(PROMPT, max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (make_request(PROMPT, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (make_request([1, 2, 100_000]), grpc.StatusCode.INVALID_ARGUMENT, "token id 100000"),
        (make_request(list(range(250)), max_tokens=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "context of 256"),
        (make_request(list(range(130)), max_tokens=1), grpc.StatusCode.RESOURCE_EXHAUSTED, "KV blocks"),
    ],
    ids=["missing", "empty-ids", "empty-text", "huge-max-tokens", "top-p", "bad-token", "too-long", "bigger-than-cache"],
)
async def test_bad_input_maps_to_status_codes_and_leaks_nothing(engine, request_, code, fragment):
    ctx = RecordingContext()
    with pytest.raises(Aborted):
        async for _ in ReplicaServicer(engine, "r0").Generate(request_, ctx):
            pass
    assert ctx.code == code and fragment in ctx.details, ctx.details
    assert await no_blocks_referenced(engine)


async def test_unknown_task_and_oversized_salt_are_invalid(engine):
    svc = ReplicaServicer(engine, "r0")
    for req, fragment in [
        (replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=PROMPT), request_class=common_pb2.RequestClass(task="poetry")), "unknown task 'poetry'"),
        (replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=PROMPT), cache_salt=b"x" * 65), "cache_salt is 65 bytes"),
    ]:
        ctx = RecordingContext()
        with pytest.raises(Aborted):
            async for _ in svc.Generate(req, ctx):
                pass
        assert (ctx.code, fragment in ctx.details) == (grpc.StatusCode.INVALID_ARGUMENT, True), ctx.details
    assert await no_blocks_referenced(engine)


async def test_closing_the_stream_midway_aborts_and_frees_blocks(engine):
    stream = ReplicaServicer(engine, "r0").Generate(make_request(PROMPT, max_tokens=100), RecordingContext())
    first = await anext(stream)
    assert len(first.token_ids) == 1
    assert engine.num_referenced_blocks() > 0
    await stream.aclose()
    assert await no_blocks_referenced(engine)
    assert engine.load().running == 0


async def test_get_cache_state_reports_the_engine(engine):
    await direct(engine, PROMPT, max_tokens=3)  # 10 + 2 fed-back tokens -> 3 full blocks cached
    state = await ReplicaServicer(engine, "r7").GetCacheState(replica_pb2.GetCacheStateRequest(), RecordingContext())
    assert (state.replica_id, state.block_size, state.capacity_blocks, state.eviction_policy) == ("r7", BS, NUM_BLOCKS, "lru")
    assert (state.cached_blocks, state.free_blocks, state.used_blocks, dict(state.queue_sizes)) == (3, NUM_BLOCKS, 0, {"lru": 3})


# ------------------------------------------------------------------ through grpc.aio on port 0
@pytest.fixture
async def served(engine):
    server = ReplicaServer(engine, "r0", port=0, grace_s=0.5)
    port = await server.start()
    assert port > 0
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine, channel
    await channel.close()
    await server.stop()


async def test_grpc_generate_health_and_cache_state(served):
    engine, channel = served
    want_toks, _, _ = await direct(engine, PROMPT, max_tokens=6)
    stub = replica_pb2_grpc.ReplicaStub(channel)
    msgs = [m async for m in stub.Generate(make_request(PROMPT, max_tokens=6), timeout=30)]
    assert [t for m in msgs for t in m.token_ids] == want_toks
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    state = await stub.GetCacheState(replica_pb2.GetCacheStateRequest(), timeout=5)
    assert (state.replica_id, state.capacity_blocks) == ("r0", NUM_BLOCKS)


async def test_grpc_errors_carry_codes_and_messages(served):
    engine, channel = served
    stub = replica_pb2_grpc.ReplicaStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(make_request(), timeout=10)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "missing prompt: set either text or token_ids"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(make_request(list(range(130)), max_tokens=1), timeout=10)]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "request needs 33 KV blocks, the cache has 32"
    assert await no_blocks_referenced(engine)


async def test_client_cancellation_reaches_the_engine(served):
    engine, channel = served
    stub = replica_pb2_grpc.ReplicaStub(channel)
    call = stub.Generate(make_request(PROMPT, max_tokens=100), timeout=30)
    first = await call.read()
    assert len(first.token_ids) == 1
    call.cancel()
    assert await no_blocks_referenced(engine)
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while engine.load().running and loop.time() < end:
        await asyncio.sleep(0.01)
    assert engine.load().running == 0
