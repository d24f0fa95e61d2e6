"""End-to-end tests: real processes across components (Ray, redis-server, vLLM servers, a browser). Marked e2e and slow by tests/conftest.py."""
