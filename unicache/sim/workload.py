"""``unicache gen-workload``: a seeded, labelled, heterogeneous request mix.

Four sources, each a Poisson arrival process over ``duration`` seconds:
    * chat sessions: a per-tenant system prompt, then turns whose prompt is the whole
      previous prompt + the previous answer + a new user message; log-normal gaps
      (the UniCache paper's chat fit by default: mu 4.77, sigma 1.279, seconds).
    * agent sessions: one of a few long agent system prompts, then turns that append a
      long tool result each; short log-normal gaps (mu 1.81, sigma 1.092).
    * templated single-turn tool/code requests: a template prefix chosen with Zipf
      popularity from the tenant's templates, plus a unique suffix.
    * plain single-turn requests: unique prompts (qa, math, other).

Block ids: equal ids mean equal whole prefixes (the trace format). Session prompts are
padded to whole blocks so that a turn's ``output_hash_ids`` (the answer's full blocks,
chained after the prompt) are exactly the blocks the next turn reads after the prompt.
Turns that would start after ``duration`` are dropped.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from itertools import accumulate
from dataclasses import dataclass, field, fields


def knob(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class WorkloadConfig:
    """Every knob of the generator; each field is also a ``gen-workload`` flag."""

    seed: int = knob(0, "random seed (same seed, same trace)")
    duration: float = knob(1200.0, "seconds of arrivals")
    block_size: int = knob(16, "tokens per block")
    tenants: int = knob(4, "number of tenants (each has its own cache salt)")
    chat_rate: float = knob(0.15, "chat sessions started per second")
    chat_turns_mean: float = knob(6.0, "mean turns per chat session (geometric)")
    chat_gap_mu: float = knob(4.77, "log-normal mu of chat inter-turn gaps (log seconds)")
    chat_gap_sigma: float = knob(1.279, "log-normal sigma of chat inter-turn gaps")
    chat_system_tokens: int = knob(320, "per-tenant chat system prompt tokens")
    chat_user_tokens: int = knob(150, "mean user message tokens")
    chat_output_tokens: int = knob(250, "mean chat answer tokens")
    agent_rate: float = knob(0.04, "agent sessions started per second")
    agent_turns_mean: float = knob(8.0, "mean turns per agent session (geometric)")
    agent_gap_mu: float = knob(1.81, "log-normal mu of agent inter-turn gaps (log seconds)")
    agent_gap_sigma: float = knob(1.092, "log-normal sigma of agent inter-turn gaps")
    agent_prompts: int = knob(3, "distinct agent system prompts per tenant")
    agent_system_tokens: int = knob(2000, "agent system prompt tokens (tool definitions)")
    agent_tool_tokens: int = knob(600, "mean tool result tokens appended per turn")
    agent_output_tokens: int = knob(120, "mean agent action tokens")
    template_rate: float = knob(1.0, "templated single-turn requests per second")
    templates: int = knob(30, "templates per tenant")
    template_zipf: float = knob(1.1, "Zipf exponent of template popularity")
    template_tokens: int = knob(1200, "mean template prefix tokens")
    template_suffix_tokens: int = knob(160, "mean unique suffix tokens of a templated request")
    template_output_tokens: int = knob(150, "mean output tokens of a templated request")
    plain_rate: float = knob(1.0, "plain single-turn requests per second")
    plain_tokens: int = knob(900, "mean prompt tokens of a plain request")
    plain_output_tokens: int = knob(250, "mean output tokens of a plain request")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "seed":
                continue
            if value < 0 or (f.name in ("duration", "block_size", "tenants") and value <= 0):
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive, got {value}")
        for name in ("chat_turns_mean", "agent_turns_mean"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.agent_rate > 0 and self.agent_prompts < 1:
            raise ValueError("--agent-prompts must be >= 1 when --agent-rate > 0")
        if self.template_rate > 0 and self.templates < 1:
            raise ValueError("--templates must be >= 1 when --template-rate > 0")


class _Gen:
    """Generator state: one RNG, one block-id counter, the shared prefixes."""

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.next_id = 0
        self.out: list[dict] = []
        bs = cfg.block_size
        self.tenants = [f"tenant{i}" for i in range(cfg.tenants)]
        self.chat_system = {t: self.new_ids(self.blocks(cfg.chat_system_tokens)) for t in self.tenants}
        self.agent_system = {
            t: [self.new_ids(self.blocks(self.length(cfg.agent_system_tokens))) for _ in range(cfg.agent_prompts)]
            for t in self.tenants
        }
        self.templates = {
            t: [
                (self.new_ids(max(1, self.length(cfg.template_tokens) // bs)), self.rng.choice(("tool", "code")))
                for _ in range(cfg.templates)
            ]
            for t in self.tenants
        }
        weights = [1.0 / (k + 1) ** cfg.template_zipf for k in range(cfg.templates)]
        total = sum(weights)
        self.template_cum = list(accumulate(w / total for w in weights))

    # ------------------------------------------------------------- helpers
    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def length(self, mean: int) -> int:
        """A positive token count, exponential-ish around ``mean`` (log-normal, sigma 0.6)."""
        if mean <= 0:
            return 0
        sigma = 0.6
        return max(1, int(self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    def turns(self, mean: float) -> int:
        p = 1.0 / mean
        n = 1
        while self.rng.random() > p:
            n += 1
        return n

    def arrivals(self, rate: float):
        t = 0.0
        if rate <= 0:
            return
        while True:
            t += self.rng.expovariate(rate)
            if t >= self.cfg.duration:
                return
            yield t

    def emit(self, t: float, hash_ids: list[int], input_length: int, output_length: int, output_ids: list[int], **labels) -> None:
        rec = {
            "timestamp": round(t * 1000.0, 3),
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": hash_ids,
            "output_hash_ids": output_ids,
        }
        rec.update(labels)
        self.out.append(rec)

    # ------------------------------------------------------------- sources
    def session(self, kind: str, sid: str, tenant: str, start: float, system_ids: list[int]) -> None:
        cfg, bs, rng = self.cfg, self.cfg.block_size, self.rng
        chat = kind == "chat"
        n_turns = self.turns(cfg.chat_turns_mean if chat else cfg.agent_turns_mean)
        mu, sigma = (cfg.chat_gap_mu, cfg.chat_gap_sigma) if chat else (cfg.agent_gap_mu, cfg.agent_gap_sigma)
        ctx = list(system_ids)
        carry = 0  # tokens of the previous answer not filling a whole block
        t = start
        for turn in range(n_turns):
            if t >= cfg.duration:
                break
            new_tokens = carry + self.length(cfg.chat_user_tokens if chat else cfg.agent_tool_tokens)
            prompt = ctx + self.new_ids(self.blocks(new_tokens))
            out_tokens = self.length(cfg.chat_output_tokens if chat else cfg.agent_output_tokens)
            out_ids = self.new_ids(out_tokens // bs)
            self.emit(
                t, prompt, len(prompt) * bs, out_tokens, out_ids,
                session_id=sid, turn=turn, task=kind, tenant=tenant, template=False,
            )
            ctx = prompt + out_ids
            carry = out_tokens % bs
            t += out_tokens * 0.02 + rng.lognormvariate(mu, sigma)

    def single(self, t: float, tenant: str, prefix: list[int], suffix_tokens: int, out_tokens: int, **labels) -> None:
        bs = self.cfg.block_size
        input_length = len(prefix) * bs + suffix_tokens
        prompt = prefix + self.new_ids(self.blocks(suffix_tokens))
        out_ids = self.new_ids(max(0, (input_length + out_tokens) // bs - len(prompt)))
        self.emit(t, prompt, input_length, out_tokens, out_ids, tenant=tenant, turn=0, **labels)

    def run(self) -> list[dict]:
        cfg, rng = self.cfg, self.rng
        for n, t in enumerate(self.arrivals(cfg.chat_rate)):
            tenant = rng.choice(self.tenants)
            self.session("chat", f"chat-{n}", tenant, t, self.chat_system[tenant])
        for n, t in enumerate(self.arrivals(cfg.agent_rate)):
            tenant = rng.choice(self.tenants)
            self.session("agent", f"agent-{n}", tenant, t, rng.choice(self.agent_system[tenant]))
        for t in self.arrivals(cfg.template_rate):
            tenant = rng.choice(self.tenants)
            k = _bisect_cum(self.template_cum, rng.random())
            prefix, task = self.templates[tenant][k]
            self.single(
                t, tenant, prefix, self.length(cfg.template_suffix_tokens), self.length(cfg.template_output_tokens),
                task=task, template=True,
            )
        for t in self.arrivals(cfg.plain_rate):
            tenant = rng.choice(self.tenants)
            self.single(
                t, tenant, [], self.length(cfg.plain_tokens), self.length(cfg.plain_output_tokens),
                task=rng.choice(("qa", "math", "other")), template=False,
            )
        self.out.sort(key=lambda r: r["timestamp"])
        return self.out


def _bisect_cum(cum: list[float], u: float) -> int:
    return min(bisect_left(cum, u), len(cum) - 1)


def generate(cfg: WorkloadConfig) -> list[dict]:
    """The trace records (JSON-ready dicts, sorted by timestamp) for ``cfg``."""
    return _Gen(cfg).run()
