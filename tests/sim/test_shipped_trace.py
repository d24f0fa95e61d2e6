"""The trace shipped in traces/: a byte-for-byte slice of the Mooncake conversation trace
with its source and licence named, and the documented commands use it (a fresh clone has
no ../shared)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

from unicache.cli.main import build_parser
from unicache.sim.trace import read_trace
from tests.support.source_tree import REPO

SLICE = REPO / "traces" / "mooncake-conversation-slice.jsonl"
README = REPO / "traces" / "README.md"
WHOLE = REPO.parent / "shared" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"


def test_the_slice_is_the_first_300_requests_with_source_and_licence_named():
    data = SLICE.read_bytes()
    readme = README.read_text()
    assert hashlib.sha256(data).hexdigest() in readme and f"{len(data):,} bytes" in readme
    for needed in ("kvcache-ai/Mooncake", "3b5a594", "Apache-2.0", "first 300 requests", "--block-size 512"):
        assert needed in readme, needed
    reqs = read_trace(SLICE)
    assert len(reqs) == 300 and reqs[0].input_length == 6758 and reqs[0].hash_ids == list(range(14))
    if WHOLE.exists():  # beside a development checkout: the slice is its head, unmodified
        with WHOLE.open("rb") as fh:
            assert data == b"".join(fh.readline() for _ in range(300))


def test_docs_and_help_point_at_the_shipped_trace_not_outside_the_clone():
    for doc in ("docs/simulator.md", "docs/trace-format.md"):
        text = (REPO / doc).read_text()
        assert "shared/traces" not in text and "traces/mooncake-conversation-slice.jsonl" in text, doc
    parser = build_parser()
    for command in ("sim", "bench"):
        sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
        (trace,) = [a for a in sub._actions if "--trace" in a.option_strings]
        assert "traces/mooncake-conversation-slice.jsonl" in trace.help and "shared" not in trace.help


def test_the_documented_sim_command_runs_on_the_slice(tmp_path):
    cmd = re.search(r"^(unicache sim --trace traces/mooncake-conversation-slice\.jsonl .*?)$",
                    (REPO / "docs" / "simulator.md").read_text().replace("\\\n    ", ""), flags=re.M).group(1)
    out = tmp_path / "sim.json"
    run = subprocess.run([sys.executable, "-m", "unicache.cli.main", *cmd.split()[1:], "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["requests"], report["block_size"], report["unique_blocks"], report["block_accesses"]) == (300, 512, 7814, 8490)
    assert len(report["results"]) == 4 * 3  # 4 policies (the default) x round_robin, cache_aware, pooled
