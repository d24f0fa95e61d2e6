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

Issue 39's rows: a process on a killed replica's ports (gRPC and hop, one router per
transport): requests it received, bearer credentials it captured (and whether one replays
on another replica), client failures; a relay between the router and the genuine replica's
hop: requests it could read; every heartbeat and summary key deleted at 20 Hz for 6 s:
client failures; malformed client requests (HTTP and gRPC): how many are refused with the
status docs/openai.md gives. Router and replicas run with mutual TLS (unicache/plumbing/tls.py), the
default; ``--insecure-no-tls`` runs them with the named opt-out instead (``insecure_no_tls``);
``--cpu`` measures the routers' CPU per request with and without TLS on both transports
(router processes, a fake replica; rounds interleaved).

Run: ``.venv/bin/python -m bench.attacks [--requests 20] [--insecure-no-tls] [--cpu]``; writes
bench/results/attacks[-insecure-no-tls].json and .md, and attacks-cpu.json with ``--cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import redis.asyncio as aioredis

from unicache.contract.redis_keys import RedisKeys
from unicache.contract.state_auth import CALL_METADATA, CallCredential, StateAuthError, StateSigner, new_cluster_key, parse_cluster_key
from unicache.plumbing.redis_server import EmbeddedRedis, free_port
from unicache.plumbing.tls import ClientTls, ClusterCA, make_cluster_pki, write_tls_files
from unicache.replica.runtime import ReplicaRuntime
from unicache.replica.settings import ReplicaSettings
from unicache.router.app import RouterApp
from unicache.router.config import build_config
from unicache.router.upstream.replica_client import ReplicaClients
from unicache.testing.fake_replica import FakeReplica
from unicache.testing.tcp_relay import RecordingRelay
from unicache.v1 import cache_pb2, common_pb2, replica_pb2, replica_pb2_grpc, router_pb2, router_pb2_grpc
from bench.paths import RESULTS

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
    def __init__(self, requests: int, tls: bool = True):
        self.n = requests
        self.tls = tls
        self.key = new_cluster_key()
        self.pki_dir = tempfile.mkdtemp(prefix="atk-pki-")
        self.router_files = None
        if tls:
            self.router_files, self.replica_tls = make_cluster_pki(self.pki_dir, ["r0", "r1"])
        self.redis = EmbeddedRedis(password=os.urandom(12).hex())
        self.replicas: dict[str, ReplicaRuntime] = {}
        self.forger = FakeReplica("forger", block_size=BS)
        self.forger.signer = StateSigner(parse_cluster_key(new_cluster_key()))
        self.app: RouterApp | None = None

    async def start(self) -> None:
        self.redis.start()
        for rid in ("r0", "r1"):
            await self.start_replica(rid)
        await self.forger.start()
        self.app = RouterApp(self.router_config("auto"), subscriber_kwargs=SUBSCRIBER)
        await self.app.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.app.grpc_port}")
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        # A second router on the gRPC transport, following the same Redis (issue 39's setup).
        self.app_grpc = RouterApp(self.router_config("grpc"), subscriber_kwargs=SUBSCRIBER)
        await self.app_grpc.start()
        self.channel_grpc = grpc.aio.insecure_channel(f"127.0.0.1:{self.app_grpc.grpc_port}")
        self.stub_grpc = router_pb2_grpc.RouterStub(self.channel_grpc)
        self.r = aioredis.Redis.from_url(self.redis.url, socket_timeout=5)
        await self.wait(self.both_admitted, "replicas admitted")
        self.old_r0_heartbeat = await self.r.get(KEYS.heartbeat("r0"))  # replayed later, when it is old
        self.salt = self.app.auth.cache_salt(TENANT)
        # Prime: each replica caches its own prompts (sent to it directly, as the router would).
        self.primed: dict[str, str] = {}
        clients = self.replica_clients()
        for i, rid in enumerate(("r0", "r1")):
            prompt = f"cached prompt of {rid}: " + "x" * 48
            self.primed[prompt] = rid
            req = replica_pb2.GenerateRequest(
                token_ids=replica_pb2.TokenIds(ids=list(prompt.encode())), cache_salt=self.salt,
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
            stream = clients.generate(self.replicas[rid].address, req, 60, replica_id=rid)
            while await stream.next() is not None:
                pass
        await clients.close()
        await self.wait(self.index_true, "index to learn the primed prompts", 30)

    def replica_clients(self) -> ReplicaClients:
        """What the router dials replicas with (gRPC transport)."""
        cred = CallCredential(parse_cluster_key(self.key))
        return ReplicaClients(credential=cred, transport="grpc", tls=ClientTls(self.router_files) if self.tls else None)

    def settings(self, rid: str) -> ReplicaSettings:
        tls = dict(zip(("tls_ca", "tls_cert", "tls_key"), self.replica_tls)) if self.tls else {"insecure_no_tls": True}
        return ReplicaSettings(
            replica_id=rid, redis_url=self.redis.url, redis_prefix=PREFIX, cluster_key=self.key, model_preset="tiny",
            block_size=BS, num_blocks=4096,  # nothing is evicted: a cached prompt stays where it is
            eviction_policy="lru", device="cpu", default_max_tokens=2, **tls,
        )

    async def start_replica(self, rid: str) -> None:
        self.replicas[rid] = ReplicaRuntime(self.settings(rid))
        await self.replicas[rid].start()

    def router_config(self, transport: str, **overrides):
        tls = {"insecure_no_tls": True}
        if self.tls:
            f = self.router_files
            tls = {"replica_tls_ca": f.ca, "replica_tls_cert": f.cert, "replica_tls_key": f.key}
        return build_config(
            env={"UNICACHE_API_KEYS": f"{API_KEY}:{TENANT}", "UNICACHE_SALT_SECRET": "atk-salt", "UNICACHE_CLUSTER_KEY": self.key},
            overrides={"grpc_port": 0, "http_port": 0, "redis_url": self.redis.url, "redis_prefix": PREFIX,
                       "block_size": BS, "tokenizer": "byte", "replica_transport": transport, **tls, **overrides},
        )

    def both_admitted(self) -> bool:
        want = sorted(self.replicas)
        return all(sorted(a.cluster.replicas) == want and not any(r.quarantined for r in a.cluster.replicas.values())
                   for a in (self.app, self.app_grpc))

    async def stop(self) -> None:
        await self.channel.close()
        await self.channel_grpc.close()
        await self.r.aclose()
        await self.app.stop()
        await self.app_grpc.stop()
        for rt in self.replicas.values():
            await rt.stop()
        await self.forger.stop()
        self.redis.close()
        shutil.rmtree(self.pki_dir, ignore_errors=True)

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

    async def requests(self, stub=None, n: int | None = None) -> tuple[int, int]:
        """(misrouted, failures) over ``n`` requests; half are the primed prompts."""
        misrouted = failures = 0
        prompts = list(self.primed)
        stub = stub or self.stub
        for i in range(self.n if n is None else n):
            prompt = prompts[(i // 2) % 2] if i % 2 == 0 else f"fresh prompt {i} " + "y" * 24
            req = router_pb2.RouterGenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=2))
            try:
                msgs = [m async for m in stub.Generate(req, metadata=[("x-api-key", API_KEY)], timeout=30)]
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
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(stack.replicas["r0"].address) as ch:
        stub = replica_pb2_grpc.ReplicaStub(ch)
        for i in range(stack.n):
            try:
                [m async for m in stub.Generate(req, timeout=10, metadata=None if i % 2 else wrong)]
                exposed += 1
            except grpc.aio.AioRpcError as exc:
                # NOTE: UNAUTHENTICATED without TLS; with it the handshake fails first (UNAVAILABLE).
                codes[f"refused {exc.code().name}"] = codes.get(f"refused {exc.code().name}", 0) + 1
    return Outcome("direct replica call with a captured salt", stack.n, 0, exposed, 0, 0.0, codes)


# --- issue 39: port takeover, handshake relay, deleted keys ----------------------------
async def crash(stack: Stack, rid: str) -> tuple[int, int]:
    """Kill replica ``rid`` as a crash would (its heartbeat stays until the TTL); returns
    its freed (gRPC, hop) ports."""
    rt = stack.replicas.pop(rid)
    ports = (rt.server.port, rt.server.hop_port)
    await rt.publisher.stop(remove_heartbeat=False)
    rt.publisher = None
    rt.server.grace_s = 0.0
    await rt.stop()
    return ports


async def takeover(stack: Stack, transport: str) -> Outcome:
    """r1 crashes; 43 ms later a process binds its gRPC and hop ports (no cluster key; under
    TLS a certificate for r1 from its own CA). The client sends ``n`` requests through the
    router on ``transport``; r1 restarts on new ports afterwards."""
    app, stub = (stack.app, stack.stub) if transport == "auto" else (stack.app_grpc, stack.stub_grpc)
    impostor = FakeReplica("r1", block_size=BS)
    ports = await crash(stack, "r1")
    await asyncio.sleep(0.043)
    files = None
    if stack.tls:
        other = ClusterCA("impostor CA")
        files = write_tls_files(stack.pki_dir, "impostor", other.cert_pem, other.issue_replica("r1"))
    await impostor.start(hop=True, tls=files, port=ports[0], hop_port=ports[1])
    sent = misrouted = failures = 0
    t_end = time.monotonic() + 15.0
    try:
        # NOTE: requests until the router has let r1 go (its heartbeat stopped), the whole
        # window in which the impostor could be sent anything; at least ``n``.
        while sent < stack.n or ("r1" in app.cluster.replicas and time.monotonic() < t_end):
            m, f = await stack.requests(stub, 2)
            sent, misrouted, failures = sent + 2, misrouted + m, failures + f
    finally:
        await impostor.stop()
    # NOTE: a request the impostor answered is misrouted in the client's view too: count it once.
    got = impostor.requests
    captured = [keys for keys in impostor.metadata_keys if CALL_METADATA in keys]
    replay = "-"
    if captured:
        replay = "accepted by r0" if await replays(stack, impostor) else "refused by r0"
    await stack.start_replica("r1")
    await stack.wait(stack.both_admitted, "r1 back in both routers", 60)
    await stack.wait(stack.index_true, "index true after the takeover", 60)
    return Outcome(f"port takeover of a crashed replica ({'hop' if transport == 'auto' else 'gRPC'} router)", sent,
                   max(misrouted, len(got)), sum(1 for r in got if r.cache_salt), failures, 0.0,
                   {"impostor requests": len(got), "credentials captured": len(captured), "replay": replay})


async def replays(stack: Stack, impostor: FakeReplica) -> bool:
    """Whether a credential the impostor captured opens r0 (GetCacheSummary, replayed)."""
    token = getattr(impostor, "last_credential", None)
    if token is None:
        return False
    async with grpc.aio.insecure_channel(stack.replicas["r0"].address) as ch:
        try:
            await replica_pb2_grpc.ReplicaStub(ch).GetCacheSummary(
                replica_pb2.GetCacheSummaryRequest(nonce=os.urandom(16)), timeout=5, metadata=((CALL_METADATA, token),))
            return True
        except grpc.aio.AioRpcError:
            return False


async def relay(stack: Stack) -> Outcome:
    """A relay between a router and the genuine r1's hop forwards every byte both ways
    (the issue's handshake relay); counts the requests whose prompt it saw in clear."""
    r1 = stack.replicas["r1"]
    relay_tap = await RecordingRelay(r1.server.hop_port).start()
    seen, relay_addr = relay_tap.seen, relay_tap.address
    app = RouterApp(stack.router_config("auto", use_redis=False, routing_policy="round_robin",
                                        replicas=f"r1={r1.address}@{relay_addr}"))
    await app.start()
    prompts = [f"relayed secret prompt {i} " + "q" * 24 for i in range(stack.n)]
    failures = 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            for p in prompts:
                req = router_pb2.RouterGenerateRequest(text=p, sampling=common_pb2.SamplingParams(max_tokens=2))
                try:
                    [m async for m in stub.Generate(req, metadata=[("x-api-key", API_KEY)], timeout=30)]
                except grpc.aio.AioRpcError:
                    failures += 1
    finally:
        await app.stop()
        await relay_tap.close()
    read = sum(1 for p in prompts if p.encode() in seen)
    salt = stack.app.auth.cache_salt(TENANT)
    return Outcome("relay between router and the genuine replica (hop)", stack.n, 0, int(salt in seen) * read, failures, 0.0,
                   {"requests read by the relay": read, "bytes relayed": len(seen)})


def malformed_inputs() -> list[tuple[str, str, str, object, dict | None, int]]:
    """(name, method, path, body (bytes: sent as is), extra headers, expected HTTP status)
    of malformed client requests; docs/openai.md's error table gives each status."""
    deep: object = "x"
    for _ in range(65):
        deep = [deep]
    ok = {"prompt": "a valid prompt"}
    return [
        ("invalid JSON", "POST", "/v1/completions", b"{", None, 400),
        ("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400),
        ("lone surrogate", "POST", "/v1/completions", b'{"prompt": "\\ud800"}', None, 400),
        ("nesting deeper than 64", "POST", "/v1/completions", {"prompt": "x", "user": deep}, None, 400),
        ("no prompt", "POST", "/v1/completions", {}, None, 400),
        ("prompt of the wrong type", "POST", "/v1/completions", {"prompt": 5}, None, 400),
        ("token id outside the vocabulary", "POST", "/v1/completions", {"prompt": [10**9]}, None, 400),
        ("a batch of 65 prompts", "POST", "/v1/completions", {"prompt": ["p"] * 65}, None, 400),
        ("negative max_tokens", "POST", "/v1/completions", {**ok, "max_tokens": -1}, None, 400),
        ("max_tokens of the wrong type", "POST", "/v1/completions", {**ok, "max_tokens": "many"}, None, 400),
        ("max_tokens 0 without echo", "POST", "/v1/completions", {**ok, "max_tokens": 0}, None, 400),
        ("temperature out of range", "POST", "/v1/completions", {**ok, "temperature": 3}, None, 400),
        ("top_p out of range", "POST", "/v1/completions", {**ok, "top_p": -0.5}, None, 400),
        ("n of 0", "POST", "/v1/completions", {**ok, "n": 0}, None, 400),
        ("stop of the wrong type", "POST", "/v1/completions", {**ok, "stop": 5}, None, 400),
        ("unknown parameter", "POST", "/v1/completions", {**ok, "frobnicate": 1}, None, 400),
        ("non-empty logit_bias", "POST", "/v1/completions", {**ok, "logit_bias": {"1": 5}}, None, 400),
        ("stream_options without stream", "POST", "/v1/completions", {**ok, "stream_options": {"include_usage": True}}, None, 400),
        ("top_logprobs on completions", "POST", "/v1/completions", {**ok, "top_logprobs": 2}, None, 400),
        ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, None, 400),
        ("echo on chat", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, None, 400),
        ("another model", "POST", "/v1/completions", {**ok, "model": "not-served"}, None, 404),
        ("no API key", "POST", "/v1/completions", ok, {"x-api-key": ""}, 401),
        ("unknown API key", "POST", "/v1/completions", ok, {"x-api-key": "not-a-key"}, 401),
        ("unknown path", "POST", "/v1/nothing", ok, None, 404),
        ("wrong method", "GET", "/v1/completions", None, None, 405),
        ("body over max_request_bytes", "POST", "/v1/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}', None, 413),
    ]


async def bad_inputs(stack: Stack) -> Outcome:
    """Malformed client requests through the router's HTTP API (``malformed_inputs``) and
    gRPC API: how many are refused with the expected status (HTTP: in OpenAI's error shape,
    a non-null ``code``)."""
    import httpx

    refused, wrong = 0, {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stack.app.http_port}", timeout=30) as client:
        for name, method, path, body, headers, status in malformed_inputs():
            h = {"x-api-key": API_KEY, "content-type": "application/json", **(headers or {})}
            h = {k: v for k, v in h.items() if v}
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            r = await client.request(method, path, content=content, headers=h)
            try:
                shaped = r.json()["error"]["code"] is not None
            except (ValueError, KeyError, TypeError):
                shaped = False
            if r.status_code == status and shaped:
                refused += 1
            else:
                wrong[f"{name}: got {r.status_code}"] = 1
    grpc_cases = [
        ("no prompt", router_pb2.RouterGenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1)), API_KEY, grpc.StatusCode.INVALID_ARGUMENT),
        ("another model", router_pb2.RouterGenerateRequest(text="p", model="not-served"), API_KEY, grpc.StatusCode.NOT_FOUND),
        ("chat_json not JSON", router_pb2.RouterGenerateRequest(chat_json="[{"), API_KEY, grpc.StatusCode.INVALID_ARGUMENT),
        ("no API key", router_pb2.RouterGenerateRequest(text="p"), None, grpc.StatusCode.UNAUTHENTICATED),
        ("unknown API key", router_pb2.RouterGenerateRequest(text="p"), "not-a-key", grpc.StatusCode.UNAUTHENTICATED),
    ]
    for name, req, key, code in grpc_cases:
        try:
            [m async for m in stack.stub.Generate(req, metadata=[("x-api-key", key)] if key else None, timeout=30)]
            wrong[f"gRPC {name}: served"] = 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == code:
                refused += 1
            else:
                wrong[f"gRPC {name}: got {exc.code().name}"] = 1
    n = len(malformed_inputs()) + len(grpc_cases)
    return Outcome("malformed client inputs (HTTP and gRPC)", n, 0, 0, n - refused, 0.0,
                   {"refused with the expected status": refused, **wrong})


async def deleted_keys(stack: Stack, seconds: float = 6.0) -> Outcome:
    """Every heartbeat and summary key deleted at 20 Hz for ``seconds`` while the client
    sends requests through both routers; client failures are the 503s of the issue."""
    stop = asyncio.Event()

    async def delete():
        while not stop.is_set():
            await stack.r.delete(*[k for rid in stack.replicas for k in (KEYS.heartbeat(rid), KEYS.summary(rid))])
            await asyncio.sleep(0.05)

    task = asyncio.create_task(delete())
    sent = failures = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for stub in (stack.stub, stack.stub_grpc):
            _, failed = await stack.requests(stub, 1)
            sent, failures = sent + 1, failures + failed
    stop.set()
    await task
    await stack.wait(stack.both_admitted, "replicas after the deletions", 30)
    await stack.wait(stack.index_true, "index true after the deletions", 60)
    kept = stack.app.subscriber.kept_alive + stack.app_grpc.subscriber.kept_alive
    return Outcome(f"heartbeat and summary keys deleted at 20 Hz for {seconds:g} s", sent, 0, 0, failures, 0.0,
                   {"kept by their own proof": kept})


# --- router CPU per request: TLS on / off, both transports ------------------------------
CPU_VARIANTS = ("hop", "grpc", "hop+tls", "grpc+tls")


async def _router_process(variant: str, replica: FakeReplica, key: str, pki_dir: str, router_files) -> tuple:
    """A ``unicache router`` process with ``replica`` as its static replica; (process, stub)."""
    import subprocess
    import sys

    port, http = free_port(), free_port()
    transport = "grpc" if variant.startswith("grpc") else "auto"
    cmd = [sys.executable, "-m", "unicache.cli.main", "router", "--grpc-port", str(port), "--http-port", str(http),
           "--use-redis", "false", "--auth-enabled", "false", "--replica-transport", transport, "--block-size", str(BS),
           "--tokenizer", "byte", "--replicas", f"r0={replica.address}@127.0.0.1:{replica.hop.port}"]
    if variant.endswith("+tls"):
        cmd += ["--replica-tls-ca", router_files.ca, "--replica-tls-cert", router_files.cert, "--replica-tls-key", router_files.key]
    else:
        cmd += ["--insecure-no-tls", "true"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, UNICACHE_CLUSTER_KEY=key), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.RouterStub(channel)
    for _ in range(300):
        try:
            await _one(stub, "warm-up")
            return proc, channel, stub
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)
    raise TimeoutError(f"router {variant} did not serve")


async def _one(stub, text: str) -> None:
    req = router_pb2.RouterGenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=1))
    [m async for m in stub.Generate(req, timeout=30)]


async def router_cpu(rounds: int, per_round: int, concurrency: int) -> dict:
    """Router CPU ms per request for each variant (its process's utime + stime over
    ``per_round`` requests, ``concurrency`` at a time, after a warm-up that opens its
    connections), rounds interleaved and rotated so drift hits every variant alike."""
    import tempfile

    from unicache.testing.procfs import cpu_s
    from unicache.plumbing.tls import ClusterCA, write_tls_files

    key = new_cluster_key()
    pki_dir = tempfile.mkdtemp(prefix="atk-pki-")
    ca = ClusterCA()
    r0_files = write_tls_files(pki_dir, "r0", ca.cert_pem, ca.issue_replica("r0"))
    router_files = write_tls_files(pki_dir, "router", ca.cert_pem, ca.issue_router())
    plain, secure = FakeReplica("r0", block_size=BS), FakeReplica("r0", block_size=BS)
    await plain.start(hop=True, cluster_key=parse_cluster_key(key))
    await secure.start(hop=True, cluster_key=parse_cluster_key(key), tls=r0_files)
    routers = {}
    try:
        for v in CPU_VARIANTS:
            routers[v] = await _router_process(v, secure if v.endswith("+tls") else plain, key, pki_dir, router_files)
        samples: dict[str, list[float]] = {v: [] for v in CPU_VARIANTS}
        for r in range(rounds):
            order = CPU_VARIANTS[r % len(CPU_VARIANTS):] + CPU_VARIANTS[: r % len(CPU_VARIANTS)]
            for v in order:
                proc, _, stub = routers[v]
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with sem:
                        await _one(stub, f"cpu {v} {r} {i} " + "z" * 40)

                before = cpu_s(proc.pid)
                await asyncio.gather(*(one(i) for i in range(per_round)))
                samples[v].append((cpu_s(proc.pid) - before) * 1000 / per_round)
        out = {}
        for v, xs in samples.items():
            xs = sorted(xs)
            out[v] = {"median_ms": round(xs[len(xs) // 2], 4), "rounds_ms": [round(x, 4) for x in samples[v]]}
        for t in ("hop", "grpc"):
            out[f"{t}+tls / {t}"] = round(out[f"{t}+tls"]["median_ms"] / out[t]["median_ms"], 3)
        out["grpc+tls / hop+tls"] = round(out["grpc+tls"]["median_ms"] / out["hop+tls"]["median_ms"], 3)
        return out
    finally:
        for proc, channel, _ in routers.values():
            await channel.close()
            proc.terminate()
            proc.wait(10)
        await plain.stop()
        await secure.stop()
        import shutil

        shutil.rmtree(pki_dir, ignore_errors=True)


async def main_async(args) -> list[Outcome]:
    stack = Stack(args.requests, tls=not args.insecure_no_tls)
    await stack.start()
    try:
        out = [await run_attack(stack, name, fn) for name, fn in attacks(stack).items()]
        out.append(await direct_calls(stack))
        for transport in ("auto", "grpc"):
            out.append(await takeover(stack, transport))
        out.append(await relay(stack))
        out.append(await bad_inputs(stack))
        out.append(await deleted_keys(stack))
        return out
    finally:
        await stack.stop()


def write(outcomes: list[Outcome], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "attacks-insecure-no-tls" if args.insecure_no_tls else "attacks"
    command = f".venv/bin/python -m bench.attacks --requests {args.requests}" + (" --insecure-no-tls" if args.insecure_no_tls else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": command, "outcomes": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    lines = [
        "# Control-plane attacks (bench/attacks.py)", "",
        f"`{command}`: two real replicas, two routers (hop and gRPC transports), a",
        "password-protected Redis the attacker can write, a forger without the cluster key"
        + (", no TLS between routers and replicas (the insecure_no_tls opt-out)." if args.insecure_no_tls
           else ", mutual TLS between routers and replicas (the default)."), "",
        "| attack | requests | misrouted | salts exposed | client failures | index true after (s) | dropped by the router |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(o.rejected.items())) or "-"
        lines.append(f"| {o.attack} | {o.requests} | {o.misrouted} | {o.salts_exposed} | {o.client_failures} | "
                     f"{o.index_true_after_s:.3f} | {dropped} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="client requests per attack")
    ap.add_argument("--insecure-no-tls", action="store_true",
                    help="routers and replicas without mutual TLS (the insecure_no_tls opt-out); default: mutual TLS")
    ap.add_argument("--cpu", action="store_true", help="only the routers' CPU per request, TLS on and off, both transports")
    ap.add_argument("--cpu-rounds", type=int, default=5)
    ap.add_argument("--cpu-requests", type=int, default=400, help="requests per variant per round")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.cpu:
        out = asyncio.run(router_cpu(args.cpu_rounds, args.cpu_requests, concurrency=4))
        out["command"] = f".venv/bin/python -m bench.attacks --cpu --cpu-rounds {args.cpu_rounds} --cpu-requests {args.cpu_requests}"
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "attacks-cpu.json").write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))
        return
    write(asyncio.run(main_async(args)), args)


if __name__ == "__main__":
    main()
