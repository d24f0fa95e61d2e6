"""Control-plane attacks on a real loopback cluster: what each one achieves, measured.

Two real replicas (``ReplicaRuntime``: engine with the tiny seeded model, gRPC server with
the cluster key, signed publisher, production heartbeat/flush intervals) and a
``RouterApp`` (fast subscriber polling) follow a private password-protected redis-server.
The attacker knows the Redis password (the worst case) but not the cluster key, and runs
a forger (``FakeReplica`` signing with its own key) that records every request it gets.
During each attack the client sends ``--requests`` requests through the router's gRPC
API, half with prompts a replica has cached.

Per attack: requests misrouted (served by anything but a genuine replica, or a cached
prompt sent away from the replica holding it), tenant salts exposed (requests carrying a
salt that reached the forger, plus direct replica calls a replica accepted), client-visible
failures, and seconds from the attack's end until the router's index equals every
replica's true holdings (the baseline row is the normal event lag).

Run: ``.venv/bin/python -m bench.attacks [--requests 20]``; writes
bench/results/attacks.json and bench/results/attacks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import redis.asyncio as aioredis

from bench.paths import RESULTS
from unicache.redis_keys import RedisKeys
from unicache.redis_server import EmbeddedRedis, free_port
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.state_auth import CallCredential, StateSigner, new_cluster_key, parse_cluster_key
from unicache.testing.fake_replica import FakeReplica
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc

PREFIX = "atk"
KEYS = RedisKeys(PREFIX)
API_KEY, TENANT = "atk-key", "victim"
BS = 8
SUBSCRIBER = dict(heartbeat_interval_s=0.1, block_ms=20, resync_retry_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.2)


@dataclass
class Outcome:
    attack: str
    requests: int
    misrouted: int
    salts_exposed: int
    client_failures: int
    index_true_after_s: float
    rejected: dict


class Stack:
    def __init__(self, requests: int):
        self.n = requests
        self.key = new_cluster_key()
        self.redis = EmbeddedRedis(password=os.urandom(12).hex())
        self.replicas: dict[str, ReplicaRuntime] = {}
        self.forger = FakeReplica("forger", block_size=BS)
        self.forger.signer = StateSigner(parse_cluster_key(new_cluster_key()))
        self.app: RouterApp | None = None

    async def start(self) -> None:
        self.redis.start()
        for rid in ("r0", "r1"):
            s = ReplicaSettings(
                replica_id=rid, redis_url=self.redis.url, redis_prefix=PREFIX, cluster_key=self.key, model_preset="tiny",
                block_size=BS, num_blocks=4096,  # nothing is evicted: a cached prompt stays where it is eviction_policy="lru", device="cpu", default_max_tokens=2,
            )
            self.replicas[rid] = ReplicaRuntime(s)
            await self.replicas[rid].start()
        await self.forger.start()
        cfg = build_config(
            env={"UNICACHE_API_KEYS": f"{API_KEY}:{TENANT}", "UNICACHE_SALT_SECRET": "atk-salt", "UNICACHE_CLUSTER_KEY": self.key},
            overrides={"grpc_port": 0, "http_port": 0, "redis_url": self.redis.url, "redis_prefix": PREFIX,
                       "block_size": BS, "tokenizer": "byte"},
        )
        self.app = RouterApp(cfg, subscriber_kwargs=SUBSCRIBER)
        await self.app.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.app.grpc_port}")
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.r = aioredis.Redis.from_url(self.redis.url, socket_timeout=5)
        await self.wait(lambda: sorted(self.app.cluster.replicas) == ["r0", "r1"], "replicas admitted")
        self.old_r0_heartbeat = await self.r.get(KEYS.heartbeat("r0"))  # replayed later, when it is old
        self.salt = self.app.auth.cache_salt(TENANT)
        # Prime: each replica caches its own prompts (sent to it directly, as the router would).
        self.primed: dict[str, str] = {}
        cred = CallCredential(parse_cluster_key(self.key))
        for i, rid in enumerate(("r0", "r1")):
            prompt = f"cached prompt of {rid}: " + "x" * 48
            self.primed[prompt] = rid
            async with grpc.aio.insecure_channel(self.replicas[rid].address) as ch:
                req = replica_pb2.GenerateRequest(
                    token_ids=replica_pb2.TokenIds(ids=list(prompt.encode())), cache_salt=self.salt,
                    sampling=common_pb2.SamplingParams(max_tokens=1),
                )
                [m async for m in replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=60, metadata=cred.metadata())]
        await self.wait(self.index_true, "index to learn the primed prompts", 30)

    async def stop(self) -> None:
        await self.channel.close()
        await self.r.aclose()
        await self.app.stop()
        for rt in self.replicas.values():
            await rt.stop()
        await self.forger.stop()
        self.redis.close()

    async def wait(self, pred: Callable[[], bool] | Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> float:
        t0 = time.monotonic()
        while True:
            value = pred()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(what)
            await asyncio.sleep(0.01)

    def index_true(self) -> bool:
        idx = self.app.index
        for rid, rt in self.replicas.items():
            if idx.needs_resync(rid) or set(idx.holdings(rid).blocks) != set(rt.engine.cached_hashes()):
                return False
        return True

    async def requests(self) -> tuple[int, int]:
        """(misrouted, failures) over ``n`` requests; half are the primed prompts."""
        misrouted = failures = 0
        prompts = list(self.primed)
        for i in range(self.n):
            prompt = prompts[(i // 2) % 2] if i % 2 == 0 else f"fresh prompt {i} " + "y" * 24
            req = router_pb2.RouterGenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=2))
            try:
                msgs = [m async for m in self.stub.Generate(req, metadata=[("x-api-key", API_KEY)], timeout=30)]
            except grpc.aio.AioRpcError:
                failures += 1
                continue
            served = msgs[0].route.replica_id
            if served not in self.replicas or (prompt in self.primed and served != self.primed[prompt]):
                misrouted += 1
        return misrouted, failures


async def run_attack(stack: Stack, name: str, attack: Callable[[], Awaitable[None]] | None) -> Outcome:
    before = dict(stack.app.state_rejections.counts)
    forged_before = len(stack.forger.requests)
    stop = asyncio.Event()

    async def keep_attacking():
        while not stop.is_set():
            await attack()
            await asyncio.sleep(0.02)

    task = asyncio.create_task(keep_attacking()) if attack else None
    misrouted, failures = await stack.requests()
    stop.set()
    if task:
        await task
    # Clean up what the attacker wrote (the forged keys would otherwise keep being read).
    for key in await stack.r.keys(f"{PREFIX}:hb:evil*") + await stack.r.keys(f"{PREFIX}:hb:ghost*"):
        await stack.r.delete(key)
    recovery = await stack.wait(stack.index_true, f"index true after {name}", 30)
    forged = stack.forger.requests[forged_before:]
    after = stack.app.state_rejections.counts
    return Outcome(
        name, stack.n, misrouted + len(forged), sum(1 for r in forged if r.cache_salt), failures, round(recovery, 3),
        {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)},
    )


def attacks(stack: Stack) -> dict[str, Callable[[], Awaitable[None]] | None]:
    forger_addr = stack.forger.address
    other = stack.forger.signer
    dead = f"127.0.0.1:{free_port()}"

    def hb(rid: str, address: str) -> cache_pb2.Heartbeat:
        return cache_pb2.Heartbeat(replica_id=rid, address=address, epoch=int(time.time() * 1000), seq=1 << 40,
                                   timestamp=time.time(), cache=common_pb2.CacheState(capacity_blocks=4096, free_blocks=4096))

    async def forged_new_replica():
        await stack.r.set(KEYS.heartbeat("evil-0"), hb("evil-0", forger_addr).SerializeToString())
        await stack.r.set(KEYS.heartbeat("evil-1"), other.seal("hb", hb("evil-1", forger_addr).SerializeToString()))
        await stack.r.set(KEYS.heartbeat("evil-2"), await stack.r.get(KEYS.heartbeat("r0")))

    async def address_takeover():
        real = await stack.r.get(KEYS.heartbeat("r0"))
        if real is None:
            return
        payload = cache_pb2.Heartbeat.FromString(real[36:])
        payload.address, payload.seq = forger_addr, payload.seq + 1
        await stack.r.set(KEYS.heartbeat("r0"), real[:36] + payload.SerializeToString(), px=3000)

    async def replayed_heartbeat():
        await stack.r.set(KEYS.heartbeat("r0"), stack.old_r0_heartbeat, px=3000)

    async def forged_events():
        r1_hashes = list(stack.replicas["r1"].engine.cached_hashes())
        claim = cache_pb2.KVEventBatch(replica_id="r0", epoch=stack.replicas["r0"].publisher.epoch, seq=10**6,
                                       stored=r1_hashes + [os.urandom(16) for _ in range(3849)])
        removal = cache_pb2.KVEventBatch(replica_id="r1", epoch=stack.replicas["r1"].publisher.epoch,
                                         seq=stack.replicas["r1"].publisher.seq + 1, removed=r1_hashes)
        await stack.r.xadd(KEYS.events("r0"), {"b": claim.SerializeToString()})
        await stack.r.xadd(KEYS.events("r0"), {"b": other.seal("events", claim.SerializeToString())})
        await stack.r.xadd(KEYS.events("r1"), {"b": removal.SerializeToString()})
        old = await stack.r.xrange(KEYS.events("r1"), count=1)
        if old:
            await stack.r.xadd(KEYS.events("r0"), {"b": old[0][1][b"b"]})  # r1's batch in r0's stream

    async def ghost_replicas():
        for i in range(10):
            await stack.r.set(KEYS.heartbeat(f"ghost-{i}"), hb(f"ghost-{i}", dead).SerializeToString())

    return {
        "baseline (no attack)": None,
        "forged new replica": forged_new_replica,
        "address takeover": address_takeover,
        "replayed old heartbeat": replayed_heartbeat,
        "forged stored/removed events": forged_events,
        "10 ghost replicas at a dead address": ghost_replicas,
    }


async def direct_calls(stack: Stack) -> Outcome:
    """The attacker calls a replica directly with a captured salt (no credential, and a
    credential made with another key) for a prompt the victim has cached."""
    prompt = next(p for p, rid in stack.primed.items() if rid == "r0")
    req = replica_pb2.GenerateRequest(token_ids=replica_pb2.TokenIds(ids=list(prompt.encode())), cache_salt=stack.salt,
                                      sampling=common_pb2.SamplingParams(max_tokens=1))
    exposed = 0
    wrong = CallCredential(parse_cluster_key(new_cluster_key())).metadata()
    async with grpc.aio.insecure_channel(stack.replicas["r0"].address) as ch:
        stub = replica_pb2_grpc.ReplicaStub(ch)
        for i in range(stack.n):
            try:
                [m async for m in stub.Generate(req, timeout=10, metadata=None if i % 2 else wrong)]
                exposed += 1
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
    return Outcome("direct replica call with a captured salt", stack.n, 0, exposed, 0, 0.0,
                   {"refused UNAUTHENTICATED": stack.n - exposed})


async def main_async(args) -> list[Outcome]:
    stack = Stack(args.requests)
    await stack.start()
    try:
        out = [await run_attack(stack, name, fn) for name, fn in attacks(stack).items()]
        out.append(await direct_calls(stack))
        return out
    finally:
        await stack.stop()


def write(outcomes: list[Outcome], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attacks.json").write_text(json.dumps(
        {"command": f".venv/bin/python -m bench.attacks --requests {args.requests}",
         "outcomes": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    lines = [
        "# Control-plane attacks (bench/attacks.py)", "",
        f"`.venv/bin/python -m bench.attacks --requests {args.requests}`: two real replicas, the router, a",
        "password-protected Redis the attacker can write, a forger without the cluster key.", "",
        "| attack | requests | misrouted | salts exposed | client failures | index true after (s) | dropped by the router |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(o.rejected.items())) or "-"
        lines.append(f"| {o.attack} | {o.requests} | {o.misrouted} | {o.salts_exposed} | {o.client_failures} | "
                     f"{o.index_true_after_s:.3f} | {dropped} |")
    (RESULTS / "attacks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="client requests per attack")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    write(asyncio.run(main_async(args)), args)


if __name__ == "__main__":
    main()
