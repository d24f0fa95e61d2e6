"""JSON from clients, parsed only after a bounded nesting check.

Python's ``json`` recurses once per nesting level: a document nested 100,000 deep ends in
RecursionError (an UNKNOWN status, a 500) after burning the stack. ``loads_bounded``
counts brackets first, in one linear pass that skips string contents, and refuses a
document nested deeper than ``max_depth`` before ``json.loads`` sees it. Both front doors
use it (gRPC ``chat_json``, HTTP bodies).

Invariants:
    * ``loads_bounded`` raises only ``JsonInputError`` (a ValueError) for bad input:
      too deep, not JSON, not UTF-8, integers past Python's digit limit.
    * The check costs O(len) with C-speed counting; documents with at most ``max_depth``
      brackets in total skip the scan.
"""

from __future__ import annotations

import json
import re

MAX_JSON_DEPTH = 64  # OpenAI-style bodies nest 5-6 deep (tools' JSON schemas a few more)

# A whole string (its brackets do not count) or one bracket.
_TOKENS_STR = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_TOKENS_BYTES = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_OPEN_STR, _OPEN_BYTES = frozenset("[{"), frozenset(b"[{")


class JsonInputError(ValueError):
    """The client's JSON is unacceptable (INVALID_ARGUMENT / HTTP 400); the message says why."""


def json_depth_exceeds(data: str | bytes, max_depth: int) -> bool:
    """True when ``data`` nests arrays/objects deeper than ``max_depth`` (brackets inside
    strings do not count)."""
    is_bytes = isinstance(data, (bytes, bytearray))
    opens = (data.count(b"[") + data.count(b"{")) if is_bytes else (data.count("[") + data.count("{"))
    if opens <= max_depth:
        return False
    pattern, open_chars = (_TOKENS_BYTES, _OPEN_BYTES) if is_bytes else (_TOKENS_STR, _OPEN_STR)
    depth = 0
    for m in pattern.finditer(data):
        c = m.group()[0]
        if c in open_chars:
            depth += 1
            if depth > max_depth:
                return True
        elif c != (34 if is_bytes else '"'):
            depth -= 1
    return False


def loads_bounded(data: str | bytes, what: str = "request body", max_depth: int = MAX_JSON_DEPTH):
    """``json.loads(data)`` for client input; raises JsonInputError naming ``what``.

    Args:
        data: the JSON text (str, or bytes in UTF-8).
        what: how the message names the input ("request body", "chat_json").
        max_depth: deepest nesting of arrays and objects accepted.
    """
    if json_depth_exceeds(data, max_depth):
        raise JsonInputError(f"{what} nests arrays or objects deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"{what} is not valid JSON (line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError):  # not UTF-8, an integer past the digit limit
        raise JsonInputError(f"{what} is not valid JSON") from None
