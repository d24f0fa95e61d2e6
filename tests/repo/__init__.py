"""Repository checks: the layers, docs drift, pinned versions, generated stubs."""
