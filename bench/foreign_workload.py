"""A second workload generator, written apart from ``unicache.sim.workload``, for traffic
no default of this project was chosen on.

The project's generator (and the routing suite that sweeps its knobs) has four sources
with Poisson arrivals, log-normal session gaps, geometric session lengths and stationary
Zipf template popularity. Defaults tuned there may fit those shapes rather than traffic.
This generator models five other sources, with other distributions:

    * ``chat``: sessions whose turn counts follow a power law (most sessions one or two
      turns, a few dozens), Pareto think times, system prompts drawn per tenant from a Zipf
      pool, and two client habits: *regenerate* (the last prompt re-sent for another
      answer) and *edit* (the conversation cut back to an earlier turn and continued).
    * ``rag``: a tenant's system prompt, then k retrieved chunks from a corpus with Zipf
      popularity in relevance order (a popular chunk is reused only where it comes first
      after the same chunks: chained hashes), then a question. No session.
    * ``swarm``: an orchestrator fans out sub-agents at once; every sub-agent reads the
      parent's long context, then runs rapid tool turns (exponential gaps) of its own, each
      its own session.
    * ``fewshot``: few-shot templates whose popularity *drifts*: the Zipf ranking is
      reshuffled every drift period.
    * ``docs``: long unique documents with a short instruction (heavy prefill, nothing to
      reuse).

Every source's arrivals are modulated together by an on/off Markov process (bursts and
lulls with exponential sojourns), where the project's are Poisson. A trace's source
shares and every knob are drawn from its seed alone (``draw_knobs``): shares are skewed
random weights, so most traces have one dominant source (``ForeignKnobs.dominant``).

Labels are what a client of the live router sends: the tenant (its API key) and, for
chat and sub-agent turns, a session id and turn index (``x-session-id``); task and
template are left to the classifier. Prompts are whole blocks (16 tokens by default); a
turn's ``output_hash_ids`` are the answer's whole blocks, which the session's next turn
reads after the prompt.

Invariants:
    * ``generate_foreign(seed, ...)`` is a pure function of its arguments.
    * Records are sorted by timestamp and are valid trace lines (``unicache.trace``).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

SOURCES = ("chat", "rag", "swarm", "fewshot", "docs")
BLOCK_SIZE = 16  # tokens per block of every foreign trace the studies replay


@dataclass(slots=True, frozen=True)
class ForeignKnobs:
    """One trace's setting (``draw_knobs``); lengths in tokens, times in seconds."""

    shares: dict[str, float]
    tenants: int
    burst_high: float  # arrival rate multiplier in a burst
    burst_low: float  # ... in a lull
    burst_mean_s: float  # mean sojourn in either state
    chat_system_pool: int
    chat_system_zipf: float
    chat_system_tokens: int
    chat_turns_alpha: float  # P(turns >= k) ~ k^-alpha, capped at 40
    chat_think_scale_s: float  # Pareto think time: scale * U^(-1/shape)
    chat_think_shape: float
    chat_user_tokens: int
    chat_output_tokens: int
    chat_regenerate: float
    chat_edit: float
    rag_corpus: int
    rag_zipf: float
    rag_chunk_tokens: int
    rag_chunks: int
    rag_system_tokens: int
    rag_question_tokens: int
    rag_output_tokens: int
    swarm_fanout: int
    swarm_context_tokens: int
    swarm_turns: int
    swarm_gap_mean_s: float
    swarm_tool_tokens: int
    swarm_output_tokens: int
    fewshot_templates: int
    fewshot_zipf: float
    fewshot_tokens: int
    fewshot_suffix_tokens: int
    fewshot_output_tokens: int
    fewshot_drift_s: float
    docs_tokens: int
    docs_output_tokens: int

    @property
    def dominant(self) -> str:
        """The source with the largest share of requests."""
        return max(SOURCES, key=lambda s: self.shares[s])


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_knobs(seed: int) -> ForeignKnobs:
    """The knobs of trace ``seed``: shares from weights U^3 (skewed: usually one source
    dominates), every other knob uniform or log-uniform over a wide range."""
    rng = random.Random(f"foreign-knobs-{seed}")
    w = {s: rng.random() ** 3 + 0.01 for s in SOURCES}
    total = sum(w.values())
    li = lambda lo, hi: int(round(_log_uniform(rng, lo, hi)))  # noqa: E731
    return ForeignKnobs(
        shares={s: w[s] / total for s in SOURCES},
        tenants=li(1, 12),
        burst_high=rng.uniform(1.5, 3.0), burst_low=rng.uniform(0.2, 0.6), burst_mean_s=_log_uniform(rng, 15, 120),
        chat_system_pool=li(1, 20), chat_system_zipf=rng.uniform(0.6, 1.5), chat_system_tokens=li(150, 2500),
        chat_turns_alpha=rng.uniform(0.8, 2.0), chat_think_scale_s=_log_uniform(rng, 3, 40),
        chat_think_shape=rng.uniform(1.1, 2.5), chat_user_tokens=li(20, 400), chat_output_tokens=li(30, 800),
        chat_regenerate=rng.uniform(0.0, 0.1), chat_edit=rng.uniform(0.0, 0.1),
        rag_corpus=li(50, 3000), rag_zipf=rng.uniform(0.6, 1.4), rag_chunk_tokens=li(128, 640),
        rag_chunks=li(2, 8), rag_system_tokens=li(100, 1500), rag_question_tokens=li(16, 160),
        rag_output_tokens=li(30, 500),
        swarm_fanout=li(2, 8), swarm_context_tokens=li(1000, 8000), swarm_turns=li(2, 10),
        swarm_gap_mean_s=_log_uniform(rng, 0.3, 3.0), swarm_tool_tokens=li(100, 1500), swarm_output_tokens=li(30, 400),
        fewshot_templates=li(5, 300), fewshot_zipf=rng.uniform(0.7, 1.6), fewshot_tokens=li(300, 3000),
        fewshot_suffix_tokens=li(20, 300), fewshot_output_tokens=li(20, 400), fewshot_drift_s=_log_uniform(rng, 30, 300),
        docs_tokens=li(2000, 12000), docs_output_tokens=li(50, 600),
    )


def _zipf_cum(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [c / total for c in accumulate(w)]


class _Gen:
    def __init__(self, knobs: ForeignKnobs, seed: int, duration: float, requests_per_s: float, block_size: int):
        self.k, self.duration, self.rate, self.bs = knobs, duration, requests_per_s, block_size
        self.rng = random.Random(f"foreign-trace-{seed}")
        self.next_id = 1
        self.out: list[dict] = []
        self.tenants = [f"t{i}" for i in range(knobs.tenants)]
        self.bursts = self._bursts()
        k = knobs
        self.chat_systems = {t: [self.ids(self.blocks(self.length(k.chat_system_tokens))) for _ in range(k.chat_system_pool)]
                             for t in self.tenants}
        self.chat_system_cum = _zipf_cum(k.chat_system_pool, k.chat_system_zipf)
        self.rag_systems = {t: self.ids(self.blocks(self.length(k.rag_system_tokens))) for t in self.tenants}
        self.corpus = [self.ids(self.blocks(self.length(k.rag_chunk_tokens))) for _ in range(k.rag_corpus)]
        self.corpus_cum = _zipf_cum(k.rag_corpus, k.rag_zipf)
        self.fewshots = {t: [self.ids(self.blocks(self.length(k.fewshot_tokens))) for _ in range(k.fewshot_templates)]
                         for t in self.tenants}
        self.fewshot_cum = _zipf_cum(k.fewshot_templates, k.fewshot_zipf)

    # ---------------------------------------------------------------- building blocks
    def ids(self, n: int) -> list[int]:
        first = self.next_id
        self.next_id += n
        return list(range(first, first + n))

    def blocks(self, tokens: int) -> int:
        return max(1, -(-tokens // self.bs))

    def length(self, mean: int) -> int:
        """A length around ``mean``: log-normal, sigma 0.6, at least 1."""
        return max(1, int(mean * self.rng.lognormvariate(-0.18, 0.6)))

    def pick(self, cum: list[float]) -> int:
        return min(bisect_left(cum, self.rng.random()), len(cum) - 1)

    def _bursts(self) -> list[tuple[float, float]]:
        """(start time, multiplier) of each on/off state over the trace."""
        k, t, high = self.k, 0.0, self.rng.random() < 0.5
        out = []
        while t < self.duration:
            out.append((t, k.burst_high if high else k.burst_low))
            t += self.rng.expovariate(1.0 / k.burst_mean_s)
            high = not high
        return out

    def multiplier(self, t: float) -> float:
        i = bisect_left(self.bursts, (t, math.inf)) - 1
        return self.bursts[max(i, 0)][1]

    def arrivals(self, rate: float):
        """Arrival times of a Poisson process modulated by the bursts (thinning)."""
        if rate <= 0:
            return
        peak = rate * self.k.burst_high
        mean_mult = sum(self.multiplier(x * self.duration / 64) for x in range(64)) / 64
        peak /= mean_mult  # the long-run rate stays ``rate``
        t = 0.0
        while True:
            t += self.rng.expovariate(peak)
            if t >= self.duration:
                return
            if self.rng.random() * self.k.burst_high <= self.multiplier(t):
                yield t

    def emit(self, t: float, prompt: list[int], output_tokens: int, tenant: str, **labels) -> list[int]:
        """One request; returns its answer's whole blocks (its ``output_hash_ids``)."""
        out_ids = self.ids(output_tokens // self.bs)
        rec = {"timestamp": round(t * 1000.0, 3), "input_length": len(prompt) * self.bs,
               "output_length": output_tokens, "hash_ids": prompt, "output_hash_ids": out_ids, "tenant": tenant}
        rec.update(labels)
        self.out.append(rec)
        return out_ids

    # ---------------------------------------------------------------- sources
    def chat_turns(self) -> int:
        return min(40, int((1.0 - self.rng.random()) ** (-1.0 / self.k.chat_turns_alpha)))

    def chat(self, sid: str, start: float) -> None:
        k, rng = self.k, self.rng
        tenant = rng.choice(self.tenants)
        history = [self.chat_systems[tenant][self.pick(self.chat_system_cum)]]  # context before each turn
        prompt: list[int] = []
        t = start
        for turn in range(self.chat_turns()):
            if t >= self.duration:
                return
            u = rng.random()
            if turn and u < k.chat_regenerate:
                pass  # the same prompt again, for another answer
            else:
                if turn and u < k.chat_regenerate + k.chat_edit and len(history) > 2:
                    history = history[: rng.randrange(1, len(history))]  # cut back to an earlier turn
                prompt = history[-1] + self.ids(self.blocks(self.length(k.chat_user_tokens)))
            out_tokens = self.length(k.chat_output_tokens)
            answer = self.emit(t, prompt, out_tokens, tenant, session_id=sid, turn=turn)
            history.append(prompt + answer)
            t += out_tokens * 0.02 + k.chat_think_scale_s * (1.0 - rng.random()) ** (-1.0 / k.chat_think_shape)

    def rag(self, t: float) -> None:
        k, rng = self.k, self.rng
        tenant = rng.choice(self.tenants)
        chosen: list[int] = []
        while len(chosen) < min(k.rag_chunks, k.rag_corpus):
            c = self.pick(self.corpus_cum)
            if c not in chosen:
                chosen.append(c)
        rng.shuffle(chosen)  # relevance order is the query's, not popularity's
        prompt = list(self.rag_systems[tenant])
        for c in chosen:
            prompt += self.corpus[c]
        prompt += self.ids(self.blocks(self.length(k.rag_question_tokens)))
        self.emit(t, prompt, self.length(k.rag_output_tokens), tenant)

    def swarm(self, n: int, start: float) -> None:
        k, rng = self.k, self.rng
        tenant = rng.choice(self.tenants)
        parent = self.ids(self.blocks(self.length(k.swarm_context_tokens)))
        for a in range(k.swarm_fanout):
            ctx = parent + self.ids(self.blocks(self.length(60)))  # the sub-agent's own task
            t = start + rng.uniform(0.0, 0.5)
            for turn in range(max(1, int(rng.uniform(0.5, 1.5) * k.swarm_turns))):
                if t >= self.duration:
                    break
                answer = self.emit(t, ctx, self.length(k.swarm_output_tokens), tenant,
                                   session_id=f"swarm-{n}-{a}", turn=turn)
                ctx = ctx + answer + self.ids(self.blocks(self.length(k.swarm_tool_tokens)))
                t += rng.expovariate(1.0 / k.swarm_gap_mean_s) + 0.2

    def fewshot(self, t: float) -> None:
        k, rng = self.k, self.rng
        tenant = rng.choice(self.tenants)
        # the popularity ranking of this drift period: a permutation seeded by the period
        period = int(t // k.fewshot_drift_s)
        order = list(range(k.fewshot_templates))
        random.Random(f"{period}-{k.fewshot_templates}").shuffle(order)
        template = self.fewshots[tenant][order[self.pick(self.fewshot_cum)]]
        prompt = template + self.ids(self.blocks(self.length(k.fewshot_suffix_tokens)))
        self.emit(t, prompt, self.length(k.fewshot_output_tokens), tenant)

    def docs(self, t: float) -> None:
        tenant = self.rng.choice(self.tenants)
        self.emit(t, self.ids(self.blocks(self.length(self.k.docs_tokens))), self.length(self.k.docs_output_tokens), tenant)

    def run(self) -> list[dict]:
        k = self.k
        chat_turns_mean = sum(min(40, int(u ** (-1.0 / k.chat_turns_alpha)))
                              for u in (1.0 - (i + 0.5) / 400 for i in range(400))) / 400
        swarm_requests = k.swarm_fanout * k.swarm_turns
        for n, t in enumerate(self.arrivals(k.shares["chat"] * self.rate / chat_turns_mean)):
            self.chat(f"chat-{n}", t)
        for t in self.arrivals(k.shares["rag"] * self.rate):
            self.rag(t)
        for n, t in enumerate(self.arrivals(k.shares["swarm"] * self.rate / swarm_requests)):
            self.swarm(n, t)
        for t in self.arrivals(k.shares["fewshot"] * self.rate):
            self.fewshot(t)
        for t in self.arrivals(k.shares["docs"] * self.rate):
            self.docs(t)
        self.out.sort(key=lambda r: r["timestamp"])
        return self.out


def generate_foreign(seed: int, duration: float = 300.0, requests_per_s: float = 1.5,
                     block_size: int = BLOCK_SIZE) -> list[dict]:
    """Trace ``seed``'s records (JSON-ready dicts sorted by timestamp)."""
    return _Gen(draw_knobs(seed), seed, duration, requests_per_s, block_size).run()


def add_trace_args(ap: argparse.ArgumentParser, seeds: int, duration: float = 1200.0) -> None:
    """The options of a study over foreign trace files: ``--seeds``, ``--first-seed``, ``--duration``."""
    ap.add_argument("--seeds", type=int, default=seeds, help=f"traces (default {seeds})")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=duration, help=f"seconds of arrivals per trace (default {duration:g})")


@contextmanager
def foreign_trace_files(seeds: Sequence[int], duration: float, block_size: int = BLOCK_SIZE,
                        requests_per_s: float = 1.5) -> Iterator[list[tuple[int, str, Path]]]:
    """Each seed's trace written as a trace file in a temporary directory, as (seed, name
    ``foreign-<dominant source>-s<seed>``, path); the files are gone after the block."""
    from unicache.trace import write_trace

    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for seed in seeds:
            name = f"foreign-{draw_knobs(seed).dominant}-s{seed}"
            path = Path(tmp) / f"{name}.jsonl"
            write_trace(path, generate_foreign(seed, duration=duration, requests_per_s=requests_per_s,
                                               block_size=block_size))
            out.append((seed, name, path))
        yield out
