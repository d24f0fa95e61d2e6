"""UniCache's session-gap fits: how long until a session's next turn.

One ``OnlineLogNormal`` per session queue, seeded with the paper's values (chat mu=4.77,
sigma=1.279; agent mu=1.81, sigma=1.092; log seconds) and fitted online.

A gap runs from the *release* of a session's previous turn to the *arrival* of its next:
that is the age a session block has when it is reused, the age its survival is evaluated
at. Arrival-to-arrival gaps also count the previous turn's decode time, which a block's
age does not (measured: the unicache_ablation study, docs/studies.md). Gaps are measured at arrivals, not
from cache hits: hits only show the gaps of blocks that survived eviction (a censored
sample that understates long gaps and makes the policy drop sessions too early).

Invariants:
    * ``fit(EVICT_FIRST) is fit(CHAT)``: an evict-first block is reused only when its
      request turns out to open a session, so its reuse gap is a chat inter-turn gap.
    * At most ``max_sessions`` sessions are remembered, the longest remembered dropped
      first (insertion order); a turn arriving before its predecessor released anything observes
      nothing.
"""

from __future__ import annotations

from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.lognormal import OnlineLogNormal
from unicache.replica.eviction.unicache.lanes import AGENT, CHAT, EVICT_FIRST

CHAT_PRIOR = (4.77, 1.279)
AGENT_PRIOR = (1.81, 1.092)


class SessionGaps:
    """Gap fits of the chat and agent queues (evict-first shares chat's).

    Args:
        prior_weight: observations each prior is worth.
        max_sessions: sessions whose last release is remembered for gap fitting.
    """

    def __init__(self, prior_weight: float = 20.0, max_sessions: int = 100_000):
        if max_sessions <= 0:
            raise ValueError("max_sessions must be positive")
        max_weight = max(5000.0, prior_weight)
        chat = OnlineLogNormal(*CHAT_PRIOR, prior_weight=prior_weight, max_weight=max_weight)
        agent = OnlineLogNormal(*AGENT_PRIOR, prior_weight=prior_weight, max_weight=max_weight)
        self.fits = {EVICT_FIRST: chat, CHAT: chat, AGENT: agent}
        self.max_sessions = max_sessions
        # (tenant, session id) -> when its last turn released blocks; insertion order is
        # age order for the bound.
        self._seen: dict[tuple[str, str], float] = {}

    def fit(self, queue: int) -> OnlineLogNormal:
        return self.fits[queue]

    def on_release(self, cls: RequestClass, now: float) -> None:
        """A request of ``cls`` released blocks at ``now`` (once per request)."""
        if cls.session_id is not None:
            self._note(cls, now)

    def on_arrival(self, cls: RequestClass, queue: int, now: float) -> None:
        """A request of ``cls`` (session queue ``queue``) arrived: observe its gap."""
        last = self._seen.pop((cls.tenant, cls.session_id), None)
        if last is not None and now > last:
            self.fits[queue].observe(now - last)

    def _note(self, cls: RequestClass, now: float) -> None:
        seen = self._seen
        seen[(cls.tenant, cls.session_id)] = now
        if len(seen) > self.max_sessions:
            del seen[next(iter(seen))]
