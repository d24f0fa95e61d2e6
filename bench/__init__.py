"""The benchmark suite: each module produces a README table or figure (bench/README.md).

Run from the repository root as modules, ``python -m bench.<name>`` (research studies:
``python -m bench.studies.<name>``), so shared helpers (``bench.report_files``,
``bench.mix_traces``) import by their package names and everything else comes from the
installed ``unicache`` package; no script edits ``sys.path`` or imports ``tests/``.
"""
