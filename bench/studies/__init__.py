"""Research studies: why a target is or is not met, and how defaults were chosen.

A study may define variants (policies, predictors) for its own use; it registers them in
a registry of its own and never into the production registries. Run as
``python -m bench.studies.<name>`` from the repository root.
"""
