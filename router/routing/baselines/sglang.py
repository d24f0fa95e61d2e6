"""``sglang``: a faithful baseline of SGLang's cache-aware router (sgl-router ``cache_aware``).

SGLang's router keeps, per worker, an *approximate* radix tree of the prompts it sent
there; it never hears about the worker's evictions. Per request:

1. Imbalance check on the router's per-worker load (outstanding requests): the system
   is imbalanced when ``max - min > balance_abs_threshold`` (64) **and**
   ``max > balance_rel_threshold * min`` (1.5). Then the request goes to the shortest
   queue (and is still inserted into that worker's tree).
2. Otherwise the longest prefix match over all trees: if
   ``matched_tokens / prompt_tokens > cache_threshold`` (0.3) the request goes to the
   worker holding that longest match; else to the worker with the smallest tree.
3. The chosen worker's tree gets the whole prompt; trees are LRU-bounded by evicting
   least recently used leaves.

Adaptations (same behaviour, our units): the tree is over chained block hashes, not raw
characters, so a "node" is one full block and a match is counted in whole blocks. Since
a chained hash names its whole prefix, a per-replica tree is a set of hashes; touching a
path moves its deepest block to the MRU end first and its root last, so every ancestor
is more recent than all its descendants and the LRU end is always a leaf (exactly
SGLang's leaf-first LRU eviction, O(1) per block). SGLang evicts on a timer
(``eviction_interval_secs``); we evict right after an insert that crosses the bound, so
the bound holds at every decision. Ties are deterministic: among replicas with the
longest match, the one that touched the matched block last (SGLang takes the first
tenant of the node's map); among smallest trees and shortest queues, ``load_key``/the
replica id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from unicache.contract.block_hash import BlockHash
from unicache.router.routing.base import (
    LocalityView, ReplicaLoad, RouteDecision, RoutingPolicy, RoutingRequest, replica_id_of,
)
from unicache.router.routing.keys import load_key
from unicache.router.routing.registry import register_routing_policy


class ApproxTree:
    """One replica's approximate prefix tree: block hash -> tick of its last touch.

    Invariants: iteration order is LRU order and every block comes before (is less
    recent than) all of its ancestors, so the first entry is always a leaf. ``roots``
    (shared by all trees of a policy) maps each first block of an inserted prompt that a
    tree still holds to the replicas whose trees hold it: a request can match only on
    those, so ``choose`` never looks at a tree without the request's first block.
    """

    __slots__ = ("nodes", "replica_id", "roots")

    def __init__(self, replica_id: str = "", roots: dict[BlockHash, set[str]] | None = None) -> None:
        self.nodes: OrderedDict[BlockHash, int] = OrderedDict()
        self.replica_id = replica_id
        self.roots = roots if roots is not None else {}

    def __len__(self) -> int:
        return len(self.nodes)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        nodes = self.nodes
        n = 0
        for bh in block_hashes:
            if bh not in nodes:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[BlockHash], tick: int) -> None:
        nodes = self.nodes
        for bh in reversed(block_hashes):
            nodes[bh] = tick
            nodes.move_to_end(bh)
        if block_hashes:
            self.roots.setdefault(block_hashes[0], set()).add(self.replica_id)

    def evict_to(self, max_blocks: int) -> int:
        evicted = 0
        nodes, roots = self.nodes, self.roots
        while len(nodes) > max_blocks:
            bh, _tick = nodes.popitem(last=False)
            self._unroot(roots, bh)
            evicted += 1
        return evicted

    def clear(self) -> None:
        """Forget every block (the replica left): it leaves ``roots`` too."""
        roots = self.roots
        for bh in self.nodes:
            self._unroot(roots, bh)
        self.nodes.clear()

    def _unroot(self, roots: dict[BlockHash, set[str]], bh: BlockHash) -> None:
        held = roots.get(bh)
        if held is not None:
            held.discard(self.replica_id)
            if not held:
                del roots[bh]




@register_routing_policy("sglang")
class SGLangPolicy(RoutingPolicy):
    """SGLang's cache-aware policy over router-side approximate trees.

    Args:
        cache_threshold: minimum match rate (matched / prompt tokens, strictly greater)
            for cache routing (default 0.3).
        balance_abs_threshold: imbalance needs ``max - min`` load above this (default 64).
        balance_rel_threshold: and ``max`` above this times ``min`` (default 1.5).
        max_tree_tokens: per-replica tree bound in tokens (default 2**24, about SGLang's
            2**26 characters); converted to blocks with the request's block size.
    """

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 2**24,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, ApproxTree] = {}
        self._roots: dict[BlockHash, set[str]] = {}
        self._tick = 0

    def tree(self, replica_id: str) -> ApproxTree:
        t = self.trees.get(replica_id)
        if t is None:
            t = self.trees[replica_id] = ApproxTree(replica_id, self._roots)
        return t

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        live = set(replica_ids)
        for r in list(self.trees):
            if r not in live:
                self.trees.pop(r).clear()
        for r in replica_ids:
            self.tree(r)

    def on_replica_died(self, replica_id: str) -> None:
        t = self.trees.pop(replica_id, None)
        if t is not None:
            t.clear()

    def is_imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        loads = [max(r.in_flight, r.running + r.waiting) for r in replicas]  # ``outstanding``, inlined
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: LocalityView) -> RouteDecision:
        hashes = request.block_hashes
        if self.is_imbalanced(replicas):
            chosen = min(replicas, key=load_key).replica_id
            return self._commit(chosen, hashes, request.block_size, "imbalanced_shortest_queue", 0, 0.0)

        best_id, best_m, best_tick = "", 0, -1
        held = self._roots.get(hashes[0]) if hashes else None
        if held:
            # NOTE: only trees holding the first block can match; the order of the visit
            # does not matter (the winner is the max of (m, tick, id)).
            live = set(map(replica_id_of, replicas))
            trees = self.trees
            for rid in held:
                if rid not in live:
                    continue
                t = trees[rid]
                m = t.match(hashes)
                tick = t.nodes[hashes[m - 1]]
                if m > best_m or (m == best_m and (tick, rid) > (best_tick, best_id)):
                    best_id, best_m, best_tick = rid, m, tick
        rate = best_m * request.block_size / request.num_prompt_tokens if request.num_prompt_tokens else 0.0
        if best_m and rate > self.cache_threshold:
            return self._commit(best_id, hashes, request.block_size, "cache_match", best_m, rate)
        chosen = min(replicas, key=lambda r: (len(self.tree(r.replica_id)), r.replica_id)).replica_id
        return self._commit(chosen, hashes, request.block_size, "smallest_tree", 0, rate)

    def _commit(self, replica_id: str, hashes: list[BlockHash], block_size: int, reason: str, matched: int, rate: float) -> RouteDecision:
        # NOTE: SGLang inserts inside select_worker, not after the send; we do the same so
        # the simulator and the live router see identical tree states.
        self._tick += 1
        t = self.tree(replica_id)
        t.insert(hashes, self._tick)
        t.evict_to(max(1, self.max_tree_tokens // max(1, block_size)))
        return RouteDecision(replica_id, reason, matched_blocks=matched, score=rate)
