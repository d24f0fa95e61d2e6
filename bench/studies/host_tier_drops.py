"""Why a host tier under unicache can lose to lru on both tiers: where the misses come from.

Replays tuning traces only (generated mixes of seeds 100 and up, labelled or with labels
hidden, and the first quarter of the Mooncake trace, which bench.host_tier_report does
not report on) with a GPU pool and a host tier, for each (GPU policy, host policy), and
sorts every prompt block that a request had to compute (a miss) by why:

    compulsory   the hash was never cached before;
    interleaved  the hash is cached (GPU or host) but the match stopped before it: the
                 run GPU prefix + host continuation ends at a block that the *other* tier
                 holds (a parent demoted while its child stays on the GPU);
    broken       the hash is cached but an earlier block of the request is in no tier;
    dropped      the host tier evicted it (by the host lane it was evicted from, for
                 unicache: ``queue/lane``);
    other        cached once, now in no tier, not dropped by the host (an in-flight
                 request computed it, or it was never demoted).

It also counts host evictions per lane (the lane a GPU-style UniCache host policy took
them from), with the mean age at eviction, the lane's alpha and the share requested again
("missed after"), and evictions of a block that still had a child in the host tier.

Host policies (``--configs GPU+HOST``): any registry name (``unicache`` is the production
host rule, ``HostUniCachePolicy``: the evict-first queue first, then demotion order), and
the variants below, each measured as losing to it on these traces (figures in
``replica/eviction/unicache/host.py``):

    lanes            (``unicache`` before: ``UniCachePolicy`` on the host) lane scores,
                     alpha x session-gap horizon, the novel lane first
    recency          score alpha / age, age from the block's last GPU release
    demoted          the lane scores with ages from the demotion
    demoted-recency  alpha / age from the demotion
    ef-fifo          the production rule written on the lane heaps (same figures)
    novel-fifo       the novel lane first, then demotion order
    alpha-fifo       the lane of the lowest alpha first, demotion order within

    nice -n 10 .venv/bin/python -m bench.studies.host_tier_drops [--traces mix100,mix101h,mooncake0]
        [--gpu-fracs 0.05,0.10] [--host-multiples 4,10] [--configs lru+lru,unicache+unicache,unicache+lanes]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from unicache.replica.eviction.registry import make_host_policy
from unicache.replica.eviction.unicache.lanes import EVICT_FIRST, LANE_QUEUE, NUM_LANES, QUEUE_NAMES
from unicache.replica.eviction.unicache.policy import UniCachePolicy
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.eviction.base import ReleaseInfo
from unicache.sim.prepare import PreparedTrace, prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.suite import mooncake_slice
from unicache.trace import read_trace
from bench.eviction_tuning import mix_trace
from bench.paths import mooncake_trace


def lane_name(lane: int) -> str:
    return f"{QUEUE_NAMES[lane // NUM_LANES]}/{lane % NUM_LANES}"


class RecordingHostTier(HostTier):
    """A host tier that remembers what it evicted (hash -> lane name) and counts them."""

    def __init__(self, num_blocks, policy, dropped: dict, evictions: Counter):
        super().__init__(num_blocks, policy)
        self.dropped, self.eviction_lanes = dropped, evictions
        self.ages: Counter = Counter()  # lane -> summed age (now - heap key) at eviction
        self._kids: dict = {}  # host hash -> its children's hashes in the host tier
        self._parent_of: dict = {}
        self.with_children = 0  # evictions of a block with a child in the host tier

    def _leave(self, h):
        self._kids.pop(h, None)
        p = self._parent_of.pop(h, None)
        if p is not None and p in self._kids:
            self._kids[p].discard(h)

    def take(self, block_hash, cls, now):
        self._leave(block_hash)
        return super().take(block_hash, cls, now)

    def discard(self, block_hash):
        self._leave(block_hash)
        super().discard(block_hash)

    def put(self, block_hash, parent_hash, info, now, parent_on_gpu=False):
        if getattr(self.policy, "demotion_time", False):
            info = ReleaseInfo(info.cls, info.position, info.num_blocks, info.is_decode, now)
        slot, evicted = super().put(block_hash, parent_hash, info, now, parent_on_gpu)
        self.dropped.pop(block_hash, None)
        if evicted is not None:
            if self._kids.get(evicted):
                self.with_children += 1
            self._leave(evicted)
        if slot is not None and parent_hash is not None and parent_hash in self:
            self._kids.setdefault(parent_hash, set()).add(block_hash)
            self._parent_of[block_hash] = parent_hash
        if evicted is not None:
            ghosts = getattr(getattr(self.policy, "weights", None), "ghosts", None)
            ghost = ghosts.get(evicted) if ghosts is not None else None
            name = lane_name(ghost[0]) if ghost is not None else self.policy.name
            self.dropped[evicted] = name
            self.eviction_lanes[name] += 1
            if ghost is not None:
                self.ages[name] += now - ghost[1]
        return slot, evicted


class DiagnosedReplay(Replay):
    """A replay that sorts every missed prompt block by cause (module docstring)."""

    def __init__(self, trace: PreparedTrace, config: ReplayConfig, host_factory=None):
        self.dropped: dict = {}
        self.evictions: Counter = Counter()
        self.causes: Counter = Counter()
        self.regret: Counter = Counter()
        self.seen: set = set()
        self._host_factory = host_factory
        super().__init__(trace, config)
        for rep in self.replicas:
            rep.store.allocate = self._wrap(rep.store)

    def _make_host(self, scale: int):
        cfg = self.config
        if not cfg.host_capacity_blocks:
            return None
        policy = self._host_factory() if self._host_factory else make_host_policy(cfg.host_policy)
        return RecordingHostTier(cfg.host_capacity_blocks * scale, policy, self.dropped, self.evictions)

    def _wrap(self, store):
        allocate = store.allocate

        def diagnosed(request_id, block_hashes, num_tokens, cls, now, num_prompt_tokens=None):
            alloc = allocate(request_id, block_hashes, num_tokens, cls, now, num_prompt_tokens)
            self._diagnose(store, block_hashes, alloc.num_hit_blocks)
            return alloc

        return diagnosed

    def _diagnose(self, store, hashes, hits: int) -> None:
        gpu, host = store._cached, store.host
        causes, seen, dropped = self.causes, self.seen, self.dropped
        in_tier_run = True
        for i in range(hits, len(hashes)):
            h = hashes[i]
            cached = h in gpu or (host is not None and h in host)
            if h not in seen:
                cause = "compulsory"
                in_tier_run = False
            elif cached:
                # NOTE: the allocation already promoted its host hits, so a block the
                # other tier holds right after the match is an interleaved miss.
                cause = "interleaved" if in_tier_run else "broken"
            elif h in dropped:
                cause = "dropped " + dropped[h]
                if i == hits or in_tier_run:
                    self.regret[dropped[h]] += 1
                in_tier_run = False
            else:
                cause = "other"
                in_tier_run = False
            causes[cause] += 1
        seen.update(hashes)


class RecencyHostUniCache(UniCachePolicy):
    """Host variant: score = alpha / age (the lane's reuse probability, spread over the
    block's age since its last use), the novel lane emptied first as on the GPU."""

    novel_first = True

    def _score(self, lane: int, age: float) -> float:
        return self.weights.alpha[lane] / (age + 1e-9)

    def _choose(self, scores):
        if self.novel_first:
            return super()._choose(scores)
        return scores.index(min(scores))


class RecencyHostUniCacheNoNovel(RecencyHostUniCache):
    novel_first = False


class DemotionTimeUniCache(UniCachePolicy):
    """Host variant: a block's age runs from its demotion, not its last GPU release."""

    demotion_time = True


class DemotionTimeRecency(RecencyHostUniCache):
    demotion_time = True


class EvictFirstThenDemotionOrder(UniCachePolicy):
    """Host variant: the evict-first queue first, then every lane in demotion order."""

    demotion_time = True
    dead_queues = (EVICT_FIRST,)

    def _score(self, lane: int, age: float) -> float:
        return (0.0 if LANE_QUEUE[lane] in self.dead_queues else 2.0) + 1.0 / (1.0 + age)

    def _choose(self, scores):
        return scores.index(min(scores))


class NovelThenDemotionOrder(EvictFirstThenDemotionOrder):
    """Host variant: the novel lane first (as on the GPU), then demotion order."""

    dead_queues = ()

    def _choose(self, scores):
        return UniCachePolicy._choose(self, scores)


class AlphaThenDemotionOrder(EvictFirstThenDemotionOrder):
    """Host variant: the lane of the lowest measured reuse first, demotion order within."""

    def _score(self, lane: int, age: float) -> float:
        return self.weights.alpha[lane] + 1e-6 / (1.0 + age)


HOST_VARIANTS = {"lanes": UniCachePolicy, "alpha-fifo": AlphaThenDemotionOrder, "ef-fifo": EvictFirstThenDemotionOrder, "novel-fifo": NovelThenDemotionOrder, "demoted": DemotionTimeUniCache, "demoted-recency": DemotionTimeRecency, "recency": RecencyHostUniCache, "recency-nonovel": RecencyHostUniCacheNoNovel}


def load(name: str) -> PreparedTrace:
    base, _, duration = name.partition("@")
    if base.startswith("mix") and int(base[3:].removesuffix("h")) >= 100:
        # mixSEED[h][@SECONDS]: labelled, or labels hidden (h: the classifier infers the
        # classes); 1200 s unless @SECONDS says otherwise.
        return mix_trace(int(base[3:].removesuffix("h")), float(duration or 1200.0), 16, base.endswith("h"))
    if name == "mooncake0":
        # Slice 0 of 4: the first quarter, which bench.host_tier_report does not report on.
        return prepare(mooncake_slice(read_trace(mooncake_trace()), 0, 4), 512)
    raise ValueError(f"unknown trace {name!r} (mixSEED, mixSEEDh with seeds >= 100, mooncake0: tuning data only)")


CONFIGS = [("lru", "lru"), ("unicache", "lru"), ("unicache", "unicache"), ("unicache", "lanes")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="mix100,mix101h,mooncake0")
    ap.add_argument("--gpu-fracs", default="0.05,0.10")
    ap.add_argument("--host-multiples", default="4,10")
    ap.add_argument("--configs", default=",".join(f"{g}+{h}" for g, h in CONFIGS))
    args = ap.parse_args(argv)
    configs = [tuple(c.split("+")) for c in args.configs.split(",")]
    for name in args.traces.split(","):
        trace = load(name)
        print(f"## {name}: {len(trace.requests)} requests, {trace.unique_blocks} unique blocks, "
              f"{trace.block_accesses} accesses\n")
        for frac in (float(f) for f in args.gpu_fracs.split(",")):
            gpu = int(frac * trace.unique_blocks)
            for m in (int(x) for x in args.host_multiples.split(",")):
                print(f"### GPU {frac:.0%} ({gpu}), host {m}x\n")
                for gp, hp in configs:
                    t0 = time.process_time()
                    factory = HOST_VARIANTS.get(hp)
                    cfg = ReplayConfig(gp, gpu, host_capacity_blocks=m * gpu, host_policy="unicache" if factory else hp)
                    rep = DiagnosedReplay(trace, cfg, factory)
                    rec = rep.run()
                    acc = trace.block_accesses
                    top = ", ".join(f"{k} {100 * v / acc:.2f}" for k, v in sorted(rep.causes.items()))
                    print(f"- {gp}+{hp}: hit {100 * rec['block_hit_ratio']:.2f} (host "
                          f"{100 * rec['host_hit_ratio']:.2f}); misses % of accesses: {top} "
                          f"[{time.process_time() - t0:.1f}s]")
                    host = rep.replicas[0].store.host
                    alpha = getattr(host.policy, "alpha", None)
                    rows = []
                    for k, v in sorted(rep.evictions.items()):
                        missed = rep.causes.get("dropped " + k, 0)
                        row = f"{k} {v} (missed after {100 * missed / v:.0f}%"
                        if k in host.ages and alpha is not None:
                            q, lane = k.split("/")
                            idx = QUEUE_NAMES.index(q) * NUM_LANES + int(lane)
                            row += f", age {host.ages[k] / v:.0f}s, alpha {alpha[idx]:.2f}"
                        rows.append(row + ")")
                    print(f"  - host evictions: {', '.join(rows) or 'none'}")
                    print(f"  - host evictions of a block with a host child: {host.with_children}")
                print()
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
