"""bench.profile_summary: the inclusive and self shares of a collapsed-stack profile."""

from __future__ import annotations

from bench.profile_summary import frame_key, main, summarize


def test_inclusive_counts_a_recursing_function_once_and_self_the_innermost():
    lines = [
        "run (loop.py:10);handle (core.py:5);encode (tok.py:7) 6\n",
        "run (loop.py:10);handle (core.py:5);handle (core.py:9);hash (bh.py:3) 3\n",
        "run (loop.py:11) 1\n",
        "\n",
    ]
    total, inclusive, self_ = summarize(lines)
    assert total == 10
    assert inclusive[("handle", "core.py")] == 9  # recursing: still once per sample
    assert inclusive[("run", "loop.py")] == 10
    assert self_ == {("encode", "tok.py"): 6, ("hash", "bh.py"): 3, ("run", "loop.py"): 1}
    _, under, _ = summarize(lines, under="core")
    assert set(under) == {("handle", "core.py")}


def test_frame_key_drops_the_line_and_keeps_odd_frames(tmp_path, capsys):
    assert frame_key("encode (/x/site-packages/tokenizers/__init__.py:42)") == ("encode", "/x/site-packages/tokenizers/__init__.py")
    assert frame_key("<native>") == ("<native>", "")
    prof = tmp_path / "p.txt"
    prof.write_text("a (f.py:1);b (g.py:2) 3\na (f.py:1) 1\n")
    assert main([str(prof), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 samples" in out and "| `a` (f.py) | 100.0% |" in out and "| `b` (g.py) | 75.0% |" in out
