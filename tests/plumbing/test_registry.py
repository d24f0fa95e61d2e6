"""The generic plug-in registry and the two registries built on it (eviction, routing)."""

from __future__ import annotations

import pytest

from unicache.plumbing.registry import Registry
from unicache.replica.eviction.lru import LRUPolicy
from unicache.replica.eviction.registry import EVICTION_POLICIES, make_policy, policy_names
from unicache.router.routing.registry import ROUTING_POLICIES, make_routing_policy, routing_policy_names


def make_registry(*modules: str) -> Registry:
    reg: Registry = Registry("widget", modules)

    @reg.register("plain")
    class Plain:
        def __init__(self, size: int = 1):
            self.size = size

    return reg


def test_register_sets_the_name_and_make_passes_kwargs():
    reg = make_registry()
    widget = reg.make("plain", size=3)
    assert (type(widget).name, widget.size, reg.names()) == ("plain", 3, ["plain"])


def test_unknown_name_fails_listing_the_valid_ones():
    reg = make_registry()
    reg.register("other")(type("Other", (), {}))
    with pytest.raises(ValueError, match=r"^unknown widget 'nope' \(choose from other, plain\)$"):
        reg.make("nope")


def test_unknown_keyword_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^widget 'plain' does not take colour, weight \(its arguments: size\)$"):
        make_registry().make("plain", weight=2, colour="red")


def test_a_name_registered_twice_fails():
    reg = make_registry()
    with pytest.raises(ValueError, match="widget 'plain' registered twice"):
        reg.register("plain")(type("Again", (), {}))


def test_a_missing_builtin_module_fails_every_lookup():
    reg = make_registry("unicache.no_such_module")
    for lookup in (reg.names, lambda: reg.get("plain"), lambda: reg.make("plain")):
        with pytest.raises(ModuleNotFoundError, match="unicache.no_such_module"):
            lookup()


def test_builtin_modules_are_imported_on_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "widget_plugin_mod.py").write_text(
        "from tests.plumbing.test_registry import LATE\n@LATE.register('late')\nclass Late:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert LATE.names() == ["late"]
    assert type(LATE.make("late")).__name__ == "Late"


LATE: Registry = Registry("widget", ["widget_plugin_mod"])


def test_eviction_registry_holds_the_builtin_policies():
    assert policy_names() == EVICTION_POLICIES.names() == ["arc", "fifo", "lecar", "lfu", "lru", "opt", "radix-lru", "s3fifo", "unicache"]
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match=r"^unknown eviction policy 'lfru' \(choose from arc, fifo, lecar, lfu, lru, opt, radix-lru, s3fifo, unicache\)$"):
        make_policy("lfru")
    with pytest.raises(ValueError, match=r"^eviction policy 'lru' does not take capacity"):
        make_policy("lru", capacity=3)


def test_routing_registry_holds_the_builtin_policies():
    names = ["cache_aware", "least_loaded", "round_robin", "session_affinity", "sglang"]
    assert routing_policy_names() == ROUTING_POLICIES.names() == names
    with pytest.raises(ValueError, match=r"^unknown routing policy 'random' \(choose from " + ", ".join(names) + r"\)$"):
        make_routing_policy("random")
    with pytest.raises(ValueError, match=r"^routing policy 'round_robin' does not take bogus"):
        make_routing_policy("round_robin", bogus=1)
