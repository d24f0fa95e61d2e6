"""The maintained benchmark suite: each module produces a table or figure of the docs
(docs/results.md; the index is bench/README.md).

Run from the repository root as modules, ``python -m bench.<name>``, so shared helpers
(``bench.report_files``, ``bench.rounds``) import by their package names and everything
else comes from the installed ``unicache`` package; no script edits ``sys.path`` or
imports ``tests/``. Research studies left once answered: docs/studies.md records each.
"""
