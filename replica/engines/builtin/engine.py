"""The synchronous engine: one ``step()`` schedules, runs the model once, samples.

``LLMEngine`` is driven by a single thread (``AsyncEngine``'s step loop, or a test).
Other threads may only call the snapshot methods (``take_events``, ``cached_hashes``,
``cache_state``, ``load``, ``num_referenced_blocks``), which take ``lock``; ``step`` holds
the lock while it touches the store and releases it for the forward pass.

Invariant: when no request is in flight, no block is referenced (``num_referenced_blocks()
== 0``); finished, aborted and failed requests always free their blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from unicache.replica.engines.api import (
    CacheStateInfo,
    EngineInputError,
    EngineLoad,
    EngineOutput,
    EngineRequest,
)
from unicache.contract.tokenizer import load_tokenizer
from unicache.replica.engines.builtin.attention import build_metadata
from unicache.replica.engines.builtin.config import EngineConfig
from unicache.replica.engines.builtin.model import LlamaForCausalLM, ModelConfig
from unicache.replica.engines.builtin.sampling import apply_penalties, make_generator, sample, token_logprob
from unicache.replica.engines.builtin.scheduler import ScheduledChunk, Scheduler
from unicache.replica.engines.builtin.sequence import RequestGroup, Sequence
from unicache.replica.engines.builtin.validation import check_request
from unicache.replica.eviction.registry import make_host_policy, make_policy
from unicache.replica.kv.host_tier import HostTier
from unicache.replica.kv.locked_reads import LockedStoreReads
from unicache.replica.kv.store import KVStore
from unicache.replica.kv.torch_storage import TorchKVStorage

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """"auto" -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from auto, {', '.join(_DTYPES)})") from None


class LLMEngine(LockedStoreReads):
    """Model + paged KV store + scheduler. See the module docstring for threading rules."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.device = resolve_device(config.device)
        if config.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.tokenizer = load_tokenizer(config.tokenizer_path())
        # A sample ends on any of these (unless ignore_eos): the tokenizer's EOS and every id
        # the checkpoint's generation config names (vLLM adds the latter as stop tokens).
        self.eos_token_ids = frozenset(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        if config.checkpoint is not None:
            from unicache.replica.engines.builtin.checkpoint import generation_eos_ids, load_checkpoint

            self.model = load_checkpoint(config.checkpoint)
            self.eos_token_ids |= generation_eos_ids(config.checkpoint)
        else:
            self.model = LlamaForCausalLM.random(config.model, config.seed)
        mcfg: ModelConfig = self.model.config
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model.place(self.device, self.dtype)
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or mcfg.max_position, mcfg.max_position)
        self.vocab_size = mcfg.vocab_size
        self.policy_name = config.eviction_policy
        self.storage = TorchKVStorage(
            mcfg.num_layers,
            config.total_blocks,
            config.block_size,
            mcfg.num_kv_heads,
            mcfg.dim_per_head,
            dtype=self.dtype,
            device=self.device,
            host_blocks=config.host_blocks,
        )
        host = HostTier(config.host_blocks, make_host_policy(config.host_eviction_policy)) if config.host_blocks else None
        self.store = KVStore(
            config.total_blocks,
            config.block_size,
            make_policy(self.policy_name),
            storage=self.storage,
            enable_prefix_caching=config.enable_prefix_caching,
            host=host,
            record_transfers=host is not None,
        )
        self.scheduler = Scheduler(
            self.store,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            clock,
            watermark_blocks=int(config.total_blocks * config.admission_watermark),
        )
        self.lock = threading.Lock()
        self._groups: dict[str, RequestGroup] = {}
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    # ------------------------------------------------------------ validation
    def validate(self, req: EngineRequest) -> None:
        """Raise ``EngineInputError`` if ``req`` can never be served as given."""
        check_request(
            req, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            max_n=min(self.config.max_n, self.config.max_num_seqs), num_blocks=self.store.num_blocks, block_size=self.block_size,
        )
        if req.request_id in self._groups:
            raise EngineInputError("invalid", f"request id {req.request_id!r} is already in flight")

    # -------------------------------------------------------------- requests
    def add_request(self, req: EngineRequest) -> None:
        """Queue a validated request (call from the step thread)."""
        self.validate(req)
        group = RequestGroup(req, self.clock())
        fallback = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item())
        group.fallback_seed = fallback
        max_stop = max((len(s) for s in req.sampling.stop), default=0)
        seq = Sequence(
            group=group,
            index=0,
            token_ids=list(req.prompt_token_ids),
            num_prompt=len(req.prompt_token_ids),
            detok=self.tokenizer.detokenizer(),
            generator=make_generator(req.sampling, 0, fallback),
            max_stop_len=max_stop,
        )
        group.seqs.append(seq)
        with self.lock:
            self._groups[req.request_id] = group
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[EngineOutput]:
        """Drop a request and free its blocks. Returns "abort" outputs for its unfinished samples."""
        with self.lock:
            group = self._groups.pop(request_id, None)
            if group is None:
                return []
            dropped = self.scheduler.remove_group(group)
        now = self.clock()
        outs = [s.abort_output(now) for s in dropped]
        present = {s.index for s in group.seqs}
        for idx in range(group.request.sampling.n):
            if idx not in present:
                outs.append(EngineOutput(request_id, idx, [], "", True, "abort", group.seqs[0].usage(now)))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def request_ids(self) -> list[str]:
        return list(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineOutput]:
        """Run one iteration: schedule, forward, sample. Returns this step's outputs."""
        with self.lock:
            chunks = self.scheduler.schedule()
            # This step's demotions and promotions, batched, before the forward pass that
            # reads the promoted blocks (and the prefill that overwrites demoted ones).
            self.store.flush_transfers()
            if not chunks:
                return []
            tables = [self.store.block_table(c.seq.seq_id) for c in chunks]
        logits = self._forward(chunks, tables)
        with self.lock:
            return self._postprocess(chunks, logits)

    def _forward(self, chunks: list[ScheduledChunk], tables: list[list[int]]) -> torch.Tensor | None:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start : c.end])
            positions.extend(range(c.start, c.end))
            if c.samples:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        meta = build_metadata(
            [(t, c.start, c.end) for t, c in zip(tables, chunks)], self.block_size, dev, self.model.config.sliding_window
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, pos, self.storage, meta)
        if not sample_rows:
            return None
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return self.model.logits(hidden.index_select(0, rows)).cpu()

    def _postprocess(self, chunks: list[ScheduledChunk], logits: torch.Tensor | None) -> list[EngineOutput]:
        now = self.clock()
        outputs: list[EngineOutput] = []
        row = 0
        for c in chunks:
            seq = c.seq
            row_logits = None
            if c.samples:
                assert logits is not None
                row_logits = logits[row]
                row += 1
            if not seq.allocated:
                continue  # aborted while the forward ran
            seq.num_computed = c.end
            self._publish_blocks(seq, now)
            if row_logits is None:
                continue
            group = seq.group
            if group.first_token is None:
                group.first_token = now
            samples = [seq]
            if not group.forked:
                group.forked = True
                samples.extend(self._fork_children(seq))
            params = group.request.sampling
            for s in samples:
                logits_s = apply_penalties(row_logits, s.output_counts, params) if params.penalized else row_logits
                tok = sample(logits_s, params, s.generator)
                lp = token_logprob(row_logits, tok, params.logprobs) if params.logprobs is not None else None
                out = s.append_token(tok, self.eos_token_ids, params.ignore_eos, self.max_model_len, now, lp)
                outputs.append(out)
                if out.finished:
                    self.scheduler.finish(s)
            if group.finished:
                self._groups.pop(group.request_id, None)
        return outputs

    def _publish_blocks(self, seq: Sequence, now: float) -> None:
        """Hand hashes of newly computed full blocks to the store and offer them to the cache."""
        hashes = seq.full_block_hashes(seq.num_computed, self.block_size)
        if len(hashes) > seq.num_store_hashes:
            self.store.add_block_hashes(seq.seq_id, hashes[seq.num_store_hashes :])
            seq.num_store_hashes = len(hashes)
        self.store.cache_blocks(seq.seq_id, now, upto=len(hashes))

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        group = parent.group
        children = []
        for idx in range(1, group.request.sampling.n):
            gen = make_generator(group.request.sampling, idx, group.fallback_seed)
            child = parent.fork(idx, gen, self.tokenizer.detokenizer())
            self.store.fork(parent.seq_id, child.seq_id)
            group.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def fail_all(self, exc: BaseException) -> list[str]:
        """After a failed step: drop every request (blocks freed). Returns their ids."""
        ids = self.request_ids()
        for rid in ids:
            self.abort(rid)
        return ids

    # ------------------------------------------------------------- snapshots
    # take_events, cached_hashes, host_hashes, cached_blocks: LockedStoreReads.
    def num_referenced_blocks(self) -> int:
        with self.lock:
            return sum(1 for b in self.store.blocks if b.ref_cnt > 0)

    def load(self) -> EngineLoad:
        with self.lock:
            return EngineLoad(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            )

    def cache_state(self) -> CacheStateInfo:
        with self.lock:
            return CacheStateInfo.of_store(self.store, self.policy_name, self.config.host_eviction_policy)

    def check_invariants(self) -> None:
        with self.lock:
            self.store.check_invariants()
