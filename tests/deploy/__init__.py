"""Deployment tests: the Helm chart and the container images. Marked deploy by tests/conftest.py."""
