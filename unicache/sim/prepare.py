"""Turn a parsed trace into simulator requests, once per trace (outside any policy loop).

Hashing and classification are the per-trace work: every policy and capacity then
replays the same ``SimRequest`` list, so they see identical hashes and classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from unicache.contract.block_hash import BlockHash, hash_id_blocks, reusable_prompt_blocks
from unicache.contract.request_class import DEFAULT_TENANT, RequestClass, Task
from unicache.replica.eviction.opt import FutureAccesses
from unicache.router.request_path.classifier import Labels, RequestClassifier
from unicache.sim.trace import TraceRequest


@dataclass(slots=True)
class SimRequest:
    """One request as the simulator replays it.

    Attributes:
        index: arrival position (0-based, the opt oracle's clock).
        rid: request id handed to the KV store.
        arrival_s: arrival time in seconds.
        prompt_hashes: one chained hash per trace ``hash_id`` (the last may stand for a
            partial block; it is treated as a whole cacheable block).
        output_hashes: decode blocks, chained after the prompt's last hash.
        prompt_tokens: tokens the prompt's blocks span (``len(prompt_hashes) * block_size``).
        reusable_blocks: how many leading prompt blocks a cache hit may cover
            (``reusable_prompt_blocks`` of ``input_length``: the last token is always
            computed, as on a real replica).
        num_tokens: tokens reserved at admission (prompt blocks plus the output).
        cls: the class the replicas see (labels, or the classifier's inference).
        truth: the class built from the trace's labels (None for an unlabelled trace).
    """

    index: int
    rid: str
    arrival_s: float
    input_length: int
    output_length: int
    prompt_hashes: list[BlockHash]
    output_hashes: list[BlockHash]
    prompt_tokens: int
    num_tokens: int
    cls: RequestClass
    reusable_blocks: int
    truth: RequestClass | None = None
    task_key: str = field(default="other")


@dataclass(slots=True)
class PreparedTrace:
    requests: list[SimRequest]
    block_size: int
    unique_blocks: int
    block_accesses: int
    labelled: bool
    classifier_accuracy: dict[str, float] | None = None


def _salt(tenant: str | None) -> bytes | None:
    return tenant.encode("utf-8") if tenant else None


def labels_of(r: TraceRequest) -> Labels:
    return Labels(tenant=r.tenant, session_id=r.session_id, turn=r.turn, task=r.task, template=r.template)


def truth_class(r: TraceRequest) -> RequestClass:
    """The class a labelled trace line states (fields it omits take their defaults)."""
    return RequestClass(
        tenant=r.tenant or DEFAULT_TENANT,
        session_id=r.session_id,
        turn=r.turn or 0,
        task=r.task or Task.OTHER,
        template=bool(r.template),
    )


def prepare(
    trace: Sequence[TraceRequest],
    block_size: int,
    ignore_labels: bool = False,
    classifier: RequestClassifier | None = None,
) -> PreparedTrace:
    """Hash and classify every request of a (timestamp-sorted) trace.

    Args:
        trace: requests sorted by timestamp (``read_trace`` order).
        block_size: tokens per block (a trace ``hash_id`` stands for one block).
        ignore_labels: classify from block hashes alone (tenant is kept: it comes from
            the API key, never from inference), and score the inference against labels.
        classifier: the classifier to use (default ``RequestClassifier()``).
    """
    if block_size <= 0:
        raise ValueError("block size must be positive")
    clf = classifier if classifier is not None else RequestClassifier()
    labelled = any(r.labelled for r in trace)
    requests: list[SimRequest] = []
    seen: set[BlockHash] = set()
    accesses = 0
    for i, r in enumerate(trace):
        salt = _salt(r.tenant)
        prompt = hash_id_blocks(r.hash_ids, cache_salt=salt)
        output = hash_id_blocks(r.output_hash_ids, parent=prompt[-1], start_index=len(prompt)) if r.output_hash_ids else []
        seen.update(prompt)
        seen.update(output)
        accesses += len(prompt)
        now = r.timestamp_ms / 1000.0
        labels = Labels(tenant=r.tenant) if ignore_labels else labels_of(r)
        cls = clf.classify(prompt, labels, now)
        prompt_tokens = len(prompt) * block_size
        num_tokens = max(prompt_tokens + r.output_length, (len(prompt) + len(output)) * block_size)
        requests.append(
            SimRequest(
                index=i,
                rid=str(i),
                arrival_s=now,
                input_length=r.input_length,
                output_length=r.output_length,
                prompt_hashes=prompt,
                output_hashes=output,
                prompt_tokens=prompt_tokens,
                num_tokens=num_tokens,
                cls=cls,
                reusable_blocks=min(reusable_prompt_blocks(r.input_length, block_size), len(prompt)),
                truth=truth_class(r) if r.labelled else None,
                task_key=cls.task.value if not (ignore_labels and r.labelled) else truth_class(r).task.value,
            )
        )
    accuracy = classifier_accuracy(requests) if ignore_labels and labelled else None
    return PreparedTrace(requests, block_size, len(seen), accesses, labelled, accuracy)


def classifier_accuracy(requests: Sequence[SimRequest]) -> dict[str, float]:
    """Share of labelled requests whose inferred class agrees with the labels, per aspect.

    ``session``: multi-turn or not; ``turn``: same turn index; ``template``: same flag;
    ``task``: same task among the tasks inference can tell apart (chat, agent, other:
    single-turn tool/code/qa/math count as ``other``); ``all``: session, template and
    task agree (what decides an eviction queue).
    """
    n = agree_s = agree_turn = agree_t = agree_task = agree_all = 0
    for r in requests:
        t = r.truth
        if t is None:
            continue
        c = r.cls
        n += 1
        s = (c.session_id is not None) == (t.session_id is not None)
        tmpl = c.template == t.template
        task = _coarse_task(c) == _coarse_task(t)
        agree_s += s
        agree_turn += c.turn == t.turn
        agree_t += tmpl
        agree_task += task
        agree_all += s and tmpl and task
    if not n:
        return {}
    return {
        "labelled_requests": n,
        "session": agree_s / n,
        "turn": agree_turn / n,
        "template": agree_t / n,
        "task": agree_task / n,
        "all": agree_all / n,
    }


def _coarse_task(c: RequestClass) -> str:
    if c.session_id is None:
        return "other"
    return "agent" if c.task in (Task.AGENT, Task.TOOL) else "chat"


def future_accesses(trace: PreparedTrace) -> FutureAccesses:
    """The opt oracle of ``trace``: for each block hash, the requests that can read it
    from a cache (each prompt's ``reusable_blocks``, in arrival order)."""
    return FutureAccesses.from_prompts(r.prompt_hashes[: r.reusable_blocks] for r in trace.requests)
