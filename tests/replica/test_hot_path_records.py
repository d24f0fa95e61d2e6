"""Hot-path records are slots dataclasses (no per-instance __dict__)."""

from __future__ import annotations

import dataclasses

import pytest

from unicache.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from unicache.contract.request_class import RequestClass
from unicache.replica.eviction.base import ReleaseInfo
from unicache.replica.eviction.lognormal import OnlineLogNormal
from unicache.replica.kv.block import KVBlock
from unicache.replica.kv.store import Allocation, CacheStats, RequestBlocks
from unicache.router.request_path.classifier import Labels, _BlockUse, _Session

RECORDS = [
    KVBlock, ReleaseInfo, RequestBlocks, Allocation, CacheStats, BlockStored, BlockRemoved,
    AllBlocksCleared, RequestClass, Labels, _Session, _BlockUse, OnlineLogNormal,
]


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_record_is_a_slots_dataclass(cls):
    assert dataclasses.is_dataclass(cls)
    assert "__slots__" in cls.__dict__
    assert "__dict__" not in {name for c in cls.__mro__ for name in c.__dict__.get("__slots__", ())}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, f in fields.items():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[name] = 1.0 if name in ("mu", "sigma") else None
    obj = cls(**kwargs)
    assert not hasattr(obj, "__dict__")
