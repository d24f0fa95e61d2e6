"""AsyncEngine's surface: validation, streaming, stop strings, seeds, cancellation, stop()."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from unicache.replica.engines.api import EngineInputError, EngineRequest, SamplingParams
from unicache.replica.engines.builtin.async_engine import AsyncEngine
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.engines.builtin.scheduler import ScheduledChunk
from unicache.replica.engines.builtin.sequence import RequestGroup, Sequence
from tests.support.engine_factory import make_request, run_one, tiny_config

PROMPT = [(i * 13 + 5) % 256 for i in range(21)]


@pytest.fixture
async def engine():
    eng = AsyncEngine(tiny_config())
    await eng.start()
    yield eng
    await eng.stop()


async def collect(engine, req):
    outs = []
    async for out in engine.generate(req):
        outs.append(out)
    return outs


async def idle(engine, deadline_s: float = 10.0) -> bool:
    """Aborts reach the step thread asynchronously: wait, with a deadline, for zero refs."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while (engine.num_referenced_blocks() or engine.load().running) and loop.time() < end:
        await asyncio.sleep(0.01)
    return engine.num_referenced_blocks() == 0


async def test_streams_tokens_text_and_usage(engine):
    outs = await collect(engine, make_request("a", PROMPT, max_tokens=6))
    assert [o.index for o in outs] == [0] * 6
    assert [o.finished for o in outs] == [False] * 5 + [True]
    last = outs[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (21, 0, 6)
    # queue and prefill times: exact under a fake clock in test_engine_scheduler.py
    toks = [t for o in outs for t in o.new_token_ids]
    want = run_one(LLMEngine(tiny_config()), make_request("a", PROMPT, max_tokens=6)).tokens[0]
    assert toks == want
    assert "".join(o.text_delta for o in outs) == engine.decode(toks)
    again = await collect(engine, make_request("b", PROMPT, max_tokens=6))
    assert again[-1].usage.cached_tokens == 20
    assert await idle(engine)
    state = engine.cache_state()
    assert (state.block_size, state.capacity_blocks, state.used_blocks, state.eviction_policy) == (4, 128, 0, "lru")
    assert state.cached_blocks == len(engine.cached_hashes()) == 6  # 21 prompt + 5 decode tokens
    assert len(engine.take_events()) == 6 and engine.take_events() == []


def _bad(**kw):
    sampling = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__dataclass_fields__}
    return EngineRequest("bad", kw.pop("prompt", PROMPT), SamplingParams(**sampling), **kw)


@pytest.mark.parametrize(
    "req, kind, fragment",
    [
        (_bad(prompt=[]), "invalid", "empty"),
        (_bad(max_tokens=0), "invalid", "max_tokens"),
        (_bad(max_tokens=10_000), "invalid", "max_tokens"),
        (_bad(temperature=-1.0), "invalid", "temperature"),
        (_bad(top_p=0.0), "invalid", "top_p"),
        (_bad(n=0), "invalid", "n must"),
        (_bad(n=1000), "invalid", "n must"),
        (_bad(cache_salt=b"x" * 65), "invalid", "cache_salt"),
        (_bad(prompt=[1, 2, 259]), "invalid", "token id 259"),
        (_bad(prompt=[1] * 500, max_tokens=20), "exhausted", "context"),
    ],
)
async def test_bad_requests_fail_before_the_first_output(engine, req, kind, fragment):
    with pytest.raises(EngineInputError, match=fragment) as info:
        await collect(engine, req)
    assert info.value.kind == kind
    assert engine.load().waiting == 0 and engine.num_referenced_blocks() == 0


async def test_request_larger_than_the_cache_is_exhausted():
    eng = AsyncEngine(tiny_config(num_blocks=10))
    await eng.start()
    try:
        with pytest.raises(EngineInputError, match="KV blocks") as info:
            await collect(eng, make_request("big", PROMPT, max_tokens=30))
        assert info.value.kind == "exhausted"
    finally:
        await eng.stop()


async def test_stop_string_ends_the_sample_and_is_not_emitted(engine):
    full = await collect(engine, make_request("a", PROMPT, max_tokens=24))
    text = "".join(o.text_delta for o in full)
    stop = text[10:12]
    cut = text.find(stop)
    outs = await collect(engine, make_request("b", PROMPT, max_tokens=24, stop=[stop, "\x00never"]))
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in outs) == text[:cut]
    assert await idle(engine)


async def test_seeds_are_reproducible_and_top_p_near_zero_is_greedy(engine):
    def req(rid, **kw):
        return make_request(rid, PROMPT, max_tokens=12, temperature=1.0, **kw)

    def toks(outs):
        return [t for o in outs for t in o.new_token_ids]

    a, b, c = await asyncio.gather(
        collect(engine, req("a", seed=5)), collect(engine, req("b", seed=5)), collect(engine, req("c", seed=6))
    )
    assert toks(a) == toks(b) != toks(c)
    greedy = await collect(engine, make_request("g", PROMPT, max_tokens=12))
    narrow = await collect(engine, req("p", seed=9, top_p=1e-9))
    assert toks(narrow) == toks(greedy)


async def test_fork_streams_every_sample_and_frees_its_blocks(engine):
    outs = await collect(engine, make_request("f", PROMPT, max_tokens=5, n=3, temperature=1.0, seed=3))
    finished = sorted(o.index for o in outs if o.finished)
    assert finished == [0, 1, 2]
    assert sum(len(o.new_token_ids) for o in outs) == 15
    assert await idle(engine)


async def test_consumer_that_stops_iterating_aborts_the_request(engine):
    gen = engine.generate(make_request("c", PROMPT, max_tokens=200))
    first = await gen.__anext__()
    assert not first.finished
    assert engine.num_referenced_blocks() > 0
    await gen.aclose()
    assert await idle(engine)

    async def consume():
        async for _ in engine.generate(make_request("d", PROMPT, max_tokens=200)):
            pass

    task = asyncio.create_task(consume())
    while not engine.load().running:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await idle(engine)


async def test_stop_aborts_requests_in_flight():
    eng = AsyncEngine(tiny_config())
    await eng.start()
    gen = eng.generate(make_request("s", PROMPT, max_tokens=300))
    await gen.__anext__()
    await eng.stop()
    rest = [o async for o in gen]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert eng.num_referenced_blocks() == 0
    with pytest.raises(RuntimeError, match="stopped"):
        await collect(eng, make_request("late", PROMPT))


async def test_reports_device_block_size_and_encodes_before_start():
    eng = AsyncEngine(dataclasses.replace(tiny_config(), device="auto"))
    assert eng.device in ("cpu", "cuda")
    assert eng.block_size == 4
    assert eng.decode(eng.encode("héllo")) == "héllo"
    with pytest.raises(RuntimeError, match="start"):
        eng.cache_state()


def test_hot_path_records_use_slots():
    for cls in (Sequence, RequestGroup, ScheduledChunk):
        assert "__slots__" in cls.__dict__, cls
