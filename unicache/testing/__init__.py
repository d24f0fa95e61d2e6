"""Harnesses shared by the tests and the benchmarks (top layer: may import anything).

``bench/`` imports the installed package, never ``tests/``; what a benchmark and a test
both drive lives here: a loopback cluster (``cluster_harness``), the fault scenarios run
by ``tests/e2e/test_fault_cluster.py`` and ``bench/faults.py`` (``fault_scenarios``), a fake
replica servicer (``fake_replica``), polling with a deadline (``polling``) and tiny
transformers-written checkpoints with transformers' reference outputs (``hf_models``).
Nothing here runs in production code paths.
"""
