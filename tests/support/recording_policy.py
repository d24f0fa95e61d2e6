"""An LRU policy that records every call a pool makes to it (the vLLM plug-in's free queue,
``PoolCandidates``), for tests that assert what a policy is told."""

from __future__ import annotations

from unicache.replica.eviction.lru import LRUPolicy


class RecordingLRU(LRUPolicy):
    """LRU that records every call the queue makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def on_cached(self, block_id, block_hash, parent_id, now):
        self.calls.append(("cached", block_id, parent_id))
        super().on_cached(block_id, block_hash, parent_id, now)

    def on_release_many(self, block_ids, positions, cls, num_blocks, num_prompt_blocks, now):
        self.calls.append(("release", list(block_ids), list(positions), cls, num_blocks, num_prompt_blocks))
        super().on_release_many(block_ids, positions, cls, num_blocks, num_prompt_blocks, now)

    def on_access(self, block_id, cls, now):
        self.calls.append(("access", block_id, cls))
        super().on_access(block_id, cls, now)

    def on_removed(self, block_id):
        self.calls.append(("removed", block_id))
        super().on_removed(block_id)
