"""UniCache's global weights: alpha per lane, the probability that a released block is reused.

The paper weights each queue by its efficiency (hits / capacity, normalised, ^(1/T),
clipped, smoothed); measured on Mooncake that lost badly to lru (the unicache_ablation
study, docs/studies.md; the test double tests/support/unicache_variants.py keeps it).
Here alpha_lane = p_lane, the decayed fraction of the lane's released blocks that were
reused later. Reuses of *evicted* blocks count too, through a ghost list of their
hashes: otherwise eviction would hide reuse and confirm itself. So a lane score
alpha * s estimates the probability that the block is reused.

Invariants:
    * ``0 <= alpha[lane] <= 1`` (a ghost can be re-cached by several requests in a row,
      so the ratio is capped at 1).
    * Before the first update alpha is the prior, and the prior counts as one release
      afterwards: from a cold start a lane with a low prior (evict-first) is weighed
      below one with a high prior (a live session), as the paper's evict-first queue.
    * The ghost list holds at most ``ghost_factor`` x the peak candidate count, oldest
      dropped first; a ghost is consumed by the first re-cache of its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from unicache.contract.block_hash import BlockHash


class ReuseWeights:
    """alpha per lane from released and reused counts, recomputed every ``update_every``
    requests.

    Args:
        priors: per lane, the reuse probability assumed before any is measured.
        decay: per-update decay of the counts (the estimate's memory).
        ghost_factor: ghost list size, as a multiple of the peak candidate count.
        update_every: requests between updates.
    """

    def __init__(self, priors: Sequence[float], decay: float = 0.995, ghost_factor: float = 2.0, update_every: int = 32):
        if not 0 < decay <= 1 or ghost_factor < 0 or update_every <= 0:
            raise ValueError("need 0 < reuse_decay <= 1, ghost_factor >= 0 and update_every > 0")
        if not all(0.0 <= p <= 1.0 for p in priors):
            raise ValueError("reuse priors must lie in [0, 1]")
        self.decay, self.ghost_factor, self.update_every = decay, ghost_factor, update_every
        self.alpha = list(priors)
        # The prior is worth one release.
        self.released = [1.0] * len(priors)
        self.reused = list(priors)
        # Evicted hashes -> (lane, heap key): a later re-cache is a reuse the eviction missed.
        self.ghosts: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self.peak = 0  # most candidates seen at once
        self._requests = 0

    def on_released(self, lanes: list[int]) -> None:
        released = self.released
        for lane in lanes:
            released[lane] += 1.0

    def on_hit(self, lane: int) -> None:
        """A candidate of ``lane`` was hit (reused before eviction)."""
        self.reused[lane] += 1.0

    def remember(self, block_hash: BlockHash, lane: int, key: float) -> None:
        """An evicted block of ``lane`` (heap key ``key``) becomes a ghost."""
        ghosts = self.ghosts
        ghosts[block_hash] = (lane, key)
        if len(ghosts) > self.ghost_factor * self.peak:
            ghosts.popitem(last=False)

    def recall(self, block_hash: BlockHash) -> tuple[int, float] | None:
        """A hash was cached again: if it was a ghost, count the missed reuse for its
        lane and return (lane, key)."""
        ghost = self.ghosts.pop(block_hash, None)
        if ghost is not None:
            self.reused[ghost[0]] += 1.0
        return ghost

    def on_request(self) -> None:
        self._requests += 1
        if self._requests % self.update_every == 0:
            self.update()

    def update(self) -> None:
        """alpha <- reused / released (capped at 1), then decay both counts."""
        d, alpha, released, reused = self.decay, self.alpha, self.released, self.reused
        for lane in range(len(alpha)):
            alpha[lane] = min(1.0, reused[lane] / released[lane])
            reused[lane] *= d
            released[lane] *= d
