"""Replay of a prepared trace through a model of one vLLM 0.32 server: its scheduler's
steps over ``VllmBlockPool``, counting prefix-cache hits as vLLM's metrics do.

What it counts is ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``:
at a request's first admission, queries += its prompt tokens, hits += the tokens its
longest cached prefix covers, in whole blocks and at most ``prompt - 1`` tokens (vLLM
recomputes at least the last token for its logits; a prompt whose blocks are all cached
still computes its last block). Requests re-admitted after a preemption are not counted.

The scheduler step (``vllm/v1/core/sched/scheduler.py``, FCFS, chunked prefill, no
speculative decoding, watermark 0), one per ``_step``::

    budget = max_num_batched_tokens
    running, in order:  new = min(tokens not yet computed, budget); allocate slots,
                        preempting the last running request until they fit (a preempted
                        request frees its blocks and goes back to the front of waiting)
    waiting, FIFO, while budget and fewer than max_num_seqs run (skipped in a step
                        that preempted): look the prefix up, admit only if the whole
                        sequence fits (vLLM's default ``scheduler_reserve_full_isl``),
                        new = min(uncached tokens, budget)
    then every scheduled request whose tokens are all computed samples one token;
    one that has ``output_length`` tokens finishes and frees its blocks.

Blocks are cached when scheduled full (``allocate_slots`` caches up to the request's
known tokens), decode blocks included; a request's last sampled token is never computed,
so its table holds ``ceil((prompt + output - 1) / block_size)`` blocks.

Time: with ``sequential`` the next request arrives when the previous one finished (a
client sending one at a time: the only live replay whose order does not depend on
timing); otherwise at its trace time divided by ``rate_scale``, and a step lasts
``step_fixed_s + step_token_s * scheduled tokens``. The policy's clock is the simulated
time, or with ``step_clock_s`` the number of steps run times it (the plug-in's
``step_clock_s``, which makes a live server's policy decisions independent of wall time:
during a step's scheduling the clock reads that step's end).

Output blocks (no trace knows what a model generates) get hashes derived from the whole
prompt and the block's index: equal prompts, equal outputs (greedy decoding), and no later
prompt ever hits them, as live, where a later turn carries the trace's words.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from unicache.contract.block_hash import BlockHash, hash_block
from unicache.replica.eviction.registry import make_policy
from unicache.sim.prepare import PreparedTrace, SimRequest
from unicache.sim.vllm_pool import VllmBlockPool


@dataclass(slots=True, frozen=True)
class VllmServerModel:
    """The server being modelled.

    Attributes:
        num_gpu_blocks: the pool, null block included (vLLM's ``num_gpu_blocks``).
        max_num_seqs: requests running at once (``--max-num-seqs``).
        max_num_batched_tokens: tokens per step (``--max-num-batched-tokens``).
        sequential: one request at a time (see the module docstring).
        rate_scale: arrival times are divided by this (not sequential).
        step_fixed_s, step_token_s: a step's duration (not sequential).
        step_clock_s: the policy's clock in steps of this many seconds (None: simulated time).
    """

    num_gpu_blocks: int
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    sequential: bool = True
    rate_scale: float = 1.0
    step_fixed_s: float = 0.02
    step_token_s: float = 0.0001
    step_clock_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not self.rate_scale > 0:
            raise ValueError("rate_scale must be positive")
        if self.step_clock_s is not None and not self.step_clock_s > 0:
            raise ValueError("step_clock_s must be positive")


@dataclass(slots=True)
class _Req:
    sim: SimRequest
    prompt: int  # prompt tokens
    output: int  # tokens to generate
    hashes: list[BlockHash]  # full blocks' hashes, prompt first (output ones made on demand)
    num_computed: int = 0
    num_output: int = 0
    table: list[int] = field(default_factory=list)
    num_cached: int = 0
    preempted: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.num_output


@dataclass(slots=True)
class VllmReplayResult:
    """vLLM's prefix-cache counters after the replay, and what the model saw."""

    query_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0
    preemptions: int = 0
    rejected: int = 0
    evictions: int = 0
    steps: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class VllmReplay:
    """Replays ``trace`` through one modelled vLLM server evicting with ``policy``.

    Args:
        trace: prepared requests; their ``input_length`` and ``output_length`` are the
            prompt and output tokens, ``prompt_hashes`` one per ``block_size`` tokens (the
            last may stand for a partial block, which is never cached).
        policy: eviction policy name (``lru``: vLLM's own order).
        server: the server model.
        policy_kwargs: the policy's constructor arguments.
    """

    def __init__(self, trace: PreparedTrace, policy: str, server: VllmServerModel, policy_kwargs: dict | None = None):
        self.trace = trace
        self.bs = trace.block_size
        self.server = server
        self.now = 0.0
        self._steps = 0
        self._in_schedule = False
        self._preempted = False  # the last step preempted a request
        self.pool = VllmBlockPool(server.num_gpu_blocks, make_policy(policy, **(policy_kwargs or {})), self.clock)
        self.result = VllmReplayResult()
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []

    def clock(self) -> float:
        s = self.server.step_clock_s
        if s is None:
            return self.now
        return (self._steps + (1 if self._in_schedule else 0)) * s

    # ------------------------------------------------------------------ run
    def run(self) -> VllmReplayResult:
        reqs = self.trace.requests
        srv = self.server
        i, n = 0, len(reqs)
        while i < n or self.waiting or self.running:
            if srv.sequential:
                if not self.waiting and not self.running:
                    self._arrive(reqs[i])
                    i += 1
            else:
                while i < n and reqs[i].arrival_s / srv.rate_scale <= self.now:
                    self._arrive(reqs[i])
                    i += 1
                if not self.waiting and not self.running:
                    self.now = max(self.now, reqs[i].arrival_s / srv.rate_scale)
                    continue
            if srv.sequential and len(self.running) == 1 and not self.waiting:
                self._skip_quiet_decode(self.running[0])
            scheduled = self._schedule()
            if not scheduled:
                if not self._preempted:
                    # Nothing runs and the head cannot fit even into an empty pool.
                    assert not self.running
                    self.waiting.popleft()
                    self.result.rejected += 1
                continue
            self._steps += 1
            self.now += srv.step_fixed_s + srv.step_token_s * sum(k for _, k in scheduled)
            self._update(scheduled)
        self.result.evictions = self.pool.evictions
        self.result.steps = self._steps
        return self.result

    def _skip_quiet_decode(self, r: _Req) -> None:
        """Run at once the decode steps of a lone request that neither allocate, cache nor
        finish (only the step count and time move in them)."""
        t = r.num_tokens
        if r.num_computed != t - 1:
            return  # still prefilling
        bs = self.bs
        quiet = min((r.num_cached + 1) * bs, len(r.table) * bs + 1, r.prompt + r.output - 1) - t
        if quiet > 0:
            self._steps += quiet
            self.now += quiet * (self.server.step_fixed_s + self.server.step_token_s)
            r.num_output += quiet
            r.num_computed += quiet

    def _arrive(self, sim: SimRequest) -> None:
        bs = self.bs
        full = min(sim.input_length // bs, len(sim.prompt_hashes))
        r = _Req(sim, sim.input_length, max(1, sim.output_length), list(sim.prompt_hashes[:full]))
        self.pool.policy.on_request(sim.cls, self.clock())
        self.waiting.append(r)

    # ------------------------------------------------------------ a step
    def _schedule(self) -> list[tuple[_Req, int]]:
        self._in_schedule = True
        try:
            return self._schedule_step()
        finally:
            self._in_schedule = False

    def _schedule_step(self) -> list[tuple[_Req, int]]:
        srv, running = self.server, self.running
        budget = srv.max_num_batched_tokens
        scheduled: list[tuple[_Req, int]] = []
        self._preempted = preempted = False
        idx = 0
        while idx < len(running) and budget > 0:
            r = running[idx]
            new = min(r.num_tokens - r.num_computed, budget)
            ok = False
            while True:
                if self._allocate(r, new, []):
                    ok = True
                    break
                victim = running.pop()
                self._preempt(victim)
                self._preempted = preempted = True
                if victim is r:
                    break
            if not ok:
                break
            scheduled.append((r, new))
            budget -= new
            idx += 1
        if preempted:
            return scheduled
        while self.waiting and budget > 0 and len(running) < srv.max_num_seqs:
            r = self.waiting[0]
            limit = (r.num_tokens - 1) // self.bs
            self._hashes_upto(r, limit)
            hit = self.pool.lookup(r.hashes[:limit])
            hit_tokens = len(hit) * self.bs
            # The whole sequence must fit (vLLM's scheduler_reserve_full_isl).
            full = -(-r.num_tokens // self.bs) - len(hit) + self.pool.num_evictable(hit)
            if full > self.pool.num_free_blocks:
                break
            new = min(r.num_tokens - hit_tokens, budget)
            if not self._allocate(r, new, hit):
                break
            if not r.preempted:
                self.result.requests += 1
                self.result.query_tokens += r.num_tokens
                self.result.hit_tokens += hit_tokens
            self.waiting.popleft()
            running.append(r)
            scheduled.append((r, new))
            budget -= new
        return scheduled

    def _allocate(self, r: _Req, new: int, hit: list[int]) -> bool:
        """vLLM's ``allocate_slots``: room for ``new`` tokens after the hit, then cache
        the blocks whose tokens are all known. False (nothing changed) if short."""
        bs, pool = self.bs, self.pool
        computed = r.num_computed + len(hit) * bs
        required = -(-(computed + new) // bs)
        num_new = max(required - len(hit) - len(r.table), 0)
        if num_new + pool.num_evictable(hit) > pool.num_free_blocks:
            return False
        if hit:
            pool.touch(hit, r.sim.cls)
            r.table.extend(hit)
            r.num_computed = computed
            r.num_cached = len(hit)
        if num_new:
            r.table.extend(pool.get_new_blocks(num_new))
        full = min(computed + new, r.num_tokens) // bs
        if full > r.num_cached:
            self._hashes_upto(r, full)
            pool.cache_full_blocks(r.table, r.hashes, r.num_cached, full)
            r.num_cached = full
        return True

    def _hashes_upto(self, r: _Req, n: int) -> None:
        """Extend ``r.hashes`` to ``n`` blocks with output blocks' hashes."""
        prompt_hashes = r.sim.prompt_hashes
        while len(r.hashes) < n:
            j = len(r.hashes)
            parent = r.hashes[-1] if j > r.prompt // self.bs else prompt_hashes[-1]
            r.hashes.append(hash_block(parent, (r.prompt, j), ("out",)))

    def _preempt(self, r: _Req) -> None:
        self._free(r)
        r.num_computed = 0
        r.num_cached = 0
        r.preempted = True
        self.result.preemptions += 1
        self.waiting.appendleft(r)

    def _free(self, r: _Req) -> None:
        self.pool.free(r.table, r.sim.cls, -(-r.prompt // self.bs))
        r.table = []

    def _update(self, scheduled: list[tuple[_Req, int]]) -> None:
        """After the step ran: computed tokens advance, finished prefills and decodes
        sample a token, finished requests free their blocks (in scheduling order)."""
        for r, new in scheduled:
            r.num_computed += new
            if r.num_computed >= r.num_tokens:
                r.num_output += 1
                if r.num_output >= r.output:
                    self.running.remove(r)
                    self._free(r)
