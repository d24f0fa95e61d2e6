"""YAML parsing for rendered manifests with duplicate mapping keys refused.

PyYAML keeps the last of two equal keys silently (a ConfigMap that sets a variable twice
parses "fine"); the Kubernetes API server and strict parsers refuse it. Chart tests parse
with ``safe_load_all`` from here so a duplicate key fails them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    pass


class StrictSafeLoader(_Base):
    """``SafeLoader`` that raises ``DuplicateKeyError`` for a key repeated in one mapping."""

    def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN201 - PyYAML's signature
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise DuplicateKeyError(
                        "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                    )
                seen[key] = True
        return super().construct_mapping(node, deep=deep)


def safe_load_all(text: str) -> Iterator[Any]:
    """Every document of ``text``, as ``yaml.safe_load_all``, with duplicate keys refused."""
    return yaml.load_all(text, Loader=StrictSafeLoader)


def safe_load(text: str) -> Any:
    return yaml.load(text, Loader=StrictSafeLoader)
