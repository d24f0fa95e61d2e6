"""UniCache's queues and lanes: where a released block waits to be evicted.

Queues, by the class of the request that released the block (docs/eviction.md):
    evict_first  decode blocks of single-turn requests, and prompt blocks of single-turn
                 requests outside a template prefix.
    chat         blocks of chat sessions (any session not classed agent).
    agent        blocks of agent sessions (short inter-turn gaps).
    structural   the template prefix blocks of single-turn templated requests.

Each queue is split into ``NUM_LANES`` lanes, each with its own reuse estimate:
    * session queues by turn depth (turn 0, 1, 2, 3-4, 5-8, 9+): a session that has run
      many turns is likelier to continue (Mooncake: P(continue) is 0.25 after turn 0,
      0.39 after 1, 0.49 after 2 and 0.81 after 8+);
    * the other two by the block's hits since it was cached (0, 1, 2-3, 4-7, 8-15, 16+):
      hot templates apart from cold ones;
    * the last lane of every queue (``TAIL_LANE``) takes a request's last prompt block,
      often a partial block the next turn rewrites (in Mooncake it is never reused);
    * the evict-first queue's ``NOVEL_LANE`` takes blocks of a *novel* prefix: one whose
      every block, from the first, was cached fresh (never hit, never a ghost) — a prompt
      that shares nothing with what the cache holds or remembers. With labels hidden the
      evict-first queue mixes such one-off prompts (never reused) with the first turns
      of sessions and first uses of templates (reused often); one reuse estimate for
      both kept one-off blocks as long as a session's (measured: the eviction_tuning study, docs/studies.md).

A lane is numbered ``queue * NUM_LANES + offset`` with ``0 <= offset < NUM_LANES``.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import ReleaseInfo

EVICT_FIRST, CHAT, AGENT, STRUCTURAL = 0, 1, 2, 3
QUEUE_NAMES = ("evict_first", "chat", "agent", "structural")
NUM_QUEUES = 4
NUM_LANES = 8
TAIL_LANE = NUM_LANES - 1
NOVEL_LANE = TAIL_LANE - 1  # evict-first only; empty in the other queues
_DEEPEST = NOVEL_LANE - 1  # the last turn-depth / hit-count lane
ALL_LANES = range(NUM_QUEUES * NUM_LANES)
LANE_QUEUE = tuple(lane // NUM_LANES for lane in ALL_LANES)
_TURN_LANE = (0, 1, 2, 3, 3, 4, 4, 4, 4)


def turn_lane(turn: int) -> int:
    """The session-queue lane offset of a block of session turn ``turn``."""
    return _TURN_LANE[turn] if turn < len(_TURN_LANE) else _DEEPEST


def hit_lane(uses: int) -> int:
    """The evict-first/structural lane offset of a block hit ``uses`` times."""
    hot = uses.bit_length()
    return hot if hot < _DEEPEST else _DEEPEST


class LanePlacement:
    """Places one request's released blocks in lanes.

    Invariants:
        * All blocks of a session request go to that session's queue; of a single-turn
          request, prompt blocks below ``template_blocks`` go to structural, the rest
          to evict-first.
        * An evict-first block of a novel prefix goes to ``NOVEL_LANE`` (before the tail
          lane: a novel prompt's last block is as dead as the rest of it).
        * The tail lane takes the first prompt block of each release burst (the store
          releases tail first, so that is the request's last cached prompt block).
          NOTE: a heuristic across calls: a burst that starts below the previous burst's
          last position is missed, and a tail still shared by another request marks its
          predecessor.
    """

    def __init__(self) -> None:
        self._last_pos, self._last_decode = -1, False  # the previous released block

    def session_queue(self, cls: RequestClass) -> int:
        """The queue of a session request (also the gap fit its arrivals feed)."""
        return AGENT if cls.agentic else CHAT

    def request_queue(self, cls: RequestClass) -> tuple[int, int]:
        """(the queue of all the request's blocks, or -1 when it depends on the block;
        how many leading prompt blocks join structural)."""
        if cls.session_id is not None:
            return self.session_queue(cls), 0
        return -1, (cls.template_blocks if cls.template else 0)

    def lane(self, queue: int, is_tail: bool, turn: int, uses: int, novel: bool = False) -> int:
        """The lane of a block of ``queue`` (tail block or not, session turn, hits, of a
        novel prefix or not)."""
        base = queue * NUM_LANES
        if novel and queue == EVICT_FIRST:
            return base + NOVEL_LANE
        if is_tail:
            return base + TAIL_LANE
        if queue == CHAT or queue == AGENT:
            return base + turn_lane(turn)
        return base + hit_lane(uses)

    def queue_of(self, info: ReleaseInfo) -> int:
        """The queue a released block joins (tests)."""
        q, template_blocks = self.request_queue(info.cls)
        if q >= 0:
            return q
        return STRUCTURAL if not info.is_decode and info.position < template_blocks else EVICT_FIRST

    def place(
        self,
        block_ids: Sequence[int],
        positions: Sequence[int],
        cls: RequestClass,
        num_prompt_blocks: int,
        uses: Mapping[int, int],
        novel: Container[int] = (),
    ) -> list[int]:
        """The lanes of one request's released blocks, in release order.

        Args:
            block_ids: the released blocks (tail first).
            positions: their indices in the request's block table.
            cls: the request's class.
            num_prompt_blocks: blocks at or past this position were filled in decode.
            uses: block id -> hits since it was cached.
            novel: the blocks of novel prefixes.
        """
        fixed_q, template_blocks = self.request_queue(cls)
        structural_below = min(template_blocks, num_prompt_blocks)  # prompt blocks only
        turn, lane = cls.turn, self.lane
        last_pos, last_decode = self._last_pos, self._last_decode
        lanes = []
        for block_id, pos in zip(block_ids, positions):
            if fixed_q >= 0:
                q = fixed_q
            else:
                q = STRUCTURAL if pos < structural_below else EVICT_FIRST
            is_decode = pos >= num_prompt_blocks
            is_tail = not is_decode and (pos >= last_pos or last_decode)
            last_pos, last_decode = pos, is_decode
            lanes.append(lane(q, is_tail, turn, uses.get(block_id, 0), block_id in novel))
        self._last_pos, self._last_decode = last_pos, last_decode
        return lanes
