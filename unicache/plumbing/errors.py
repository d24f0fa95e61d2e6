"""Errors shared across components."""


class UsageError(Exception):
    """Bad input or configuration a user can fix; the CLI prints ``str(err)`` and exits 2."""
