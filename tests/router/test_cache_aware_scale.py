"""cache_aware's churn window grows with the fleet past 8 replicas (32 requests per replica),
so its decisions at 4 and 8 replicas, where the defaults were chosen, are unchanged."""

from __future__ import annotations

import pytest

from unicache.router.routing.cache_aware.policy import CHURN_WINDOW_PER_REPLICA, CacheAwarePolicy


@pytest.mark.parametrize("replicas, window", [(1, 256), (4, 256), (8, 256), (9, 288), (64, 2048), (1024, 32768)])
def test_churn_window_is_the_default_up_to_8_replicas_then_32_per_replica(replicas, window):
    policy = CacheAwarePolicy()
    policy.update_replicas([f"r{i}" for i in range(replicas)])
    assert CHURN_WINDOW_PER_REPLICA == 32
    assert policy._decay == pytest.approx(1.0 - 1.0 / window, abs=0.0)
    policy.update_replicas(["r0", "r1"])  # the fleet shrinks: back to the default
    assert policy._decay == 1.0 - 1.0 / 256
