"""LeCaR (Vietri et al., HotStorage 2018): LRU and LFU as two experts, reweighted by regret.

Each eviction asks one expert, drawn with probability w_lru or w_lfu (a seeded generator,
so runs repeat exactly), for its victim. When the two experts disagree the victim's hash
goes to the chooser's history. Caching a hash from an expert's history again is that
expert's regret: its weight is multiplied by exp(-learning_rate * discount^age), age =
blocks cached since the eviction, and the weights renormalised.

Prefix-aware: only unreferenced blocks are candidates. The LRU expert takes the least
recently released candidate (tail first within a request); the LFU expert the one used
least often (uses since cached, carried across an eviction through the history), ties
by release order (a prefix is used at least as often as its suffix, so tail first).

The policy is not told the cache size: c, which sets the histories' size and the
discount 0.005^(1/c) (the paper's), is the most blocks it has seen cached at once.

Invariants:
    * ``w_lru + w_lfu == 1`` (up to rounding), each in (0, 1).
    * A candidate is in ``_lru`` and has exactly one live entry in ``_lfu``.
    * Each history holds at most c hashes, oldest dropped first; a hash is in at most one.
    * Every operation is O(log n) amortised.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.replica.eviction.candidates import KeyedCandidates
from unicache.replica.eviction.registry import register_policy

LRU, LFU = 0, 1


@register_policy("lecar")
class LeCaRPolicy(EvictionPolicy):
    """Regret-weighted choice between an LRU and an LFU victim.

    Args:
        learning_rate: the paper's lambda (0.45).
        seed: seed of the expert draw.
    """

    def __init__(self, learning_rate: float = 0.45, seed: int = 0):
        if learning_rate <= 0:
            raise ValueError("learning_rate must be positive")
        self.learning_rate = learning_rate
        self._rng = random.Random(seed)
        self.weights = [0.5, 0.5]
        self._hash: dict[int, BlockHash] = {}
        self._uses: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lfu = KeyedCandidates()
        # hash -> (the block count when it was evicted, its uses); one per expert.
        self._history: tuple[OrderedDict[BlockHash, tuple[int, int]], ...] = (OrderedDict(), OrderedDict())
        self._cached_count = 0  # blocks cached so far: the clock of the regret discount
        self.c = 0

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        self._cached_count += 1
        self._hash[block_id] = block_hash
        if len(self._hash) > self.c:
            self.c = len(self._hash)
        uses = 1
        for expert in (LRU, LFU):
            entry = self._history[expert].pop(block_hash, None)
            if entry is not None:
                evicted_at, uses = entry
                uses += 1
                discount = 0.005 ** (1.0 / max(self.c, 1))
                regret = discount ** (self._cached_count - evicted_at)
                w = self.weights
                w[expert] *= math.exp(-self.learning_rate * regret)
                total = w[LRU] + w[LFU]
                w[LRU], w[LFU] = w[LRU] / total, w[LFU] / total
        self._uses[block_id] = uses

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        self._lru[block_id] = None
        self._lfu.push(block_id, self._uses.get(block_id, 1))

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        if block_id in self._uses:
            self._uses[block_id] += 1
        self._lru.pop(block_id, None)
        self._lfu.discard(block_id)

    def pop_victim(self) -> int | None:
        if not self._lru:
            return None
        lru_victim = next(iter(self._lru))
        lfu_victim = self._lfu.peek()[1]
        expert = LRU if self._rng.random() < self.weights[LRU] else LFU
        block_id = lru_victim if expert == LRU else lfu_victim
        del self._lru[block_id]
        self._lfu.discard(block_id)
        block_hash = self._hash.pop(block_id)
        uses = self._uses.pop(block_id)
        if lru_victim != lfu_victim:
            history = self._history[expert]
            history[block_hash] = (self._cached_count, uses)
            if len(history) > self.c:
                history.popitem(last=False)
        return block_id

    def on_removed(self, block_id: int) -> None:
        self._lru.pop(block_id, None)
        self._lfu.discard(block_id)
        self._hash.pop(block_id, None)
        self._uses.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._lru)
