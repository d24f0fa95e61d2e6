"""Tests of the simulator and the trace reader (unicache.sim)."""
