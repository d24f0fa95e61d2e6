"""Tests of unicache.router (folder router/), in process."""
