"""Iteration-level scheduling: which sequences compute which tokens in the next step.

Each step, running sequences go first (in admission order): a decode token each, or the
next chunk of a prefill. Then waiting sequences are admitted in FIFO order while there
is token budget, a sequence slot, and free blocks for the whole prompt (``can_allocate``
counts cache hits). When a running sequence needs a new block and none is free, the most
recently admitted running sequence is preempted: its blocks are freed (its computed full
blocks stay in the prefix cache) and it goes back to the head of the queue to be
recomputed later.

Invariant: every sequence in ``running`` holds a block table in the store; no sequence in
``waiting`` does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from unicache.contract.block_hash import reusable_prompt_blocks
from unicache.replica.engines.builtin.sequence import RequestGroup, SeqStatus, Sequence
from unicache.replica.kv.store import KVStore, OutOfBlocks


@dataclass(slots=True)
class ScheduledChunk:
    """Compute positions ``start..end-1`` of ``seq``; sample a token when ``end`` reaches its length."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == len(self.seq.token_ids)


class Scheduler:
    """Owns the waiting and running queues and every block-table change for them.

    Args:
        store: the KV store.
        max_num_seqs: most running sequences (a request with n samples counts n at admission).
        max_num_batched_tokens: most tokens computed per step.
        clock: seconds, passed to the store as ``now``.
        watermark_blocks: blocks kept free when admitting next to running sequences, so a
            fresh admission does not force a preemption on the very next decode step.
    """

    def __init__(
        self,
        store: KVStore,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float],
        watermark_blocks: int = 0,
    ):
        self.store = store
        self.block_size = store.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> list[ScheduledChunk]:
        now = self.clock()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            end = min(len(seq.token_ids), seq.num_computed + budget)
            if not self._reserve_slots(seq, end, now):
                continue  # seq itself was preempted; running[i] is now the next one
            chunks.append(ScheduledChunk(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
            i += 1
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats_in_use() + self._seats(seq) > self.max_num_seqs:
                break
            if not self._admit(seq, now):
                break
            self.waiting.popleft()
            end = min(len(seq.token_ids), seq.num_computed + budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed, end))
            budget -= end - seq.num_computed
        return chunks

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Sequence slots ``seq`` takes: all n samples until its group has forked."""
        return 1 if seq.group.forked else seq.group.request.sampling.n

    def _seats_in_use(self) -> int:
        return sum(self._seats(s) for s in self.running)

    def _reserve_slots(self, seq: Sequence, end: int, now: float) -> bool:
        """Grow ``seq``'s block table to hold ``end`` tokens, preempting others if needed."""
        need = end - self.store.request(seq.seq_id).num_tokens
        while need > 0:
            try:
                self.store.append_tokens(seq.seq_id, need, now)
                return True
            except OutOfBlocks:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def _admit(self, seq: Sequence, now: float) -> bool:
        n_tokens = len(seq.token_ids)
        hashes = seq.full_block_hashes(n_tokens, self.block_size)
        query = hashes[: reusable_prompt_blocks(n_tokens, self.block_size)]
        reserve = self.watermark_blocks * self.block_size if self.running else 0
        if not self.store.can_allocate(query, n_tokens + reserve):
            return False
        group = seq.group
        alloc = self.store.allocate(
            seq.seq_id, query, n_tokens, group.request.cls, now, num_prompt_tokens=seq.num_prompt
        )
        seq.allocated = True
        seq.num_store_hashes = len(query)
        seq.num_computed = alloc.num_hit_tokens
        seq.status = SeqStatus.RUNNING
        if group.first_scheduled is None:
            group.first_scheduled = now
            group.cached_tokens = alloc.num_hit_tokens
        self.running.append(seq)
        return True

    # ------------------------------------------------------------ transitions
    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and requeue it at the head for recomputation."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def add_running(self, seq: Sequence) -> None:
        """A forked child that already holds blocks."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)

    def remove_group(self, group: RequestGroup) -> list[Sequence]:
        """Drop every unfinished sequence of ``group`` (abort/error). Returns those dropped."""
        dropped = []
        for seq in group.seqs:
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self._release(seq)
            dropped.append(seq)
        return dropped

    def _release(self, seq: Sequence) -> None:
        if seq.allocated:
            self.store.free(seq.seq_id, self.clock())
            seq.allocated = False
        seq.num_computed = 0
        seq.num_store_hashes = 0

    def queued_prefill_tokens(self) -> int:
        """The whole prompts (with a preempted sequence's output so far) of the sequences
        without their first token: waiting, or running with more than one token to
        compute (a prefill in progress). The router scales it by the uncached share of
        the requests it routed here that have no first token yet (``cache_aware``'s
        queue share), the same set, so cached parts are not discounted twice."""
        return sum(len(s.token_ids) for s in self.waiting) + sum(
            len(s.token_ids) for s in self.running if len(s.token_ids) - s.num_computed > 1
        )
