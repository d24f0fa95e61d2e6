"""Tests of unicache.plumbing."""
