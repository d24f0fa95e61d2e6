"""bench.studies.agent_gap's decision rule, on hand-made rows."""

from __future__ import annotations

from bench.studies.agent_gap import DEFAULT_GAP, choose_gap, mean_gain


def _rows(hits: dict[tuple[str, float], list[float]]) -> list[dict]:
    """Rows of two seeds x two capacities per generator; ``hits[(kind, gap)]``: their ratios."""
    rows = []
    for (kind, gap), values in hits.items():
        for (seed, frac), hit in zip([(1, 0.02), (1, 0.05), (2, 0.02), (2, 0.05)], values):
            rows.append({"kind": kind, "seed": seed, "gap_s": gap, "frac": frac, "block_hit_ratio": hit})
    return rows


def test_the_best_mean_replaces_the_default_only_if_it_gains_on_each_generator():
    base = [0.30, 0.50, 0.40, 0.60]
    rows = _rows({("mix", DEFAULT_GAP): base, ("foreign", DEFAULT_GAP): base,
                  ("mix", 40.0): [0.32, 0.52, 0.42, 0.62], ("foreign", 40.0): [0.301, 0.50, 0.40, 0.60],
                  ("mix", 10.0): [0.29, 0.50, 0.40, 0.60], ("foreign", 10.0): [0.31, 0.50, 0.40, 0.60]})
    assert round(mean_gain(rows, 40.0, "mix"), 6) == 2.0
    assert round(mean_gain(rows, 40.0, "foreign"), 6) == 0.025
    assert round(mean_gain(rows, 40.0), 6) == 1.0125
    assert choose_gap(rows, (10.0, DEFAULT_GAP, 40.0)) == 40.0
    # the best mean loses on one generator: the default stays
    rows = _rows({("mix", DEFAULT_GAP): base, ("foreign", DEFAULT_GAP): base,
                  ("mix", 40.0): [0.34, 0.54, 0.44, 0.64], ("foreign", 40.0): [0.29, 0.50, 0.40, 0.60]})
    assert choose_gap(rows, (DEFAULT_GAP, 40.0)) == DEFAULT_GAP
    # nothing gains: the default stays
    rows = _rows({("mix", DEFAULT_GAP): base, ("foreign", DEFAULT_GAP): base,
                  ("mix", 40.0): base, ("foreign", 40.0): base})
    assert choose_gap(rows, (DEFAULT_GAP, 40.0)) == DEFAULT_GAP
