"""Security tests across components: API keys, tenant isolation, limits, signed Redis state, secrets."""
