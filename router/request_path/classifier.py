"""The request classifier: explicit labels where given, inference from block hashes otherwise.

The router calls it with hashes of real tokens, the simulator with hashes of a trace's
``hash_ids``; both get the same answer for the same prefixes. One ``classify`` call both
answers and learns (it records the request for later calls).

Inference rules (each a tunable):
    * Next turn: a request whose prompt starts with an earlier request's whole prompt is
      the next turn of that request's session. An earlier prompt is remembered by its last
      block hash and by its second-to-last one, because a trace's last block (and a real
      prompt's trailing tokens) is usually a partial block that the next turn completes
      with different content. The matched block must be *private* to that session (used
      by no other session so far): a prefix many sessions share is a template, not a
      conversation (every Mooncake prompt starts with one shared system-prompt block).
    * Template: the leading blocks that at least ``template_min_sessions`` distinct
      sessions (a single-turn request is a session of its own) have used before form the
      template; ``template_blocks`` is their count. Only single-turn requests are
      inferred templated (a session's shared system prompt is not a template).
    * Chat vs agent: a session whose typical inter-turn gap (geometric mean of arrival
      gaps, an EMA of log gaps) is below ``agent_gap_s`` is an agent; otherwise chat.
    * Everything else is single-turn (no session), task ``other``. A request labelled
      ``template=True`` without a session id is single-turn (no turn is inferred).

Invariants:
    * ``classify`` is O(len(block_hashes)) (dict operations only).
    * Memory is bounded: at most ``max_prompts`` remembered prompt ends, ``max_sessions``
      sessions and ``max_blocks`` block-popularity records, each evicted LRU.
    * Explicit labels win field by field; ``inferred`` is True iff some class field
      (session, turn, task, template) was not given by the labels.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from unicache.contract.block_hash import BlockHash
from unicache.contract.request_class import DEFAULT_TENANT, RequestClass, Task


@dataclass(slots=True)
class Labels:
    """Whatever the request carries explicitly; ``None`` means unknown (to be inferred)."""

    tenant: str | None = None
    session_id: str | None = None
    turn: int | None = None
    task: Task | None = None
    template: bool | None = None


@dataclass(slots=True)
class _Session:
    """What the classifier knows about one (labelled or inferred) session."""

    key: object
    session_id: str | None  # None while it has had only one (single-turn looking) request
    turn: int
    last_time: float
    log_gap_ema: float = 0.0
    num_gaps: int = 0
    task: Task | None = None  # explicit task label, once seen


@dataclass(slots=True)
class _BlockUse:
    """Popularity of one block hash: distinct sessions that used it (approximate, see below)."""

    sessions: int
    last_key: object


class RequestClassifier:
    """Labels requests by tenant, session, turn, task and template (see module docstring).

    Args:
        agent_gap_s: sessions whose typical inter-turn gap is shorter are ``agent``
            (default 15 s: between the paper's agent median e^1.81 = 6 s and chat median
            e^4.77 = 118 s; on the generated mix 10/15/25/40 s tell chat from agent for
            89.5/91.3/91.9/91.1% of requests, and 15 s costs Mooncake nothing measurable).
        gap_ema: weight of the newest log gap in a session's gap average.
        template_min_sessions: distinct sessions that must have used a prefix block
            before it counts as template (default 2).
        max_prompts / max_sessions / max_blocks: LRU caps on remembered state.
    """

    def __init__(
        self,
        agent_gap_s: float = 15.0,
        gap_ema: float = 0.5,
        template_min_sessions: int = 2,
        max_prompts: int = 200_000,
        max_sessions: int = 200_000,
        max_blocks: int = 2_000_000,
    ):
        if agent_gap_s <= 0:
            raise ValueError("agent_gap_s must be positive")
        if not 0 < gap_ema <= 1:
            raise ValueError("gap_ema must be in (0, 1]")
        if template_min_sessions < 2:
            raise ValueError("template_min_sessions must be >= 2")
        self.log_agent_gap = math.log(agent_gap_s)
        self.gap_ema = gap_ema
        self.template_min_sessions = template_min_sessions
        self.max_prompts = max_prompts
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks
        # prompt-end hash -> session that sent that prompt
        self._prompts: OrderedDict[BlockHash, tuple[_Session, int]] = OrderedDict()
        # labelled (tenant, session_id) -> session
        self._labelled: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._blocks: OrderedDict[BlockHash, _BlockUse] = OrderedDict()
        self._next_key = 0

    # ------------------------------------------------------------------ API
    def classify(
        self, block_hashes: Sequence[BlockHash], labels: Labels | None, now: float
    ) -> RequestClass:
        """Classify one request and remember it.

        Args:
            block_hashes: the prompt's chained block hashes (salted by tenant), in order.
            labels: explicit labels, or None.
            now: arrival time in seconds (simulated or wall clock; must not go backwards
                for gap estimates to mean anything).
        """
        lab = labels if labels is not None else _NO_LABELS
        tenant = lab.tenant or DEFAULT_TENANT
        n = len(block_hashes)

        session, inferred_session = self._find_session(block_hashes, lab, tenant, now)
        continued = session is not None
        if session is None:
            session = _Session(key=self._new_key(), session_id=None, turn=0, last_time=now)
            if lab.session_id is not None:
                session.session_id = lab.session_id
                self._remember_labelled(tenant, lab.session_id, session)
        else:
            if continued and session.session_id is None:
                session.session_id = f"auto-{session.key}"
            gap = now - session.last_time
            if gap > 0:
                lg = math.log(gap)
                session.log_gap_ema = lg if session.num_gaps == 0 else (
                    (1 - self.gap_ema) * session.log_gap_ema + self.gap_ema * lg
                )
                session.num_gaps += 1
            session.turn += 1
            session.last_time = now
        if lab.task is not None:
            session.task = lab.task

        template_blocks = self._update_blocks(block_hashes, session.key)
        if n:
            self._remember_prompt(block_hashes[n - 1], session)
            if n >= 2:
                self._remember_prompt(block_hashes[n - 2], session)

        # ---- field by field: labels win
        inferred = inferred_session
        session_id = session.session_id if lab.session_id is None else lab.session_id
        if lab.turn is not None:
            turn = lab.turn
        else:
            turn = session.turn if session_id is not None else 0
            inferred = True
        if lab.task is not None:
            task = lab.task
        else:
            inferred = True
            task = self._infer_task(session) if session_id is not None else Task.OTHER
        if lab.template is not None:
            template = lab.template
            if not template:
                template_blocks = 0
            elif template_blocks == 0:
                # NOTE: first sighting of a labelled template: its extent is unknown yet,
                # so the whole prompt is offered as template (depth still orders it).
                template_blocks = n
        else:
            inferred = True
            # NOTE: a session's shared prefix (its system prompt) is not reported as a
            # template: the flag means "templated single-turn request", as in the labels.
            if session_id is not None:
                template_blocks = 0
            template = template_blocks > 0
        return RequestClass(
            tenant=tenant,
            session_id=session_id,
            turn=turn,
            task=task,
            template=template,
            template_blocks=template_blocks,
            inferred=inferred,
        )

    def __len__(self) -> int:
        """Remembered prompt ends (for stats and tests)."""
        return len(self._prompts)

    # ------------------------------------------------------------ internals
    def _new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def _find_session(
        self, hashes: Sequence[BlockHash], lab: Labels, tenant: str, now: float
    ) -> tuple[_Session | None, bool]:
        """The session this request continues, and whether that was inferred."""
        if lab.session_id is not None:
            s = self._labelled.get((tenant, lab.session_id))
            if s is not None:
                self._labelled.move_to_end((tenant, lab.session_id))
            return s, False
        if lab.template:
            return None, False  # labelled templated requests are single-turn by definition
        prompts, blocks = self._prompts, self._blocks
        # NOTE: longest earlier prompt first; a strict prefix only (an identical prompt is
        # a retry or a shared template, not a new turn).
        for i in range(len(hashes) - 2, -1, -1):
            h = hashes[i]
            rec = prompts.get(h)
            if rec is None:
                continue
            use = blocks.get(h)
            if use is not None and use.sessions > 1:
                # Shared by several sessions: a template. Every shorter prefix is shared too.
                return None, True
            session, turn = rec
            if turn != session.turn:
                # A second continuation of an older turn: the tree branches, so this is
                # a shared prefix (a template seen by one session so far), not a turn.
                return None, True
            return session, True
        return None, True

    def _update_blocks(self, hashes: Sequence[BlockHash], key: object) -> int:
        """Count this session's use of each block; return the template prefix length.

        NOTE: ``sessions`` counts changes of the using session, so a block two sessions
        alternate on is over-counted; it is exact for the common case (each session's
        uses are consecutive or the block is new), and is only compared with a small
        threshold.
        """
        blocks = self._blocks
        threshold = self.template_min_sessions
        template = 0
        counting = True
        for h in hashes:
            use = blocks.get(h)
            if use is None:
                blocks[h] = _BlockUse(1, key)
                counting = False
                continue
            blocks.move_to_end(h)
            if counting:
                if use.sessions >= threshold or (use.last_key != key and use.sessions + 1 >= threshold):
                    template += 1
                else:
                    counting = False
            if use.last_key != key:
                use.sessions += 1
                use.last_key = key
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        return template

    def _remember_prompt(self, h: BlockHash, session: _Session) -> None:
        self._prompts[h] = (session, session.turn)
        self._prompts.move_to_end(h)
        if len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)

    def _remember_labelled(self, tenant: str, session_id: str, session: _Session) -> None:
        self._labelled[(tenant, session_id)] = session
        if len(self._labelled) > self.max_sessions:
            self._labelled.popitem(last=False)

    def _infer_task(self, session: _Session) -> Task:
        if session.task is not None:
            return session.task
        if session.num_gaps and session.log_gap_ema < self.log_agent_gap:
            return Task.AGENT
        return Task.CHAT


_NO_LABELS = Labels()
