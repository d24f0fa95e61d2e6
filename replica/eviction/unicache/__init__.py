"""UniCache eviction, one job per module:

    lanes.py    queue/lane placement of released blocks (novel prefixes apart)
    scoring.py  lane scores (horizon score, structural decayed-count rate, residence time)
    weights.py  the reuse-probability weights alpha per lane (with the ghost list)
    gaps.py     the session-gap fits
    policy.py   ``UniCachePolicy``: the lane heaps and the global choice (registered
                as "unicache")

What each part contributes was measured by ablation studies whose code has left the
repository (docs/studies.md); the design and its reasons are in docs/eviction.md.
"""

from unicache.replica.eviction.unicache.lanes import (
    AGENT,
    CHAT,
    EVICT_FIRST,
    NOVEL_LANE,
    NUM_LANES,
    NUM_QUEUES,
    QUEUE_NAMES,
    STRUCTURAL,
    TAIL_LANE,
    turn_lane,
)
from unicache.replica.eviction.unicache.policy import UniCachePolicy

__all__ = [
    "AGENT",
    "CHAT",
    "EVICT_FIRST",
    "NOVEL_LANE",
    "NUM_LANES",
    "NUM_QUEUES",
    "QUEUE_NAMES",
    "STRUCTURAL",
    "TAIL_LANE",
    "UniCachePolicy",
    "turn_lane",
]
