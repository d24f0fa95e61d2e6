"""Beyond capacity the system sheds load at once instead of queueing without bound:
the router answers RESOURCE_EXHAUSTED / HTTP 429 past ``max_in_flight``, and a replica
answers RESOURCE_EXHAUSTED past ``EngineConfig.max_waiting`` (the router passes that on).

The engines are frozen (``LoadStack.freeze``: step threads stopped, event loops serving),
so the admitted requests stay in flight and the counts are exact, with no timing involved.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from unicache.testing.polling import eventually
from unicache.v1 import common_pb2, replica_pb2, replica_pb2_grpc, router_pb2
from tests.support.load_stack import LoadStack, start_replica

AUTH = [("authorization", "Bearer key-acme")]


def gen_request(i: int, max_tokens: int = 3) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(text=f"shed {i:03d} please", sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def collect(stub, req) -> tuple[list[int], int]:
    tokens, finish = [], 0
    async for m in stub.Generate(req, metadata=AUTH, timeout=60):
        tokens.extend(m.token_ids)
        finish = m.finish_reason or finish
    return tokens, finish


async def grpc_code(stub, req) -> tuple[grpc.StatusCode, str]:
    try:
        await collect(stub, req)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


async def test_replica_refuses_past_max_waiting_then_serves_again():
    rep = await start_replica("r0", max_waiting=3)
    channel = grpc.aio.insecure_channel(rep.address)
    stub = replica_pb2_grpc.ReplicaStub(channel)

    def req(i: int) -> replica_pb2.GenerateRequest:
        return replica_pb2.GenerateRequest(
            request_id=f"q{i}", token_ids=replica_pb2.TokenIds(ids=[10 + i] * 20), sampling=common_pb2.SamplingParams(max_tokens=2)
        )

    async def run(i: int) -> int:
        n = 0
        async for m in stub.Generate(req(i), timeout=60):
            n += len(m.token_ids)
        return n

    lock = rep.engine.engine.lock
    try:
        lock.acquire()  # freeze the step thread: accepted requests stay waiting
        admitted = [asyncio.create_task(run(i)) for i in range(3)]
        await eventually(lambda: rep.engine.num_waiting == 3, "3 waiting requests")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run(3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == "replica overloaded: 3 requests waiting (max_waiting=3); retry later"
        assert rep.engine.num_waiting == 3
        lock.release()
        assert await asyncio.gather(*admitted) == [2, 2, 2]
        assert rep.engine.num_waiting == 0
        assert await run(4) == 2  # capacity is back
        assert sorted(rep.servicer.request_ids) == ["q0", "q1", "q2", "q3", "q4"]
        assert rep.engine.num_referenced_blocks() == 0
    finally:
        if lock.locked():
            lock.release()
        await channel.close()
        await rep.server.stop()
        await rep.engine.stop()


async def test_router_sheds_past_max_in_flight_over_grpc_and_http():
    st = await LoadStack.start(num_replicas=2, router={"max_in_flight": 6})
    try:
        st.freeze()
        admitted = [asyncio.create_task(collect(st.stub, gen_request(i))) for i in range(6)]
        await eventually(lambda: st.app.cluster.total_in_flight() == 6, "6 requests in flight")
        refused = await asyncio.gather(*(grpc_code(st.stub, gen_request(10 + i)) for i in range(4)))
        assert refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "router has 6 requests in flight; retry later")] * 4
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as client:
            for stream in (False, True):
                r = await client.post(
                    "/v1/completions", json={"prompt": "over capacity", "max_tokens": 2, "stream": stream}, headers={"x-api-key": "key-acme"}
                )
                assert r.status_code == 429
                assert r.json()["error"]["type"] == "rate_limit_error"
            st.thaw()
            results = await asyncio.gather(*admitted)
            assert [(len(tokens), finish) for tokens, finish in results] == [(3, common_pb2.FINISH_REASON_LENGTH)] * 6
            r = await client.post("/v1/completions", json={"prompt": "room again", "max_tokens": 2}, headers={"x-api-key": "key-acme"})
            assert r.status_code == 200
        # Only the admitted six (and the last one) ever reached a replica.
        assert len(st.served_ids()) == 7
        assert st.app.cluster.total_in_flight() == 0
        assert st.referenced_blocks() == [0, 0]
    finally:
        await st.close()


async def test_router_passes_replica_overload_on_as_resource_exhausted_and_429():
    st = await LoadStack.start(num_replicas=1, max_waiting=2)
    try:
        st.freeze()
        admitted = [asyncio.create_task(collect(st.stub, gen_request(i))) for i in range(2)]
        engine = st.replicas[0].engine
        await eventually(lambda: engine.num_waiting == 2, "2 waiting requests")
        code, details = await grpc_code(st.stub, gen_request(5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details == "replica r0: replica overloaded: 2 requests waiting (max_waiting=2); retry later"
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as client:
            r = await client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2}, headers={"x-api-key": "key-acme"})
        assert r.status_code == 429
        st.thaw()
        assert [len(t) for t, _ in await asyncio.gather(*admitted)] == [3, 3]
        assert st.app.metrics.retries._value.get() == 0  # overload is not retried elsewhere
        assert engine.num_waiting == 0 and st.referenced_blocks() == [0]
    finally:
        await st.close()


def test_replica_max_waiting_is_a_flag_and_an_environment_variable(monkeypatch):
    import argparse

    from unicache.replica.settings import add_settings_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert settings_from_args(parser.parse_args([])).engine_config().max_waiting == 1024
    assert settings_from_args(parser.parse_args(["--max-waiting", "5"])).engine_config().max_waiting == 5
    monkeypatch.setenv("UNICACHE_MAX_WAITING", "9")
    assert settings_from_args(parser.parse_args([])).engine_config().max_waiting == 9


async def test_too_large_is_400_context_length_and_overload_is_429_over_http():
    """Both are RESOURCE_EXHAUSTED from the replica; its refusal metadata tells them apart.
    A request that can never fit is OpenAI's (and vLLM's) 400 context_length_exceeded."""
    st = await LoadStack.start(num_replicas=1, max_waiting=1)
    try:
        long_prompt = {"prompt": "w" * 600, "max_tokens": 2}  # context is 512
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as client:
            r = await client.post("/v1/completions", json=long_prompt, headers={"x-api-key": "key-acme"})
            assert r.status_code == 400
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("invalid_request_error", "context_length_exceeded")
            assert err["message"].endswith("prompt (600 tokens) + max_tokens (2) exceeds the context of 512")
            code, details = await grpc_code(st.stub, router_pb2.RouterGenerateRequest(text="w" * 600))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the context of 512" in details
            st.freeze()
            admitted = asyncio.create_task(collect(st.stub, gen_request(0)))
            await eventually(lambda: st.replicas[0].engine.num_waiting == 1, "1 waiting request")
            r = await client.post("/v1/completions", json={"prompt": "short", "max_tokens": 2}, headers={"x-api-key": "key-acme"})
            assert r.status_code == 429
            st.thaw()
            assert len((await admitted)[0]) == 3
    finally:
        await st.close()


async def test_replica_marks_why_it_refused():
    rep = await start_replica("r0", max_waiting=1)
    channel = grpc.aio.insecure_channel(rep.address)
    stub = replica_pb2_grpc.ReplicaStub(channel)
    lock = rep.engine.engine.lock
    try:
        too_long = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=[1] * 600))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(too_long, timeout=10)]
        assert dict(err.value.trailing_metadata()).get("unicache-refusal") == "too_large"
        lock.acquire()
        first = stub.Generate(replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=[1] * 5)), timeout=30)
        pending = asyncio.create_task(first.read())
        await eventually(lambda: rep.engine.num_waiting == 1, "1 waiting request")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=[2] * 5)), timeout=10)]
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata()).get("unicache-refusal") == "overloaded"
        lock.release()
        await pending
        first.cancel()
    finally:
        if lock.locked():
            lock.release()
        await channel.close()
        await rep.server.stop()
        await rep.engine.stop()
