"""The package's shape: one import root, and layers that the imports respect.

Layers, bottom to top:
  core     ``unicache.*`` shared definitions (block hash, request class, classifier, trace
           reader, tokenizer, protobuf stubs, Redis keys, settings): imports only core.
  replica  ``unicache.replica``: imports core and itself, never the router.
  router   ``unicache.router``: imports core and itself, never the replica.
  top      the simulator, ``up``, ``demo``, ``bench``, the CLI and the shared test and bench
           harnesses (``unicache.testing``): may import anything.
"""

from __future__ import annotations

import pytest

from tests.support.source_tree import (
    REPO,
    declared_packages,
    first_party_files,
    imported_modules,
    module_file,
    module_name,
    package_dirs,
)

TOP = ("unicache.sim", "unicache.testing", "unicache.cli", "unicache.local_cluster", "unicache.demo", "unicache.bench_client",
       "unicache.bench_stats")
ALLOWED = {
    "core": {"core"},
    "replica": {"core", "replica"},
    "router": {"core", "router"},
    "top": {"core", "replica", "router", "top"},
}


def layer(module: str) -> str:
    if module == "unicache.router" or module.startswith("unicache.router."):
        return "router"
    if module == "unicache.replica" or module.startswith("unicache.replica."):
        return "replica"
    if any(module == t or module.startswith(t + ".") for t in TOP):
        return "top"
    return "core"


def layer_violations() -> list[str]:
    bad = []
    for path in first_party_files():
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            if imported.split(".")[0] != "unicache" or module_file(imported) is None:
                continue  # third-party, or "module.name" of a name that is not a module
            if layer(imported) not in ALLOWED[layer(importer)]:
                bad.append(f"{importer} ({layer(importer)}) imports {imported} ({layer(imported)})")
    return bad


def test_every_package_installs_under_one_root():
    assert all(p == "unicache" or p.startswith("unicache.") for p in declared_packages())
    assert package_dirs()["unicache.router"] == REPO / "router"
    assert package_dirs()["unicache.replica"] == REPO / "replica"


def test_declared_packages_equal_the_folders_on_disk():
    on_disk = {module_name(init) for init in first_party_files() if init.name == "__init__.py"}
    assert sorted(declared_packages()) == sorted(on_disk)


def test_imports_respect_the_layers():
    assert layer_violations() == []


@pytest.mark.parametrize(
    "module, expected",
    [
        ("unicache.block_hash", "core"),
        ("unicache.tokenizer", "core"),
        ("unicache.v1.replica_pb2", "core"),
        ("unicache.router.core", "router"),
        ("unicache.replica.kv.store", "replica"),
        ("unicache.sim.replay", "top"),
        ("unicache.local_cluster", "top"),
        ("unicache.cli", "top"),
    ],
)
def test_layer_of(module, expected):
    assert module_file(module) is not None
    assert layer(module) == expected


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The check is not vacuous: a core module importing the router is reported."""
    import tests.support.source_tree as source_tree

    fake = tmp_path / "unicache"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "leaky.py").write_text("from unicache.router.core import RouterCore\n")
    real_dirs = source_tree.package_dirs()
    monkeypatch.setattr(source_tree, "package_dirs", lambda: {**real_dirs, "unicache": fake})
    monkeypatch.setattr(source_tree, "first_party_files", lambda: [fake / "leaky.py"])
    import tests.test_layers as me

    monkeypatch.setattr(me, "first_party_files", source_tree.first_party_files)
    assert me.layer_violations() == ["unicache.leaky (core) imports unicache.router.core (router)"]
