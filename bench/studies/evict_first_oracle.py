"""Why unicache lost hit ratio when the mix's labels are hidden: an oracle lane split.

On a tuning mix (seed 100 by default; never a reported seed), labels hidden, replays
unicache three ways: as is; with the novel-prefix lane switched off (the policy before
it, ``AblationUniCache(novel_lane=False)``); and with an *oracle* that moves every
evict-first block of a truly plain request (no session, no template, by the trace's
labels, which the policy never sees) to a lane of its own. The oracle bounds what telling
one-off prompts apart can win; the novel lane is the online approximation. Also prints
labelled unicache (the ceiling of the classes) and per-task hit ratios.

    python -m bench.studies.evict_first_oracle [--seed 100] [--fracs 0.02,0.25]
"""

from __future__ import annotations

import argparse
import sys

from unicache.replica.eviction.unicache.lanes import EVICT_FIRST, NOVEL_LANE, NUM_LANES
from unicache.sim.replay import Replay, ReplayConfig
from unicache.sim.runner import capacities_from_fracs
from bench.eviction_tuning import mix_trace
from bench.unicache_variants import AblationPlacement, AblationUniCache

_PLAIN_LANE = EVICT_FIRST * NUM_LANES + NOVEL_LANE


def oracle_factory(truth: dict[int, object]):
    """An ``AblationUniCache`` (novel lane off) whose placement moves the evict-first blocks
    of truly plain requests (``truth``: id of the class object -> its labelled class) to
    the otherwise empty novel lane, weighed like any lane."""

    class OraclePlacement(AblationPlacement):
        def place(self, block_ids, positions, cls, num_prompt_blocks, uses, novel=()):
            lanes = super().place(block_ids, positions, cls, num_prompt_blocks, uses, ())
            t = truth[id(cls)]
            if t.session_id is None and not t.template:
                return [_PLAIN_LANE if lane // NUM_LANES == EVICT_FIRST else lane for lane in lanes]
            return lanes

    class Oracle(AblationUniCache):
        def __init__(self, **kwargs):
            super().__init__(novel_lane=False, novel_first=False, **kwargs)

        def _make_placement(self):
            return OraclePlacement(*self._placement_flags)

    return Oracle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--fracs", default="0.02,0.25")
    args = ap.parse_args(argv)
    fracs = [float(f) for f in args.fracs.split(",")]
    hidden = mix_trace(args.seed, 1200.0, 16, True)
    labelled = mix_trace(args.seed, 1200.0, 16, False)
    truth = {id(r.cls): r.truth for r in hidden.requests}
    print("| capacity | run | block hit % | per task % |")
    print("|---|---|---|---|")
    for frac, cap in zip(fracs, capacities_from_fracs(fracs, hidden.unique_blocks)):
        runs = [
            ("labels hidden, no novel lane", hidden, ReplayConfig("unicache", cap, policy_factory=AblationUniCache,
                                                                  policy_kwargs={"novel_lane": False})),
            ("labels hidden, unicache", hidden, ReplayConfig("unicache", cap)),
            ("labels hidden, oracle plain lane", hidden, ReplayConfig("unicache", cap, policy_factory=oracle_factory(truth))),
            ("labelled, unicache", labelled, ReplayConfig("unicache", cap)),
        ]
        for name, trace, cfg in runs:
            rec = Replay(trace, cfg).run()
            tasks = ", ".join(f"{k} {100 * v:.1f}" for k, v in rec["per_task"].items() if v > 0)
            print(f"| {frac:.0%} | {name} | {100 * rec['block_hit_ratio']:.2f} | {tasks} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
