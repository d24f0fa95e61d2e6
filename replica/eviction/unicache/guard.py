"""UniCache's recency guard: a shadow LRU that tells when plain recency would hit more,
and the share of victims UniCache then takes in LRU order instead of its own.

The guard replays every block the cache is asked for through a shadow LRU of hashes as
large as the most blocks the cache has held (so its memory is bounded by the pool's
size), and counts, per window of requests, the hits the shadow would have had against
the hits the cache had. A request hits a block only through an unbroken prefix, so the
shadow counts a hit only if the block's parent was one at its own last lookup. Each
window moves ``lru_share`` (the fraction of victims taken from the head of the release
order, as vLLM's own queue would) up by ``step`` when the shadow won, down by ``step``
when the cache won, and down by ``step / 512`` in between, so class-aware eviction comes
back when the two tie. A win is a difference in hits over ``margin`` of the lookups and
over ``z`` standard deviations of a tie (a sign test over requests of the difference
between the lookups only the shadow hit and those only the cache hit), so noise does not
move it.

The shadow LRU is vLLM's order up to two simplifications: blocks move to the front when
looked up and when released (tail first), and blocks held by running requests are not
pinned. A block recomputed while another copy is cached (vLLM recomputes a fully cached
prompt's last block) is no lookup: neither order could have hit it.

Invariants:
    * ``0 <= lru_share <= 1``; it changes only in ``end_window``;
    * ``len(shadow) <= capacity``; ``capacity`` never falls;
    * with ``lru_share == 0``, ``take_lru`` is always False (UniCache's own order exactly).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from unicache.contract.block_hash import BlockHash


class RecencyGuard:
    """Shadow LRU against the cache's hits, and the share of victims taken in LRU order.

    Args:
        step: how far ``lru_share`` moves per window.
        margin: the hit-ratio difference (of lookups in the window) that counts as a win.
        min_lookups: windows with fewer (decayed) lookups leave ``lru_share`` as it is.
        decay: per-window decay of the counts (their memory, in windows).
        window: requests per window.
        z: how many standard deviations of a tie a win must exceed.
    """

    def __init__(self, step: float = 1.0, margin: float = 0.003, min_lookups: float = 64.0, decay: float = 0.98,
                 window: int = 8, z: float = 2.0):
        if not 0 < step <= 1 or margin < 0 or min_lookups < 0 or not 0 <= decay < 1 or window <= 0:
            raise ValueError("need 0 < step <= 1, margin >= 0, min_lookups >= 0, 0 <= decay < 1 and window > 0")
        self.step, self.margin, self.min_lookups, self.decay, self.window, self.z = step, margin, min_lookups, decay, window, z
        self._requests = 0
        self.lru_share = 0.0
        self.capacity = 0
        # hash -> the shadow had it, through an unbroken prefix, at its last lookup
        self._shadow: OrderedDict[BlockHash, bool] = OrderedDict()
        self._copies: dict[BlockHash, int] = {}  # hash -> blocks of the cache holding it
        self._credit = 0.0
        self.lookups = self.shadow_hits = self.hits = 0.0  # this window's, decayed
        # Per request d = (lookups only the shadow hit) - (only the cache hit); their sum
        # and sum of squares this window, decayed. Blocks of one prompt hit or miss
        # together, so requests, not blocks, are the independent trials.
        self._diff = 0
        self.diff_sum = self.diff_sq = 0.0

    # ------------------------------------------------------------ the cache's events
    def on_hit(self, h: BlockHash, parent: BlockHash | None) -> None:
        """A request took cached block ``h`` (a real hit)."""
        self.hits += 1.0
        self._lookup(h, parent, True)

    def on_cached(self, h: BlockHash, parent: BlockHash | None, cached_blocks: int) -> None:
        """A block was computed and cached under ``h``; the cache now holds ``cached_blocks``."""
        copies = self._copies
        n = copies.get(h, 0)
        copies[h] = n + 1
        if cached_blocks > self.capacity:
            self.capacity = cached_blocks
        if not n:
            self._lookup(h, parent, False)

    def on_uncached(self, h: BlockHash) -> None:
        """A cached block under ``h`` left the cache."""
        copies = self._copies
        n = copies.get(h, 0)
        if n <= 1:
            copies.pop(h, None)
        else:
            copies[h] = n - 1

    def on_released(self, hashes: Iterable[BlockHash]) -> None:
        """One request's blocks, in release order, become the shadow's most recent."""
        shadow = self._shadow
        for h in hashes:
            if h in shadow:
                shadow.move_to_end(h)
            else:
                shadow[h] = False
        self._trim()

    def _lookup(self, h: BlockHash, parent: BlockHash | None, real: bool) -> None:
        shadow = self._shadow
        self.lookups += 1.0
        hit = h in shadow and (parent is None or shadow.get(parent, False))
        if hit:
            self.shadow_hits += 1.0
            if not real:
                self._diff += 1
        elif real:
            self._diff -= 1
        shadow[h] = hit
        shadow.move_to_end(h)
        self._trim()

    def _trim(self) -> None:
        shadow, cap = self._shadow, max(self.capacity, 1)
        while len(shadow) > cap:
            shadow.popitem(last=False)

    # ------------------------------------------------------------ decisions
    def take_lru(self) -> bool:
        """Whether the next victim comes from the head of the release order."""
        share = self.lru_share
        if share <= 0.0:
            return False
        self._credit += share
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def on_request(self) -> None:
        """A request arrived; every ``window`` of them ends a window."""
        d = self._diff
        if d:
            self.diff_sum += d
            self.diff_sq += d * d
            self._diff = 0
        self._requests += 1
        if self._requests % self.window == 0:
            self.end_window()

    def end_window(self) -> None:
        """Move ``lru_share`` by this window's counts (see the module docstring), then
        decay them."""
        n = self.lookups
        if n >= self.min_lookups:
            s = self.diff_sum
            # A win must exceed the margin and z standard deviations of a tie (a sign
            # test over requests: under a tie the sum of d has variance sum d^2).
            bar = max(self.margin * n, self.z * math.sqrt(self.diff_sq))
            if s > bar:
                self.lru_share = min(1.0, self.lru_share + self.step)
            elif -s > bar:
                self.lru_share = max(0.0, self.lru_share - self.step)
            else:
                self.lru_share = max(0.0, self.lru_share - self.step / 512)
        d = self.decay
        self.lookups *= d
        self.shadow_hits *= d
        self.hits *= d
        self.diff_sum *= d
        self.diff_sq *= d
