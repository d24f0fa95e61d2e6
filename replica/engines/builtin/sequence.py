"""Per-request and per-sample state the scheduler and engine share.

A ``RequestGroup`` is one ``EngineRequest``; its ``Sequence`` objects are the samples
(n > 1 forks children off sample 0 once the prompt is computed). A sequence's KV covers
``token_ids[:num_computed]``; the last sampled token's KV is computed by the next step.

Invariants:
    * ``hashes[i]`` is the chained hash of full block i of ``token_ids`` (computed lazily);
    * the store holds a block table for the sequence iff ``allocated``;
    * ``num_store_hashes`` hashes were handed to the store; all cover computed blocks
      or prompt blocks matched at allocation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from unicache.contract.block_hash import ROOT_HASH, BlockHash, hash_token_blocks
from unicache.contract.tokenizer import IncrementalDetokenizer
from unicache.replica.engines.api import EngineOutput, EngineRequest, TokenLogprob, Usage


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestGroup:
    request: EngineRequest
    arrival: float
    seqs: list["Sequence"] = field(default_factory=list)
    forked: bool = False
    first_scheduled: float | None = None
    first_token: float | None = None
    cached_tokens: int = 0
    fallback_seed: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.request.sampling.n and all(
            s.status is SeqStatus.FINISHED for s in self.seqs
        )


@dataclass(slots=True)
class Sequence:
    group: RequestGroup
    index: int
    token_ids: list[int]
    num_prompt: int
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    max_stop_len: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    allocated: bool = False
    hashes: list[BlockHash] = field(default_factory=list)
    num_store_hashes: int = 0
    text: str = ""
    emitted_chars: int = 0
    finish_reason: str | None = None
    output_counts: dict[int, int] = field(default_factory=dict)  # kept only when penalized

    @property
    def seq_id(self) -> str:
        return f"{self.group.request_id}#{self.index}"

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def full_block_hashes(self, num_tokens: int, block_size: int) -> list[BlockHash]:
        """Hashes of the full blocks within ``token_ids[:num_tokens]`` (extends the cache)."""
        n_full = num_tokens // block_size
        if len(self.hashes) < n_full:
            req = self.group.request
            start = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.extend(
                hash_token_blocks(
                    self.token_ids[start * block_size : n_full * block_size],
                    block_size,
                    req.cache_salt,
                    req.adapter_id,
                    parent=parent,
                    start_index=start,
                )
            )
        return self.hashes[:n_full]

    def fork(self, index: int, generator: torch.Generator | None, detok: IncrementalDetokenizer) -> "Sequence":
        return Sequence(
            group=self.group,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt=self.num_prompt,
            detok=detok,
            generator=generator,
            max_stop_len=self.max_stop_len,
            status=self.status,
            num_computed=self.num_computed,
            allocated=self.allocated,
            hashes=list(self.hashes),
            num_store_hashes=self.num_store_hashes,
            output_counts=dict(self.output_counts),
        )

    def append_token(
        self,
        token_id: int,
        eos_token_ids: frozenset[int],
        ignore_eos: bool,
        max_model_len: int,
        now: float,
        logprob: TokenLogprob | None = None,
    ) -> EngineOutput:
        """Record a sampled token, decide whether the sample is done, build its output.

        A token in ``stop_token_ids``, or in ``eos_token_ids`` unless ``ignore_eos``,
        finishes the sample with "stop"; its text is not returned (vLLM's rule: a
        stop-terminated sample's last token is not detokenized).
        """
        params = self.group.request.sampling
        self.token_ids.append(token_id)
        if params.penalized:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        piece = self.detok.step(token_id)
        reason = None
        cut = None
        if (params.stop_token_ids and token_id in params.stop_token_ids) or (token_id in eos_token_ids and not ignore_eos):
            reason = "stop"
            cut = len(self.text)
        else:
            self.text += piece
        if reason is None and params.stop:
            # Only the tail can contain a new match.
            window_start = max(0, self.emitted_chars - self.max_stop_len)
            for s in params.stop:
                pos = self.text.find(s, window_start)
                if pos != -1 and (cut is None or pos < cut):
                    cut = pos
            if cut is not None:
                reason = "stop"
        if reason is None:
            if (params.max_tokens is not None and self.num_output >= params.max_tokens) or len(self.token_ids) >= max_model_len:
                reason = "length"
        if reason is not None:
            self.finish_reason = reason
            self.status = SeqStatus.FINISHED
            if cut is not None:
                self.text = self.text[:cut]
            else:
                self.text += self.detok.flush()
            end = len(self.text)
        else:
            # Hold back text that may be the start of a stop string.
            end = max(self.emitted_chars, len(self.text) - (self.max_stop_len - 1 if self.max_stop_len else 0))
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = end
        return EngineOutput(
            request_id=self.group.request_id,
            index=self.index,
            new_token_ids=[token_id],
            text_delta=delta,
            finished=reason is not None,
            finish_reason=reason,
            usage=self.usage(now) if reason is not None else None,
            logprobs=[logprob] if logprob is not None else None,
        )

    def abort_output(self, now: float) -> EngineOutput:
        self.status = SeqStatus.FINISHED
        self.finish_reason = "abort"
        return EngineOutput(self.group.request_id, self.index, [], "", True, "abort", self.usage(now))

    def usage(self, now: float) -> Usage:
        """Token counts and timings at ``now``, a reading of the engine's clock (the clock
        ``arrival`` came from): a phase not yet reached (never scheduled, no first token)
        ends at ``now``."""
        g = self.group
        started = g.first_scheduled if g.first_scheduled is not None else now
        first = g.first_token if g.first_token is not None else now
        return Usage(
            prompt_tokens=self.num_prompt,
            cached_tokens=g.cached_tokens,
            completion_tokens=self.num_output,
            queue_time_s=started - g.arrival,
            prefill_time_s=first - started,
        )
