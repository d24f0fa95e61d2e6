"""Tests of the unicache command (unicache.cli) and the bench client."""
