"""How much of the lru-to-opt gap on Mooncake can an order by predicted continuation close?

Issue 2 asks unicache eviction to close >= 0.25 of the lru-to-opt gap in block hit ratio
on the unlabelled Mooncake conversation trace (block size 512, classes inferred) at 5%
and 10% of the trace's unique blocks. Nearly all reuse there is a session's next turn
reading the previous prompt, so this script measures what an eviction order built on
"will the session of the request that released this block continue?" reaches, with
predictors that get every advantage (fitted on the whole trace, c tuned after the fact):

    1. Prepares the trace as ``bench/eviction_report.py`` does (``prepare`` on
       ``read_trace``, block size 512, classes from ``unicache.classifier``).
    2. Labels every request: it *continues* iff a later request is its next turn. The
       parent link follows the classifier: a turn >= 2 request continues the previous
       request of its inferred session; a turn-1 request (its parent, single-turn-looking
       when it arrived, got no session id) continues the request whose prompt ends (last
       or second-to-last block, the classifier's rule) at the longest strict prefix of
       its prompt; links that disagree with the classifier's sessions are counted.
       Reports where repeat accesses come from (previous turn, the shared first block,
       other), continuation rates per feature bucket and inter-turn gap quantiles.
    3. Fits per-cell continuation rates (``--prior`` pseudo-requests at the global rate)
       on nested feature sets -- depth; + input, output length, previous gap; + new
       blocks, previous output length, 10-minute time bin -- both in-sample (each
       request's own answer is in its cell) and cross-fitted (``--folds`` folds by
       session), and reports each one's AUC. Synthetic predictors of set AUC (score =
       label + Gaussian noise, turned into the calibrated posterior) map AUC to gap closed;
       the oracle has p = 0.999 if the request continues, else 0.001.
    4. Replays through the real simulator (``unicache.sim.replay.Replay``, the real
       ``KVStore``) at 5% and 10%: lru, unicache, opt (``run_grid``), and a bench-local
       policy that evicts the candidate with the smallest ``release time + c * logit(p)``,
       p being the predictor's value for the request that released the block (a heap
       with lazy invalidation; with c = 0 it is lru exactly, which the script checks),
       for c in ``--c-values``. A request's last prompt block either takes its request's
       bonus as every other block (``as lru``) or is ``demoted`` (bonus c * logit(0.001):
       the next turn almost never reads it). The policy learns which request released a
       block from the class's session id: it runs on a copy of the prepared trace in which
       request i has session id ``req-i``. No product code changes; the policy is
       registered in this process only.
    5. Writes ``mooncake_bound.json`` and ``mooncake_bound.md`` to ``--out-dir``, with the
       conclusion read off the numbers (``--rewrite`` redoes the .md from the JSON).

Run (from the repository root; about 8 minutes of CPU, 198 replays; longer in wall time when
other jobs share the cores):
    .venv/bin/python -m bench.studies.mooncake_bound [--trace PATH] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from unicache.replica.eviction.base import EvictionPolicy, ReleaseInfo
from unicache.block_hash import BlockHash
from unicache.request_class import RequestClass
from unicache.sim.prepare import PreparedTrace, SimRequest, prepare
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs, run_grid
from unicache.trace import read_trace
from bench.paths import RESULTS, mooncake_trace
from bench.report_files import write_report

FRACS = [0.05, 0.10]
C_VALUES = [30.0, 100.0, 300.0, 1000.0, 3000.0]
SYNTHETIC_AUCS = [0.7, 0.8, 0.85, 0.9]
TARGET = 0.25
POLICY = "bench-continuation-bonus"
ORACLE_EPS = 1e-3
TIME_BIN_S = 600.0
AS_LRU, DEMOTED = "as lru", "demoted"  # a request's last prompt block: its request's bonus, or "surely ends"

# Bucket upper bounds (a value v falls in bucket bisect_right(bounds, v)); -1 = no parent.
INPUT_BOUNDS = [1024, 2048, 4096, 8192, 16384, 32768]
OUTPUT_BOUNDS = [32, 128, 256, 384, 512, 768]
GAP_BOUNDS = [10, 30, 60, 120, 300, 600]
NEW_BLOCK_BOUNDS = [2, 3, 5, 9, 17, 33]
MAX_DEPTH = 6

FEATURES = ["depth", "input", "output", "prev_gap", "new_blocks", "prev_output", "time"]
FEATURE_SETS = {
    "depth": FEATURES[:1],
    "depth+in+out+gap": FEATURES[:4],
    "all seven": FEATURES,
}


# ----------------------------------------------------------------- the policy
class ContinuationBonusPolicy(EvictionPolicy):
    """Evicts the candidate with the smallest ``release time + bonus(release)``.

    Bench only (the bonus needs hindsight). Ties go by release order, so within one
    request the tail goes first, as in lru; with a zero bonus the order is lru's.

    Invariants:
        * A block is a candidate iff it is in ``_live``; its one live heap entry carries
          ``_live[id]`` as token; other entries are stale, skipped on pop, and dropped by
          a rebuild once they outnumber live ones (O(log n) amortised per operation).

    Args:
        bonus: seconds added to a released block's release time (larger: kept longer).
    """

    name = POLICY

    def __init__(self, bonus: Callable[[ReleaseInfo], float]):
        self._bonus = bonus
        self._live: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._tokens = itertools.count()

    def on_cached(self, block_id: int, block_hash: BlockHash, parent_id: int, now: float) -> None:
        pass

    def on_release(self, block_id: int, info: ReleaseInfo) -> None:
        tok = next(self._tokens)
        self._live[block_id] = tok
        heapq.heappush(self._heap, (info.now + self._bonus(info), tok, block_id))
        if len(self._heap) > 2 * len(self._live) + 1024:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def on_access(self, block_id: int, cls: RequestClass, now: float) -> None:
        self._live.pop(block_id, None)

    def pop_victim(self) -> int | None:
        heap, live = self._heap, self._live
        while heap:
            _, tok, block_id = heapq.heappop(heap)
            if live.get(block_id) == tok:
                del live[block_id]
                return block_id
        return None

    def on_removed(self, block_id: int) -> None:
        self._live.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._live)


class BonusReplay(Replay):
    """``Replay`` whose store evicts with ``ContinuationBonusPolicy`` (built from
    ``policy_kwargs``): the study's policy stays in the study, and the production
    eviction registry never learns its name."""

    def _make_policy(self) -> EvictionPolicy:
        return ContinuationBonusPolicy(**self.config.policy_kwargs)


def tagged(trace: PreparedTrace) -> PreparedTrace:
    """A copy in which request i's class has session id ``req-i`` (for these runs only)."""
    reqs = [replace(r, cls=replace(r.cls, session_id=f"req-{r.index}")) for r in trace.requests]
    return replace(trace, requests=reqs)


def bonus_by_request(bonus: Sequence[float], last: Sequence[int] | None, demoted: float) -> Callable:
    """``bonus[i]`` for blocks request i releases (tagged trace); with ``last``, the block
    at position ``last[i]`` gets ``demoted`` instead."""
    if last is None:
        return lambda info: bonus[int(info.cls.session_id[4:])]

    def f(info: ReleaseInfo) -> float:
        i = int(info.cls.session_id[4:])
        return demoted if info.position == last[i] else bonus[i]

    return f


# -------------------------------------------------------------- labelling
def link_turns(reqs: Sequence[SimRequest]) -> tuple[list[int], dict]:
    """Parent request of each request (-1: none) by the classifier's next-turn rule.

    Returns the parents and a consistency record (links that disagree with the
    classifier's session ids and turns, and how each child extends its parent's prompt).
    """
    parent = [-1] * len(reqs)
    last_of_session: dict[str, int] = {}
    ends: dict[BlockHash, int] = {}  # prompt end hash (last, second-to-last) -> request
    disagree = whole = all_but_last = 0
    for r in reqs:
        hs = r.prompt_hashes
        by_hash = -1
        for i in range(len(hs) - 2, -1, -1):
            j = ends.get(hs[i])
            if j is not None:
                by_hash = j
                break
        sid = r.cls.session_id
        if sid is not None and r.cls.turn >= 1:
            p = last_of_session.get(sid, -1) if r.cls.turn >= 2 else by_hash
            q = reqs[p].cls if p >= 0 else None
            ok = q is not None and p == by_hash and q.turn == r.cls.turn - 1 and (
                q.session_id == sid if r.cls.turn >= 2 else q.session_id is None)
            disagree += not ok
            if p >= 0:
                parent[r.index] = p
                ph = reqs[p].prompt_hashes
                if hs[: len(ph)] == ph:
                    whole += 1
                elif hs[: len(ph) - 1] == ph[:-1]:
                    all_but_last += 1
        if sid is not None:
            last_of_session[sid] = r.index
        if hs:
            ends[hs[-1]] = r.index
            if len(hs) >= 2:
                ends[hs[-2]] = r.index
    links = sum(p >= 0 for p in parent)
    return parent, {"links": links, "disagree_with_classifier": disagree,
                    "child_holds_whole_parent_prompt": whole, "child_holds_all_but_last_block": all_but_last}


def reuse_sources(reqs: Sequence[SimRequest], parent: Sequence[int]) -> dict:
    """Where repeat block accesses (the hits of an infinite cache) come from."""
    seen: set[BlockHash] = set()
    src = Counter()
    accesses = 0
    for r in reqs:
        ph = set(reqs[parent[r.index]].prompt_hashes) if parent[r.index] >= 0 else set()
        for pos, h in enumerate(r.prompt_hashes):
            accesses += 1
            if h in seen:
                src["previous turn's prompt" if h in ph else ("first block (shared)" if pos == 0 else "other")] += 1
            seen.add(h)
    repeats = sum(src.values())
    return {"block_accesses": accesses, "repeat_accesses": repeats,
            "infinite_cache_hit_ratio": repeats / accesses,
            "share_of_repeats": {k: v / repeats for k, v in src.most_common()}}


def features(reqs: Sequence[SimRequest], parent: Sequence[int]) -> list[tuple[int, ...]]:
    """One tuple per request, in ``FEATURES`` order (all known when the request ends)."""
    rows = []
    for r in reqs:
        p = parent[r.index]
        pr = reqs[p] if p >= 0 else None
        rows.append((
            min(r.cls.turn, MAX_DEPTH) if p >= 0 else 0,
            bisect_right(INPUT_BOUNDS, r.input_length),
            bisect_right(OUTPUT_BOUNDS, r.output_length),
            bisect_right(GAP_BOUNDS, r.arrival_s - pr.arrival_s) if pr else -1,
            bisect_right(NEW_BLOCK_BOUNDS, len(r.prompt_hashes) - (len(pr.prompt_hashes) if pr else 0)),
            bisect_right(OUTPUT_BOUNDS, pr.output_length) if pr else -1,
            int(r.arrival_s // TIME_BIN_S),
        ))
    return rows


def bucket_label(feature: str, b: int) -> str:
    if b < 0:
        return "no parent"
    if feature == "depth":
        return f"{b}+" if b == MAX_DEPTH else str(b)
    if feature == "time":
        return f"{int(b * TIME_BIN_S)}-{int((b + 1) * TIME_BIN_S)} s"
    bounds = {"input": INPUT_BOUNDS, "output": OUTPUT_BOUNDS, "prev_output": OUTPUT_BOUNDS,
              "prev_gap": GAP_BOUNDS, "new_blocks": NEW_BLOCK_BOUNDS}[feature]
    unit = " s" if feature == "prev_gap" else ""
    if b == 0:
        return f"< {bounds[0]}{unit}"
    if b == len(bounds):
        return f">= {bounds[-1]}{unit}"
    return f"{bounds[b - 1]}-{bounds[b]}{unit}"


def rates_by_bucket(rows, y) -> dict[str, list[dict]]:
    out = {}
    for k, name in enumerate(FEATURES):
        n, pos = Counter(), Counter()
        for row, label in zip(rows, y):
            n[row[k]] += 1
            pos[row[k]] += label
        out[name] = [{"bucket": bucket_label(name, b), "requests": n[b], "continue_rate": pos[b] / n[b]}
                     for b in sorted(n)]
    return out


# ------------------------------------------------------------- predictors
def cell_keys(rows, feature_names: Sequence[str]) -> list[tuple[int, ...]]:
    cols = [FEATURES.index(f) for f in feature_names]
    return [tuple(row[c] for c in cols) for row in rows]


def cell_rates(keys: Sequence[tuple], y: np.ndarray, prior: float, folds: np.ndarray | None = None) -> np.ndarray:
    """Per-cell empirical continuation rate, ``prior`` pseudo-requests at the global rate.

    Without ``folds`` every request is scored by the table of all requests (its own answer
    included: in-sample); with them, by the table of the other folds only (cross-fitted).
    """
    n, pos = Counter(keys), Counter(k for k, label in zip(keys, y) if label)
    if folds is None:
        base = y.mean()
        return np.array([(pos[k] + prior * base) / (n[k] + prior) for k in keys])
    out = np.empty(len(keys))
    for f in np.unique(folds):
        idx = np.flatnonzero(folds == f)
        nf = Counter(keys[i] for i in idx)
        pf = Counter(keys[i] for i in idx if y[i])
        base = (y.sum() - y[idx].sum()) / (len(y) - len(idx))
        for i in idx:
            k = keys[i]
            out[i] = (pos[k] - pf[k] + prior * base) / (n[k] - nf[k] + prior)
    return out


def session_folds(parent: Sequence[int], k: int, seed: int) -> np.ndarray:
    """A fold per request; all turns of one session (chain of next-turn links) share it."""
    root = list(range(len(parent)))
    for i, p in enumerate(parent):
        if p >= 0:
            root[i] = root[p]
    return np.random.default_rng(seed).integers(0, k, len(parent))[root]


def auc(scores: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half)."""
    _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    ranks = (starts + (counts + 1) / 2.0)[inv]
    n1 = int(y.sum())
    n0 = len(y) - n1
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def synthetic_logits(y: np.ndarray, target_auc: float, seed: int) -> np.ndarray:
    """Calibrated log-odds from a score ``label + N(0, s^2)`` whose AUC is ``target_auc``."""
    s = 1.0 / (math.sqrt(2.0) * statistics.NormalDist().inv_cdf(target_auc))
    score = y + np.random.default_rng(seed).normal(0.0, s, len(y))
    base = y.mean()
    return math.log(base / (1 - base)) + (score - 0.5) / (s * s)


# ------------------------------------------------------------------- runs
def gap_closed(hit: float, lru: float, opt: float) -> float:
    return (hit - lru) / (opt - lru) if opt > lru else float("nan")


def measure(args) -> dict:
    t0 = time.perf_counter()
    trace = prepare(read_trace(args.trace), args.block_size)
    reqs = trace.requests
    log(f"{len(reqs)} requests, {trace.unique_blocks} unique blocks, {trace.block_accesses} accesses "
        f"(prepare {time.perf_counter() - t0:.1f}s)")

    parent, linking = link_turns(reqs)
    y = np.zeros(len(reqs), dtype=np.int64)
    for p in parent:
        if p >= 0:
            y[p] = 1
    gaps = np.array([r.arrival_s - reqs[p].arrival_s for r, p in zip(reqs, parent) if p >= 0])
    rows = features(reqs, parent)
    log(f"{linking['links']} next-turn links ({linking['disagree_with_classifier']} disagree with the "
        f"classifier), continuation rate {y.mean():.3f}")

    predictors: dict[str, dict] = {"constant": {"kind": "constant", "auc": 0.5}}
    logits: dict[str, np.ndarray] = {"constant": np.zeros(len(reqs))}
    folds = session_folds(parent, args.folds, args.seed)
    for name, cols in FEATURE_SETS.items():
        keys = cell_keys(rows, cols)
        for kind, f in (("hindsight table", None), ("cross-fitted table", folds)):
            p = cell_rates(keys, y, args.prior, f)
            label = name if f is None else f"{name} ({args.folds}-fold)"
            predictors[label] = {"kind": kind, "features": cols, "cells": len(set(keys)), "auc": auc(p, y)}
            logits[label] = logit(p)
    for target in SYNTHETIC_AUCS:
        name = f"synthetic AUC {target:.2f}"
        logits[name] = synthetic_logits(y.astype(float), target, args.seed)
        predictors[name] = {"kind": "synthetic", "target_auc": target, "auc": auc(logits[name], y)}
    oracle_p = np.where(y == 1, 1 - ORACLE_EPS, ORACLE_EPS)
    predictors["oracle"] = {"kind": "oracle", "auc": auc(oracle_p, y)}
    logits["oracle"] = logit(oracle_p)
    for name, pr in predictors.items():
        log(f"predictor {name}: AUC {pr['auc']:.3f}" + (f" ({pr['cells']} cells)" if "cells" in pr else ""))

    caps = capacities_from_fracs(args.fracs, trace.unique_blocks)
    baselines = run_grid(trace, ["lru", "unicache", "opt"], caps, ReplayConfig("lru", caps[0]),
                         on_result=lambda r: log(f"  {r['policy']:<10} {r['capacity_blocks']:>6} "
                                                  f"hit {100 * r['block_hit_ratio']:.2f}%"))
    base = {(r["policy"], r["capacity_blocks"]): r["block_hit_ratio"] for r in baselines}

    tagged_trace = tagged(trace)
    last_block = [len(r.prompt_hashes) - 1 if len(r.prompt_hashes) > 1 else -1 for r in reqs]
    demote_logit = float(logit(np.array([ORACLE_EPS]))[0])

    def replay(lg: np.ndarray, c: float, cap: int, variant: str, label: str) -> float:
        last = last_block if variant == DEMOTED else None
        bonus = bonus_by_request((c * lg).tolist(), last, c * demote_logit)
        cfg = ReplayConfig(POLICY, cap, policy_kwargs={"bonus": bonus}, label=label)
        return BonusReplay(tagged_trace, cfg).run()["block_hit_ratio"]

    c0_equals_lru = all(replay(logits["constant"], 0.0, cap, AS_LRU, "c=0") == base[("lru", cap)] for cap in caps)
    log(f"bonus policy with c = 0 equals lru at every capacity: {c0_equals_lru}")

    sweep = []
    for variant in (AS_LRU, DEMOTED):
        for name, lg in logits.items():
            kind = predictors[name]["kind"]
            if (variant == AS_LRU and kind == "constant") or (variant == DEMOTED and kind == "synthetic"):
                continue  # constant as lru is lru; synthetic rows only map AUC to gap closed
            for c in args.c_values:
                for frac, cap in zip(args.fracs, caps):
                    hit = replay(lg, c, cap, variant, name)
                    g = gap_closed(hit, base[("lru", cap)], base[("opt", cap)])
                    sweep.append({"predictor": name, "last_block": variant, "c_s": c, "capacity_frac": frac,
                                  "capacity_blocks": cap, "block_hit_ratio": hit, "gap_closed": g})
                    log(f"  {variant:<8} {name:<30} c={c:>5g} {frac:.0%} hit {100 * hit:.2f}% gap closed {g:.3f}")

    summary = []
    for variant in (AS_LRU, DEMOTED):
        for name, pr in predictors.items():
            runs = [s for s in sweep if s["predictor"] == name and s["last_block"] == variant]
            if not runs:
                continue
            row = {"predictor": name, "last_block": variant, "kind": pr["kind"], "auc": pr["auc"]}
            for frac in args.fracs:
                best = max((s for s in runs if s["capacity_frac"] == frac), key=lambda s: s["block_hit_ratio"])
                row[f"{frac:g}"] = {"best_c_s": best["c_s"], "block_hit_ratio": best["block_hit_ratio"],
                                    "gap_closed": best["gap_closed"]}
            summary.append(row)

    return {
        "trace": str(args.trace), "block_size": args.block_size, "requests": len(reqs),
        "unique_blocks": trace.unique_blocks, "block_accesses": trace.block_accesses,
        "linking": linking, "reuse": reuse_sources(reqs, parent),
        "continuation_rate": float(y.mean()),
        "continuation_by_bucket": rates_by_bucket(rows, y.tolist()),
        "gap_s_quantiles": {f"p{q}": float(np.percentile(gaps, q)) for q in (10, 25, 50, 75, 90, 99)},
        "prior_requests": args.prior, "folds": args.folds, "predictors": predictors,
        "baselines": [{"policy": p, "capacity_frac": f, "capacity_blocks": cap, "block_hit_ratio": base[(p, cap)]}
                      for p in ("lru", "unicache", "opt") for f, cap in zip(args.fracs, caps)],
        "c0_equals_lru": c0_equals_lru, "sweep": sweep, "summary": summary,
    }


# ----------------------------------------------------------------- report
def _fmt(xs) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


def conclusion(rep: dict, fracs: Sequence[float]) -> list[str]:
    """Sentences read off the numbers (a rerun on other data states its own result)."""
    keys = [f"{f:g}" for f in fracs]
    pct = " / ".join(f"{f:.0%}" for f in fracs)
    rows = {(r["predictor"], r["last_block"]): r for r in rep["summary"]}
    preds = rep["predictors"]

    def closes(name: str, variant: str = AS_LRU) -> list[float]:
        return [rows[(name, variant)][k]["gap_closed"] for k in keys]

    def meets(name: str, variant: str = AS_LRU) -> bool:
        return all(g >= TARGET for g in closes(name, variant))

    base = {(b["policy"], b["capacity_frac"]): b["block_hit_ratio"] for b in rep["baselines"]}
    uc = [gap_closed(base[("unicache", f)], base[("lru", f)], base[("opt", f)]) for f in fracs]
    out = [f"Target: close >= {TARGET} of the lru-to-opt gap at {pct}; unicache closes {_fmt(uc)}. "
           "Gap closed below is at the best c per capacity, chosen after the fact."]

    insample = [n for n, p in preds.items() if p["kind"] == "hindsight table"]
    crossfit = [n for n, p in preds.items() if p["kind"] == "cross-fitted table"]
    ok_in = [n for n in insample if meets(n) or meets(n, DEMOTED)]
    best_in = max(insample, key=lambda n: min(closes(n)))
    out.append(
        f"Fitted in hindsight on the answers themselves, the richest table ({best_in}, {preds[best_in]['cells']} "
        f"cells, AUC {preds[best_in]['auc']:.3f}) closes {_fmt(closes(best_in))} "
        f"({_fmt(closes(best_in, DEMOTED))} with the last prompt block demoted): "
        + ("the ordering itself can meet the target given a predictor that good"
           if ok_in else "even that misses the target") + ".")
    best_cf = max(crossfit, key=lambda n: max(min(closes(n)), min(closes(n, DEMOTED))))
    ok_cf = [n for n in crossfit if meets(n) or meets(n, DEMOTED)]
    cf_max = [max(rows[(n, v)][k]["gap_closed"] for n in crossfit for v in (AS_LRU, DEMOTED)) for k in keys]
    line = (f"Scored out of fold ({rep['folds']} folds by session: each request's p comes from the table of the "
            "other sessions, so a cell can no longer memorise its own answer), the same feature sets reach AUC "
            + ", ".join(f"{preds[n]['auc']:.3f}" for n in crossfit)
            + f"; the best ({best_cf}) closes {_fmt(closes(best_cf))}, {_fmt(closes(best_cf, DEMOTED))} with the "
            "last prompt block demoted" + (": it meets the target." if ok_cf else ": short of the target."))
    depth_cf = f"depth ({rep['folds']}-fold)"
    if depth_cf in preds and abs(preds["depth"]["auc"] - preds[depth_cf]["auc"]) < 0.02:
        line += (" Depth alone generalises (in-sample and cross-fitted AUC agree); what the finer cells add "
                 "in sample is memorisation.")
    out.append(line)
    synth = sorted((p["target_auc"], n) for n, p in preds.items() if p["kind"] == "synthetic")
    ok_s = [(a, n) for a, n in synth if meets(n)]
    if ok_s:
        a, n = ok_s[0]
        line = (f"Synthetic predictors (independent per-request errors) first meet the target at AUC {a:.2f} "
                f"(closing {_fmt(closes(n))})")
        below = [m for m in synth if m[0] < a]
        if below:
            line += f"; at AUC {below[-1][0]:.2f} they close {_fmt(closes(below[-1][1]))}"
        out.append(line + ".")
    elif synth:
        out.append(f"No synthetic predictor tried (up to AUC {synth[-1][0]:.2f}) meets the target.")
    out.append(f"Demoting each request's last prompt block (the next turn reads it in "
               f"{rep['linking']['child_holds_whole_parent_prompt']} of {rep['linking']['links']} links) is "
               f"knowable online; on its own (constant p) it closes {_fmt(closes('constant', DEMOTED))}.")
    out.append(f"The oracle (knows which requests' sessions continue; lru among the rest) closes "
               f"{_fmt(closes('oracle'))} ({_fmt(closes('oracle', DEMOTED))} demoted): with perfect knowledge "
               "of continuation this ordering closes most of the gap; what is missing is the knowledge.")
    if ok_cf:
        out.append("So: a table that does not see its own answers meets the target here; the target is reachable "
                   "with features known online.")
    elif ok_s:
        below = [m for m in synth if m[0] < ok_s[0][0]]
        need = (f"between {below[-1][0]:.2f} and {ok_s[0][0]:.2f}" if below else f"about {ok_s[0][0]:.2f}")
        out.append(
            f"So: on this trace the target needs a session-continuation predictor with AUC {need}; tables of the "
            "features the trace offers online (depth, lengths, gaps, new blocks, time) reach at most "
            f"{max(preds[n]['auc'] for n in crossfit):.2f} when they cannot see the answers and close at most "
            f"{_fmt(cf_max)} (best c and last-block treatment per capacity), about what unicache closes today. "
            "Only a table that memorises the outcomes reaches the target. This is measured evidence for this "
            "ordering family and these features, not a proof for every online policy: a markedly better "
            "online predictor of session continuation would change it.")
    return out


def markdown(rep: dict, fracs: Sequence[float]) -> str:
    pct = [f"{f:.0%}" for f in fracs]
    keys = [f"{f:g}" for f in fracs]
    lines = ["# Mooncake bound: eviction by predicted session continuation\n",
             f"Produced by `{rep['command']}` on {rep['host']} ({rep['cpus']} CPUs). "
             f"{rep['requests']} requests, {rep['unique_blocks']} unique blocks, {rep['block_accesses']} block "
             f"accesses, block size {rep['block_size']}, classes inferred. Every replay is the real "
             "`unicache.sim.replay.Replay` with the real `KVStore`.\n"]
    lines.append("## Conclusion\n")
    lines += [f"- {s}" for s in rep["conclusion"]]
    lines.append("")
    lines.append("## Best c per predictor and capacity\n")
    lines.append("Policy: evict the smallest `release time + c * logit(p)`, p = the predictor's value for the request "
                 "that released the block; c chosen per capacity after the fact. *Last block*: a request's last "
                 "prompt block gets its request's bonus (`as lru`), or is `demoted` (bonus c * logit(0.001), as if "
                 "its request surely ends). Gap closed = (hit - lru) / (opt - lru).\n")
    lines.append("| predictor | last block | AUC | " + " | ".join(
        f"best c {p} (s) | hit% {p} | gap closed {p}" for p in pct) + " |")
    lines.append("|---|---|---|" + "---|---|---|" * len(fracs))
    base = {(b["policy"], b["capacity_frac"]): b["block_hit_ratio"] for b in rep["baselines"]}
    for b in ("lru", "unicache", "opt"):
        lines.append(f"| {b} (product policy) | - | - | " + " | ".join(
            f"- | {100 * base[(b, f)]:.2f} | {gap_closed(base[(b, f)], base[('lru', f)], base[('opt', f)]):.2f}"
            for f in fracs) + " |")
    for r in rep["summary"]:
        pr = rep["predictors"][r["predictor"]]
        name = r["predictor"] + (f" ({pr['cells']} cells)" if "cells" in pr else "")
        lines.append(f"| {name} | {r['last_block']} | {r['auc']:.3f} | " + " | ".join(
            f"{r[k]['best_c_s']:g} | {100 * r[k]['block_hit_ratio']:.2f} | {r[k]['gap_closed']:.2f}"
            for k in keys) + " |")
    lines.append(f"\nThe bonus policy with c = 0 reproduces lru's hit ratio exactly: "
                 f"{'yes' if rep['c0_equals_lru'] else 'NO'}. Tables: per-cell continuation rate with a prior of "
                 f"{rep['prior_requests']:g} requests at the global rate; plain rows are fitted on the whole trace "
                 f"(in-sample: the request's own answer is in its cell), `{rep['folds']}-fold` rows are "
                 "cross-fitted by session. Synthetic: score = label + Gaussian noise sized for the AUC, turned "
                 "into the calibrated posterior log-odds. Oracle: p = 0.999 if the request continues, else 0.001 "
                 "(from c = 300 s the bonus gap exceeds the trace's length: lru among the rest).\n")
    lines.append("## Gap closed by c\n")
    cs = sorted({s["c_s"] for s in rep["sweep"]})
    lines.append("| predictor | last block | capacity | " + " | ".join(f"c={c:g}" for c in cs) + " |")
    lines.append("|---|---|---|" + "---|" * len(cs))
    for r in rep["summary"]:
        for f in fracs:
            vals = {s["c_s"]: s["gap_closed"] for s in rep["sweep"] if s["predictor"] == r["predictor"]
                    and s["last_block"] == r["last_block"] and s["capacity_frac"] == f}
            lines.append(f"| {r['predictor']} | {r['last_block']} | {f:.0%} | "
                         + " | ".join(f"{vals[c]:.2f}" for c in cs) + " |")
    lines.append("\n## Where reuse comes from\n")
    ru, lk = rep["reuse"], rep["linking"]
    lines.append(f"An infinite cache hits {100 * ru['infinite_cache_hit_ratio']:.2f}% of block accesses; of those "
                 "repeat accesses: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in ru["share_of_repeats"].items())
                 + f". {lk['links']} next-turn links ({lk['disagree_with_classifier']} disagree with the "
                 f"classifier's sessions); the child holds the parent's whole prompt in "
                 f"{lk['child_holds_whole_parent_prompt']}, all but its last block in "
                 f"{lk['child_holds_all_but_last_block']}. Continuation rate overall "
                 f"{rep['continuation_rate']:.3f}; inter-turn gap (arrival to arrival) quantiles: "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in rep["gap_s_quantiles"].items()) + ".\n")
    lines.append("## Continuation rate by feature bucket\n")
    lines.append("Buckets are [low, high). The last time bin is cut short by the trace's end (censored).\n")
    for name, buckets in rep["continuation_by_bucket"].items():
        lines.append(f"**{name}**: " + "; ".join(
            f"{b['bucket']} {b['continue_rate']:.2f} (n={b['requests']})" for b in buckets) + "\n")
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(mooncake_trace()), help="Mooncake trace (default: shared/traces at or above the checkout)")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--fracs", default=",".join(f"{f:g}" for f in FRACS))
    ap.add_argument("--c-values", default=",".join(f"{c:g}" for c in C_VALUES), help="bonus scales c, seconds")
    ap.add_argument("--prior", type=float, default=2.0, help="pseudo-requests at the global rate per table cell")
    ap.add_argument("--folds", type=int, default=5, help="session folds of the cross-fitted tables")
    ap.add_argument("--seed", type=int, default=0, help="seed of the folds and of the synthetic predictors' noise")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--rewrite", action="store_true", help="no replays: redo the conclusion and the .md from the JSON")
    args = ap.parse_args(argv)
    args.fracs = [float(f) for f in args.fracs.split(",")]
    args.c_values = [float(c) for c in args.c_values.split(",")]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.rewrite:
        rep = json.loads((out_dir / "mooncake_bound.json").read_text())
        args.fracs = sorted({b["capacity_frac"] for b in rep["baselines"]})
    else:
        t0 = time.perf_counter()
        rep = {
            "command": "python -m bench.studies.mooncake_bound " + " ".join(argv if argv is not None else sys.argv[1:]),
            "host": platform.node() or "unknown", "cpus": os.cpu_count(), "python": platform.python_version(),
        }
        rep.update(measure(args))
        rep["elapsed_s"] = time.perf_counter() - t0
        log(f"measured in {rep['elapsed_s']:.0f}s")
    rep["conclusion"] = conclusion(rep, args.fracs)
    write_report(out_dir, "mooncake_bound", rep, markdown(rep, args.fracs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
