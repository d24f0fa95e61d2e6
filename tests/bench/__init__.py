"""Tests of the maintained benchmarks' harnesses (bench/)."""
