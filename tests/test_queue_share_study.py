"""The queue-share study's oracle replay: what it reports as each replica's queue."""

from __future__ import annotations

from bench.studies.queue_share import UncachedQueueReplay
from unicache.sim.prepare import prepare
from unicache.sim.replay import Replay, ReplayConfig
from tests.test_sim_replay import BS, LINEAR, req


def _queues(replay_cls: type[Replay]) -> list[list[int]]:
    # round robin over 2 replicas, one lane each; r0: [1, 2] (done at t = 1), then
    # [3, 4, 5, 6] prefilling t = 2..4, then [1, 2, 7] waiting behind it from t = 3 (its
    # first 2 blocks cached: 4 of its 12 tokens uncached); r1 gets one-block requests
    trace = [req(0, [1, 2]), req(0.5, [8]), req(2, [3, 4, 5, 6]), req(2.5, [9]), req(3, [1, 2, 7]), req(3.5, [10])]
    seen = []

    class Watching(replay_cls):
        def _snapshot(self):
            loads = super()._snapshot()
            seen.append([r.queued_prefill_tokens for r in loads])
            return loads

    Watching(prepare(trace, BS), ReplayConfig("lru", 64, replicas=2, router="round_robin", lanes=1, timing=LINEAR)).run()
    return seen


def test_the_oracle_reports_waiting_requests_uncached_and_prefilling_ones_whole():
    assert _queues(Replay)[-1] == [16 + 12, 0]
    assert _queues(UncachedQueueReplay)[-1] == [16 + 4, 0]
