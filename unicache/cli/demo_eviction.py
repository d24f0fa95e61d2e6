"""The demo's eviction phase: fill every replica's cache with one-off prompts, then bring
back the sessions and templates, and say what UniCache kept that LRU would not.

Why the LRU figure is exact, not simulated: a one-off prompt's full blocks are new to the
cache (each flood prompt starts with its own nonce), so once a replica has cached at least
``capacity`` flood blocks, the ``capacity`` blocks it touched last are all flood blocks. An
LRU cache of that size then holds nothing from before the flood, and a returning session
or template would hit 0 tokens there. Every token the replica serves from cache to them
after the flood is one UniCache kept and LRU would have recomputed. Where a replica got
less than its capacity of flood blocks the comparison is not claimed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

FLOOD_WORDS = ("cache", "route", "block", "token", "prefix", "evict", "replica", "session", "batch", "queue", "model", "prompt")


def flood_text(seed: int, i: int, chars: int) -> str:
    """One-off prompt ``i`` of ``chars`` characters; its first block is its own."""
    rng = random.Random(f"{seed}:flood:{i}")
    words = [f"Flood {i} nonce {rng.getrandbits(64):016x}:"]
    size = len(words[0])
    while size < chars:
        w = rng.choice(FLOOD_WORDS) + str(rng.randrange(1000))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:chars]


@dataclass(slots=True)
class ReplicaFill:
    """What one replica saw of the flood and of the returning requests."""

    capacity_blocks: int
    flood_blocks: int = 0  # full prompt blocks of the flood requests routed here
    evictions_before: int = 0
    evictions_after: int = 0
    returning_prompt: int = 0
    returning_cached: int = 0

    @property
    def filled(self) -> bool:
        """At least a cache's worth of new blocks: LRU would hold nothing older."""
        return self.flood_blocks >= self.capacity_blocks


@dataclass(slots=True)
class FillReport:
    block_size: int
    replicas: dict[str, ReplicaFill] = field(default_factory=dict)

    def add_flood(self, replica: str, prompt_tokens: int) -> None:
        self.replicas[replica].flood_blocks += prompt_tokens // self.block_size

    def add_returning(self, replica: str, prompt_tokens: int, cached_tokens: int) -> None:
        r = self.replicas[replica]
        r.returning_prompt += prompt_tokens
        r.returning_cached += cached_tokens

    def all_filled(self) -> bool:
        return all(r.filled for r in self.replicas.values())

    def lines(self) -> list[str]:
        out = ["eviction: one-off prompts filled each replica's cache, then the sessions and templates came back"]
        for rid, r in sorted(self.replicas.items()):
            out.append(f"  {rid}: {r.flood_blocks} one-off blocks into a {r.capacity_blocks}-block cache, "
                       f"{r.evictions_after - r.evictions_before} evictions; returning requests: "
                       f"{r.returning_cached} of {r.returning_prompt} prompt tokens from cache")
        kept = sum(r.returning_cached for r in self.replicas.values() if r.filled)
        prompt = sum(r.returning_prompt for r in self.replicas.values() if r.filled)
        if not any(r.filled for r in self.replicas.values()):
            out.append("  (no replica took a cache's worth of one-off blocks: no LRU comparison)")
        else:
            out.append(f"UniCache kept {kept} of {prompt} returning prompt tokens through the flood "
                       f"(session and template blocks outrank one-offs in its eviction queues); an LRU cache "
                       f"of the same size would have evicted all of them (its last {'/'.join(str(r.capacity_blocks) for r in self.replicas.values())} "
                       f"blocks touched were one-offs) and served 0")
        return out
