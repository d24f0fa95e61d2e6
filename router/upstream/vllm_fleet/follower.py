"""Following one stock vLLM server: its KV events into the locality index, its ``/health``
and ``/v1/models`` into membership, its ``/metrics`` into the load policies see.

Membership. A backend joins the cluster (``ClusterView.upsert``, static: no heartbeat
expires it) once ``/health`` answers 200, ``/v1/models`` names its model, its block size
(``vllm:cache_config_info``) equals the router's, and its events stream is connected and
caught up from the server's replay buffer (a
backend given without ``kv-events`` joins without, and the router logs once that it cannot
route by prefix to it). After that the request path quarantines it when it refuses or
stalls and ``unicache.router.cluster.prober`` re-probes it through ``/health``, as for replicas.

Background work, sized as the Rust routers' (they poll every 10-60 s): once joined, a
backend's liveness is its events stream, the requests it serves and its ``/metrics``
scrape (every ``metrics_interval_s``, 5 s by default). ``/health`` is asked only of a
backend in doubt: a scrape failed and neither an event, a request's progress nor a
``/health`` answer came from it since the previous poll. It is asked ``health_interval_s``
later; a failure quarantines the backend (the prober then takes over). Log lines say what
changed (joined, a failure, answering again, quarantined), never that a poll ran. The
events stream is awaited on the event loop (``KVEventSubscriber.take_async``): no thread,
no polling timeout, nothing done while it is idle.

Invariants:
    * The index holds, for this backend, exactly the blocks its translated events stored
      and did not remove since the stream's last break; a break (reconnect, a gap replay
      cannot fill) drops them all and starts over from what follows; an impossible claim
      (more blocks than the server's pool) drops them and resyncs from its replay buffer.
    * A backend whose events stream is disconnected for ``stale_after_s`` has its blocks
      aged out of the index (it may have restarted empty); they come back with its events.
    * ``/metrics`` is scraped once per ``metrics_interval_s`` once joined (every
      ``health_interval_s`` while joining or in doubt); the load it gives
      (running, waiting, free and total blocks) is written in place into the backend's
      ``ReplicaLoad``, the router's own in-flight count stays the router's.
    * ``/v1/models`` is read again every ``models_interval_s``: the base models and LoRA
      adapters it lists (adapters loaded at run time too) are what requests naming them
      may be routed to (``cluster.models``, router/cluster/models.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from prometheus_client.parser import text_string_to_metric_families

from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from unicache.contract.kv_tier import Tier
from unicache.contract.vllm_events import SCHEMAS, EventTranslator, KVEventSubscriber
from unicache.router.cluster.index import LocalityIndex
from unicache.router.cluster.models import cards_from_models_list
from unicache.router.cluster.view import ClusterView
from unicache.router.upstream.vllm_fleet.events_listener import EventsListener
from unicache.router.upstream.vllm_fleet.http_stream import BackendUnreachable, VllmClients
from unicache.router.upstream.vllm_fleet.spec import BackendSpec

log = logging.getLogger(__name__)


def apply_events(index: LocalityIndex, backend_id: str, events: list[KVEvent]) -> None:
    """Apply translated events to the index in order (runs of one kind per call)."""
    stored: list = []
    parents: list = []
    removed: list = []
    host_stored: list = []
    host_removed: list = []

    runs = (stored, parents, removed, host_stored, host_removed)

    def flush(cleared: bool = False) -> None:
        if stored or removed or host_stored or host_removed or cleared:
            index.apply_events_unchecked(
                backend_id, list(stored), list(removed), list(parents), cleared=cleared,
                host_stored=list(host_stored), host_removed=list(host_removed),
            )
            for run in runs:
                run.clear()

    for ev in events:
        if isinstance(ev, BlockStored):
            if removed or host_removed:
                flush()
            if ev.tier == Tier.HOST:
                host_stored.append(ev.block_hash)
            else:
                stored.append(ev.block_hash)
                parents.append(ev.parent_hash)
        elif isinstance(ev, BlockRemoved):
            if stored or host_stored:
                flush()
            (host_removed if ev.tier == Tier.HOST else removed).append(ev.block_hash)
        elif isinstance(ev, AllBlocksCleared):
            for run in runs:  # what came before the clear in this batch is gone with it
                run.clear()
            flush(cleared=True)
    flush()


_SERIES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "usage",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:prompt_tokens_cached": "prompt_tokens_cached",
}
# histograms whose _sum and _count feed the cost model (router/routing/cost_model.py)
_HISTOGRAMS = {
    "vllm:request_prefill_time_seconds": "prefill_time",
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:time_per_output_token_seconds": "tpot",  # its name before vLLM 0.11
    "vllm:request_queue_time_seconds": "queue_time",
}
_PREFIXES = (*(f"{name}{{" for name in _SERIES), *(f"{name}_total{{" for name in _SERIES), "vllm:cache_config_info{",
             *(f"{name}_{part}{{" for name in _HISTOGRAMS for part in ("sum", "count")))
_WANTED = (*_PREFIXES, *(f"# TYPE {p[:-1]} " for p in _PREFIXES))  # the series' samples and their TYPE lines


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The series the router reads from a vLLM ``/metrics`` page (summed over engines):
    ``running``, ``waiting``, ``usage`` (0..1), ``gpu_blocks``, ``cpu_blocks``,
    ``block_size``, ``prefix_hits``, ``prefix_queries``, ``prompt_tokens``,
    ``prompt_tokens_cached`` and the histograms' ``prefill_time_sum`` / ``_count``,
    ``tpot_sum`` / ``_count``, ``queue_time_sum`` / ``_count``; absent ones are left out."""
    out: dict[str, float] = {}
    # NOTE: only the lines of these series reach the parser: a vLLM page has ~650 lines and
    # parsing all of it cost 12 ms per scrape, every second, per backend.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    for family in text_string_to_metric_families(wanted + "\n"):
        if family.name in _SERIES:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = _SERIES[family.name]
                out[key] = out.get(key, 0.0) + sample.value
        elif family.name.endswith(("_sum", "_count")) and family.name.rpartition("_")[0] in _HISTOGRAMS:
            # NOTE: only a histogram's _sum and _count lines reach the parser, without its
            # TYPE line: each is read as an untyped family of that name
            base, _, part = family.name.rpartition("_")
            key = f"{_HISTOGRAMS[base]}_{part}"
            for sample in family.samples:
                out[key] = out.get(key, 0.0) + sample.value
        elif family.name == "vllm:cache_config_info":
            for sample in family.samples:
                for label, key in (("num_gpu_blocks", "gpu_blocks"), ("num_cpu_blocks", "cpu_blocks"), ("block_size", "block_size")):
                    value = sample.labels.get(label, "")
                    if value.isdigit():
                        out[key] = out.get(key, 0.0) + int(value) if key != "block_size" else int(value)
    return out


def observe_histograms(model, backend_id: str, prev: dict[str, float], now: dict[str, float]) -> None:
    """Feed ``model`` (a ``CostModel``) what a vLLM server's histograms say between two
    scrapes: the mean prefill time of the requests prefilled in between against their
    mean uncached prompt tokens (prompt less cached tokens), and their mean time per
    output token against the requests running now."""
    def delta(key: str) -> float:
        return now.get(key, 0.0) - prev.get(key, 0.0)

    n = delta("prefill_time_count")
    if n > 0 and "prompt_tokens" in now:
        uncached = max(0.0, delta("prompt_tokens") - delta("prompt_tokens_cached")) / n
        model.observe_prefill(backend_id, delta("prefill_time_sum") / n, uncached)
    n = delta("tpot_count")
    if n > 0:
        model.observe_itl(backend_id, delta("tpot_sum") / n, max(1.0, now.get("running", 0.0)))


class BackendFollower:
    """See the module docstring.

    Args:
        spec: the backend.
        cluster: where it joins, and whose index its events fill.
        clients: the HTTP clients (its served model name is recorded there).
        block_size: the router's block size; a backend with another one never joins.
        health_interval_s: polling interval while it joins or is in doubt (default 1 s).
        stale_after_s: events disconnected this long age its blocks out (default 10 s).
        models_interval_s: ``/v1/models`` read again this often (default 60 s).
        metrics_interval_s: ``/metrics`` scraped this often once joined (default 5 s).
    """

    def __init__(
        self, spec: BackendSpec, cluster: ClusterView, clients: VllmClients, block_size: int,
        health_interval_s: float = 1.0, stale_after_s: float = 10.0, models_interval_s: float = 60.0,
        metrics_interval_s: float = 5.0, listener: EventsListener | None = None, events_wait_s: float = 5.0,
    ):
        self.spec = spec
        self.cluster = cluster
        self.clients = clients
        self.block_size = block_size
        self.health_interval_s = health_interval_s
        self.stale_after_s = stale_after_s
        self.models_interval_s = models_interval_s
        self.metrics_interval_s = metrics_interval_s
        self.in_doubt = False  # joined, but a poll failed without other signs of life: ask /health
        self.health_probes = 0  # /health requests sent (joining, or in doubt)
        self._doubt = ""  # the failure logged since its last good scrape ("": none)
        self._healthy_at = 0.0  # time.monotonic() of its last /health 200
        self._polled_at = 0.0  # time.monotonic() at the end of the previous poll
        self._scraped_at = -float("inf")  # time.monotonic() of its last /metrics request
        self._models_asked_at = -float("inf")  # time.monotonic() of its last /v1/models request
        self._models_at = -float("inf")  # time.monotonic() of its last /v1/models answer
        self.translator = EventTranslator()
        if spec.events:
            self.subscriber = KVEventSubscriber(spec.events, spec.replay)
        else:  # with the router listening, the server publishes to it (events_listener.py)
            self.subscriber = listener.stream(spec) if listener is not None else None
        self.events_wait_s = events_wait_s
        self._started_at = time.monotonic()
        self.joined = False
        self.caught_up = False  # its events are connected and the replay buffer is applied
        self.problem = ""  # why it has not joined (logged once per distinct reason)
        self.capacity_blocks = 0
        self.batches = 0  # event batches applied
        self.breaks = 0  # stream breaks (each dropped its blocks)
        self.last_event_at = 0.0  # time.monotonic() of its last batch
        self._disconnected_since: float | None = None
        self._stop = False
        if self.subscriber is None:
            log.warning("backend %s (%s) has no kv-events address and the router does not listen (--kv-events-listen): the router cannot route by prefix to it", spec.backend_id, spec.url)

    @property
    def backend_id(self) -> str:
        return self.spec.backend_id

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._poll_loop(), name=f"backend-poll-{self.backend_id}")]
        if self.subscriber is not None:
            tasks.append(asyncio.create_task(self._events_loop(), name=f"backend-events-{self.backend_id}"))
        try:
            await asyncio.gather(*tasks)
        finally:
            self._stop = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.subscriber is not None:
                self.subscriber.close()

    # --- events -------------------------------------------------------------------------
    async def _events_loop(self) -> None:
        sub = self.subscriber
        while not self._stop:
            # NOTE: the wait is on the event loop itself (no thread, no polling timeout): an
            # idle stream costs nothing. Only a disconnected stream whose blocks are still
            # indexed sets a deadline: when its blocks age out.
            timeout = None
            if not sub.connected and len(self.translator):
                since = self._disconnected_since
                timeout = self.stale_after_s if since is None else max(0.001, since + self.stale_after_s - time.monotonic())
            batches = await sub.take_async(timeout)
            self.apply(batches, sub.broken)
            # NOTE: the take that saw the connection also replayed the server's buffer, so
            # once its batches are applied the index knows what the server cached before.
            self.caught_up = sub.connected
            if sub.connected:
                self._disconnected_since = None
            elif self._disconnected_since is None:
                self._disconnected_since = time.monotonic()
            elif time.monotonic() - self._disconnected_since >= self.stale_after_s and len(self.translator):
                log.warning("backend %s: events disconnected for %.0fs, its blocks leave the index", self.backend_id, self.stale_after_s)
                self._drop_blocks()

    def apply(self, batches: list, broken: bool = False) -> None:
        """Translate and index ``batches`` (``broken``: the stream broke before them)."""
        if broken:
            self.breaks += 1
            self._drop_blocks()
        events: list[KVEvent] = []
        for batch in batches:
            events.extend(self.translator.translate(batch))
        if batches:
            self.batches += len(batches)
            self.last_event_at = time.monotonic()
            if self.translator.schema != self.cluster.backend_schema.get(self.backend_id):
                self._schema_seen(self.translator.schema)
        index = self.cluster.index
        if batches and self.translator.windows:  # a hybrid model: prefix hits bounded by its window groups
            index.set_windows(self.backend_id, self.translator.window_constraints())
        if events:
            apply_events(index, self.backend_id, events)
            if index.needs_resync(self.backend_id):  # an impossible claim: resync from the replay buffer
                self.breaks += 1
                self._drop_blocks()
                if self.subscriber is not None:
                    self.subscriber.request_catch_up()

    def _schema_seen(self, schema: str | None) -> None:
        if schema is None:
            return
        self.cluster.backend_schema[self.backend_id] = schema
        log.info("backend %s publishes KV events in the %s form: %s", self.backend_id, schema, SCHEMAS[schema])

    def _drop_blocks(self) -> None:
        self.translator.reset()
        self.cluster.index.drop_replica(self.backend_id)
        if self.capacity_blocks:
            self.cluster.index.set_capacity(self.backend_id, self.capacity_blocks)

    # --- health, model, load ----------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while not self._stop:
            await self.poll()
            # NOTE: a quarantined backend is probed by the prober: its scrapes keep the pace.
            steady = self.joined and (not self.in_doubt or not self.cluster.healthy(self.backend_id))
            await asyncio.sleep(self._next_due() if steady else self.health_interval_s)

    def _next_due(self) -> float:
        """Seconds to the next scrape or ``/v1/models`` read, whichever comes first."""
        now = time.monotonic()
        return max(0.0, min(self._scraped_at + self.metrics_interval_s, self._models_asked_at + self.models_interval_s) - now)

    async def poll(self) -> None:
        """One poll: joining (``/health``, ``/v1/models``, ``/metrics``), ``/health`` when
        in doubt, else ``/metrics`` (and ``/v1/models`` when due)."""
        try:
            await self.poll_once()
        except BackendUnreachable as exc:
            self._failed(f"unreachable ({exc})")
        self._polled_at = time.monotonic()

    def _alive_since_last_poll(self) -> bool:
        """Did an event batch, a request's progress (``ReplicaRecord.last_message``) or a
        /health 200 come from it since the previous poll ended?"""
        rec = self.cluster.replicas.get(self.backend_id)
        last = max(self.last_event_at, self._healthy_at, rec.last_message if rec is not None else 0.0)
        return last > self._polled_at

    def _failed(self, why: str) -> None:
        """A poll failed: a joining backend is not routable yet; a joined one is in doubt
        unless it showed signs of life since the previous poll."""
        if not self.joined:
            self._not_joined(why)
            return
        if why != self._doubt:
            log.warning("backend %s (%s): %s", self.backend_id, self.spec.url, why)
            self._doubt = why
        if not self._alive_since_last_poll():
            self.in_doubt = True

    async def poll_once(self) -> None:
        url = self.spec.url
        timeout = max(self.health_interval_s, 2.0)
        if not self.joined or self.in_doubt:
            if not (self.joined and not self.cluster.healthy(self.backend_id)):  # the prober probes a quarantined one
                self.health_probes += 1
                try:
                    answer = str((await self.clients.get(url, "/health", timeout)).status)
                except BackendUnreachable as exc:
                    if not self.joined:
                        raise
                    answer = f"nothing ({exc})"  # unreachable: in doubt no more
                if answer != "200":
                    why = f"/health answered {answer}"
                    if not self.joined:
                        self._not_joined(why)
                    elif self.cluster.quarantine(self.backend_id):
                        log.warning("backend %s quarantined (%s) until it answers a probe", self.backend_id, why)
                    return
                self._healthy_at = time.monotonic()
                self.in_doubt = False
        if not self.joined or time.monotonic() - self._models_asked_at >= self.models_interval_s:
            self._models_asked_at = time.monotonic()
            if not await self._read_models(timeout) and not self.joined:
                return
        if self.joined and not self.in_doubt and time.monotonic() - self._scraped_at < self.metrics_interval_s:
            return  # woken for /v1/models only
        self._scraped_at = time.monotonic()
        r = await self.clients.get(url, "/metrics", timeout)
        if r.status != 200:
            self._failed(f"/metrics answered {r.status}")
            return
        stats = parse_vllm_metrics(r.body.decode("utf-8", "replace"))
        if "block_size" not in stats:
            self._failed("/metrics has no vllm:cache_config_info: not a vLLM server")
            return
        if int(stats["block_size"]) != self.block_size:
            self._failed(f"its block size is {int(stats['block_size'])}, the router's {self.block_size}: start both with one")
            return
        self.in_doubt = False
        if self._doubt:
            log.info("backend %s answers /metrics again (after: %s)", self.backend_id, self._doubt)
            self._doubt = ""
        self._set_load(stats)
        if not self.joined:
            if self.subscriber is not None and not self.caught_up and not self._events_overdue():
                return
            self.joined = True
            self.cluster.upsert(self.backend_id, self.spec.url, static=True)
            self.cluster.backend_events += 1 if self.subscriber is not None else 0
            self._set_load(stats)
            log.info("backend %s (%s, serving %s) joined", self.backend_id, self.spec.url, ", ".join(self.cluster.models.backend(self.backend_id)))

    def _events_overdue(self) -> bool:
        """Whether a backend whose events are not there yet may join without them: one
        log line says what to check once ``events_wait_s`` has passed (a stream of ours
        never joins without its events; one on the listener does, as an idle server
        publishing to it has nothing to send)."""
        if time.monotonic() - self._started_at < self.events_wait_s:
            return False
        if self.spec.events:
            port = self.spec.events.rpartition(":")[2]
            self._not_joined(
                f"no publisher at {self.spec.events} after {self.events_wait_s:.0f}s. Check its --kv-events-config: vLLM "
                f"binds its events socket only for a wildcard endpoint (\"endpoint\": \"tcp://*:{port}\"); given a host "
                "address it connects out to a listener instead (then start the router with --kv-events-listen tcp://*:PORT, "
                "point vLLM's endpoint at the router and drop kv-events= from this backend). Check also that this address "
                "is the server's and the port is open to the router")
            return False
        if self.problem != "events overdue":
            self.problem = "events overdue"
            log.warning(
                "backend %s (%s): no KV events on %s after %.0fs%s; it joins without them. If it has served requests, check "
                "its --kv-events-config: endpoint tcp://<router address>:%s (a host address: vLLM connects to the router) "
                "and topic %s", self.backend_id, self.spec.url, self.subscriber.endpoint, self.events_wait_s,
                "" if not self.spec.replay else f" nor an answer from its replay socket {self.spec.replay}",
                self.subscriber.endpoint.split(" ")[0].rpartition(":")[2], self.subscriber.topics[0])
        return True

    async def _read_models(self, timeout: float) -> bool:
        """Record the base models and LoRA adapters ``/v1/models`` lists (adapters loaded
        or unloaded at run time show up here); False when it lists none (a joined backend
        keeps what it listed before)."""
        r = await self.clients.get(self.spec.url, "/v1/models", timeout)
        data = None
        if r.status == 200 and r.content_type.startswith("application/json"):
            try:
                listed = json.loads(r.body)
            except ValueError:
                listed = None
            data = listed.get("data") if isinstance(listed, dict) else None
        cards = cards_from_models_list(data) if isinstance(data, list) else []
        bases = [card.name for card in cards if not card.is_adapter]
        if not bases:
            if not self.joined:
                self._not_joined("/v1/models lists no model: not a vLLM OpenAI server")
            return False
        self._models_at = time.monotonic()
        self.clients.models[self.spec.url] = bases[0]
        if self.cluster.models.set_backend(self.backend_id, cards) and self.joined:
            log.info("backend %s now serves %s", self.backend_id, ", ".join(card.name for card in cards))
        return True

    def _set_load(self, stats: dict[str, float]) -> None:
        prev = self.cluster.backend_stats.get(self.backend_id)
        if prev is not None:
            observe_histograms(self.cluster.cost_model, self.backend_id, prev, stats)
        self.cluster.backend_stats[self.backend_id] = stats
        gpu = int(stats.get("gpu_blocks", 0))
        self.capacity_blocks = gpu
        self.translator.max_entries = gpu + int(stats.get("cpu_blocks", 0))
        self.cluster.index.set_capacity(self.backend_id, gpu)
        free = max(0, round(gpu * (1.0 - stats.get("usage", 0.0))))
        self.cluster.set_external_load(self.backend_id, int(stats.get("running", 0)), int(stats.get("waiting", 0)), free, gpu)

    def _not_joined(self, why: str) -> None:
        if why != self.problem:
            log.warning("backend %s (%s) not routable: %s", self.backend_id, self.spec.url, why)
            self.problem = why
