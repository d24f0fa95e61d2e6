"""A second service model for the replay: one engine per replica stepping through a shared
token budget, as vLLM's scheduler does, instead of independent prefill lanes.

``Replay`` (the lanes model) prefills batches on ``lanes`` independent workers and decodes
for free beside them, ``decode_s_per_token`` per output token whatever else runs. vLLM
runs one step at a time: each step gives every decoding request one token and fills the
rest of a token budget (``max_num_batched_tokens``) with prefill chunks, the requests
already prefilling first, then new ones in arrival order. A long prefill therefore delays
the decodes it shares steps with, and a new request waits for budget, not for a free lane.
Routing policies were chosen on the lanes model; this one checks that their figures do
not depend on it.

The step model (``StepReplay``; the same arrivals, stores, routing and counters as
``Replay``):
    * A replica steps while it has running or admissible work. A step schedules, within
      ``step_token_budget`` tokens: one decode token for every running request past its
      prefill, the next chunk of every request still prefilling (admission order), then
      new requests from the queue head while budget is left and fewer than
      ``max_running`` run. A new request's blocks are allocated when it is admitted, as in
      ``Replay`` (prompt plus room for its output; the head waits when they do not fit,
      and a request larger than the replica is rejected).
    * A step lasts max(``decode_s_per_token`` if it decodes anything,
      ``prefill_s(chunks, prefill tokens) / lanes``): the engine prefills as fast as the
      lanes model's ``lanes`` lanes together (the same nominal capacity, so only the
      discipline differs), and a decode step's fixed cost hides a prefill chunk cheaper
      than itself. The pooled replica has every replica's lanes, budget and
      ``max_running``.
    * A request's first token comes at the end of the step that computes its last prompt
      token (TTFT = that time - arrival); its prompt blocks are cached then, its output
      blocks when its last decode step ends (``output_length`` steps after the first
      token), and then its blocks are released, as in ``Replay``.
    * Loads are published as in ``Replay``: ``queued_prefill_tokens`` is the whole
      prompts of the requests without a first token, ``running`` the admitted ones.

Not modelled: host-tier promotions (``StepReplay`` refuses a host tier) and preemption
(vLLM may evict a running request's blocks under memory pressure; here admission reserves
them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from unicache.sim.prepare import PreparedTrace, SimRequest
from unicache.sim.replay import _PREFILL_DONE, Replay, ReplayConfig
from unicache.sim.replica import SimReplica
from unicache.sim.timing import TimingModel

DEFAULT_STEP_TOKEN_BUDGET = 8192  # vLLM's max_num_batched_tokens for online serving
DEFAULT_MAX_RUNNING = 256  # vLLM's max_num_seqs


@dataclass(slots=True)
class _Active:
    """An admitted request: prompt tokens still to compute, decode steps still to run."""

    req: SimRequest
    prefill_left: int
    decode_left: int


class StepReplay(Replay):
    """``Replay`` with the step service model of the module docstring.

    Args (beyond ``Replay``'s):
        step_token_budget: tokens one step may schedule (default 8,192).
        max_running: requests a replica runs at once (default 256).
    """

    def __init__(self, trace: PreparedTrace, config: ReplayConfig, *args,
                 step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET, max_running: int = DEFAULT_MAX_RUNNING, **kwargs):
        if config.host_capacity_blocks:
            raise ValueError("the step model has no host tier")
        if step_token_budget <= 0 or max_running <= 0:
            raise ValueError("step_token_budget and max_running must be positive")
        super().__init__(trace, config, *args, **kwargs)
        scale = config.replicas if config.pooled else 1  # the pooled replica: every replica's engine in one
        self.step_token_budget = step_token_budget * scale
        self.max_running = max_running * scale
        self._active: dict[str, list[_Active]] = {rep.replica_id: [] for rep in self.replicas}

    # NOTE: ``Replay.run`` hands every event that is not a finish to ``_prefill_done``;
    # here the only such event is a step's end, and a request finishes inside it.
    def _schedule(self, rep: SimReplica, t: float) -> None:
        """Start a step on an idle replica that has work (``busy_lanes`` 1 while one runs)."""
        if rep.busy_lanes or not (self._active[rep.replica_id] or rep.waiting):
            return
        active = self._active[rep.replica_id]
        budget = self.step_token_budget
        decodes = 0
        chunks: list[tuple[_Active, int]] = []
        for a in active:  # running requests first: decodes, then prefills under way
            if a.prefill_left == 0:
                decodes += 1
        budget -= decodes
        for a in active:
            if budget <= 0:
                break
            if a.prefill_left:
                c = min(a.prefill_left, budget)
                chunks.append((a, c))
                budget -= c
        while budget > 0 and rep.waiting and len(active) < self.max_running:
            a = self._admit(rep, t)
            if a is None:
                break
            c = min(a.prefill_left, budget)
            chunks.append((a, c))
            budget -= c
        if not decodes and not chunks:
            return  # the queue head waits for blocks a running request will free
        prefill_tokens = sum(c for _, c in chunks)
        dt = max(self.timing.decode_s_per_token if decodes else 0.0,
                 self.timing.prefill_s(len(chunks), prefill_tokens) / rep.lanes if chunks else 0.0)
        rep.busy_lanes = 1
        heapq.heappush(self._heap, (t + dt, next(self._seq), _PREFILL_DONE, rep, chunks))

    def _admit(self, rep: SimReplica, t: float) -> _Active | None:
        """Admit the queue head (``Replay._admit_head``: its blocks allocated, its hits
        counted); None when it must wait."""
        admitted = self._admit_head(rep, t)
        if admitted is None:
            return None
        req, uncached = admitted
        a = _Active(req, max(1, uncached), req.output_length)  # a full hit still computes one token
        self._active[rep.replica_id].append(a)
        return a

    def _prefill_done(self, rep: SimReplica, chunks: list[tuple[_Active, int]], t: float) -> None:
        """A step ended at ``t``: decodes advance, chunks land, first tokens and finishes."""
        rep.busy_lanes = 0
        store, rid = rep.store, rep.replica_id
        active = self._active[rid]
        arrival = self._arrival
        done: list[_Active] = []
        # the decodes of this step: every request past its prefill (a chunk of this step
        # has not landed yet, so its request still counts tokens to prefill)
        for a in active:
            if a.prefill_left == 0:
                a.decode_left -= 1
                if a.decode_left <= 0:
                    done.append(a)
        for a, c in chunks:
            a.prefill_left -= c
            if a.prefill_left == 0:
                req = a.req
                rep.queued_prefill_tokens -= req.prompt_tokens
                self.counters.ttfts.append(t - arrival[req.index])
                store.cache_blocks(req.rid, t, len(req.prompt_hashes))
                if self.router is not None:
                    self.router.on_first_token(self._routed[req.rid], rid)
                if a.decode_left <= 0:
                    done.append(a)
        if done:
            gone = {id(a) for a in done}
            self._active[rid] = [a for a in active if id(a) not in gone]
            for a in done:
                self._release(rep, a.req, t)
        self._schedule(rep, t)
        self._publish(rep, t)

    def _finish(self, rep: SimReplica, req: SimRequest, t: float) -> None:  # pragma: no cover - never queued
        raise AssertionError("the step model finishes requests inside steps")


def unloaded_ttft_s(timing: TimingModel, input_length: int, lanes: int = 4,
                    step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET, decoding: bool = False) -> float:
    """TTFT of a request with nothing cached on a step-model replica: its prompt in chunks
    of the budget, one step each. ``decoding=False``: alone on an idle replica;
    ``decoding=True``: on a replica that is decoding other requests (light load), so it
    first waits for the step in flight and each of its steps lasts at least a decode step."""
    d = timing.decode_s_per_token if decoding else 0.0
    t, left = d, max(1, input_length)
    while left > 0:
        chunk = min(left, step_token_budget)
        t += max(d, timing.prefill_s(1, chunk) / lanes)
        left -= chunk
    return t
