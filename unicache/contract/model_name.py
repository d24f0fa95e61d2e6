"""The model name a deployment serves: one definition for the router's ``/v1/models``,
the replicas' ``model_name`` metric label and the clients' defaults.

The seeded random model (no checkpoint) is served as ``DEFAULT_MODEL_NAME``; a checkpoint
directory is served under its directory name unless a served name is given.
"""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "unicache-default"


def served_model_name(served_name: str = "", checkpoint: str = "") -> str:
    """``served_name`` if set, else the checkpoint directory's name, else ``DEFAULT_MODEL_NAME``."""
    if served_name:
        return served_name
    if checkpoint:
        return os.path.basename(os.path.normpath(checkpoint))
    return DEFAULT_MODEL_NAME
