"""Tenant isolation, property-based: under any interleaving of requests from several
tenants, a tenant's cache hits are exactly those it would get on a replica of its own.

Each request goes through the real router path (``Authenticator.authenticate`` on its API
key, ``RouterCore.prepare``: the tenant's salt and the chained block hashes) and then into
a real replica-side cache: a ``KVStore`` (many examples) or the real ``LLMEngine`` with a
tiny model (fewer examples; the engine hashes the forwarded token ids with the forwarded
salt itself). Prompts are drawn from a tiny pool of blocks, so tenants send identical
prefixes all the time. The oracles:
    * shared store: hit blocks == the longest prefix *this tenant* already computed
      (an exact count, not a bound), and never more;
    * shared engine: ``cached_tokens`` of every request equals what a private engine
      serving only that tenant reports for the same request.
A control run with auth disabled (every request is tenant ``default``, one salt) shows
the oracle does detect sharing: there, tenants do hit each other's blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unicache.contract.block_hash import hash_token_blocks
from unicache.replica.engines.api import EngineRequest, SamplingParams
from unicache.replica.engines.builtin.engine import LLMEngine
from unicache.replica.eviction.registry import make_policy
from unicache.replica.kv.store import KVStore
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.request_path.core import Labelled
from tests.support.engine_factory import drain, tiny_config

BS = 4
TENANTS = ("acme", "globex", "initech")
KEYS = {f"sk-{t}": t for t in TENANTS}
# Three distinct blocks; prompts are sequences of them (plus an optional partial tail),
# so many prompts share prefixes within and across tenants.
POOL = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]


def make_router(auth_enabled: bool = True) -> RouterApp:
    env = {"UNICACHE_API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items()), "UNICACHE_SALT_SECRET": "iso-secret"}
    return RouterApp(build_config(env=env, overrides={"use_redis": False, "block_size": BS, "auth_enabled": auth_enabled}))


ROUTER = make_router()
OPEN_ROUTER = make_router(auth_enabled=False)

request_st = st.tuples(
    st.sampled_from(sorted(KEYS)),  # the API key the client sends
    st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=4),  # full blocks
    st.integers(0, BS - 1),  # partial tail length
)


def prompt_of(blocks: list[int], tail: int) -> list[int]:
    return [t for b in blocks for t in POOL[b]] + [40 + i for i in range(tail)]


def through_router(app: RouterApp, key: str, tokens: list[int]):
    tenant = app.auth.authenticate(key)
    prep = app.core.prepare(tenant, tokens, Labelled())
    return tenant, prep


def own_prefix_blocks(seen: set[tuple[int, ...]], tokens: list[int]) -> int:
    n = 0
    while (n + 1) * BS <= len(tokens) and tuple(tokens[: (n + 1) * BS]) in seen:
        n += 1
    return n


def run_store(app: RouterApp, requests) -> list[tuple[str, int, int]]:
    """(tenant, hit blocks, own-history oracle) per request, on one shared store."""
    store = KVStore(512, BS, make_policy("lru"))  # never evicts at these sizes
    seen: dict[str, set[tuple[int, ...]]] = {}
    out = []
    for i, (key, blocks, tail) in enumerate(requests):
        tokens = prompt_of(blocks, tail)
        tenant, prep = through_router(app, key, tokens)
        hashes = prep.routing.block_hashes
        # The replica recomputes the hashes from the forwarded ids and salt: same values.
        assert hashes == hash_token_blocks(tokens, BS, cache_salt=prep.salt)
        alloc = store.allocate(f"r{i}", hashes, len(tokens), prep.cls, float(i))
        store.cache_blocks(f"r{i}", float(i))
        store.free(f"r{i}", float(i))
        mine = seen.setdefault(tenant, set())
        out.append((tenant, alloc.num_hit_blocks, own_prefix_blocks(mine, tokens)))
        mine.update(tuple(tokens[: (n + 1) * BS]) for n in range(len(tokens) // BS))
    store.check_invariants()
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=1, max_size=24))
def test_no_cross_tenant_prefix_hit_in_a_shared_store(requests):
    for tenant, hit, oracle in run_store(ROUTER, requests):
        assert hit == oracle, (tenant, hit, oracle)


def test_control_without_tenant_salts_blocks_are_shared():
    """The same check catches sharing: with one salt for everyone, globex hits acme's blocks."""
    requests = [("sk-acme", [0, 1], 0), ("sk-globex", [0, 1], 0)]
    salted = run_store(ROUTER, requests)
    assert [(t, hit) for t, hit, _ in salted] == [("acme", 0), ("globex", 0)]
    open_ = run_store(OPEN_ROUTER, requests)
    assert [(t, hit, oracle) for t, hit, oracle in open_] == [("default", 0, 0), ("default", 2, 2)]
    # Distinct tenants, same prompt: the salts (and so every block hash) differ.
    _, a = through_router(ROUTER, "sk-acme", prompt_of([0, 1], 0))
    _, g = through_router(ROUTER, "sk-globex", prompt_of([0, 1], 0))
    assert a.salt != g.salt and not set(a.routing.block_hashes) & set(g.routing.block_hashes)


def engine_cached_tokens(engine: LLMEngine, rid: str, tokens: list[int], salt: bytes) -> int:
    engine.add_request(EngineRequest(rid, list(tokens), SamplingParams(max_tokens=2, ignore_eos=True), cache_salt=salt))
    return drain(engine)[rid].last[0].usage.cached_tokens




@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=2, max_size=10))
def test_shared_engine_hits_equal_private_engine_hits(requests):
    cfg = dict(num_blocks=256, block_size=BS)
    shared = LLMEngine(tiny_config(**cfg))
    private = {t: LLMEngine(tiny_config(**cfg)) for t in TENANTS}
    for i, (key, blocks, tail) in enumerate(requests):
        tokens = prompt_of(blocks, tail)
        tenant, prep = through_router(ROUTER, key, tokens)
        got = engine_cached_tokens(shared, f"s{i}", tokens, prep.salt)
        alone = engine_cached_tokens(private[tenant], f"p{i}", tokens, prep.salt)
        assert got == alone, (i, tenant, got, alone)
