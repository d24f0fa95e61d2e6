"""Tests of unicache.replica (folder replica/): engines, KV store, eviction, serving, publishing."""
