"""``UniCacheScheduler``: vLLM's V1 scheduler with our eviction policy deciding its victims.

Passed to vLLM as ``scheduler_cls``; it runs inside vLLM's engine-core process. After
vLLM's own constructor it

    * replaces ``block_pool.free_block_queue`` with a ``PolicyFreeQueue`` built around the
      policy named in ``additional_config["unicache"]["eviction_policy"]`` (registry name;
      ``"vllm"`` keeps vLLM's own queue, the baseline, and only reports status);
    * wraps four calls of vLLM's KV-cache manager and pool, on this instance only, to tell
      the queue who is freeing (``free`` / ``pop_blocks_for_free``: the request's class and
      block positions), who is hitting (``allocate_slots``: the class of an accessing
      request), what was just cached (``cache_full_blocks``: parent links) and when the
      cache was reset;
    * publishes a ``PoolStatus`` snapshot (capacity, free, cached, hit counters, the
      policy's queue sizes) on an ipc:// socket after every step that changed it, so the
      replica's heartbeats and ``GetCacheState`` report vLLM's pool; inside a stock vLLM
      server (no replica around it), ``metrics_port`` serves the same snapshot as the
      replica's ``unicache_replica_*`` series (replica/engines/vllm/plugin_metrics.py).

The request class travels in ``SamplingParams.extra_args`` (replica/engines/vllm/request_meta.py).
Per-request state (class) lives in a dict of live requests, dropped when the request's
blocks are freed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from unicache.contract.request_class import RequestClass
from unicache.replica.engines.vllm.config import NATIVE_POLICY
from unicache.replica.engines.vllm.free_queue import PolicyFreeQueue
from unicache.replica.engines.vllm.request_meta import class_from_request
from unicache.replica.engines.vllm.status import PoolStatus, StatusPublisher
from unicache.replica.eviction.base import QueueCounters
from unicache.replica.eviction.registry import make_policy

log = logging.getLogger(__name__)

CONFIG_KEY = "unicache"


class UniCacheScheduler(Scheduler):
    """See the module docstring. Options come from ``additional_config["unicache"]``:
    ``eviction_policy`` (registry name, required), ``status_endpoint`` (ipc:// address;
    empty: no snapshots), ``metrics_port`` / ``metrics_host`` (the plug-in's own
    Prometheus endpoint; unset: none) and ``step_clock_s`` (the policy's clock counts the
    steps that scheduled work, this many seconds each, instead of wall time: a replay
    then makes the same decisions on any machine, as ``unicache.sim.vllm_replay`` does;
    unset: wall time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opts = dict((self.vllm_config.additional_config or {}).get(CONFIG_KEY) or {})
        policy_name = opts.get("eviction_policy")
        if not policy_name:
            raise ValueError(f"UniCacheScheduler needs additional_config[{CONFIG_KEY!r}]['eviction_policy']")
        if len(self.kv_cache_manager.coordinator.single_type_managers) != 1:
            raise ValueError("UniCacheScheduler supports models with one KV-cache group (full attention) only")
        km = self.kv_cache_manager
        pool = km.block_pool
        self.policy_name = policy_name
        self.free_queue: PolicyFreeQueue | None = None
        self._steps = 0  # steps that scheduled work
        self._in_schedule = False
        step_clock_s = opts.get("step_clock_s")
        if step_clock_s is not None and not float(step_clock_s) > 0:
            raise ValueError(f"additional_config[{CONFIG_KEY!r}]['step_clock_s'] must be positive")
        self._step_clock_s = float(step_clock_s) if step_clock_s is not None else None
        if policy_name != NATIVE_POLICY:
            self.free_queue = PolicyFreeQueue(
                pool.free_block_queue.get_all_free_blocks(), pool.num_gpu_blocks, make_policy(policy_name),
                clock=self._step_clock if self._step_clock_s is not None else time.monotonic,
            )
            pool.free_block_queue = self.free_queue
        self._manager = km.coordinator.single_type_managers[0]
        self._classes: dict[str, RequestClass] = {}
        self._queries = 0  # prompt tokens looked up in the prefix cache
        self._hits = 0  # of which hit
        self._status = StatusPublisher(opts["status_endpoint"]) if opts.get("status_endpoint") else None
        self._last_status: PoolStatus | None = None
        self._metrics = bool(opts.get("metrics_port"))
        if self._metrics:
            from unicache.replica.engines.vllm.plugin_metrics import serve_plugin_metrics

            names = self.vllm_config.model_config.served_model_name or self.vllm_config.model_config.model
            model = names[0] if isinstance(names, list) else names
            serve_plugin_metrics(int(opts["metrics_port"]), self._latest_status, self.block_size, str(model),
                                 opts.get("metrics_host", "0.0.0.0"))
        self._wrap_stats(km)
        if self.free_queue is not None:
            self._wrap(km, pool, self.free_queue)

    # ------------------------------------------------------------ hooks
    def _wrap_stats(self, km: Any) -> None:
        orig_record = km.record_prefix_cache_stats

        def record_prefix_cache_stats(request: Request, num_hits: int) -> None:
            self._queries += request.num_tokens
            self._hits += num_hits
            orig_record(request, num_hits)

        km.record_prefix_cache_stats = record_prefix_cache_stats

    def _wrap(self, km: Any, pool: Any, queue: PolicyFreeQueue) -> None:
        orig_allocate, orig_free, orig_pop = km.allocate_slots, km.free, km.pop_blocks_for_free
        orig_cache, orig_reset = pool.cache_full_blocks, pool.reset_prefix_cache

        def allocate_slots(request: Request, *a: Any, **kw: Any):
            queue.access_cls = self._class_of(request)
            return orig_allocate(request, *a, **kw)

        def free(request: Request) -> None:
            self._note_release(request)
            orig_free(request)

        def pop_blocks_for_free(request: Request):
            self._note_release(request)
            return orig_pop(request)

        def cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *a: Any, **kw: Any) -> None:
            orig_cache(request, blocks, num_cached_blocks, num_full_blocks, *a, **kw)
            queue.note_cached(blocks, num_cached_blocks, num_full_blocks)

        def reset_prefix_cache() -> bool:
            done = orig_reset()
            if done:
                queue.on_reset()
            return done

        km.allocate_slots, km.free, km.pop_blocks_for_free = allocate_slots, free, pop_blocks_for_free
        pool.cache_full_blocks, pool.reset_prefix_cache = cache_full_blocks, reset_prefix_cache

    def _class_of(self, request: Request) -> RequestClass:
        cls = self._classes.get(request.request_id)
        if cls is None:
            cls = self._classes[request.request_id] = class_from_request(request)
        return cls

    def _note_release(self, request: Request) -> None:
        blocks = self._manager.req_to_blocks.get(request.request_id)
        if blocks and self.free_queue is not None:
            num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
            self.free_queue.note_release(blocks, self._class_of(request), num_prompt_blocks)
        if request.is_finished():
            self._classes.pop(request.request_id, None)

    # ------------------------------------------------------------ vLLM's entry points
    def _step_clock(self) -> float:
        """The policy's time with ``step_clock_s``: steps run so far (while a step is
        being scheduled, that step counts) times ``step_clock_s``."""
        assert self._step_clock_s is not None
        return (self._steps + self._in_schedule) * self._step_clock_s

    def add_request(self, request: Request) -> None:
        if self.free_queue is not None:
            self.free_queue.policy.on_request(self._class_of(request), self.free_queue.clock())
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any):
        self._in_schedule = True
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._in_schedule = False
        if out.total_num_scheduled_tokens > 0:
            self._steps += 1
        self._publish_status()
        return out

    def update_from_output(self, *args: Any, **kwargs: Any):
        out = super().update_from_output(*args, **kwargs)
        self._publish_status()
        return out

    def finish_requests(self, *args: Any, **kwargs: Any):
        out = super().finish_requests(*args, **kwargs)
        self._publish_status()
        return out

    def shutdown(self) -> None:
        super().shutdown()
        if self._status is not None:
            self._status.close()

    # ------------------------------------------------------------ status
    def pool_status(self) -> PoolStatus:
        pool = self.kv_cache_manager.block_pool
        queue = self.free_queue
        counters = queue.policy.queue_counters() if queue is not None else None
        if counters is None and queue is not None:  # a one-queue policy: its total under its name
            counters = QueueCounters({self.policy_name: queue.evictions}, {})
        return PoolStatus(
            capacity_blocks=pool.num_gpu_blocks - 1,  # less vLLM's null block
            free_blocks=pool.get_num_free_blocks(),
            cached_blocks=len(pool.cached_block_hash_to_block),
            query_tokens=self._queries,
            hit_tokens=self._hits,
            evictions=queue.evictions if queue is not None else 0,
            queue_sizes=queue.queue_sizes() if queue is not None else {NATIVE_POLICY: pool.get_num_free_blocks()},
            eviction_policy=self.policy_name,
            queue_evictions=counters.evictions if counters else {},
            queue_hits=counters.hits if counters else {},
        )

    def _latest_status(self) -> PoolStatus:
        """The last snapshot a step took (what a metrics scrape reads from its thread)."""
        return self._last_status or self.pool_status()

    def _publish_status(self) -> None:
        if self._status is None and not self._metrics:
            return
        status = self.pool_status()
        if status != self._last_status:
            if self._status is not None:
                self._status.publish(status)
            self._last_status = status
