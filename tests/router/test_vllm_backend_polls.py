"""What the router asks of a vLLM backend in the background (router/upstream/vllm_fleet/follower.py):
``/health``, ``/v1/models`` and ``/metrics`` to join; then only ``/metrics`` (and ``/v1/models``
when due), ``/health`` only for a backend in doubt, a failed ``/health`` quarantining it, and
one log line per change, never per poll. The backend answers ``VllmClients.get`` in process."""

from __future__ import annotations

import logging
import time

import json

import pytest

from unicache.plumbing.errors import UsageError
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.view import ClusterView
from unicache.router.config import RouterConfig
from unicache.router.routing.registry import make_routing_policy
from unicache.router.upstream.vllm_fleet.follower import BackendFollower
from unicache.router.upstream.vllm_fleet.http_stream import BackendUnreachable, PolledAnswer, VllmClients
from unicache.router.upstream.vllm_fleet.spec import BackendSpec

URL = "http://127.0.0.1:1"
METRICS = "\n".join([
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
    "# TYPE vllm:cache_config_info gauge",
    'vllm:cache_config_info{block_size="16",num_cpu_blocks="None",num_gpu_blocks="64"} 1.0',
]) + "\n"


class FakeBackend:
    """A vLLM server's background endpoints; ``status``: what each path answers now."""

    def __init__(self):
        self.status = {"/health": 200, "/v1/models": 200, "/metrics": 200}
        self.asked: list[str] = []
        self.reachable = True

    def __call__(self, path: str) -> PolledAnswer:
        self.asked.append(path)
        if not self.reachable:
            raise BackendUnreachable("cannot connect: ConnectionRefusedError")
        code = self.status[path]
        if code != 200:
            return PolledAnswer(code, "text/plain", b"")
        if path == "/v1/models":
            listed = {"object": "list", "data": [{"id": "m", "object": "model", "root": "m", "parent": None}]}
            return PolledAnswer(200, "application/json", json.dumps(listed).encode())
        return PolledAnswer(200, "text/plain", METRICS.encode() if path == "/metrics" else b"")

    def take(self) -> list[str]:
        asked, self.asked = self.asked, []
        return asked


class MockClients(VllmClients):
    def __init__(self, backend: FakeBackend):
        super().__init__()
        self.backend = backend

    async def get(self, url: str, path: str, timeout_s: float) -> PolledAnswer:
        assert url == URL and timeout_s > 0
        return self.backend(path)


@pytest.fixture
async def joined():
    backend = FakeBackend()
    clients = MockClients(backend)
    cluster = ClusterView(make_routing_policy("round_robin"), LocalityIndex())
    follower = BackendFollower(BackendSpec("b", URL), cluster, clients, 16, metrics_interval_s=1e-9)  # a scrape due at every poll
    await follower.poll()
    assert (follower.joined, backend.take()) == (True, ["/health", "/v1/models", "/metrics"])
    yield follower, backend, cluster
    await clients.close()


async def test_a_joined_backend_is_only_scraped_and_its_models_read_when_due(joined):
    follower, backend, cluster = joined
    for _ in range(3):
        await follower.poll()
    assert backend.take() == ["/metrics"] * 3
    follower._models_asked_at -= follower.models_interval_s  # its /v1/models is due
    await follower.poll()
    assert (backend.take(), follower.health_probes, cluster.replicas["b"].load.running) == (["/v1/models", "/metrics"], 1, 2)


async def test_health_is_asked_only_of_a_backend_in_doubt(joined, caplog):
    follower, backend, cluster = joined
    caplog.set_level(logging.INFO, logger="unicache.router.upstream.vllm_fleet.follower")
    backend.status["/metrics"] = 503
    await follower.poll()  # no event, no request since the previous poll: in doubt
    assert (backend.take(), follower.in_doubt) == (["/metrics"], True)
    backend.status["/metrics"] = 200
    await follower.poll()  # /health answers, then the scrape does
    assert (backend.take(), follower.in_doubt, follower.health_probes) == (["/health", "/metrics"], False, 2)

    backend.status["/metrics"] = 503
    cluster.replicas["b"].last_message = time.monotonic()  # a request progressed on it: alive
    await follower.poll()
    assert (backend.take(), follower.in_doubt) == (["/metrics"], False)
    await follower.poll()  # nothing since: in doubt now
    assert (backend.take(), follower.in_doubt) == (["/metrics"], True)

    backend.status["/health"] = 500  # a failed /health quarantines it; the prober probes it from then on
    await follower.poll()
    assert (backend.take(), cluster.healthy("b")) == (["/health"], False)
    await follower.poll()
    assert (backend.take(), follower.health_probes) == (["/metrics"], 3)

    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"backend b ({URL}): /metrics answered 503",
        "backend b answers /metrics again (after: /metrics answered 503)",
        f"backend b ({URL}): /metrics answered 503",
        "backend b quarantined (/health answered 500) until it answers a probe",
    ]


async def test_a_joined_backend_is_not_scraped_before_its_interval(joined):
    follower, backend, _cluster = joined
    follower.metrics_interval_s = 60.0
    follower._models_asked_at -= follower.models_interval_s  # only /v1/models is due
    await follower.poll()
    assert backend.take() == ["/v1/models"]
    assert 59.0 < follower._next_due() <= 60.0  # the loop sleeps until the next scrape


async def test_a_backend_in_doubt_that_cannot_be_reached_is_quarantined(joined):
    follower, backend, cluster = joined
    backend.status["/metrics"] = 503
    await follower.poll()
    assert follower.in_doubt

    backend.reachable = False
    await follower.poll()
    assert (cluster.healthy("b"), follower.health_probes) == (False, 2)


def test_the_scrape_interval_is_a_validated_setting():
    assert RouterConfig().backend_metrics_interval_s == 5.0
    with pytest.raises(UsageError, match="backend_metrics_interval_s must be positive"):
        RouterConfig(backend_metrics_interval_s=0).validate()
