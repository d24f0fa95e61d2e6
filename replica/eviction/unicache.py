"""UniCache eviction: four class-aware queues and a global, adaptively weighted choice.

Queues (by the class of the request that released the block):
    evict_first  decode blocks of single-turn requests, and prompt blocks of single-turn
                 requests outside a template prefix.
    chat         blocks of chat sessions (any multi-turn session not classed agent).
    agent        blocks of agent sessions (short inter-turn gaps).
    structural   the template prefix blocks of single-turn templated requests.

Local score of a queue's head: s_q = S_q(now - key), the survival function (1 - CDF) of
that queue's reuse gaps, a log-normal fitted online from the gaps of the queue's own hits
(seeded with the paper's chat/agent fits). Global choice: victim = argmin_q alpha_q * s_q,
where alpha_q comes from each queue's efficiency E_q = hits_q / mean size_q, normalised by
the mean, raised to 1/T, clipped and smoothed (EMA), recomputed every few requests.

Changes from a literal transcription (each switchable for the ablation table):
    * Every queue is ordered by *last use* (ties: release order, so a request's tail goes
      before its head, as in vLLM). In the structural queue this makes cold templates go
      before hot ones and deep blocks before shallow ones (a parent is always used at least
      as recently as its child); ``depth_bonus_s`` adds the paper's offset score as extra
      seconds of recency for shallow template blocks.
    * ``strict_evict_first=False`` scores the evict-first queue like the others instead
      of always emptying it first: with *inferred* classes, a "single-turn" request may be
      the first turn of a session that has not been recognised yet.

Invariants:
    * A block is a candidate iff it is in ``_live``; it then has exactly one live heap
      entry (matching sequence number) in the heap of its queue; other entries are stale
      and skipped on pop (lazy invalidation).
    * Within a queue, heap order == score order, because s_q is monotone in the key
      (S_q is decreasing in age and the same for all blocks of the queue).
    * Every operation is O(log n) amortised; ``pop_victim`` looks at four heap heads; a
      heap is compacted when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from unicache.block_hash import BlockHash
from unicache.request_class import RequestClass
from replica.eviction.base import EvictionPolicy, ReleaseInfo
from replica.eviction.lognormal import OnlineLogNormal
from replica.eviction.registry import register_policy

EVICT_FIRST, CHAT, AGENT, STRUCTURAL = 0, 1, 2, 3
QUEUE_NAMES = ("evict_first", "chat", "agent", "structural")

# Priors of log(gap seconds): chat/agent from the paper's code; evict-first and structural
# start like chat (weak priors, replaced by observed gaps).
_PRIORS = {EVICT_FIRST: (4.77, 1.279), CHAT: (4.77, 1.279), AGENT: (1.81, 1.092), STRUCTURAL: (4.77, 1.279)}


@dataclass(slots=True)
class _Candidate:
    """A live candidate: its queue, heap key (effective last use) and entry token."""

    queue: int
    key: float
    token: int


@register_policy("unicache")
class UniCachePolicy(EvictionPolicy):
    """Four-queue UniCache eviction (see module docstring).

    Args:
        strict_evict_first: always evict from evict-first while it holds a candidate
            (the paper's rule). Off: it competes by score like the other queues.
        session_queues: route session blocks to the chat/agent queues (off: evict-first
            or structural only).
        split_agent: separate agent sessions from chat (off: all sessions share chat).
        structural: route template prefix blocks to the structural queue.
        depth_bonus_s: seconds of extra recency for the shallowest template block,
            decreasing linearly to 0 at the template's end (paper's 1 - offset/max_offset).
        online_fit: fit each queue's gap distribution from its hits (off: priors only).
        weighting: how alpha_q is set: "reuse" (default: alpha_q = p_q, the decayed
            fraction of the queue's released blocks that were reused, counting reuses of
            evicted blocks through a ghost list, so the score alpha_q * s_q estimates the
            probability that the block is reused), "efficiency" (the paper's
            hits/capacity weights) or "none" (alpha_q = 1).
        ghost_factor: ghost list size, as a multiple of the peak candidate count.
        reuse_decay: per-update decay of the reuse counters of "reuse" weighting.
        fit_prior_weight: observations the gap priors are worth in the online fits.
        max_sessions: sessions whose last arrival is remembered for gap fitting (LRU).
        horizon_scoring: score P(reuse within the cache's residence time | age), i.e.
            p (S(a) - S(a + tau)) / (1 - p + p S(a)), tau = EMA of victims' ages, instead
            of p S(a) (reuse at any later time).
        structural_fit: fit the structural queue's gaps from its hits (off: keep the
            prior; hit gaps of one hot system-prompt block swamp colder templates).
        temperature: T of alpha_q = (E_q / mean E)^(1/T).
        alpha_ema: smoothing of alpha updates.
        alpha_min / alpha_max: clip of alpha_q.
        update_every: requests between alpha updates.
    """

    def __init__(
        self,
        strict_evict_first: bool = False,
        session_queues: bool = True,
        split_agent: bool = True,
        structural: bool = True,
        depth_bonus_s: float = 0.0,
        online_fit: bool = True,
        temperature: float = 0.2,
        alpha_ema: float = 0.1,
        alpha_min: float = 0.05,
        alpha_max: float = 20.0,
        update_every: int = 32,
        weighting: str = "reuse",
        ghost_factor: float = 2.0,
        reuse_decay: float = 0.995,
        fit_prior_weight: float = 20.0,
        max_sessions: int = 100_000,
        structural_fit: bool = False,
        horizon_scoring: bool = True,
    ):
        if temperature <= 0 or not 0 < alpha_ema <= 1 or not 0 < alpha_min <= 1 <= alpha_max:
            raise ValueError("need temperature > 0, 0 < alpha_ema <= 1, alpha_min <= 1 <= alpha_max")
        if update_every <= 0 or depth_bonus_s < 0:
            raise ValueError("update_every must be positive and depth_bonus_s >= 0")
        if weighting not in _WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(_WEIGHTINGS)}")
        self.weighting = weighting
        self.ghost_factor = ghost_factor
        self.reuse_decay = reuse_decay
        self.strict_evict_first = strict_evict_first
        self.session_queues = session_queues
        self.split_agent = split_agent
        self.structural = structural
        self.depth_bonus_s = depth_bonus_s
        self.inv_temperature = 1.0 / temperature
        self.alpha_ema = alpha_ema
        self.alpha_min, self.alpha_max = alpha_min, alpha_max
        self.update_every = update_every
        self.max_sessions = max_sessions
        self.structural_fit = structural_fit
        self.horizon_scoring = horizon_scoring
        self._horizon = 60.0  # EMA of victims' ages: how long a block stays after last use
        self._session_seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.fits = [
            OnlineLogNormal(
                *_PRIORS[q],
                prior_weight=fit_prior_weight,
                max_weight=max(5000.0, fit_prior_weight),
                frozen=not online_fit,
            )
            for q in range(4)
        ]
        # Evict-first blocks are reused only when their request turns out to open a
        # session, so their reuse gap is a chat inter-turn gap: share that fit.
        self.fits[EVICT_FIRST] = self.fits[CHAT]
        self.alpha = [1.0, 1.0, 1.0, 1.0]
        self._heaps: list[list[tuple[float, int, int]]] = [[], [], [], []]
        self._live: dict[int, _Candidate] = {}
        self._sizes = [0, 0, 0, 0]
        self._hits = [0, 0, 0, 0]
        self._size_sum = [0, 0, 0, 0]
        self._requests = 0
        self._tokens = itertools.count()
        self._now = 0.0
        self._hash: dict[int, BlockHash] = {}
        # Evicted hashes -> (queue, key): a later re-cache is a reuse the eviction missed.
        self._ghosts: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self._peak = 0
        self._released = [1.0, 1.0, 1.0, 1.0]
        self._reused = [0.5, 0.5, 0.5, 0.5]

    # ------------------------------------------------------------ placement
    def queue_of(self, info: ReleaseInfo) -> int:
        """The queue a released block joins (public for tests and the ablation)."""
        cls = info.cls
        if cls.session_id is not None and self.session_queues:
            return AGENT if (self.split_agent and cls.agentic) else CHAT
        if self.structural and cls.template and not info.is_decode and info.position < cls.template_blocks:
            return STRUCTURAL
        return EVICT_FIRST

    # ---------------------------------------------------------------- hooks
    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        if now > self._now:
            self._now = now
        self._hash[block_id] = block_hash
        ghost = self._ghosts.pop(block_hash, None)
        if ghost is not None:
            q, key = ghost
            self._reused[q] += 1.0
            if q == STRUCTURAL and self.structural_fit:
                self.fits[q].observe(now - key)

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        now = info.now
        if now > self._now:
            self._now = now
        q = self.queue_of(info)
        key = now
        if q == STRUCTURAL and self.depth_bonus_s:
            key += self.depth_bonus_s * (1.0 - info.position / info.cls.template_blocks)
        tok = next(self._tokens)
        self._released[q] += 1.0
        self._live[block_id] = _Candidate(q, key, tok)
        if len(self._live) > self._peak:
            self._peak = len(self._live)
        self._sizes[q] += 1
        heap = self._heaps[q]
        heapq.heappush(heap, (key, tok, block_id))
        if len(heap) > 2 * self._sizes[q] + 64:
            self._compact(q)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        if now > self._now:
            self._now = now
        cand = self._live.pop(block_id, None)
        if cand is None:
            return
        q = cand.queue
        self._sizes[q] -= 1
        self._hits[q] += 1
        self._reused[q] += 1.0
        if q == STRUCTURAL and self.structural_fit:
            self.fits[q].observe(now - cand.key)

    def on_request(self, cls: RequestClass, now: float) -> None:
        if now > self._now:
            self._now = now
        sid = cls.session_id
        if sid is not None:
            # NOTE: session gaps are measured here, from arrivals, not from cache hits:
            # hits only show the gaps of blocks that survived eviction (a censored sample
            # that understates long gaps and makes the policy drop sessions too early).
            seen = self._session_seen
            key = (cls.tenant, sid)
            last = seen.pop(key, None)
            if last is not None and now > last:
                self.fits[AGENT if (self.split_agent and cls.agentic) else CHAT].observe(now - last)
            seen[key] = now
            if len(seen) > self.max_sessions:
                seen.popitem(last=False)
        sizes, sums = self._sizes, self._size_sum
        for q in range(4):
            sums[q] += sizes[q]
        self._requests += 1
        if self._requests % self.update_every == 0:
            self._update_alpha()

    def pop_victim(self) -> int | None:
        if not self._live:
            return None
        best_q, best_score = -1, 0.0
        if self.strict_evict_first and self._head(EVICT_FIRST) is not None:
            best_q = EVICT_FIRST
        else:
            now = self._now
            for q in range(4):
                head = self._head(q)
                if head is None:
                    continue
                age = now - head[0]
                fit, p = self.fits[q], self.alpha[q]
                if self.horizon_scoring:
                    s_now = fit.survival(age)
                    score = p * (s_now - fit.survival(age + self._horizon)) / (1.0 - p + p * s_now + 1e-12)
                else:
                    score = p * fit.survival(age)
                if best_q < 0 or score < best_score:
                    best_q, best_score = q, score
        key, _, block_id = heapq.heappop(self._heaps[best_q])
        self._horizon += 0.01 * (max(0.0, self._now - key) - self._horizon)
        del self._live[block_id]
        self._sizes[best_q] -= 1
        h = self._hash.pop(block_id, None)
        if h is not None and self.weighting == "reuse":
            ghosts = self._ghosts
            ghosts[h] = (best_q, key)
            if len(ghosts) > self.ghost_factor * self._peak:
                ghosts.popitem(last=False)
        return block_id

    def on_removed(self, block_id: int) -> None:
        self._hash.pop(block_id, None)
        cand = self._live.pop(block_id, None)
        if cand is not None:
            self._sizes[cand.queue] -= 1

    def __len__(self) -> int:
        return len(self._live)

    def queue_sizes(self) -> dict[str, int]:
        return dict(zip(QUEUE_NAMES, self._sizes))

    # ------------------------------------------------------------ internals
    def _head(self, q: int) -> tuple[float, int, int] | None:
        """The queue's live minimum, dropping stale entries above it."""
        heap, live = self._heaps[q], self._live
        while heap:
            entry = heap[0]
            cand = live.get(entry[2])
            if cand is not None and cand.token == entry[1]:
                return entry
            heapq.heappop(heap)
        return None

    def _compact(self, q: int) -> None:
        """Drop stale entries of queue q (amortised O(1): runs after >= n stale pushes)."""
        live = self._live
        heap = [e for e in self._heaps[q] if (c := live.get(e[2])) is not None and c.token == e[1]]
        heapq.heapify(heap)
        self._heaps[q] = heap

    def _update_alpha(self) -> None:
        _WEIGHTINGS[self.weighting](self)
        self._hits = [0, 0, 0, 0]
        self._size_sum = [0, 0, 0, 0]

    def _alpha_reuse(self) -> None:
        """alpha_q <- p_q, the fraction of the queue's releases reused later (hits, plus
        re-caches of evicted blocks remembered as ghosts, so eviction does not hide reuse)."""
        d = self.reuse_decay
        for q in range(4):
            self.alpha[q] = self._reused[q] / self._released[q]
            self._reused[q] *= d
            self._released[q] *= d

    def _alpha_efficiency(self) -> None:
        """alpha_q <- EMA of clip((E_q / mean E)^(1/T)) with E_q = hits_q / mean size_q."""
        n = self.update_every
        eff: dict[int, float] = {}
        for q in range(4):
            mean_size = self._size_sum[q] / n
            if mean_size >= 1.0:
                eff[q] = self._hits[q] / mean_size
        if not eff:
            return
        mean_e = sum(eff.values()) / len(eff)
        if mean_e <= 0:
            return
        for q, e in eff.items():
            raw = (e / mean_e) ** self.inv_temperature if e > 0 else self.alpha_min
            raw = min(self.alpha_max, max(self.alpha_min, raw))
            self.alpha[q] += self.alpha_ema * (raw - self.alpha[q])

    def _alpha_fixed(self) -> None:
        """alpha_q = 1 (ablation: no global weights)."""


# How alpha_q is set: name -> method (registry, so a new scheme is one entry).
_WEIGHTINGS = {
    "reuse": UniCachePolicy._alpha_reuse,
    "efficiency": UniCachePolicy._alpha_efficiency,
    "none": UniCachePolicy._alpha_fixed,
}
