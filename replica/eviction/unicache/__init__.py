"""UniCache eviction, one job per module:

    lanes.py    queue/lane placement of released blocks (novel prefixes apart)
    scoring.py  lane scores (horizon score, structural decayed-count rate, residence time)
    weights.py  the reuse-probability weights alpha per lane (with the ghost list)
    gaps.py     the session-gap fits
    policy.py   ``UniCachePolicy``: the lane heaps and the global choice (registered
                as "unicache")

Ablation variants of these parts live with the study that measured them
(``bench/unicache_variants.py``).
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
